"""Days of uptime: the live policy loop forgets streams that left and keeps a bounded history of
each live one (found by the soak benchmark's review: the ledger used to keep every stream it ever
served, each with a log row per chunk)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from _security_fixtures import tiny_factory  # noqa: F401

from app.server.config import ServerConfig
from app.server.serving.serving_loop import build_serving_loop
from engine.serving.playout import PlayoutTracker


def _feed(tracker: PlayoutTracker, chunks: int) -> None:
    """Chunks that arrive late every third time (stalls), with pauses and prompt switches."""
    t = 0.0
    for i in range(chunks):
        t += 0.5 if i % 3 == 0 else 0.05
        tracker.on_chunk_ready(t, 0.125)
        if i % 50 == 0:
            tracker.pause(t)
            tracker.resume(t + 0.01)
        if i % 70 == 0:
            tracker.reset_slack(t)


def test_tracker_history_is_bounded_and_counts_every_stall() -> None:
    bounded = PlayoutTracker(0.0, 0.5, 1e9, max_log=40)
    unbounded = PlayoutTracker(0.0, 0.5, 1e9)
    for tracker in (bounded, unbounded):
        _feed(tracker, 3000)
    assert len(unbounded.log) > 3000 and len(unbounded.stalls) > 500
    assert len(bounded.log) <= 40 and len(bounded.stalls) <= 40
    assert bounded.log == unbounded.log[-len(bounded.log):]  # the newest rows, unchanged
    # Same accounting as the full history.
    assert bounded.stall_count == unbounded.stall_count == len(unbounded.stalls)
    assert (bounded.chunks_on_time, bounded.chunks_late) == (unbounded.chunks_on_time, unbounded.chunks_late)


def test_policy_loop_forgets_streams_that_left(tiny_factory: object) -> None:  # noqa: F811
    with ThreadPoolExecutor(1) as executor:
        loop = build_serving_loop(ServerConfig(model="tiny-random", max_fps=8.0), tiny_factory, executor)  # type: ignore[arg-type]
        for _ in range(200):  # admitted streams that closed (or never opened)
            sid = loop.admit()
            loop.remove(sid)
        assert loop.core.ledger.entries == {} and loop.core.stats == {}
        assert not any(loop.core.ledger._by_worker.values())
        assert loop.admit() not in (None, 0)  # admission still works
