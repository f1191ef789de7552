"""The live server's policy loop feeds the serving ledger what actually happened (hand-driven clock).

Real tiny engine, real frame path objects; only the clock is driven by hand, so every observation the
ledger receives (chunk ready times, playout cursor, pauses, prompt switches) can be computed here
independently from the frames pushed and played.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from app.server.engine_bridge import StreamSettings
from app.server.frame_path import ChunkAssembler, Playout, StreamRunner
from app.server.scheduler import LIVE_PROFILE, AdmissionError, PolicyScheduler, live_profile
from engine.serving.fidelity import FidelityConfig, ProfilePoint, bundled_profile


@pytest.fixture(scope="module")
def engine_factory() -> Any:
    """The tiny random-weight model whatever conftest picks: these tests need a model whose preset
    has 4 steps and the bundled tiny-random profile, and they are about scheduling, not pictures."""
    import torch

    from app.server.engine_bridge import PipelineFactory

    torch.set_num_threads(1)
    return PipelineFactory.load("tiny-random")


FPS = 8.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _stream(factory: Any, scheduler: PolicyScheduler, clock: FakeClock, executor: ThreadPoolExecutor,
            steps: int = 2) -> tuple[int, StreamRunner, ChunkAssembler, Playout]:
    settings = StreamSettings(steps=steps)
    sid = scheduler.admit()
    processor = factory.open(settings)
    assembler = ChunkAssembler(capacity=processor.chunk_frames, clock=clock)
    playout = Playout(factory.size, processor.chunk_frames, max_fps=FPS, min_fps=FPS, clock=clock)
    runner = StreamRunner(processor, assembler, playout, executor, asyncio.Semaphore(1), factory.size)
    scheduler.attach(sid, runner, playout, lambda: settings.steps)
    return sid, runner, assembler, playout


def _push(assembler: ChunkAssembler, n: int, size: tuple[int, int]) -> None:
    rng = np.random.default_rng(assembler.received)
    for _ in range(n):
        assembler.push(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture
def executor() -> Any:
    pool = ThreadPoolExecutor(max_workers=1)
    yield pool
    pool.shutdown(wait=True)


async def test_executor_feeds_ledger_chunk_times_and_cursor(engine_factory: Any, executor: ThreadPoolExecutor) -> None:
    clock = FakeClock()
    profile = bundled_profile(LIVE_PROFILE)
    scheduler = PolicyScheduler(profile, executor, fps=FPS, clock=clock)
    # Initial slack is the policy-independent contract: 4 x the best live config's first-chunk time.
    best = max(live_profile(profile).points, key=lambda p: (p.quality, -p.latency_s))
    s0 = 4 * best.first_chunk_latency_s
    sid, runner, assembler, playout = _stream(engine_factory, scheduler, clock, executor)
    tracker = scheduler.ledger.entries[sid].tracker
    size = engine_factory.size

    assert not await scheduler.run_once()  # no input yet: nothing to run
    _push(assembler, 1, size)  # the first chunk is one frame
    clock.now = 0.5
    assert await scheduler.run_once()
    assert tracker.log == [("chunk", 0.5, 1 / FPS)]
    assert tracker.slack(0.5) == pytest.approx(1 / FPS + s0 - 0.5)
    assert playout.buffered == 1
    config = scheduler.streams[sid].config
    assert config is not None and config.steps <= 2 and config.resolution_scale == 1.0  # user's ceiling

    clock.now = 0.6
    playout.tick()  # the one frame is played: cursor 1/8 s
    _push(assembler, 4, size)
    clock.now = 0.9
    assert await scheduler.run_once()
    assert tracker.log[-1] == ("chunk", 0.9, 4 / FPS)
    clock.now = 1.0
    playout.tick()
    playout.tick()  # 3 frames have left the buffer, 2 wait
    _push(assembler, 4, size)
    clock.now = 1.2
    assert await scheduler.run_once()  # reports the cursor (3 frames = 0.375 s), then the chunk is ready
    assert tracker.log[-1] == ("chunk", 1.2, 4 / FPS)
    assert tracker.cursor(1.2) == pytest.approx(3 / FPS)
    assert tracker.slack(1.2) == pytest.approx(9 / FPS - 3 / FPS)
    assert tracker.stalls == []

    runner.pause()
    assert tracker.paused
    runner.resume()
    assert not tracker.paused
    await runner.update(prompt="pencil sketch")  # prompt switch: slack reset, old output not played
    assert tracker.epoch == 1 and playout.buffered == 0
    assert tracker.slack(1.2) == pytest.approx(s0)

    stats = scheduler.stats(sid)
    assert stats["policy_chunks"] == 3 and stats["fidelity_steps"] == config.steps
    scheduler.remove(sid)
    assert sid not in scheduler.ledger.entries  # forgotten: a server running for days keeps no closed streams


async def test_streams_with_one_config_share_a_batched_forward(
    engine_factory: Any, executor: ThreadPoolExecutor
) -> None:
    clock = FakeClock()
    scheduler = PolicyScheduler(bundled_profile(LIVE_PROFILE), executor, fps=FPS, clock=clock, max_batch=2)
    a = _stream(engine_factory, scheduler, clock, executor, steps=1)
    b = _stream(engine_factory, scheduler, clock, executor, steps=1)
    size = engine_factory.size
    for _, _, assembler, _ in (a, b):
        _push(assembler, 1, size)
    clock.now = 0.1
    assert await scheduler.run_once()  # the batcher explores: the first forward has one row
    assert scheduler.batched_chunks == 1
    clock.now = 0.2
    assert await scheduler.run_once()
    for _, _, assembler, _ in (a, b):
        _push(assembler, 4, size)
    clock.now = 0.3
    assert await scheduler.run_once()  # same config (1 step, the only one allowed), same cache fill
    assert (scheduler.batches_run, scheduler.batched_chunks) == (3, 4)
    for sid, _, _, playout in (a, b):
        assert scheduler.ledger.entries[sid].tracker.log[-1] == ("chunk", 0.3, 4 / FPS)
        assert scheduler.streams[sid].batch == 2 and playout.buffered == 5


async def test_admission_refuses_a_stream_whose_first_chunk_would_be_late(
    engine_factory: Any, executor: ThreadPoolExecutor
) -> None:
    clock = FakeClock()
    scheduler = PolicyScheduler(bundled_profile(LIVE_PROFILE), executor, fps=FPS, clock=clock)
    admitted = 0
    with pytest.raises(AdmissionError, match="first chunk would be ready in"):
        for _ in range(50):
            clock.now += 0.01  # streams arriving one after another, none has input yet
            _stream(engine_factory, scheduler, clock, executor)
            admitted += 1
    # Every admitted stream's next chunk is queued ahead of a newcomer; the initial slack covers a few.
    assert 1 <= admitted < 50


async def test_a_config_the_engine_cannot_run_ends_only_that_stream(
    engine_factory: Any, executor: ThreadPoolExecutor
) -> None:
    clock = FakeClock()
    measured = bundled_profile(LIVE_PROFILE)
    # A profile from some other engine: a 2-frame KV window cannot hold this engine's 3 sink frames.
    alien = replace(measured, points=(ProfilePoint(FidelityConfig(steps=1, kv_window_frames=2), 0.1, 0.1, 30.0, 0.0),))
    scheduler = PolicyScheduler(alien, executor, fps=FPS, clock=clock)
    sid, runner, assembler, _ = _stream(engine_factory, scheduler, clock, executor)
    failures: list[BaseException] = []
    scheduler.streams[sid].on_failure = failures.append
    _push(assembler, 1, engine_factory.size)
    assert await scheduler.run_once()
    assert len(failures) == 1 and "kv_window_frames=2" in str(failures[0])
    assert sid not in scheduler.streams and sid not in scheduler.ledger.entries


async def test_policy_recalibrates_to_the_measured_engine_speed(
    engine_factory: Any, executor: ThreadPoolExecutor
) -> None:
    clock = FakeClock()
    measured = bundled_profile(LIVE_PROFILE)
    # A profile that claims the engine is 100x faster than it is on this box.
    fast = replace(measured, points=tuple(replace(p, latency_s=p.latency_s / 100, first_chunk_latency_s=p.first_chunk_latency_s / 100)
                                          for p in measured.points))
    scheduler = PolicyScheduler(fast, executor, fps=FPS, clock=clock, max_batch=1)
    claimed = scheduler.policy.reference.latency_s
    _, _, assembler, _ = _stream(engine_factory, scheduler, clock, executor)
    for i in range(7):
        _push(assembler, 1 if i == 0 else 4, engine_factory.size)
        clock.now += 1.0
        assert await scheduler.run_once()
    # Independent: the engine's real chunk time is what the runner measured for its last chunk.
    assert scheduler.applied_ratio > 10
    assert scheduler.policy.reference.latency_s == pytest.approx(claimed * scheduler.applied_ratio)
    assert scheduler.policy.reference.latency_s > 0.2 * scheduler.streams[1].runner.chunk_seconds
