"""Workloads: SlackServe's synthetic ones (appendix B) and a JSONL trace format for real traces.

Trace format: one JSON object per line, sorted by ``t`` (seconds, absolute)::

    {"t": 0.84, "event": "arrive", "stream": 0, "frames": 129, "fps": 16.0, "resolution": [832, 480]}
    {"t": 5.10, "event": "prompt_switch", "stream": 0}
    {"t": 6.00, "event": "pause", "stream": 0}
    {"t": 7.60, "event": "resume", "stream": 0}
    {"t": 9.00, "event": "leave", "stream": 0}

``leave`` is optional (a stream otherwise ends when all its frames are generated). Lines starting with
``#`` and blank lines are ignored.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import numpy as np

WORKLOADS = ("steady", "burst", "prompt-switch", "pause")
LENGTHS_FRAMES = (81, 129, 161, 241)
EVENTS_PER_LENGTH = {81: 1, 129: 2, 161: 2, 241: 3}


class EventKind(Enum):
    ARRIVE = "arrive"
    PROMPT_SWITCH = "prompt_switch"
    PAUSE = "pause"
    RESUME = "resume"
    LEAVE = "leave"


@dataclass(frozen=True, slots=True)
class TraceEvent:
    t: float
    kind: EventKind
    stream: int
    frames: int = 0
    fps: float = 16.0
    resolution: tuple[int, int] = (832, 480)

    def to_json(self) -> dict[str, object]:
        d: dict[str, object] = {"t": round(self.t, 6), "event": self.kind.value, "stream": self.stream}
        if self.kind is EventKind.ARRIVE:
            d.update(frames=self.frames, fps=self.fps, resolution=list(self.resolution))
        return d


@dataclass(frozen=True)
class WorkloadSpec:
    name: str = "steady"
    streams: int = 946
    rate: float = 1.0
    seed: int = 0
    fps: float = 16.0
    resolution: tuple[int, int] = (832, 480)
    nominal_lead_s: float = 3.0  # initial slack used to place switch/pause points on the playout timeline
    burst_points: tuple[float, ...] = (0.2, 0.5, 0.8)
    burst_fraction: float = 0.1
    pause_fraction: float = 0.2

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"unknown workload {self.name!r}; choose one of {', '.join(WORKLOADS)}")
        if self.streams < 1 or self.rate <= 0:
            raise ValueError(f"need streams >= 1 and rate > 0, got {self.streams}, {self.rate}")


def _sort(events: Iterable[TraceEvent]) -> list[TraceEvent]:
    order = {EventKind.ARRIVE: 0, EventKind.RESUME: 1, EventKind.PAUSE: 2, EventKind.PROMPT_SWITCH: 3,
             EventKind.LEAVE: 4}
    return sorted(events, key=lambda e: (e.t, order[e.kind], e.stream))


def generate(spec: WorkloadSpec) -> list[TraceEvent]:
    rng = np.random.default_rng(spec.seed)
    n = spec.streams
    arrivals = np.cumsum(rng.exponential(1.0 / spec.rate, size=n))
    lengths = rng.choice(np.array(LENGTHS_FRAMES), size=n)
    if spec.name == "burst":
        k = int(round(spec.burst_fraction * n))
        pool = rng.permutation(n)
        # Burst timestamps come from the original Steady sequence, before any stream is reassigned.
        points = [float(arrivals[min(n - 1, int(p * n))]) for p in spec.burst_points]
        for i, at in enumerate(points):
            arrivals[pool[i * k : (i + 1) * k]] = at
    events = [
        TraceEvent(float(arrivals[i]), EventKind.ARRIVE, i, int(lengths[i]), spec.fps, spec.resolution)
        for i in range(n)
    ]
    for i in range(n):
        duration = lengths[i] / spec.fps
        start = float(arrivals[i]) + spec.nominal_lead_s
        count = EVENTS_PER_LENGTH[int(lengths[i])]
        pos = np.sort(rng.uniform(0.0, duration, size=count))
        if spec.name == "prompt-switch":
            events += [TraceEvent(start + float(p), EventKind.PROMPT_SWITCH, i) for p in pos]
        elif spec.name == "pause":
            pause_len = spec.pause_fraction * duration
            for j, p in enumerate(pos):
                t0 = start + float(p) + j * pause_len
                events += [TraceEvent(t0, EventKind.PAUSE, i), TraceEvent(t0 + pause_len, EventKind.RESUME, i)]
    return _sort(events)


def write_trace(events: Iterable[TraceEvent], path: str | Path) -> None:
    with Path(path).open("w") as f:
        for e in _sort(events):
            f.write(json.dumps(e.to_json()) + "\n")


def read_trace(path: str | Path) -> list[TraceEvent]:
    events: list[TraceEvent] = []
    kinds = {k.value: k for k in EventKind}
    arrived: set[int] = set()
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc})") from exc
        for key in ("t", "event", "stream"):
            if key not in obj:
                raise ValueError(f"{where}: missing required key {key!r}")
        if obj["event"] not in kinds:
            raise ValueError(f"{where}: unknown event {obj['event']!r}; expected one of {sorted(kinds)}")
        kind = kinds[obj["event"]]
        sid = int(obj["stream"])
        if kind is EventKind.ARRIVE:
            if "frames" not in obj:
                raise ValueError(f"{where}: arrive event needs 'frames'")
            if int(obj["frames"]) < 1:
                raise ValueError(f"{where}: frames must be >= 1, got {obj['frames']}")
            if sid in arrived:
                raise ValueError(f"{where}: stream {sid} arrives twice")
            arrived.add(sid)
            res = obj.get("resolution", [832, 480])
            events.append(TraceEvent(float(obj["t"]), kind, sid, int(obj["frames"]), float(obj.get("fps", 16.0)),
                                     (int(res[0]), int(res[1]))))
        else:
            if sid not in arrived:
                raise ValueError(f"{where}: {kind.value} for stream {sid} before its arrive event")
            events.append(TraceEvent(float(obj["t"]), kind, sid))
    return _sort(events)
