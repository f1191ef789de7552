"""Synthetic workloads follow SlackServe appendix B; traces round-trip and reject bad lines clearly."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from engine.sim.workload import (
    EVENTS_PER_LENGTH,
    LENGTHS_FRAMES,
    EventKind,
    WorkloadSpec,
    generate,
    read_trace,
    write_trace,
)


def arrivals(events: list) -> dict[int, tuple[float, int]]:
    return {e.stream: (e.t, e.frames) for e in events if e.kind is EventKind.ARRIVE}


def test_steady_is_poisson_at_the_rate_with_paper_lengths() -> None:
    ev = generate(WorkloadSpec("steady", streams=2000, rate=1.0, seed=3))
    arr = arrivals(ev)
    assert len(arr) == 2000
    times = sorted(t for t, _ in arr.values())
    assert times[-1] / 2000 == pytest.approx(1.0, rel=0.08)  # mean gap 1/rate
    assert set(f for _, f in arr.values()) == set(LENGTHS_FRAMES)
    assert all(e.kind is EventKind.ARRIVE for e in ev)


def test_burst_moves_ten_percent_to_each_of_three_points() -> None:
    n = 1000
    steady = arrivals(generate(WorkloadSpec("steady", streams=n, seed=1)))
    burst = arrivals(generate(WorkloadSpec("burst", streams=n, seed=1)))
    assert len(burst) == n
    counts = Counter(t for t, _ in burst.values())
    top = counts.most_common(3)
    assert all(c >= 100 for _, c in top)  # 10 % each (plus the stream that was already there)
    ordered = sorted(t for t, _ in steady.values())
    assert sorted(t for t, _ in top) == [ordered[int(p * n)] for p in (0.2, 0.5, 0.8)]


def test_prompt_switch_and_pause_counts_and_durations() -> None:
    spec = WorkloadSpec("prompt-switch", streams=200, seed=2, nominal_lead_s=3.0)
    ev = generate(spec)
    arr = arrivals(ev)
    switches = Counter(e.stream for e in ev if e.kind is EventKind.PROMPT_SWITCH)
    for sid, (_, frames) in arr.items():
        assert switches[sid] == EVENTS_PER_LENGTH[frames]
    for e in ev:
        if e.kind is EventKind.PROMPT_SWITCH:
            t0, frames = arr[e.stream]
            assert t0 + 3.0 <= e.t <= t0 + 3.0 + frames / 16.0
    ev = generate(WorkloadSpec("pause", streams=200, seed=2))
    arr = arrivals(ev)
    by_stream: dict[int, list] = {}
    for e in ev:
        if e.kind in (EventKind.PAUSE, EventKind.RESUME):
            by_stream.setdefault(e.stream, []).append(e)
    for sid, evs in by_stream.items():
        frames = arr[sid][1]
        assert len(evs) == 2 * EVENTS_PER_LENGTH[frames]
        for p, r in zip(evs[::2], evs[1::2], strict=True):
            assert p.kind is EventKind.PAUSE and r.kind is EventKind.RESUME
            assert r.t - p.t == pytest.approx(0.2 * frames / 16.0)


def test_trace_round_trip(tmp_path: Path) -> None:
    ev = generate(WorkloadSpec("pause", streams=30, seed=5))
    path = tmp_path / "t.jsonl"
    write_trace(ev, path)
    back = read_trace(path)
    assert [(e.kind, e.stream, e.frames) for e in back] == [(e.kind, e.stream, e.frames) for e in ev]
    assert [e.t for e in back] == pytest.approx([e.t for e in ev], abs=1e-6)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"t": 1, "event": "arrive", "stream": 0}', "needs 'frames'"),
        ('{"t": 1, "event": "teleport", "stream": 0}', "unknown event"),
        ('{"event": "arrive", "stream": 0, "frames": 9}', "missing required key 't'"),
        ('{"t": 1, "event": "pause", "stream": 7}', "before its arrive"),
        ("{not json", "not valid JSON"),
    ],
)
def test_trace_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("# comment\n\n" + line + "\n")
    with pytest.raises(ValueError, match=message) as err:
        read_trace(path)
    assert ":3:" in str(err.value)


def test_bad_spec_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        WorkloadSpec("diurnal")
