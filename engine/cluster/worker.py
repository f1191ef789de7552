"""The worker: one model replica and the streams homed on it, as a plain class that runs as a Ray actor.

Every method is a chunk-boundary operation; Ray runs an actor's stream calls one at a time, so a stream's
state is never touched by two calls at once (health pings run on a thread of their own and touch no
stream). The class itself does not import Ray: the controller wraps it
with ``ray.remote`` (so it can also be constructed in-process, e.g. by the migration benchmark).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.devices import resolve_device, resolve_dtype, stream_memory
from engine.fidelity import FidelityConfig
from engine.pipeline import Pipeline, Stream, StreamParams
from engine.streaming.parcel import Parcel, park, unpark
from engine.streaming.state import StreamState
from engine.streaming.step_processor import InProcessProcessor, StepRow, run_step
from engine.streaming.thread_budget import serial_opencv

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerInfo:
    """What the control process needs to know about a replica (same for every replica of a model)."""

    model: str
    pid: int
    first_chunk_frames: int
    chunk_frames: int
    default_size: tuple[int, int]
    loras: tuple[dict[str, Any], ...] = ()  # Pipeline.lora_info() of the replica
    size_granularity: int = 16  # Pipeline.size_granularity: a stream's sides are multiples of it
    # engine.devices.stream_memory of the replica once loaded: device bytes free for states (None on a
    # CPU) and its weights' bytes; the replicas run alike, so the first one's stands for all.
    free_memory_bytes: int | None = None
    weight_bytes: int = 0


@dataclass(frozen=True)
class StreamHandoff:
    """One stream in flight between workers: its current controls and its parked state.

    ``state`` is a `Parcel` (engine/streaming/parcel.py): its tensors' bytes travel as numpy arrays, which
    Ray serialises out of band, so the state is copied once into the object store and the destination
    reads it in place. The handoff goes from the source actor straight to the destination actor, never
    through the controller.
    """

    stream_id: int
    params: StreamParams
    state: Parcel


@dataclass(frozen=True)
class MoveReport:
    """One end of a migration: bytes handled and the seconds that end spent (serialise or install)."""

    stream_id: int
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class ChunkOrder:
    """One stream's part of a step: ``frames`` and ``config`` for a chunk that enters now (uint8
    [T, H, W, 3] at the engine size), both None for the next step of the chunk in flight. ``camera``:
    the (width, height) of the camera the frames were resized from, which the stream takes its size from
    at its first chunk (the engine's rule, StreamRuntime.sizes); None: the frames are at the stream's
    size, and it takes its size from them."""

    stream_id: int
    config: FidelityConfig | None = None
    frames: np.ndarray | None = None
    camera: tuple[int, int] | None = None


@dataclass(frozen=True)
class StepCall:
    """One engine-core ``Work`` on this worker (engine/serving/core.py): park ``evict``, unpark
    ``restore``, then one denoising step of ``orders`` (streams at one point share a forward)."""

    orders: tuple[ChunkOrder, ...]
    evict: tuple[int, ...] = ()
    restore: tuple[int, ...] = ()
    delay_s: float = 0.0  # emulated extra latency per chunk entering (--engine-delay-ms, --worker-delay-ms)
    step_delay_s: float = 0.0  # per forward (--engine-step-delay-ms)
    drop: tuple[int, ...] = ()  # streams whose chunks in flight the policy abandoned: forgotten first


@dataclass(frozen=True)
class StepOutcome:
    """Finished chunks per stream (oldest first), forwards run, the step's engine seconds, and the
    parked copies of the states evicted by this call (the controller keeps them: a copy that outlives
    this worker)."""

    finished: dict[int, list[np.ndarray]]
    forwards: int
    seconds: float
    parked: dict[int, Parcel] = field(default_factory=dict)


class UnknownStreamError(LookupError):
    """The worker does not host this stream (never opened here, closed, or moved away)."""


class StreamWorker:
    """A model replica plus its streams: resident (ready to run), suspended (state in host memory), or
    frozen (exported for a migration; dropped once the controller confirms the move)."""

    def __init__(self, model: str | None, device: str = "cpu", threads: int = 1,
                 loras: tuple[tuple[str, str, float], ...] = (), dtype: str = "auto", vae: str | None = None) -> None:
        if threads > 0:
            # One thread per actor: actors share the machine's cores, and fixed threading keeps the
            # floating-point reduction order, hence a migrated stream's output, bit-identical.
            torch.set_num_threads(threads)
        t0 = time.perf_counter()
        self.pipe = Pipeline.load(model, device=device, dtype=resolve_dtype(dtype, resolve_device(device)), vae=vae)
        if resolve_device(device).type == "cpu":
            serial_opencv()  # actors share the cores: OpenCV adds no threads to theirs
        for name, path, strength in loras:
            self.pipe.load_lora(name, path, strength)
        self.device = device
        self._streams: dict[int, Stream] = {}
        # The step-wise view of each stream (the engine core's Work runs through it), and the frame
        # count each chunk in flight must come back with (a re-admitted stream's first chunk is shorter).
        self._steppers: dict[int, InProcessProcessor] = {}
        self._lengths: dict[int, deque[int]] = {}
        self._suspended: set[int] = set()
        self._frozen: set[int] = set()
        log.info("worker %d loaded %s on %s in %.1f s", os.getpid(), self.pipe.name, device, time.perf_counter() - t0)

    def info(self) -> WorkerInfo:
        pipe = self.pipe
        width, height = pipe.default_size
        free, weights = stream_memory(pipe.runtime)
        return WorkerInfo(pipe.name, os.getpid(), pipe.first_chunk_frames, pipe.chunk_frames, (int(width), int(height)),
                          tuple(pipe.lora_info()), int(pipe.size_granularity), free, weights)

    def ping(self) -> dict[str, int]:
        """Health check; also the counts the controller reports."""
        # A suspended stream's state is parked too; count it once, as suspended.
        parked = sum(1 for sid, p in self._steppers.items() if p.offloaded and sid not in self._suspended)
        return {"resident": len(self._streams) - len(self._suspended) - parked, "suspended": len(self._suspended),
                "parked": parked}

    # -- stream lifetime ------------------------------------------------------------------------------

    def open(self, stream_id: int, params: StreamParams) -> None:
        if stream_id in self._streams:
            raise ValueError(f"stream {stream_id} is already open on this worker")
        self._install(stream_id, self.pipe.open_stream(params, str(stream_id)))

    def _install(self, stream_id: int, stream: Stream) -> None:
        self._streams[stream_id] = stream
        pipe = self.pipe
        self._steppers[stream_id] = InProcessProcessor(stream, int(pipe.first_chunk_frames), int(pipe.chunk_frames))
        self._lengths[stream_id] = deque()

    def close(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)
        self._steppers.pop(stream_id, None)
        self._lengths.pop(stream_id, None)
        self._suspended.discard(stream_id)
        self._frozen.discard(stream_id)

    def _runnable(self, stream_id: int) -> Stream:
        stream = self._streams.get(stream_id)
        if stream is None:
            raise UnknownStreamError(f"stream {stream_id} is not on this worker")
        if stream_id in self._frozen:
            raise RuntimeError(f"stream {stream_id} is being migrated away from this worker")
        if stream_id in self._suspended:
            raise RuntimeError(f"stream {stream_id} is suspended to host memory; resume it first")
        return stream

    def process(self, stream_id: int, frames: np.ndarray, camera: tuple[int, int] | None = None) -> np.ndarray:
        """One chunk (``camera``: as in `ChunkOrder`). A stream that has not run yet (just opened, or
        re-admitted after its worker died) takes its first chunk from the newest frame of a full chunk
        and holds that output for the chunk's length, so a caller mid-stream needs no special case after
        a recovery."""
        self._runnable(stream_id)
        stepper = self._steppers[stream_id]
        if camera is not None:
            stepper.sizes(camera)
        first = stepper.stream.expected_frames
        if stepper.stream.state.chunks == 0 and len(frames) > first:
            out = stepper.process(frames[-first:])
            return np.repeat(out[-1:], len(frames), axis=0)
        return stepper.process(frames)

    def update(self, stream_id: int, changes: dict[str, Any]) -> StreamParams:
        """Apply control changes (next chunk boundary); returns the stream's new controls."""
        stream = self._runnable(stream_id)
        self._steppers[stream_id].update(**changes)
        return stream.params

    def reset(self, stream_id: int) -> None:
        self._runnable(stream_id)
        self._steppers[stream_id].reset()
        self._lengths[stream_id].clear()

    # -- the engine core's steps ----------------------------------------------------------------------

    def run_step(self, call: StepCall) -> StepOutcome:
        """One ``Work`` (engine.streaming.step_processor.run_step, as the in-process engine runs it)."""
        t0 = time.perf_counter()
        for sid in call.drop:
            self.drop_chunks(sid)
        rows = []
        for order in call.orders:
            self._runnable(order.stream_id)
            stepper = self._steppers[order.stream_id]
            frames = order.frames
            if frames is not None and order.camera is not None:
                # Its size from the camera's, as the server's was: not from frames at a smaller rung's size.
                stepper.sizes(order.camera, order.config)
            if frames is not None:
                # A stream that has not run yet (just opened, or re-admitted after its worker died) takes
                # its first chunk from the newest frames; its output is held for the chunk's length.
                expected = stepper.stream.expected_frames
                self._lengths[order.stream_id].append(len(frames))
                frames = frames[-expected:] if len(frames) > expected else frames
            rows.append(StepRow(stepper, order.config, frames))
        evict = [self._steppers[sid] for sid in call.evict if sid in self._steppers]
        restore = [self._steppers[sid] for sid in call.restore if sid in self._steppers]
        finished, forwards = run_step(rows, evict, restore, call.delay_s, call.step_delay_s)
        out: dict[int, list[np.ndarray]] = {}
        for order, chunks in zip(call.orders, finished, strict=True):
            lengths = self._lengths[order.stream_id]
            out[order.stream_id] = [_held(chunk, lengths.popleft() if lengths else len(chunk)) for chunk in chunks]
        parked = {sid: p for sid in call.evict if sid in self._steppers and (p := self._steppers[sid].parked)}
        return StepOutcome(out, forwards, time.perf_counter() - t0, parked)

    def drop_chunks(self, stream_id: int) -> None:
        """Forget the stream's chunks in flight (the policy abandoned them)."""
        if stream_id in self._steppers:
            self._steppers[stream_id].drop_chunks()
            self._lengths[stream_id].clear()

    def adopt(self, stream_id: int, params: StreamParams, parked: Parcel) -> None:
        """Open a stream from a parked copy of its state (re-admission after its worker died)."""
        self.open(stream_id, params)
        self._steppers[stream_id].adopt(parked)

    # -- offload --------------------------------------------------------------------------------------

    def suspend(self, stream_id: int) -> int:
        """Park the stream's state in host memory (frees accelerator memory); returns its size in bytes."""
        self._runnable(stream_id)
        nbytes = self._steppers[stream_id].offload()
        self._suspended.add(stream_id)
        return nbytes

    def resume(self, stream_id: int) -> None:
        if stream_id not in self._streams or stream_id not in self._suspended:
            raise UnknownStreamError(f"stream {stream_id} is not suspended on this worker")
        self._steppers[stream_id].restore()
        self._suspended.discard(stream_id)

    # -- migration ------------------------------------------------------------------------------------

    def export_stream(self, stream_id: int) -> tuple[MoveReport, StreamHandoff]:
        """Freeze the stream here and serialise it; it stays frozen until ``close`` (moved) or ``thaw``
        (the move failed), so a failed transfer never loses the stream. The small report comes apart
        from the handoff so that the controller can learn the export's fate without fetching the state."""
        stream = self._runnable(stream_id)
        self._steppers[stream_id].restore()  # a state parked by the policy travels as any other
        # The handoff carries the state, not chunks in flight: a step batch's partly denoised chunks
        # (the engine core already counted them as abandoned) are dropped here, giving back their frame
        # positions. Else the state would move with its position past chunks whose K/V only some step
        # caches hold, and the destination's next forward would write past a cache's end.
        self.drop_chunks(stream_id)
        t0 = time.perf_counter()
        parcel = park(stream.state)
        parcel.wait()  # the handoff is read by Ray's serialiser as soon as this returns
        self._frozen.add(stream_id)
        return (MoveReport(stream_id, parcel.nbytes, time.perf_counter() - t0),
                StreamHandoff(stream_id, stream.params, parcel))

    def thaw(self, stream_id: int) -> None:
        self._frozen.discard(stream_id)

    def prepare(self, params: StreamParams) -> None:
        """Warm this replica for a stream about to arrive (its prompt into the text encoder's cache), so
        that ``import_stream`` inside the migration hold only deserialises and installs."""
        self.pipe.open_stream(params, "prepare")

    def import_stream(self, handoff: StreamHandoff) -> MoveReport:
        t0 = time.perf_counter()
        if handoff.stream_id in self._streams:
            raise ValueError(f"stream {handoff.stream_id} is already open on this worker")
        state = unpark(handoff.state, self.device)
        if not isinstance(state, StreamState):
            raise ValueError(f"the handoff holds a {type(state).__name__}, not a stream's state")
        # Cheap after ``prepare`` (prompt cached); the fresh state it makes is replaced whole.
        stream = self.pipe.open_stream(handoff.params, str(handoff.stream_id))
        stream.state = state
        self._install(handoff.stream_id, stream)
        return MoveReport(handoff.stream_id, handoff.state.nbytes, time.perf_counter() - t0)


def _held(chunk: np.ndarray, frames: int) -> np.ndarray:
    """A chunk's output with ``frames`` frames: a short one (a restart's first chunk) holds its last frame."""
    if len(chunk) >= frames:
        return chunk
    return np.concatenate([chunk, np.repeat(chunk[-1:], frames - len(chunk), axis=0)])
