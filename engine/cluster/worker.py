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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.pipeline import Pipeline, Stream, StreamParams
from engine.streaming.state import StreamState

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


@dataclass(frozen=True)
class StreamHandoff:
    """One stream in flight between workers: its current controls and its serialised state.

    ``state`` is ``StreamState.to_bytes()`` viewed as a uint8 array: Ray serialises numpy arrays out of
    band, so the state is copied once into the object store and the destination reads it in place. The
    handoff goes from the source actor straight to the destination actor, never through the controller.
    """

    stream_id: int
    params: StreamParams
    state: np.ndarray


@dataclass(frozen=True)
class MoveReport:
    """One end of a migration: bytes handled and the seconds that end spent (serialise or install)."""

    stream_id: int
    nbytes: int
    seconds: float


class UnknownStreamError(LookupError):
    """The worker does not host this stream (never opened here, closed, or moved away)."""


class StreamWorker:
    """A model replica plus its streams: resident (ready to run), suspended (state in host memory), or
    frozen (exported for a migration; dropped once the controller confirms the move)."""

    def __init__(self, model: str | None, device: str = "cpu", threads: int = 1,
                 loras: tuple[tuple[str, str, float], ...] = ()) -> None:
        if threads > 0:
            # One thread per actor: actors share the machine's cores, and fixed threading keeps the
            # floating-point reduction order, hence a migrated stream's output, bit-identical.
            torch.set_num_threads(threads)
        t0 = time.perf_counter()
        self.pipe = Pipeline.load(model, device=device)
        for name, path, strength in loras:
            self.pipe.load_lora(name, path, strength)
        self.device = device
        self._streams: dict[int, Stream] = {}
        self._suspended: set[int] = set()
        self._frozen: set[int] = set()
        log.info("worker %d loaded %s on %s in %.1f s", os.getpid(), self.pipe.name, device, time.perf_counter() - t0)

    def info(self) -> WorkerInfo:
        pipe = self.pipe
        width, height = pipe.default_size
        return WorkerInfo(pipe.name, os.getpid(), pipe.first_chunk_frames, pipe.chunk_frames, (int(width), int(height)),
                          tuple(pipe.lora_info()))

    def ping(self) -> dict[str, int]:
        """Health check; also the counts the controller reports."""
        return {"resident": len(self._streams) - len(self._suspended), "suspended": len(self._suspended)}

    # -- stream lifetime ------------------------------------------------------------------------------

    def open(self, stream_id: int, params: StreamParams) -> None:
        if stream_id in self._streams:
            raise ValueError(f"stream {stream_id} is already open on this worker")
        self._streams[stream_id] = self.pipe.open_stream(params, str(stream_id))

    def close(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)
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

    def process(self, stream_id: int, frames: np.ndarray) -> np.ndarray:
        """One chunk. A stream that has not run yet (just opened, or re-admitted after its worker died)
        takes its first chunk from the newest frame of a full chunk and holds that output for the
        chunk's length, so a caller mid-stream needs no special case after a recovery."""
        stream = self._runnable(stream_id)
        first = stream.expected_frames
        if stream.state.chunks == 0 and len(frames) > first:
            out = stream.process(frames[-first:])
            return np.repeat(out[-1:], len(frames), axis=0)
        return stream.process(frames)

    def update(self, stream_id: int, changes: dict[str, Any]) -> StreamParams:
        """Apply control changes (next chunk boundary); returns the stream's new controls."""
        stream = self._runnable(stream_id)
        stream.update(**changes)
        return stream.params

    def reset(self, stream_id: int) -> None:
        self._runnable(stream_id).reset()

    # -- offload --------------------------------------------------------------------------------------

    def suspend(self, stream_id: int) -> int:
        """Move the stream's state to host memory (frees accelerator memory); returns its size in bytes."""
        stream = self._runnable(stream_id)
        stream.state = stream.state.to("cpu")
        self._suspended.add(stream_id)
        return stream.state.nbytes()

    def resume(self, stream_id: int) -> None:
        stream = self._streams.get(stream_id)
        if stream is None or stream_id not in self._suspended:
            raise UnknownStreamError(f"stream {stream_id} is not suspended on this worker")
        stream.state = stream.state.to(self.device)
        self._suspended.discard(stream_id)

    # -- migration ------------------------------------------------------------------------------------

    def export_stream(self, stream_id: int) -> tuple[MoveReport, StreamHandoff]:
        """Freeze the stream here and serialise it; it stays frozen until ``close`` (moved) or ``thaw``
        (the move failed), so a failed transfer never loses the stream. The small report comes apart
        from the handoff so that the controller can learn the export's fate without fetching the state."""
        stream = self._runnable(stream_id)
        t0 = time.perf_counter()
        data = np.frombuffer(stream.state.to_bytes(), dtype=np.uint8)
        self._frozen.add(stream_id)
        return MoveReport(stream_id, data.nbytes, time.perf_counter() - t0), StreamHandoff(stream_id, stream.params, data)

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
        state = StreamState.from_bytes(handoff.state.tobytes(), self.device)
        # Cheap after ``prepare`` (prompt cached); the fresh state it makes is replaced whole.
        stream = self.pipe.open_stream(handoff.params, str(handoff.stream_id))
        stream.state = state
        self._streams[handoff.stream_id] = stream
        return MoveReport(handoff.stream_id, handoff.state.nbytes, time.perf_counter() - t0)
