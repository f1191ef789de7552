"""One stream driven step by step through the chunk recipe's stages, and one engine step over several.

The engine core (engine/serving/core.py) plans every denoising step; whoever owns the engine carries a
step out with :func:`run_step`: the in-process server's engine thread (app/server/serving/executors.py) and each
Ray worker actor (engine/cluster/worker.py) run this same code, so per-chunk fidelity, cross-user
batches, eviction to host memory and step preemption behave alike on both.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeGuard, runtime_checkable

import numpy as np

from engine.aspect import StreamSizes
from engine.fidelity import FidelityConfig
from engine.streaming.parcel import Parcel, park, unpark


@runtime_checkable
class StepProcessor(Protocol):
    """A `StreamProcessor` the engine core drives through the chunk recipe's stages: its fidelity
    is set per chunk, its chunk runs one denoising step at a time (so a more urgent stream can run
    between two steps), steps of several streams share one forward, with ``step_batch`` the steps of
    its successive chunks share one forward too, and its state can be parked in host memory and
    brought back bit-identically. Calls come from the engine's threads (one per lane): ``lock`` is held
    around each, so a control change never lands in the middle of the stream's step."""

    lock: threading.RLock

    @property
    def first_chunk_frames(self) -> int: ...

    @property
    def chunk_frames(self) -> int: ...

    def process(self, frames: np.ndarray) -> np.ndarray: ...

    def update(self, **changes: Any) -> None: ...

    def reset(self) -> None: ...

    def fidelity(self) -> FidelityConfig: ...

    def set_fidelity(self, config: FidelityConfig) -> None:
        """Applies from the next chunk; raises ValueError for a config this engine cannot run."""
        ...

    def begin_chunk(self, frames: np.ndarray) -> None:
        """A new chunk enters (encode, noise). Chunks still in the step batch finish first when the new
        chunk cannot join them (another fidelity); their frames come out of :meth:`take_finished`."""
        ...

    def step_rows(self) -> list[tuple[Hashable, Any]]:
        """The chunks that take a denoising step now (one, or every chunk of the step batch), each with
        the key that says which rows may share a forward."""
        ...

    def denoise_rows(self, rows: Sequence[Any]) -> None:
        """One forward moving every row (from ``step_rows`` of any processors of this engine) one step."""
        ...

    def take_finished(self) -> list[np.ndarray]:
        """Frames of every finished chunk, oldest first (decode, stabilizer): uint8 [T, H, W, 3] each."""
        ...

    def drop_chunks(self) -> None:
        """Forget chunks in flight (the policy abandoned them); the stream's state stays as it is."""
        ...

    def offload(self) -> int:
        """Move the stream's state (and chunks in flight) to host memory; returns its bytes."""
        ...

    def restore(self) -> None:
        """Bring the state back from host memory, bit-identical."""
        ...

    @property
    def offloaded(self) -> bool: ...


class InProcessProcessor:
    """A `StepProcessor` over one `engine.pipeline` stream and its runtime's chunk stages."""

    def __init__(self, stream: Any, first_chunk_frames: int, chunk_frames: int) -> None:
        self._stream = stream
        self._first = first_chunk_frames
        self._chunk = chunk_frames
        self._queue: list[Any] = []  # the runtime's ChunkInFlight objects, oldest first
        self._drained: list[np.ndarray] = []  # frames of chunks finished while making room
        self._parked: Parcel | None = None  # state and chunks in flight while offloaded to host memory
        self._size: tuple[int, int] | None = None  # the stream's size once :meth:`sizes` has settled it
        self.lock = threading.RLock()  # run_step holds it over a whole step; control calls take it too

    @property
    def first_chunk_frames(self) -> int:
        return self._first

    @property
    def chunk_frames(self) -> int:
        return self._chunk

    def process(self, frames: np.ndarray) -> np.ndarray:
        with self.lock:
            self._resident()
            self._queue, self._drained = [], []
            return np.asarray(self._stream.process(frames), dtype=np.uint8)

    def update(self, **changes: Any) -> None:
        with self.lock:
            # A control change while offloaded: bring the state back, change it, park it again.
            parked = self.offloaded
            self._resident()
            self._stream.update(**changes)
            if parked:
                self.offload()

    def reset(self) -> None:
        with self.lock:
            self._parked = None
            self._queue, self._drained = [], []
            self._size = None  # the next chunk's camera sizes the stream again
            self._stream.reset()

    def sizes(self, camera: tuple[int, int], config: FidelityConfig | None = None) -> StreamSizes:
        """The stream's size and the engine size its next chunk runs at (``config``: the fidelity it will
        run at; None: the stream's own) for frames from a ``camera``-sized source, the stream taking its
        size from it at its first chunk (`StreamRuntime.sizes`). A parked stream's settled size needs no
        state: it stays in host memory until the engine core restores it."""
        with self.lock:
            runtime = self._stream.runtime
            if self._size is None or config is None:
                self._resident()
                state = self._stream.state
                sizes: StreamSizes = runtime.sizes(state, camera, config or state.fidelity)
                self._size = sizes.stream
                return sizes
            return StreamSizes(self._size, runtime.engine_size(self._size, config))

    def fidelity(self) -> FidelityConfig:
        self._resident()
        config: FidelityConfig = self._stream.state.fidelity
        return config

    def set_fidelity(self, config: FidelityConfig) -> None:
        # How many streams share a forward, and on how many devices, is the executor's business.
        config = replace(config, stream_batch=1, gpus=1)
        if config != self.fidelity():
            self._stream.set_fidelity(config)

    # -- the chunk recipe's stages, driven by the engine core --------------------------------------

    def begin_chunk(self, frames: np.ndarray) -> None:
        _enter([(self, frames)])

    def _prepare(self, frames: np.ndarray) -> Any:
        """Before a new chunk enters: the state resident, chunks it cannot join finished; its input tensor."""
        from engine.frames import frames_as_uint8

        self._resident()
        stream = self._stream
        fidelity = stream.state.fidelity
        if self._queue and not (fidelity.step_batch and self._queue[-1].fidelity == fidelity):
            # The new chunk cannot join the chunks in flight (another step count, size or knob, or no
            # step batch): they finish first, without new input (StreamBatch.drain's rule).
            self._drain()
        return frames_as_uint8(frames, stream.expected_frames)

    def step_rows(self) -> list[tuple[Hashable, Any]]:
        runtime = self._stream.runtime
        per_step = runtime.config.cache_mode == "per-step"
        return [((id(runtime), c.batch_key(per_step)), c) for c in self._queue if not c.done]

    def denoise_rows(self, rows: Sequence[Any]) -> None:
        self._stream.runtime.denoise_step(rows)

    def take_finished(self) -> list[np.ndarray]:
        return _finish([self])[0]

    def drop_chunks(self) -> None:
        if self._queue and self._stream.state is not None:
            # Entering a chunk moved the stream's frame and RoPE positions past it; a dropped chunk never
            # reaches the KV cache's history, so the next one takes its positions (else it would write
            # past the cache's end: "start frame leaves a gap").
            first = self._queue[0]
            self._stream.state.frame, self._stream.state.rope_frame = first.frame, first.rope
        self._queue = []

    def _drain(self) -> None:
        while rows := self.step_rows():
            groups: dict[Hashable, list[Any]] = {}
            for key, chunk in rows:
                groups.setdefault(key, []).append(chunk)
            for group in groups.values():
                self.denoise_rows(group)
        finished = self.take_finished()  # it empties self._drained first: extend the list after the call
        self._drained.extend(finished)

    def offload(self) -> int:
        if self._parked is None:
            self._parked = park((self._stream.state, self._queue))
            self._stream.state, self._queue = None, []
        return self._parked.nbytes

    def restore(self) -> None:
        self._resident()

    @property
    def offloaded(self) -> bool:
        return self._parked is not None

    @property
    def parked(self) -> Parcel | None:
        """The state (and chunks in flight) as parked in host memory, while offloaded."""
        return self._parked

    def adopt(self, parked: Parcel) -> None:
        """Take over a parked copy of this stream's state (from another replica), without its chunks
        in flight: the stream goes on from the chunk boundary the copy was made at."""
        self._parked = parked
        self._resident()
        self._queue, self._drained = [], []
        self._size = None

    @property
    def stream(self) -> Any:
        """The `engine.pipeline.Stream` underneath (resident)."""
        self._resident()
        return self._stream

    def _resident(self) -> None:
        if self._parked is None:
            return
        self._stream.state, self._queue = unpark(self._parked, self._stream.runtime.device)
        self._parked = None


def begin_chunks(rows: Sequence[tuple[StepProcessor, np.ndarray]]) -> None:
    """New chunks of several streams enter; those of in-process streams on one runtime encode in one VAE
    call (`StreamRuntime.enter_chunks`), as their denoising steps share forwards."""
    local: list[tuple[InProcessProcessor, np.ndarray]] = []
    for processor, frames in rows:
        if _batches(processor, "begin_chunk"):
            local.append((processor, frames))
        else:
            processor.begin_chunk(frames)
    _enter(local)


def take_finished(processors: Sequence[StepProcessor]) -> list[list[np.ndarray]]:
    """Each processor's finished chunks (:meth:`StepProcessor.take_finished`); in-process streams on one
    runtime decode together (`StreamRuntime.finish_chunks`)."""
    out: list[list[np.ndarray]] = [[] for _ in processors]
    local = [(i, p) for i, p in enumerate(processors) if _batches(p, "take_finished")]
    for i, processor in enumerate(processors):
        if not _batches(processor, "take_finished"):
            out[i] = processor.take_finished()
    for (i, _), frames in zip(local, _finish([p for _, p in local]), strict=True):
        out[i] = frames
    return out


def _enter(rows: Sequence[tuple[InProcessProcessor, np.ndarray]]) -> None:
    groups: dict[int, list[tuple[InProcessProcessor, Any]]] = {}
    for processor, frames in rows:
        groups.setdefault(id(processor._stream.runtime), []).append((processor, processor._prepare(frames)))
    for group in groups.values():
        runtime = group[0][0]._stream.runtime
        chunks = runtime.enter_chunks([p._stream.state for p, _ in group], [t for _, t in group])
        for (processor, _), chunk in zip(group, chunks, strict=True):
            processor._queue.append(chunk)


def _finish(processors: Sequence[InProcessProcessor]) -> list[list[np.ndarray]]:
    """Finished chunks of in-process streams, decoded a round at a time (a stream's decoder cache takes
    its chunks in order), the streams of one runtime together in each round."""
    from engine.frames import tensor_to_frames

    out: list[list[np.ndarray]] = []
    for processor in processors:
        out.append(processor._drained)
        processor._drained = []
    while heads := [(i, p) for i, p in enumerate(processors) if p._queue and p._queue[0].done]:
        groups: dict[int, list[tuple[int, InProcessProcessor]]] = {}
        for i, p in heads:
            groups.setdefault(id(p._stream.runtime), []).append((i, p))
        for group in groups.values():
            results = group[0][1]._stream.runtime.finish_chunks([p._queue.pop(0) for _, p in group])
            for (i, p), result in zip(group, results, strict=True):
                p._stream.last = result
                out[i].append(tensor_to_frames(result.frames))
    return out


def _batches(processor: StepProcessor, method: str) -> TypeGuard[InProcessProcessor]:
    """Whether ``processor``'s ``method`` may be batched with others': an in-process stream's, unless a
    subclass overrides it (its own version then runs, as the protocol promises)."""
    return isinstance(processor, InProcessProcessor) and (
        getattr(type(processor), method) is getattr(InProcessProcessor, method))


@dataclass(frozen=True)
class StepRow:
    """One stream's part of an engine step: a new chunk (its fidelity and input frames) or None, the
    next step of the chunk it has in flight."""

    processor: StepProcessor
    config: FidelityConfig | None = None
    inputs: np.ndarray | None = None


def run_step(rows: Sequence[StepRow], evict: Sequence[StepProcessor] = (), restore: Sequence[StepProcessor] = (),
             delay_s: float = 0.0, step_delay_s: float = 0.0) -> tuple[list[list[np.ndarray]], int]:
    """Park, unpark, enter new chunks, one forward per batch group, take finished chunks.

    Returns every row's finished chunks (uint8 [T, H, W, 3] each, oldest first) and the forwards run.
    ``delay_s`` per new chunk and ``step_delay_s`` per forward emulate a slower engine (test knobs).
    Every processor's lock is held for the whole step (in one order, so two lanes never deadlock)."""
    involved = {id(p): p for p in (*evict, *restore, *(row.processor for row in rows))}
    with ExitStack() as held:
        for key in sorted(involved):
            held.enter_context(involved[key].lock)
        return _run_step(rows, evict, restore, delay_s, step_delay_s)


def _run_step(rows: Sequence[StepRow], evict: Sequence[StepProcessor], restore: Sequence[StepProcessor],
              delay_s: float, step_delay_s: float) -> tuple[list[list[np.ndarray]], int]:
    for processor in evict:
        processor.offload()
    for processor in restore:
        processor.restore()
    entering = [row for row in rows if row.inputs is not None]
    for row in entering:
        if row.config is not None:
            row.processor.set_fidelity(row.config)
        if delay_s:
            time.sleep(delay_s)
    begin_chunks([(row.processor, row.inputs) for row in entering if row.inputs is not None])
    groups: dict[Hashable, list[tuple[StepProcessor, Any]]] = {}
    for row in rows:
        for key, item in row.processor.step_rows():
            groups.setdefault(key, []).append((row.processor, item))
    for group in groups.values():
        if step_delay_s:
            time.sleep(step_delay_s)
        group[0][0].denoise_rows([item for _, item in group])
    return take_finished([row.processor for row in rows]), len(groups)
