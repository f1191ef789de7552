"""The small protocol the frame path drives, and its adapter over `engine.pipeline`.

The server never touches torch: it hands uint8 RGB chunks to a `StreamProcessor` on the one
engine thread and gets uint8 RGB chunks back. Keeping this seam narrow lets the frame path be
exercised with the real tiny model in tests and lets other engines plug in.
"""

from __future__ import annotations

import logging
import time
import uuid
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from engine.serving.fidelity import FidelityConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamSettings:
    """What a client chooses when it opens a stream (the engine's StreamParams, plus blending)."""

    prompt: str = "oil painting"
    noise_scale: float = 0.8
    steps: int = 2
    seed: int = 0
    stabilize: bool = True  # the temporal stabilizer, where the model's config has one


class StreamProcessor(Protocol):
    """One stream's engine state. Every call happens on the engine thread."""

    @property
    def first_chunk_frames(self) -> int: ...

    @property
    def chunk_frames(self) -> int: ...

    def process(self, frames: np.ndarray) -> np.ndarray:
        """uint8 [T, H, W, 3] RGB at the factory's size -> uint8 [T, H, W, 3]."""
        ...

    def update(self, **changes: Any) -> None:
        """Prompt / noise / steps / seed changes, applied at the next chunk boundary."""
        ...

    def reset(self) -> None: ...


class ProcessorFactory(Protocol):
    @property
    def size(self) -> tuple[int, int]:
        """(width, height) the engine expects; the server resizes frames to it."""
        ...

    def open(self, settings: StreamSettings) -> StreamProcessor: ...


def parallel_chunks(factory: ProcessorFactory) -> int:
    """How many chunks (of different streams) the factory's engine can run at once.

    A factory may declare ``parallel_chunks``; one in-process pipeline is not thread-safe, so the
    default is 1. Engines behind a thread-safe router (Ray workers) can say how many they run.
    """
    return max(1, int(getattr(factory, "parallel_chunks", 1)))


def per_chunk_fidelity(factory: ProcessorFactory) -> bool:
    """Whether the factory's processors are `BatchProcessor`s (a factory declares it), so the
    serving policy can set their fidelity per chunk and batch them (app/server/scheduler.py)."""
    return bool(getattr(factory, "per_chunk_fidelity", False))


@runtime_checkable
class BatchProcessor(Protocol):
    """A `StreamProcessor` whose fidelity the serving policy sets per chunk and whose chunks can run
    together with other streams' in one batched forward (app/server/scheduler.py drives it)."""

    @property
    def first_chunk_frames(self) -> int: ...

    @property
    def chunk_frames(self) -> int: ...

    def process(self, frames: np.ndarray) -> np.ndarray: ...

    def fidelity(self) -> FidelityConfig: ...

    def set_fidelity(self, config: FidelityConfig) -> None:
        """Applies from the next chunk; raises ValueError for a config this engine cannot run."""
        ...

    def batch_key(self) -> Hashable:
        """Streams whose keys are equal may share one forward (same fidelity, sizes, cache fill)."""
        ...

    def process_batch(self, rows: Sequence[tuple[BatchProcessor, np.ndarray]]) -> list[np.ndarray]:
        """Run each (processor, frames) row's chunk in one batched forward; rows share ``batch_key``."""
        ...


class PipelineProcessor:
    """A `StreamProcessor` over one `engine.pipeline` stream."""

    def __init__(self, stream: Any, first_chunk_frames: int, chunk_frames: int) -> None:
        self._stream = stream
        self._first = first_chunk_frames
        self._chunk = chunk_frames

    @property
    def first_chunk_frames(self) -> int:
        return self._first

    @property
    def chunk_frames(self) -> int:
        return self._chunk

    def process(self, frames: np.ndarray) -> np.ndarray:
        return np.asarray(self._stream.process(frames), dtype=np.uint8)

    def update(self, **changes: Any) -> None:
        self._stream.update(**changes)

    def reset(self) -> None:
        self._stream.reset()

    # -- BatchProcessor: the serving policy's per-chunk fidelity and batched forwards --------------

    def fidelity(self) -> FidelityConfig:
        config: FidelityConfig = self._stream.state.fidelity
        return config

    def set_fidelity(self, config: FidelityConfig) -> None:
        if config != self.fidelity():
            self._stream.update(steps=config.steps, kv_window_frames=config.kv_window_frames,
                                precision=config.precision, resolution_scale=config.resolution_scale)

    def batch_key(self) -> Hashable:
        stream = self._stream
        state = stream.state
        runtime = stream.runtime
        cache = state.kv[0] if state.kv else None
        fill = (cache.local_end, cache.window_frames, len(state.kv)) if cache is not None else (0, 0, 0)
        return (id(runtime), state.fidelity, state.size, runtime.engine_size(state.size, state.fidelity), fill)

    def process_batch(self, rows: Sequence[tuple[BatchProcessor, np.ndarray]]) -> list[np.ndarray]:
        from engine.frames import frames_to_tensor, tensor_to_frames

        streams = []
        for processor, _ in rows:
            if not isinstance(processor, PipelineProcessor):
                raise TypeError(f"cannot batch a {type(processor).__name__} with a PipelineProcessor")
            streams.append(processor._stream)
        chunks = [frames_to_tensor(frames, s.expected_frames) for s, (_, frames) in zip(streams, rows, strict=True)]
        results = streams[0].runtime.step_batch([s.state for s in streams], chunks)
        for stream, result in zip(streams, results, strict=True):
            stream.last = result
        return [tensor_to_frames(r.frames) for r in results]


class PipelineFactory:
    """Opens streams on one loaded `engine.pipeline.Pipeline`."""

    per_chunk_fidelity = True  # its processors are BatchProcessors

    def __init__(self, pipeline: Any) -> None:
        self._pipe = pipeline

    @classmethod
    def load(cls, model: str | None, device: str = "cpu") -> PipelineFactory:
        from engine.pipeline import Pipeline

        t0 = time.perf_counter()
        pipe = Pipeline.load(model=model, device=device)
        log.info("loaded model %s on %s in %.1f s", model or "(embedded default)", device, time.perf_counter() - t0)
        return cls(pipe)

    @property
    def pipeline(self) -> Any:
        """The loaded `engine.pipeline.Pipeline` (the playground's file and text tabs use it)."""
        return self._pipe

    @property
    def size(self) -> tuple[int, int]:
        width, height = self._pipe.default_size
        return int(width), int(height)

    def open(self, settings: StreamSettings) -> StreamProcessor:
        from engine.pipeline import StreamParams

        stream = self._pipe.open_stream(StreamParams(**asdict(settings)))
        return PipelineProcessor(stream, int(self._pipe.first_chunk_frames), int(self._pipe.chunk_frames))


class RayProcessor:
    """A `StreamProcessor` whose chunks run on the stream's home Ray worker (engine.cluster): the
    controller routes each call, and re-homing or a worker failure happens underneath it."""

    def __init__(self, controller: Any, stream_id: int) -> None:
        self._controller = controller
        self.stream_id = stream_id

    @property
    def first_chunk_frames(self) -> int:
        return int(self._controller.info.first_chunk_frames)

    @property
    def chunk_frames(self) -> int:
        return int(self._controller.info.chunk_frames)

    def process(self, frames: np.ndarray) -> np.ndarray:
        return np.asarray(self._controller.process(self.stream_id, frames), dtype=np.uint8)

    def update(self, **changes: Any) -> None:
        self._controller.update(self.stream_id, **changes)

    def reset(self) -> None:
        self._controller.reset(self.stream_id)


class RayFactory:
    """Opens streams on a cluster of Ray worker actors (`diffcast serve --ray` / `--ray-address`)."""

    def __init__(self, controller: Any) -> None:
        self.controller = controller

    @classmethod
    def start(
        cls, model: str | None, device: str = "cpu", workers: int = 2, address: str | None = None, threads: int = 1
    ) -> RayFactory:
        """Start a local Ray cluster (``address`` None) or join one, bring up ``workers`` actors, and
        health-check them in the background."""
        from engine.cluster.controller import ClusterConfig, ClusterController

        gpus = 1.0 if device.startswith("cuda") else 0.0
        config = ClusterConfig(model=model, workers=workers, device=device, threads_per_worker=threads,
                               gpus_per_worker=gpus)
        controller = ClusterController.start(config, address)
        controller.start_monitor()
        return cls(controller)

    @property
    def size(self) -> tuple[int, int]:
        width, height = self.controller.info.default_size
        return int(width), int(height)

    @property
    def parallel_chunks(self) -> int:
        """One chunk per worker actor at a time (each actor runs its calls in order)."""
        return int(self.controller.config.workers)

    def open(self, settings: StreamSettings) -> StreamProcessor:
        from engine.pipeline import StreamParams

        # Unique across every factory sharing the cluster; 63 bits, as the policy's stream ids are int64.
        stream_id = uuid.uuid4().int >> 65
        self.controller.open(stream_id, StreamParams(**asdict(settings)))
        processor = RayProcessor(self.controller, stream_id)
        # The processor protocol has no close: the stream leaves its worker when its session drops it.
        weakref.finalize(processor, self.controller.close, stream_id)
        return processor


class DelayedProcessor:
    """Adds a sleep to every chunk: emulates a model slower than the camera (test knob).

    ``step_delay_s`` is added per denoising step of the chunk's fidelity (once per batched forward):
    it emulates a DiT-dominated model (the 1.3B on a GPU), where fewer steps really are faster.
    """

    def __init__(self, inner: StreamProcessor, delay_s: float, step_delay_s: float = 0.0) -> None:
        self._inner = inner
        self._delay_s = delay_s
        self._step_delay_s = step_delay_s

    def _sleep(self) -> None:
        steps = self._inner.fidelity().steps if isinstance(self._inner, BatchProcessor) else 0
        time.sleep(self._delay_s + self._step_delay_s * steps)

    def fidelity(self) -> FidelityConfig:
        return self._batch_inner().fidelity()

    def set_fidelity(self, config: FidelityConfig) -> None:
        self._batch_inner().set_fidelity(config)

    def batch_key(self) -> Hashable:
        return self._batch_inner().batch_key()

    def process_batch(self, rows: Sequence[tuple[BatchProcessor, np.ndarray]]) -> list[np.ndarray]:
        self._sleep()
        inner = [(p._batch_inner() if isinstance(p, DelayedProcessor) else p, f) for p, f in rows]
        return self._batch_inner().process_batch(inner)

    def _batch_inner(self) -> BatchProcessor:
        if not isinstance(self._inner, BatchProcessor):
            raise TypeError(f"{type(self._inner).__name__} has no per-chunk fidelity or batching")
        return self._inner

    @property
    def first_chunk_frames(self) -> int:
        return self._inner.first_chunk_frames

    @property
    def chunk_frames(self) -> int:
        return self._inner.chunk_frames

    def process(self, frames: np.ndarray) -> np.ndarray:
        self._sleep()
        return self._inner.process(frames)

    def update(self, **changes: Any) -> None:
        self._inner.update(**changes)

    def reset(self) -> None:
        self._inner.reset()


class DelayedFactory:
    def __init__(self, inner: ProcessorFactory, delay_s: float, step_delay_s: float = 0.0) -> None:
        self._inner = inner
        self._delay_s = delay_s
        self._step_delay_s = step_delay_s

    @property
    def size(self) -> tuple[int, int]:
        return self._inner.size

    @property
    def parallel_chunks(self) -> int:
        return parallel_chunks(self._inner)

    @property
    def per_chunk_fidelity(self) -> bool:
        return per_chunk_fidelity(self._inner)

    def open(self, settings: StreamSettings) -> StreamProcessor:
        return DelayedProcessor(self._inner.open(settings), self._delay_s, self._step_delay_s)
