"""Picklable pieces for the pipeline-parallel tests: spawned ranks import this module by name.

The model is the runtime tests' tiny DiT with more blocks (so 4 ranks each get at least one) plus
the tiny Wan VAE and the seeded hash text encoder; every rank seeds and builds the same weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace

import numpy as np
import pytest
import torch
from _runtime_fixtures import HashTextEncoder, clip, fidelity, guided_tiny_vae

from app.server.serving.engine_bridge import RankFactory, RankProcessor, StreamSettings
from engine.fidelity import FidelityConfig
from engine.frames import tensor_to_frames
from engine.lora_files import load_lora
from engine.models.wan_dit import CONFIGS, CausalWanDiT
from engine.models.wan_vae import WanVAE, WanVAEConfig
from engine.parallel.ring import RingRuntime
from engine.pipeline import Pipeline, StreamParams
from engine.sampling import STREAMDIFFUSION_V2
from engine.streaming.config import RuntimeConfig
from engine.streaming.runtime import PromptEncoder, StreamRuntime
from engine.streaming.stabilizer import StabilizerConfig


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread in the reference process, as in every rank (import it into a test module)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass(frozen=True)
class TinyFactory:
    layers: int = 4
    sink_refresh: bool = True
    sink_tau: float = 0.2
    stabilize: bool = False  # the temporal stabilizer stage (applied on rank 0)
    lora: str | None = None  # a LoRA file every rank loads as "ink"
    guided_vae: bool = False  # a tiny VAE whose decoder reads the input frames (random guide paths)

    def __call__(self, device: torch.device | str = "cpu") -> StreamRuntime:
        torch.manual_seed(0)
        dit = CausalWanDiT(replace(CONFIGS["tiny"], num_layers=self.layers)).to(device).eval()
        vae = (guided_tiny_vae() if self.guided_vae else WanVAE(WanVAEConfig.tiny())).to(device).eval()
        config = RuntimeConfig(sink_refresh=self.sink_refresh, sink_tau=self.sink_tau,
                               stabilizer=StabilizerConfig() if self.stabilize else None)
        runtime = StreamRuntime(dit, vae, PromptEncoder(HashTextEncoder()), STREAMDIFFUSION_V2, config)
        if self.lora is not None:
            load_lora(self.lora, runtime.loras, "ink")
        return runtime


PROMPTS = ("oil painting", "watercolor", "neon city")


@dataclass(frozen=True)
class Scenario:
    """``streams`` streams of ``chunks`` chunks each (own prompt, seed and input clip); stream s0
    switches prompt at ``switch_at``; optionally a forced rebalance before chunk ``rebalance_at``."""

    chunks: int = 9
    steps: int = 2
    streams: int = 1
    switch_at: int = 4
    refresh_on_switch: bool = False
    rebalance_at: int | None = None
    rebalance_to: tuple[tuple[int, int], ...] = ()
    precision: str = "fp32"

    def fidelity(self) -> FidelityConfig:
        return replace(fidelity(steps=self.steps), precision=self.precision)

    def reference(self, rt: StreamRuntime) -> tuple[dict[str, list[torch.Tensor]], dict[str, int]]:
        """The single-process engine: StreamRuntime.run_chunk chunk after chunk, each stream on its own."""
        out, refreshes = {}, {}
        for i in range(self.streams):
            state = rt.open(f"s{i}", PROMPTS[i], (32, 32), self.fidelity(), seed=3 + i)
            frames_out = []
            for c, frames in enumerate(clip(self.chunks, seed=i)):
                if c == self.switch_at and i == 0:
                    rt.set_prompt(state, "pencil sketch", refresh_sinks=self.refresh_on_switch)
                frames_out.append(rt.run_chunk(state, frames).frames)
            out[state.stream_id], refreshes[state.stream_id] = frames_out, state.sink_refreshes
        return out, refreshes

    def __call__(self, ring: RingRuntime) -> dict[str, object]:
        states = [ring.open(f"s{i}", PROMPTS[i], (32, 32), self.fidelity(), seed=3 + i)
                  for i in range(self.streams)]
        clips = [clip(self.chunks, seed=i) for i in range(self.streams)]
        out: dict[str, list[torch.Tensor]] = {s.stream_id: [] for s in states}
        ranges_before = [(r.start, r.stop) for r in ring.ranges]
        for c in range(self.chunks):
            if c == self.switch_at:
                ring.set_prompt(states[0], "pencil sketch", refresh_sinks=self.refresh_on_switch)
            if c == self.rebalance_at:
                ring.rebalance([range(a, b) for a, b in self.rebalance_to])
            for state, result in ring.push(states, [frames[c] for frames in clips]):
                out[state.stream_id].append(result.frames)
        for state, result in ring.drain():
            out[state.stream_id].append(result.frames)
        return {
            "frames": out,
            "sink_refreshes": {s.stream_id: s.sink_refreshes for s in states},
            "depth": ring.depth,
            "ranges_before": ranges_before,
            "ranges_after": [(r.start, r.stop) for r in ring.ranges],
            "forwards": ring.forwards,
        }


def tiny_pipeline(runtime: StreamRuntime) -> Pipeline:
    """The public Pipeline API over a TinyFactory runtime's model (32x32 frames)."""
    rt = runtime
    return Pipeline(rt.dit, rt.vae, HashTextEncoder(), rt.preset, rt.config, (32, 32), "tiny-parallel")


def uint8_clip(chunks: int) -> list[np.ndarray]:
    return [tensor_to_frames(c) for c in clip(chunks)]


@dataclass(frozen=True)
class ServiceScenario:
    """The server's StreamProcessor seam over the ranks (RankFactory): chunks in, the same chunks' frames out."""

    chunks: int = 5
    switch_at: int = 3
    # LoRA strengths (of the factory's "ink") at the start and from ``switch_at`` on; None: no LoRA.
    loras: tuple[float, float] | None = None

    def _strengths(self, c: int) -> dict[str, float]:
        return {} if self.loras is None else {"ink": self.loras[int(c >= self.switch_at)]}

    def reference(self, runtime: StreamRuntime) -> list[np.ndarray]:
        stream = tiny_pipeline(runtime).open_stream(StreamParams(prompt="oil painting", steps=2, seed=5,
                                                                 loras=self._strengths(0)))
        out = []
        for c, frames in enumerate(uint8_clip(self.chunks)):
            if c == self.switch_at:
                stream.update(prompt="pencil sketch", loras=self._strengths(c))
            out.append(stream.process(frames))
        return out

    def __call__(self, ring: RingRuntime) -> dict[str, object]:
        factory = RankFactory(ring, tiny_pipeline(ring.rt))
        processor = factory.open(StreamSettings(prompt="oil painting", steps=2, seed=5, loras=self._strengths(0)))
        out = []
        for c, frames in enumerate(uint8_clip(self.chunks)):
            if c == self.switch_at:
                processor.update(prompt="pencil sketch", loras=self._strengths(c))
            out.append(processor.process(frames))
        return {"frames": out, "rebalances": ring.rebalances, "ranges": [(r.start, r.stop) for r in ring.ranges]}


# A chunk schedule per stream: the fidelity of each chunk, as the engine core would set it.
S2 = FidelityConfig(steps=2, kv_window_frames=6, precision="fp32")
S1 = FidelityConfig(steps=1, kv_window_frames=6, precision="fp32")
S2_W4 = FidelityConfig(steps=2, kv_window_frames=4, precision="fp32")
S3 = FidelityConfig(steps=3, kv_window_frames=6, precision="fp32")
S2_HALF = FidelityConfig(steps=2, kv_window_frames=6, precision="fp32", resolution_scale=0.5)


@dataclass(frozen=True)
class BatchStream:
    """One stream of :class:`BatchScenario`: its settings, its input clip and each chunk's fidelity."""

    settings: StreamSettings
    clip_seed: int
    fidelities: tuple[FidelityConfig, ...]


BATCH_STREAMS = (
    # a and b differ only in the stabilizer switch: same prompt, seed, input and fidelities.
    BatchStream(StreamSettings(prompt="oil painting", steps=2, seed=5, stabilize=True), 0, (S2, S1, S2, S2_W4, S1, S3)),
    BatchStream(StreamSettings(prompt="oil painting", steps=2, seed=5, stabilize=False), 0, (S2, S1, S2, S2_W4, S1, S3)),
    BatchStream(StreamSettings(prompt="watercolor", steps=2, seed=9, stabilize=True), 1, (S1, S2, S2_HALF, S1, S3, S2)),
)


def batch_clip(stream: BatchStream, chunks: int) -> list[np.ndarray]:
    return [tensor_to_frames(c) for c in clip(chunks, seed=stream.clip_seed)]


@dataclass(frozen=True)
class BatchScenario:
    """Every stream's chunk c enters the ranks in one `RankFactory.run_chunks` call (one cross-user
    batch), each at its own fidelity for that chunk."""

    streams: tuple[BatchStream, ...] = BATCH_STREAMS

    @property
    def chunks(self) -> int:
        return len(self.streams[0].fidelities)

    def reference(self, runtime: StreamRuntime) -> list[list[np.ndarray]]:
        """Each stream alone on the single-process engine (the public Pipeline API), chunk by chunk."""
        pipe = tiny_pipeline(runtime)
        out = []
        for s in self.streams:
            stream = pipe.open_stream(StreamParams(**asdict(s.settings)))
            frames = []
            for config, chunk in zip(s.fidelities, batch_clip(s, self.chunks), strict=True):
                stream.set_fidelity(config)
                frames.append(stream.process(chunk))
            out.append(frames)
        return out

    def __call__(self, ring: RingRuntime) -> dict[str, object]:
        factory = RankFactory(ring, tiny_pipeline(ring.rt))
        processors = [factory.open(s.settings) for s in self.streams]
        clips = [batch_clip(s, self.chunks) for s in self.streams]
        out: list[list[np.ndarray]] = [[] for _ in self.streams]
        for c in range(self.chunks):
            frames = factory.run_chunks([(p, clips[i][c], s.fidelities[c])
                                         for i, (p, s) in enumerate(zip(processors, self.streams, strict=True))])
            for i, f in enumerate(frames):
                out[i].append(f)
        return {"frames": out, "forwards": ring.forwards, "micro_steps": ring.micro_steps, "depth": ring.depth}


class _FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class PolicyScenario:
    """`diffcast serve --gpus N`'s engine core on rank 0: `build_serving_loop` over a `RankFactory`
    (slackserve, --max-batch 2) with two streams fed the same frames, one with the stabilizer off.
    The engine first keeps up with the best point easily; from chunk ``slow_from`` the live
    calibration finds chunks taking so long that the best point no longer fits the streams' share of
    the worker, and for the last chunk it is fast again. Records every `run_chunks` call the executor
    makes: which streams, their inputs, the fidelity, the outputs."""

    chunks: int = 6
    slow_from: int = 3

    def __call__(self, ring: RingRuntime) -> dict[str, object]:
        return asyncio.run(self._serve(ring))

    async def _serve(self, ring: RingRuntime) -> dict[str, object]:
        from app.server.config import ServerConfig
        from app.server.media.frame_path import ChunkAssembler, Playout, StreamRunner
        from app.server.serving.serving_loop import build_serving_loop

        factory = RankFactory(ring, tiny_pipeline(ring.rt))
        clock, pool = _FakeClock(), ThreadPoolExecutor(max_workers=1)
        fps = 8.0
        loop = build_serving_loop(ServerConfig(model="tiny-random", max_fps=fps, policy="slackserve", max_batch=2),
                                  factory, pool, clock)
        loop.core.calibrate = False  # the hand-driven clock measures no real time
        settings = [StreamSettings(steps=4, seed=5, stabilize=True), StreamSettings(steps=4, seed=5, stabilize=False)]
        processors, sids, assemblers = [], [], []
        for s in settings:
            sid = loop.admit(s.steps)
            processor = factory.open(s)
            assembler = ChunkAssembler(capacity=processor.chunk_frames, clock=clock)
            playout = Playout(factory.size, processor.chunk_frames, max_fps=fps, min_fps=fps, clock=clock)
            loop.attach(sid, StreamRunner(processor, assembler, playout, pool, factory.size), playout)
            processors.append(processor)
            sids.append(sid)
            assemblers.append(assembler)
        calls: list[list[tuple[int, np.ndarray, FidelityConfig, np.ndarray]]] = []
        run = factory.run_chunks

        def recording(chunks: Sequence[tuple[RankProcessor, np.ndarray, FidelityConfig | None]]) -> list[np.ndarray]:
            outs = run(chunks)
            calls.append([(processors.index(p), frames, config, out)
                          for (p, frames, config), out in zip(chunks, outs, strict=True)])
            return outs

        factory.run_chunks = recording  # type: ignore[method-assign]
        for c, chunk in enumerate(uint8_clip(self.chunks)):
            if c == self.slow_from:
                # Measured twice as slow as the best point's share allows: it takes 2x the share.
                loop.core.recalibrate(2 * loop.policy.live_share_s(2) / loop.policy.top_point(4).latency_s)
            if c == self.chunks - 1:
                loop.core.recalibrate(1.0)
            for frame in chunk:  # a moving picture: the stabilizer follows its motion
                for assembler in assemblers:
                    assembler.push(frame)
            clock.now += 0.01
            for _ in range(3):
                loop.run_once()
                while loop.core.jobs:
                    await asyncio.sleep(0.005)
        pool.shutdown(wait=True)
        return {"calls": calls, "executor": type(loop.executor).__name__, "policy": loop.policy.config,
                "points": [p.config for p in loop.policy.profile.points]}


def policy_reference(runtime: StreamRuntime, calls: list[list[tuple[int, np.ndarray, FidelityConfig, np.ndarray]]],
                     settings: Sequence[StreamSettings]) -> dict[int, list[np.ndarray]]:
    """Each stream of a :class:`PolicyScenario` alone on the single-process engine, fed the chunks
    it took at the fidelities the policy chose."""
    pipe = tiny_pipeline(runtime)
    streams = {i: pipe.open_stream(StreamParams(**asdict(s))) for i, s in enumerate(settings)}
    out: dict[int, list[np.ndarray]] = {i: [] for i in streams}
    for call in calls:
        for i, frames, config, _ in call:
            streams[i].set_fidelity(replace(config, stream_batch=1, gpus=1))
            out[i].append(streams[i].process(frames))
    return out
