"""The serving loop without the media stack: the engine core, the live policy and in-process step
processors, fed by synthetic cameras in real time.

`diffcast serve` drives the same `EngineCore` (engine/serving/core.py) with the same live policy
(engine/serving/live.py) over the same `InProcessProcessor`s (engine/streaming/step_processor.py); only
the frames' way in and out differs: there WebRTC, here a synthetic camera per stream whose frame ``k``
is captured ``k / fps`` seconds after the stream arrived, and a viewer that starts playing one chunk's
worth of content after the first output arrives (a one-chunk jitter buffer) and then plays at the
camera's rate: a chunk is on time when it is there before the viewer reaches its first frame, and a
late one stalls the viewer until it comes (`engine.serving.playout.PlayoutTracker`, the same accounting
the policy's ledger keeps; anchored at the first output, since a live V2V chunk cannot be ready before
its camera frames are, whatever the initial slack). That is how
streams per GPU are measured on a machine that has torch but none of the media packages
(demos/gpu_check.py), and what `tests/test_headless.py` runs on a CPU.

`LocalExecutor` carries out the core's work on this process's engine: ``execute`` queues the step and
the loop runs it on the calling thread, then tells the core it is done (one step at a time, as one
engine lane of the server does).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.serving.core import Clock, EngineCore, Work
from engine.serving.device_memory import DeviceMemory
from engine.serving.ledger import Camera, StreamLedger
from engine.serving.live import LIVE_CONTENT_S, live_policy_config
from engine.serving.playout import PlayoutTracker
from engine.serving.policy import SlackPolicy
from engine.serving.profile import FidelityProfile
from engine.serving.snapshot import Rehome, WorkerView
from engine.streaming.step_processor import InProcessProcessor, StepProcessor, StepRow, run_step

log = logging.getLogger(__name__)

TICK_S = 0.5  # the control tick, as the live server's
# A stream's first seconds (first chunks, the policy's calibration): reports give the chunks after them apart.
STARTUP_S = 2.0
IDLE_S = 0.002  # longest sleep while waiting for a camera frame


@dataclass
class HeadlessStream:
    """One stream: its processor, its camera's frames (looped) and what came out."""

    sid: int
    processor: StepProcessor
    frames: np.ndarray  # uint8 [N, H, W, 3]: the camera's clip, looped
    taken: int = 0  # camera frames its chunks consumed
    frames_out: int = 0
    first_out_t: float | None = None
    last_out_t: float | None = None
    pending: list[int] = field(default_factory=list)  # frame counts of finished chunks not yet accounted
    points: dict[str, int] = field(default_factory=dict)  # chunks started per fidelity point
    keep: bool = False  # keep every input chunk and output chunk (tests compare them with a twin)
    inputs: list[np.ndarray] = field(default_factory=list)
    outputs: list[np.ndarray] = field(default_factory=list)
    at_startup: tuple[int, int] | None = None  # (on time, late) chunks when its start-up ended
    viewer: PlayoutTracker | None = None  # from its first output on

    def take(self, n: int) -> np.ndarray:
        index = np.arange(self.taken, self.taken + n) % len(self.frames)
        self.taken += n
        chunk = self.frames[index]
        if self.keep:
            self.inputs.append(chunk)
        return chunk


class LocalExecutor:
    """The core's `Executor` over this process's engine, one worker (one lane): steps run when the loop
    calls :meth:`run_next`, on its thread."""

    def __init__(self, clock: Clock, fps: float, state_slots: int) -> None:
        self.clock = clock
        self.fps = fps
        self.views = [WorkerView(0, 0, state_slots)]
        self.streams: dict[int, HeadlessStream] = {}
        self.core: EngineCore | None = None
        self.queue: deque[Work] = deque()
        self.wake = math.inf
        self.forwards = 0
        self.step_seconds: list[float] = []

    # -- Executor protocol --
    def worker_views(self) -> Sequence[WorkerView]:
        return self.views

    def input_ready(self, worker_id: int) -> set[int] | None:
        return None  # the ledger's camera model says when a chunk's frames are captured

    def execute(self, work: Work) -> float:
        self.queue.append(work)
        return 0.0

    def rehome(self, move: Rehome) -> float:
        return 0.0  # one worker: nowhere to move

    def wake_at(self, worker_id: int, t: float) -> None:
        self.wake = min(self.wake, t)

    # -- the loop's side --
    def run_next(self) -> bool:
        """Run the oldest queued step and report it to the core; False when none is queued."""
        if not self.queue:
            return False
        core = self.core
        assert core is not None
        work = self.queue.popleft()
        rows = []
        for order in work.orders:
            stream = self.streams[order.stream_id]
            if order.new_chunk:
                first = core.ledger.entries[order.stream_id].first_chunk
                n = stream.processor.first_chunk_frames if first else stream.processor.chunk_frames
                rows.append(StepRow(stream.processor, order.point.config, stream.take(n)))
                label = order.point.config.label()
                stream.points[label] = stream.points.get(label, 0) + 1
            else:
                rows.append(StepRow(stream.processor))
        for sid in work.drop:
            self.streams[sid].processor.drop_chunks()
        evict = [self.streams[sid].processor for sid in work.evict]
        restore = [self.streams[sid].processor for sid in work.restore]
        t0 = time.perf_counter()
        finished, forwards = run_step(rows, evict, restore)
        wall = time.perf_counter() - t0
        self.forwards += forwards
        self.step_seconds.append(wall)
        content: dict[int, float] = {}
        for order, chunks in zip(work.orders, finished, strict=True):
            stream = self.streams[order.stream_id]
            stream.pending.extend(len(c) for c in chunks)
            if stream.keep:
                stream.outputs.extend(chunks)
            if order.last_step:
                content[order.stream_id] = sum(stream.pending) / self.fps
        result = core.step_done(work.worker_id, wall, content)
        now = self.clock()
        for sid in result.delivered:
            stream = self.streams[sid]
            frames = sum(stream.pending)
            stream.frames_out += frames
            if stream.viewer is None:
                stream.first_out_t = now
                stream.viewer = PlayoutTracker(now, stream.processor.chunk_frames / self.fps, LIVE_CONTENT_S)
            stream.viewer.on_chunk_ready(now, frames / self.fps)
            stream.last_out_t = now
        for sid in (*result.delivered, *result.discarded, *result.abandoned):
            self.streams[sid].pending = []
        return True


@dataclass(frozen=True)
class StreamReport:
    """One stream of a headless run: chunks on time for its viewer (one-chunk buffer), stalls, output rate."""

    sid: int
    chunks_on_time: int
    chunks_late: int
    stalls: int
    frames_out: int
    fps_out: float  # output frames per second from its first output to its last
    points: dict[str, int]  # chunks per fidelity point
    steady_on_time: int = 0  # chunks after its first STARTUP_S seconds
    steady_late: int = 0

    @property
    def on_time_ratio(self) -> float:
        total = self.chunks_on_time + self.chunks_late
        return self.chunks_on_time / total if total else 0.0

    @property
    def steady_on_time_ratio(self) -> float:
        total = self.steady_on_time + self.steady_late
        return self.steady_on_time / total if total else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"sid": self.sid, "on_time_ratio": round(self.on_time_ratio, 4), "chunks_on_time": self.chunks_on_time,
                "chunks_late": self.chunks_late, "steady_on_time_ratio": round(self.steady_on_time_ratio, 4),
                "steady_chunks_late": self.steady_late, "stalls": self.stalls, "frames_out": self.frames_out,
                "fps_out": round(self.fps_out, 2), "points": self.points}


@dataclass(frozen=True)
class HeadlessReport:
    streams: tuple[StreamReport, ...]
    refused: tuple[str, ...]  # admission refusals' reasons
    seconds: float
    forwards: int
    evictions: int
    restores: int
    preemptions: int
    median_step_ms: float

    @property
    def min_on_time_ratio(self) -> float:
        return min((s.on_time_ratio for s in self.streams), default=0.0)

    @property
    def late_share(self) -> float:
        late = sum(s.chunks_late for s in self.streams)
        total = late + sum(s.chunks_on_time for s in self.streams)
        return late / total if total else 0.0

    @property
    def steady_late_share(self) -> float:
        late = sum(s.steady_late for s in self.streams)
        total = late + sum(s.steady_on_time for s in self.streams)
        return late / total if total else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"streams": [s.to_json() for s in self.streams], "refused": list(self.refused),
                "seconds": round(self.seconds, 2), "forwards": self.forwards, "evictions": self.evictions,
                "restores": self.restores, "preemptions": self.preemptions,
                "median_step_ms": round(self.median_step_ms, 2), "min_on_time_ratio": round(self.min_on_time_ratio, 4),
                "late_share": round(self.late_share, 4), "steady_late_share": round(self.steady_late_share, 4)}


def serve_headless(pipe: Any, profile: FidelityProfile, streams: int, seconds: float, fps: float = 16.0,
                   preset: str = "slack", max_batch: int = 8, state_slots: int | None = None,
                   memory: DeviceMemory | None = None, clip: np.ndarray | None = None,
                   clock: Clock = time.monotonic, stagger_s: float = 0.0, keep: bool = False,
                   on_progress: Callable[[float], None] | None = None) -> tuple[HeadlessReport, dict[int, HeadlessStream]]:
    """Serve ``streams`` synthetic cameras at ``fps`` on ``pipe`` (an `engine.pipeline.Pipeline`) for
    ``seconds`` of wall time under ``preset``, planning with ``profile`` (already filtered to the points
    this engine runs: `engine.serving.live.runnable_profile`). ``memory``: the device's budget for
    states (engine/serving/device_memory.py), as `diffcast serve` derives it. Streams arrive
    ``stagger_s`` apart. Returns the report and the streams (with their chunks in and out, ``keep``)."""
    from engine.pipeline import StreamParams
    from engine.profiler import synthetic_clip

    slots = state_slots if state_slots is not None else 1 << 20
    fit = memory.slots if memory is not None else None
    if fit is not None:
        slots = min(slots, fit)
        max_batch = max(1, min(max_batch, slots))
    policy = SlackPolicy(profile, live_policy_config(preset, max_batch, step_wise=True))
    executor = LocalExecutor(clock, fps, slots)
    first_n, chunk_n = int(pipe.first_chunk_frames), int(pipe.chunk_frames)
    camera = Camera(first_n / fps, chunk_n / fps, 1.0 / fps)
    ledger = StreamLedger(camera=camera)
    core = EngineCore(policy, executor, clock, ledger, calibrate=True)
    executor.core = core
    frames = clip if clip is not None else synthetic_clip(pipe.default_size, 48, seed=0)
    refused: list[str] = []
    start = clock()
    arrivals = [start + i * stagger_s for i in range(streams)]
    end = start + seconds
    last_tick = start
    sid = 0
    while clock() < end:
        now = clock()
        while arrivals and arrivals[0] <= now:
            arrivals.pop(0)
            admission = core.arrive(sid, LIVE_CONTENT_S)
            if admission.accepted:
                stream = pipe.open_stream(StreamParams(prompt="oil painting", seed=sid, size=pipe.default_size))
                processor = InProcessProcessor(stream, first_n, chunk_n)
                executor.streams[sid] = HeadlessStream(sid, processor, frames, keep=keep)
            else:
                refused.append(admission.reason)
            sid += 1
        for s in executor.streams.values():
            if s.at_startup is None and s.viewer is not None and now - s.viewer.arrival_t >= STARTUP_S:
                s.at_startup = (s.viewer.chunks_on_time, s.viewer.chunks_late)
        if now - last_tick >= TICK_S:
            last_tick = now
            core.tick()
            if on_progress is not None:
                on_progress(now - start)
        executor.wake = math.inf
        core.kick_all()
        if not executor.run_next():
            nxt = min(executor.wake, arrivals[0] if arrivals else math.inf, last_tick + TICK_S, end)
            time.sleep(max(0.0, min(IDLE_S, nxt - clock())))
    elapsed = clock() - start
    reports = []
    for s in executor.streams.values():
        tracker = s.viewer or PlayoutTracker(0.0, 0.0, 0.0)
        span = (s.last_out_t - s.first_out_t) if s.first_out_t is not None and s.last_out_t is not None else 0.0
        on0, late0 = s.at_startup or (tracker.chunks_on_time, tracker.chunks_late)
        reports.append(StreamReport(s.sid, tracker.chunks_on_time, tracker.chunks_late, tracker.stall_count,
                                    s.frames_out, s.frames_out / span if span > 0 else 0.0, dict(s.points),
                                    tracker.chunks_on_time - on0, tracker.chunks_late - late0))
    c = core.counters
    steps = sorted(executor.step_seconds)
    report = HeadlessReport(tuple(reports), tuple(refused), elapsed, executor.forwards, c.evictions, c.restores,
                            c.preemptions, 1000 * steps[len(steps) // 2] if steps else 0.0)
    return report, executor.streams
