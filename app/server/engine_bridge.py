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
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamSettings:
    """What a client chooses when it opens a stream (the engine's StreamParams, plus blending)."""

    prompt: str = "oil painting"
    noise_scale: float = 0.8
    steps: int = 2
    seed: int = 0


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


class PipelineFactory:
    """Opens streams on one loaded `engine.pipeline.Pipeline`."""

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
    """Adds a fixed sleep to every chunk: emulates a model slower than the camera (test knob)."""

    def __init__(self, inner: StreamProcessor, delay_s: float) -> None:
        self._inner = inner
        self._delay_s = delay_s

    @property
    def first_chunk_frames(self) -> int:
        return self._inner.first_chunk_frames

    @property
    def chunk_frames(self) -> int:
        return self._inner.chunk_frames

    def process(self, frames: np.ndarray) -> np.ndarray:
        time.sleep(self._delay_s)
        return self._inner.process(frames)

    def update(self, **changes: Any) -> None:
        self._inner.update(**changes)

    def reset(self) -> None:
        self._inner.reset()


class DelayedFactory:
    def __init__(self, inner: ProcessorFactory, delay_s: float) -> None:
        self._inner = inner
        self._delay_s = delay_s

    @property
    def size(self) -> tuple[int, int]:
        return self._inner.size

    @property
    def parallel_chunks(self) -> int:
        return parallel_chunks(self._inner)

    def open(self, settings: StreamSettings) -> StreamProcessor:
        return DelayedProcessor(self._inner.open(settings), self._delay_s)
