"""Playout accounting: hand-computed scenarios plus a property test against a dense re-simulation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.serving.playout import PlayoutTracker


def test_first_chunk_deadline_is_arrival_plus_initial_slack() -> None:
    tr = PlayoutTracker(arrival_t=10.0, initial_slack_s=3.0, content_s=5.0)
    assert tr.slack(10.0) == pytest.approx(3.0)
    assert tr.slack(12.0) == pytest.approx(1.0)
    out = tr.on_chunk_ready(13.0, 0.75)  # exactly at the deadline: on time
    assert out.on_time and out.stall is None
    assert tr.first_chunk_t == 13.0
    assert tr.slack(13.0) == pytest.approx(0.75)


def test_late_chunk_records_stall_and_shifts_later_deadlines() -> None:
    tr = PlayoutTracker(0.0, 1.0, 10.0)
    assert tr.on_chunk_ready(0.5, 1.0).on_time  # content [0, 1), cursor at -0.5
    out = tr.on_chunk_ready(2.7, 1.0)  # cursor hit 1.0 at t=2.0: stall 2.0 -> 2.7
    assert not out.on_time
    assert out.stall is not None
    assert (out.stall.start_t, out.stall.end_t) == pytest.approx((2.0, 2.7))
    # Playback resumed at 2.7 from position 1.0, so the next chunk (position 2.0) is due at 3.7.
    assert tr.slack(2.7) == pytest.approx(1.0)
    assert tr.on_chunk_ready(3.7, 1.0).on_time
    assert tr.chunks_on_time == 2 and tr.chunks_late == 1
    assert tr.cpr == pytest.approx(2 / 3)


def test_pause_accumulates_slack_and_resume_restarts_clock() -> None:
    tr = PlayoutTracker(0.0, 2.0, 10.0)
    tr.on_chunk_ready(1.0, 1.0)
    tr.pause(1.5)  # cursor at -0.5
    tr.on_chunk_ready(4.0, 1.0)
    assert tr.slack(5.0) == pytest.approx(2.5)  # paused: 2.0 generated - (-0.5)
    tr.resume(5.0)
    assert tr.slack(6.0) == pytest.approx(1.5)


def test_prompt_switch_discards_buffer_and_restores_initial_slack() -> None:
    tr = PlayoutTracker(0.0, 3.0, 10.0)
    for t in (0.5, 1.0, 1.5, 2.0):
        tr.on_chunk_ready(t, 0.75)  # 3.0 s buffered, cursor at -1.0 at t=2
    tr.reset_slack(4.0)  # cursor at 1.0: content after it is thrown away
    assert tr.generated_s == pytest.approx(1.0)
    assert tr.slack(4.0) == pytest.approx(3.0)
    assert tr.epoch == 1
    assert tr.remaining_content_s == pytest.approx(9.0)


def test_prompt_switch_before_playback_restarts_the_wait() -> None:
    tr = PlayoutTracker(0.0, 3.0, 10.0)
    tr.on_chunk_ready(0.5, 0.75)
    tr.reset_slack(1.0)  # cursor still at -2.0: nothing played yet
    assert tr.generated_s == 0.0
    assert tr.slack(1.0) == pytest.approx(3.0)


def test_end_of_content_is_not_a_stall() -> None:
    tr = PlayoutTracker(0.0, 1.0, 1.5)
    tr.on_chunk_ready(0.5, 0.75)
    tr.on_chunk_ready(1.0, 0.75)
    assert tr.done_generating
    assert not tr.stalled(100.0)
    assert tr.stall_in_progress_s(100.0) == 0.0


def test_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="content_s"):
        PlayoutTracker(0.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="duration"):
        PlayoutTracker(0.0, 1.0, 1.0).on_chunk_ready(1.0, 0.0)


# ---- property: the tracker's accounting equals a dense re-simulation of the event log -------------
# Times and durations are multiples of 0.25 s (exact in binary floating point), so the dense model can
# run in integer quarter-second steps and ties (chunk exactly at its deadline) compare exactly.

event = st.tuples(st.integers(min_value=0, max_value=6), st.sampled_from(["chunk", "chunk", "chunk", "pause",
                                                                           "resume", "switch"]),
                  st.integers(min_value=1, max_value=4))


def dense_replay(events: list[tuple[int, str, int]], s0: int, content: int) -> dict[str, object]:
    """Quarter-second integer simulation: the cursor moves one unit per unit of time when it can."""
    t = cursor = gen = 0
    cursor = -s0
    paused = stuck = False
    stall_units = on_time = late = depth = 0  # depth: units of the stall in progress (not yet closed)
    slack_after: list[int] = []
    for at, kind, dur in events:
        while t < at:
            if not paused:
                if cursor < gen:
                    cursor += 1
                elif gen < content:
                    stuck = True
                    stall_units += 1
                    depth += 1
            t += 1
        if kind == "chunk":
            if stuck:
                late += 1
            else:
                on_time += 1
            stuck = False
            depth = 0
            gen = min(content, gen + dur)
        elif kind == "pause":
            paused = True
            depth = 0
        elif kind == "resume":
            paused = False
        elif kind == "switch":
            gen = max(cursor, 0)
            cursor = gen - s0
            stuck = False
            depth = 0
        # Reported slack: buffered content, minus the depth of a stall still in progress.
        slack_after.append(gen - cursor - (depth if gen < content else 0))
    return {"slack": slack_after, "stall_units": stall_units, "on_time": on_time, "late": late}


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(event, min_size=1, max_size=30), s0=st.integers(min_value=0, max_value=8),
       content=st.integers(min_value=4, max_value=40))
def test_slack_accounting_matches_dense_replay(gaps: list[tuple[int, str, int]], s0: int, content: int) -> None:
    q = 0.25
    events = []
    t = 0
    for gap, kind, dur in gaps:
        t += gap
        events.append((t, kind, dur))
    tr = PlayoutTracker(0.0, s0 * q, content * q)
    slacks = []
    open_depths: list[float] = []
    for at, kind, dur in events:
        if kind == "chunk":
            if tr.done_generating:
                slacks.append(tr.slack(at * q))
                open_depths.append(tr.stall_in_progress_s(at * q))
                events[len(slacks) - 1] = (at, "noop", dur)
                continue
            tr.on_chunk_ready(at * q, dur * q)
        elif kind == "pause":
            tr.pause(at * q)
        elif kind == "resume":
            tr.resume(at * q)
        else:
            tr.reset_slack(at * q)
        slacks.append(tr.slack(at * q))
        open_depths.append(tr.stall_in_progress_s(at * q))
    ref = dense_replay(events, s0, content)
    # Never negative beyond a stall: any negative slack is exactly the open stall's depth.
    assert all(s >= -d - 1e-12 for s, d in zip(slacks, open_depths, strict=True)), "slack negative beyond a stall"
    assert slacks == pytest.approx([u * q for u in ref["slack"]])  # type: ignore[attr-defined]
    assert (tr.chunks_on_time, tr.chunks_late) == (ref["on_time"], ref["late"])
    recorded = sum(s.duration_s for s in tr.stalls) + tr.stall_in_progress_s(events[-1][0] * q)
    assert recorded == pytest.approx(ref["stall_units"] * q)  # type: ignore[operator]
