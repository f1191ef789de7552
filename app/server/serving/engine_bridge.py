"""The small protocol the frame path drives, and its adapters over the engines.

Three engines sit behind it: in process (`InProcessFactory`, over `engine.pipeline`), the DiT split
over pipeline ranks (`RankFactory`, over `engine.parallel.ring`, for `diffcast serve --gpus N`) and
Ray worker actors (`RayFactory`, over `engine.cluster`).

The server never touches torch: it hands uint8 RGB chunks to a `StreamProcessor` on the one
engine thread and gets uint8 RGB chunks back. Keeping this seam narrow lets the frame path be
exercised with the real tiny model in tests and lets other engines plug in.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from engine.aspect import StreamSizes, fit_size, scaled_size
from engine.fidelity import FidelityConfig
from engine.streaming.lanes import EngineLanes, auto_lanes

# The step-wise stream lives in engine/ (Ray worker actors run it too); the server's name for it stays.
from engine.streaming.step_processor import InProcessProcessor as InProcessProcessor
from engine.streaming.step_processor import StepProcessor as StepProcessor
from engine.streaming.thread_budget import serial_opencv, thread_budget

if TYPE_CHECKING:
    from app.server.config import LoRASpec
    from engine.compiled import CompiledRuntime
    from engine.parallel.ring import RingRuntime
    from engine.pipeline import Pipeline, StreamControls, StreamParams
    from engine.streaming.state import StreamState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamSettings:
    """What a client chooses when it opens a stream (the engine's StreamParams, plus blending)."""

    prompt: str = "oil painting"
    noise_scale: float = 0.8
    steps: int = 2
    seed: int = 0
    stabilize: bool = True  # the temporal stabilizer, where the model's config has one
    loras: dict[str, float] = field(default_factory=dict)  # strengths over the served LoRAs' defaults


class StreamProcessor(Protocol):
    """One stream's engine state. Every call happens on the engine thread."""

    @property
    def first_chunk_frames(self) -> int: ...

    @property
    def chunk_frames(self) -> int: ...

    def process(self, frames: np.ndarray) -> np.ndarray:
        """uint8 [T, H, W, 3] RGB at the chunk's engine size (`sizes`) -> uint8 [T, H, W, 3] at the
        stream's size."""
        ...

    def sizes(self, camera: tuple[int, int], config: FidelityConfig | None = None) -> StreamSizes:
        """The stream's size and the engine size of its next chunk at ``config`` (None: the stream's own
        fidelity), for frames from a ``camera``-sized source (engine/aspect.py: the engine decides, the
        stream taking its size from its first chunk's camera): the server resizes each camera frame once,
        straight to the engine size, and gets the chunk back at the stream's size."""
        ...

    def update(self, **changes: Any) -> None:
        """Prompt / noise / steps / seed changes, applied at the next chunk boundary."""
        ...

    def reset(self) -> None: ...


class EngineKind(enum.Enum):
    """How the engine core drives a factory's engine; the serving loop's executor follows from it
    (app/server/serving/serving_loop.py), never from probing the factory."""

    # StepProcessors in this process, one denoising step per engine-core Work, on engine lanes
    # (StepExecutor): per-chunk fidelity, cross-user batches, step preemption, eviction.
    IN_PROCESS = "in-process"
    # The same StepProcessors inside Ray worker actors (RayExecutor): re-homing, failures, autoscaling.
    RAY = "ray"
    # Whole chunks of several streams per Work, each at the policy's fidelity (RankExecutor; a
    # ChunkBatchFactory: the pipeline ranks): no step preemption, no eviction.
    CHUNK_BATCHES = "chunk-batches"


class ProcessorFactory(Protocol):
    """What the server needs of an engine: every member is declared by every factory."""

    kind: EngineKind

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of the model's default size (its pixel budget, and its profile's resolution)."""
        ...

    @property
    def parallel_chunks(self) -> int:
        """How many chunks (of different streams) the engine runs at once: the in-process engine's
        lanes, the Ray workers, 1 for the pipeline ranks (one ring)."""
        ...

    @property
    def pipeline(self) -> Pipeline | None:
        """The model loaded in this process (the playground's file and text tabs, the capabilities it
        serves); None where the model lives elsewhere (Ray workers)."""
        ...

    @property
    def loras(self) -> list[dict[str, Any]]:
        """The LoRAs the engine loaded (name, rank, layers, targets, default strength), for /api/config."""
        ...

    def device_memory(self) -> tuple[int | None, int]:
        """Bytes free for stream states on one worker's device (None on a CPU) and the weights' bytes."""
        ...

    def open(self, settings: StreamSettings) -> StreamProcessor: ...


class InProcessFactory:
    """Opens streams on one loaded `engine.pipeline.Pipeline`, whose steps run in ``lanes``
    (engine/streaming/lanes.py): each lane a worker of the engine core with streams of its own, the
    lanes' steps side by side on the one model."""

    kind = EngineKind.IN_PROCESS

    def __init__(self, pipeline: Any, lanes: EngineLanes | None = None) -> None:
        self._pipe = pipeline
        self.lanes = lanes if lanes is not None else EngineLanes()
        self.compiled: CompiledRuntime | None = None  # the engine's compiled call sites (serve --compile)

    @property
    def parallel_chunks(self) -> int:
        """Steps run at once: one per lane."""
        return self.lanes.lanes

    @classmethod
    def load(cls, model: str | None, device: str = "cpu", loras: Sequence[LoRASpec] = (),
             lanes: int = 1, dtype: str = "auto", vae: str | None = None) -> InProcessFactory:
        """``lanes`` 0: `auto_lanes` for the device and torch's thread count; ``dtype`` the weights'
        (engine.devices.resolve_dtype: auto = bf16 on CUDA)."""
        import torch

        from engine.devices import resolve_device, resolve_dtype
        from engine.pipeline import Pipeline

        t0 = time.perf_counter()
        pipe = Pipeline.load(model=model, device=device, dtype=resolve_dtype(dtype, resolve_device(device)), vae=vae)
        for lora in loras:
            pipe.load_lora(lora.name, lora.path, lora.strength)
        threads = torch.get_num_threads()
        count = lanes or auto_lanes(device, threads)
        log.info("loaded model %s on %s in %.1f s; %d engine lane(s), %d thread(s)", model or "(embedded default)",
                 device, time.perf_counter() - t0, count, threads)
        # On a CPU the lanes' threads follow the cores other programs leave the process, and OpenCV
        # adds no threads of its own to theirs.
        budget = None
        if device.split(":")[0] == "cpu":
            budget = thread_budget(threads)
            serial_opencv()
        return cls(pipe, EngineLanes(count, threads, budget))

    def compile(self, configs: Sequence[FidelityConfig], resolution: tuple[int, int], batches: Sequence[int],
                sites: Sequence[str], cache_dir: str | None, backend: str) -> None:
        """torch.compile the DiT and the VAE (engine/compiled.py) at the shapes ``configs`` run for streams
        at ``resolution`` (the serving profile's) and from 4:3 and 16:9 cameras, ``batches`` streams to a
        forward, at every thread count a lane may step on; other shapes run eager with a log line. Only
        configs at the weights' own precision compile (bf16 autocast over fp32 weights and fp8 run eager
        whatever their shape), so on a CPU with fp32 weights and a bf16 ladder nothing is left to compile."""
        from pathlib import Path

        from engine.compiled import compile_pipeline, config_shapes
        from engine.devices import dtype_name

        pipe = self._pipe
        native = [c for c in configs if c.precision == dtype_name(pipe.runtime.dit.dtype)]
        if not native:
            log.warning("--compile: no serving profile point runs at the weights' precision (%s); every chunk "
                        "runs eager", pipe.runtime.dit.dtype)
            return
        sizes = dict.fromkeys([resolution, pipe.stream_size((640, 480)), pipe.stream_size((1280, 720))])
        shapes = list(dict.fromkeys(s for size in sizes for s in config_shapes(pipe.runtime, size, native, batches)))
        most = self.lanes.threads or 1
        threads = list(range(1, most + 1)) if self.lanes.budget is not None or self.lanes.lanes > 1 else [most]
        self.compiled, report = compile_pipeline(pipe, shapes, backend=backend, sites=sites, threads=threads,
                                                 cache_dir=None if cache_dir is None else Path(cache_dir))
        log.info("compiled (%s) %d shapes at %d thread count(s): cold start %.1f s, %d graphs, cache %s", backend,
                 len(shapes), len(threads), report.cold_start_s, report.graphs, report.cache_dir)

    @property
    def loras(self) -> list[dict[str, Any]]:
        """The loaded LoRAs (name, rank, layers, targets, default strength), for /api/config."""
        info: list[dict[str, Any]] = self._pipe.lora_info()
        return info

    def device_memory(self) -> tuple[int | None, int]:
        """Device bytes free for stream states (None on a CPU) and the weights' bytes (admission)."""
        from engine.devices import stream_memory

        return stream_memory(self._pipe.runtime)

    @property
    def pipeline(self) -> Pipeline:
        """The loaded `engine.pipeline.Pipeline` (the playground's file and text tabs use it)."""
        pipe: Pipeline = self._pipe
        return pipe

    @property
    def size(self) -> tuple[int, int]:
        width, height = self._pipe.default_size
        return int(width), int(height)

    def open(self, settings: StreamSettings) -> StreamProcessor:
        from engine.pipeline import StreamParams

        stream = self._pipe.open_stream(StreamParams(**asdict(settings)))
        return InProcessProcessor(stream, int(self._pipe.first_chunk_frames), int(self._pipe.chunk_frames))


@runtime_checkable
class ChunkBatchFactory(Protocol):
    """A factory whose engine runs whole chunks of several streams together, each at the fidelity
    the engine core sets per chunk (the pipeline ranks: the chunks go into the ring together and
    their micro-steps overlap across ranks). The core drives it with cross-user batches and
    per-chunk fidelity, but not step by step: no step preemption, no eviction."""

    @property
    def size(self) -> tuple[int, int]: ...

    def open(self, settings: StreamSettings) -> StreamProcessor: ...

    def unsupported(self, config: FidelityConfig) -> str | None:
        """Why the engine cannot run a chunk at ``config``, in plain words; None when it can."""
        ...

    def run_chunks(self, chunks: Sequence[tuple[Any, np.ndarray, FidelityConfig | None]]) -> list[np.ndarray]:
        """One chunk of each ``(processor, uint8 [T, H, W, 3], fidelity)`` together (None: the stream's
        current fidelity); their frames, in order."""
        ...


class RankProcessor:
    """One stream on the pipeline ranks (a `StreamProcessor`); every call runs on the engine thread.

    The seam is synchronous (chunks in, the same chunks' frames out): ``process`` runs one chunk
    through the ring and back, :meth:`RankFactory.run_chunks` several streams' chunks together (the
    engine core's cross-user batches), which is what keeps every rank busy at once.
    """

    def __init__(self, factory: RankFactory, params: StreamParams) -> None:
        from engine.pipeline import StreamControls

        self.id = uuid.uuid4().hex
        self.controls = StreamControls(factory.pipeline, params, self.id, host=factory.ring)
        factory.register(self.controls)
        self._factory = factory

    @property
    def state(self) -> StreamState:
        return self.controls.state

    @property
    def first_chunk_frames(self) -> int:
        return int(self._factory.pipeline.first_chunk_frames)

    @property
    def chunk_frames(self) -> int:
        return int(self._factory.pipeline.chunk_frames)

    @property
    def expected_frames(self) -> int:
        return self.chunk_frames if self.state.chunks else self.first_chunk_frames

    def process(self, frames: np.ndarray) -> np.ndarray:
        return self._factory.run_chunks([(self, frames, None)])[0]

    def sizes(self, camera: tuple[int, int], config: FidelityConfig | None = None) -> StreamSizes:
        return self._factory.ring.rt.sizes(self.state, camera, config or self.fidelity())

    def fidelity(self) -> FidelityConfig:
        return self.controls.fidelity

    def set_fidelity(self, config: FidelityConfig) -> None:
        """The engine core's point for the stream's next chunk (a ValueError for one the ranks cannot
        run: see :meth:`RankFactory.unsupported`)."""
        config = replace(config, stream_batch=1, gpus=1)  # the batch is the executor's business
        reason = self._factory.unsupported(config)
        if reason is not None:
            raise ValueError(f"fidelity {config.label()} cannot run on the pipeline ranks: {reason}")
        if config != self.fidelity():
            self.controls.set_fidelity(config)

    def update(self, **changes: Any) -> None:
        """The controls of `engine.pipeline.StreamControls.update` (a step-count change takes effect at
        the next chunk: every rank fits the stream's per-step caches, as the single-process engine does)."""
        self.controls.update(**changes)

    def reset(self) -> None:
        self._factory.ring.close_stream(self.state)
        self.controls.reset()


class RankFactory:
    """Opens streams on a running :class:`engine.parallel.ring.RingRuntime` (rank 0 of
    `diffcast serve --gpus N`, app/server/serving/ranks.py); ``pipeline`` is the same model loaded in this
    rank, for its default size, chunk lengths and fidelity mapping."""

    kind = EngineKind.CHUNK_BATCHES
    parallel_chunks = 1  # one ring: a batch's chunks go in together

    def __init__(self, ring: RingRuntime, pipeline: Pipeline) -> None:
        self.ring = ring
        self.pipeline = pipeline
        self._streams: dict[str, StreamControls] = {}
        self._dropped: list[str] = []
        self._lock = threading.Lock()
        self._running = threading.Lock()  # held while chunks are in the ring
        self._closed = False

    @property
    def size(self) -> tuple[int, int]:
        width, height = self.pipeline.default_size
        return int(width), int(height)

    def device_memory(self) -> tuple[int | None, int]:
        """Rank 0's device bytes free for stream states and its weights' bytes: a stream's caches are
        split over the ranks, so counting its whole state on rank 0 is the safe side."""
        from engine.devices import stream_memory

        return stream_memory(self.pipeline.runtime)

    def open(self, settings: StreamSettings) -> RankProcessor:
        from engine.pipeline import StreamParams

        processor = RankProcessor(self, StreamParams(prompt=settings.prompt, noise_scale=settings.noise_scale,
                                                     steps=settings.steps, seed=settings.seed,
                                                     stabilize=settings.stabilize, loras=settings.loras))
        # The processor protocol has no close: a dropped session's stream leaves the ranks at the next
        # chunk of any stream (on the engine thread, never from the garbage collector's thread).
        weakref.finalize(processor, self._drop, processor.id)
        return processor

    def unsupported(self, config: FidelityConfig) -> str | None:
        """What the ranks run: the runtime's knobs (steps up to the preset's, KV window, resolution
        scale, precision and attention sparsity per device), one chunk of a stream in the ring at a time."""
        if config.step_batch:
            # A step batch keeps a stream's successive chunks in the ring together; the server's seam
            # hands every chunk's frames back before the stream's next chunk enters.
            return "step batches are not run on the pipeline ranks (each chunk leaves the ring before the next enters)"
        try:
            self.ring.rt.check_fidelity(config)
        except ValueError as exc:
            return str(exc)
        return None

    def run_chunks(self, chunks: Sequence[tuple[RankProcessor, np.ndarray, FidelityConfig | None]]) -> list[np.ndarray]:
        """One chunk of each stream, at its fidelity (None: the stream's own), through the ranks together
        (:meth:`RingRuntime.run`: their micro-steps overlap across ranks); the frames of each, in order."""
        with self._running:
            if self._closed:
                raise RuntimeError("the pipeline ranks are shutting down")
            return self._run_chunks(chunks)

    def close(self) -> None:
        """No more chunks: waits for the chunks in the ring (the engine thread's) to come back."""
        with self._running:
            self._closed = True

    def _run_chunks(self, chunks: Sequence[tuple[RankProcessor, np.ndarray, FidelityConfig | None]]) -> list[np.ndarray]:
        from engine.frames import frames_to_tensor, tensor_to_frames

        self.close_dropped()
        for processor, _, config in chunks:
            if config is not None:
                processor.set_fidelity(config)
        states = [p.state for p, _, _ in chunks]
        done = {id(state): result for state, result in
                self.ring.run(states, [frames_to_tensor(f, p.expected_frames) for p, f, _ in chunks])}
        missing = [p.id for p, _, _ in chunks if id(p.state) not in done]
        if missing:
            raise RuntimeError(f"the pipeline returned no chunk for streams {missing}")
        return [tensor_to_frames(done[id(state)].frames) for state in states]

    def register(self, controls: StreamControls) -> None:
        """A stream opened on the ring: its caches leave every rank when its processor is dropped."""
        with self._lock:
            self._streams[controls.id] = controls

    @property
    def loras(self) -> list[dict[str, Any]]:
        """The LoRAs every rank loaded (name, rank, layers, targets, default strength)."""
        info: list[dict[str, Any]] = self.pipeline.lora_info()
        return info

    def close_dropped(self) -> None:
        with self._lock:
            dropped, self._dropped = self._dropped, []
        for stream_id in dropped:
            with self._lock:
                controls = self._streams.pop(stream_id)
            self.ring.close_stream(controls.state)

    def _drop(self, stream_id: str) -> None:
        with self._lock:
            self._dropped.append(stream_id)


class RayProcessor:
    """A `StreamProcessor` whose chunks run on the stream's home Ray worker (engine.cluster): the
    controller routes each call, and re-homing or a worker failure happens underneath it."""

    def __init__(self, controller: Any, stream_id: int) -> None:
        self._controller = controller
        self.stream_id = stream_id
        self._size: tuple[int, int] | None = None  # the stream's, from its first chunk's camera until a reset
        self._scale = 1.0  # the resolution scale of its last chunk: the stream's own fidelity on its worker
        # The camera size of the chunk last sized, which goes to the worker with that chunk (ChunkOrder).
        self.camera: tuple[int, int] | None = None

    @property
    def first_chunk_frames(self) -> int:
        return int(self._controller.info.first_chunk_frames)

    @property
    def chunk_frames(self) -> int:
        return int(self._controller.info.chunk_frames)

    def process(self, frames: np.ndarray) -> np.ndarray:
        return np.asarray(self._controller.process(self.stream_id, frames, self.camera), dtype=np.uint8)

    def sizes(self, camera: tuple[int, int], config: FidelityConfig | None = None) -> StreamSizes:
        """The engine's sizes (engine/aspect.py: `fit_size` at the model's budget, `scaled_size` at the
        chunk's resolution scale) by the cluster's model, worked out here: the stream lives on a worker, and
        asking it would cost a round trip per chunk. The worker's stream sizes itself from the same camera
        size, which goes with the chunk (``camera``), so the frames are resized once on the way in (here,
        camera -> engine size) and once on the way out (on the worker, engine -> stream size)."""
        info = self._controller.info
        granularity = int(info.size_granularity)
        if self._size is None:
            width, height = info.default_size
            self._size = fit_size(camera, int(width) * int(height), granularity)
        if config is not None:
            self._scale = config.resolution_scale
        self.camera = camera
        return StreamSizes(self._size, scaled_size(self._size, self._scale, granularity))

    def update(self, **changes: Any) -> None:
        self._controller.update(self.stream_id, **changes)

    def reset(self) -> None:
        self._controller.reset(self.stream_id)
        self._size = None  # the worker's stream sizes itself again from its next chunk's camera


class RayFactory:
    """Opens streams on a cluster of Ray worker actors (`diffcast serve --ray` / `--ray-address`)."""

    kind = EngineKind.RAY

    def __init__(self, controller: Any) -> None:
        self.controller = controller

    @classmethod
    def start(
        cls, model: str | None, device: str = "cpu", workers: int = 2, address: str | None = None, threads: int = 1,
        loras: Sequence[LoRASpec] = (), max_workers: int = 0, dtype: str = "auto", vae: str | None = None,
    ) -> RayFactory:
        """Start a local Ray cluster (``address`` None) or join one, bring up ``workers`` actors (each
        loading the model and ``loras``), and health-check them in the background."""
        from engine.cluster.controller import ClusterConfig, ClusterController

        gpus = 1.0 if device.startswith("cuda") else 0.0
        config = ClusterConfig(model=model, workers=workers, max_workers=max_workers, device=device, dtype=dtype, vae=vae,
                               threads_per_worker=threads, gpus_per_worker=gpus,
                               loras=tuple((lora.name, lora.path, lora.strength) for lora in loras))
        controller = ClusterController.start(config, address)
        controller.start_monitor()
        return cls(controller)

    @property
    def size(self) -> tuple[int, int]:
        width, height = self.controller.info.default_size
        return int(width), int(height)

    pipeline = None  # the model lives in the worker actors

    @property
    def loras(self) -> list[dict[str, Any]]:
        """The LoRAs every worker loaded (name, rank, layers, targets, default strength)."""
        return [dict(info) for info in self.controller.info.loras]

    def device_memory(self) -> tuple[int | None, int]:
        """One worker's device bytes free for stream states (each actor has its own device) and weights."""
        info = self.controller.info
        return info.free_memory_bytes, int(info.weight_bytes)

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
