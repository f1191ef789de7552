"""`diffcast serve --gpus N`: the live service with its engine split over N pipeline ranks.

The service runs inside rank 0 (ranks 1..N-1 serve their stages) and drives the pipeline through
the server's narrow `StreamProcessor` seam. That seam is synchronous (one chunk in, the same
chunk's frames out, on the one engine thread), so each ``process`` call pushes its chunk and
drains the ring: streams are served correctly through the pipeline, but micro-steps of different
calls do not overlap yet (no throughput gain over one rank until the frame path can take chunks
back later than it hands them in).
"""

from __future__ import annotations

import logging
import signal
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.parallel.launch import LoadedModel, loaded_pipeline, run_pipeline
from engine.parallel.pipeline import PipelineOptions, PipelineRuntime
from engine.sampling import NoiseSource

if TYPE_CHECKING:
    from app.server.config import ServerConfig
    from app.server.engine_bridge import StreamSettings
    from engine.pipeline import Pipeline, StreamParams
    from engine.streaming.state import StreamState

log = logging.getLogger(__name__)

# The block scheduler checks every this many micro-steps (a few seconds of video); a move drains the
# ring once, so checks must be rare enough for that bubble not to matter.
REBALANCE_EVERY = 64


class ParallelProcessor:
    """One stream on the pipeline (a `StreamProcessor`); every call runs on the engine thread."""

    def __init__(self, factory: ParallelFactory, params: StreamParams) -> None:
        self._factory = factory
        self.params = params
        self.id = uuid.uuid4().hex
        self.state = factory.open_state(self.id, params)

    @property
    def first_chunk_frames(self) -> int:
        return int(self._factory.pipeline.first_chunk_frames)

    @property
    def chunk_frames(self) -> int:
        return int(self._factory.pipeline.chunk_frames)

    def process(self, frames: np.ndarray) -> np.ndarray:
        from engine.frames import frames_to_tensor, tensor_to_frames

        self._factory.close_dropped()
        expected = self.chunk_frames if self.state.chunks else self.first_chunk_frames
        pipe = self._factory.pipe
        done = pipe.push([self.state], [frames_to_tensor(frames, expected)]) + pipe.drain()
        mine = [result for state, result in done if state is self.state]
        if len(mine) != 1:
            raise RuntimeError(f"the pipeline returned {len(mine)} chunks for stream {self.id}, expected 1")
        return tensor_to_frames(mine[0].frames)

    def update(self, **changes: Any) -> None:
        """The controls of `engine.pipeline.Stream.update`; a step-count change restarts the stream
        (the pipeline keeps one KV cache per step on every rank)."""
        transition_chunks = int(changes.pop("transition_chunks", 0))
        refresh_sinks = bool(changes.pop("refresh_sinks", False))
        changes = {k: v for k, v in changes.items() if v is not None}
        if isinstance(changes.get("prompt"), list):
            changes["prompt"] = tuple(changes["prompt"])
        if "prompt" in changes:
            changes.setdefault("prompt_weights", None)
        if changes.get("prompt_weights") is not None:
            changes["prompt_weights"] = tuple(changes["prompt_weights"])
        seed = changes.get("seed")
        new = self.params.with_(**changes)  # validates
        pipeline, pipe = self._factory.pipeline, self._factory.pipe
        fidelity = pipeline.fidelity_for(new)
        pipe.rt.check_fidelity(fidelity)
        if new.steps != self.params.steps:
            self.params = new
            self.reset()
            return
        if {"prompt", "prompt_weights", "blend_mode"} & changes.keys():
            pipe.set_prompt(self.state, list(new.prompts), new.prompt_weights, new.blend_mode,
                            transition_chunks=transition_chunks, refresh_sinks=refresh_sinks)
        pipe.set_fidelity(self.state, fidelity)
        self.state.noise_scale = new.noise_scale
        self.state.stabilize = new.stabilize
        if seed is not None and seed != self.params.seed:
            self.state.noise = NoiseSource(seed)
        self.params = new

    def reset(self) -> None:
        self._factory.pipe.close_stream(self.state)
        self.state = self._factory.open_state(self.id, self.params)


class ParallelFactory:
    """Opens streams on a running :class:`PipelineRuntime` (a `ProcessorFactory` for the server)."""

    def __init__(self, pipe: PipelineRuntime, pipeline: Pipeline) -> None:
        self.pipe = pipe
        self.pipeline = pipeline
        self._states: dict[str, StreamState] = {}
        self._dropped: list[str] = []
        self._lock = threading.Lock()

    @property
    def size(self) -> tuple[int, int]:
        width, height = self.pipeline.default_size
        return int(width), int(height)

    def open(self, settings: StreamSettings) -> ParallelProcessor:
        from engine.pipeline import StreamParams

        processor = ParallelProcessor(self, StreamParams(prompt=settings.prompt, noise_scale=settings.noise_scale,
                                                         steps=settings.steps, seed=settings.seed,
                                                         stabilize=settings.stabilize))
        # The processor protocol has no close: a dropped session's stream leaves the ranks at the next
        # chunk of any stream (on the engine thread, never from the garbage collector's thread).
        weakref.finalize(processor, self._drop, processor.id)
        return processor

    def open_state(self, stream_id: str, params: StreamParams) -> StreamState:
        state = self._states[stream_id] = self.pipe.open(stream_id, list(params.prompts), params.size or self.pipeline.default_size,
                              self.pipeline.fidelity_for(params), seed=params.seed, weights=params.prompt_weights,
                              blend_mode=params.blend_mode, noise_scale=params.noise_scale,
                              stabilize=params.stabilize)
        return state

    def close_dropped(self) -> None:
        with self._lock:
            dropped, self._dropped = self._dropped, []
        for stream_id in dropped:
            self.pipe.close_stream(self._states.pop(stream_id))

    def _drop(self, stream_id: str) -> None:
        with self._lock:
            self._dropped.append(stream_id)


@dataclass(frozen=True)
class ServeProgram:
    """Rank 0's program: the web service on a :class:`ParallelFactory` until it is stopped."""

    config: ServerConfig

    def __call__(self, pipe: PipelineRuntime) -> None:
        import uvicorn

        from app.server.app import create_app

        pipeline = loaded_pipeline(self.config.model, pipe.rt.device)
        app = create_app(self.config, ParallelFactory(pipe, pipeline))
        log.info("serving on http://%s:%d/ with %d pipeline ranks", self.config.host, self.config.port, pipe.world)
        uvicorn.run(app, host=self.config.host, port=self.config.port, ws="websockets-sansio", log_level="info")


def serve_parallel(config: ServerConfig, ranks: int, threads: int = 1) -> None:
    """Start ``ranks`` pipeline ranks (gloo CPU ranks for ``--device cpu``) and serve from rank 0."""
    device = "cuda" if config.device.startswith("cuda") else "cpu"

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    # SIGTERM must stop the ranks too (run_pipeline stops them on an exception), not orphan them.
    signal.signal(signal.SIGTERM, interrupted)
    try:
        run_pipeline(LoadedModel(config.model), ServeProgram(config), ranks, device=device, threads=threads,
                     options=PipelineOptions(rebalance_every=REBALANCE_EVERY), timeout_s=24 * 3600.0)
    except KeyboardInterrupt as exc:
        log.info("stopped (%s); the pipeline ranks are down", exc)
