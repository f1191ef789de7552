"""Picklable pieces for the pipeline-parallel tests: spawned ranks import this module by name.

The model is the runtime tests' tiny DiT with more blocks (so 4 ranks each get at least one) plus
the tiny Wan VAE and the seeded hash text encoder; every rank seeds and builds the same weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from _runtime_fixtures import HashTextEncoder, clip, fidelity

from app.server.engine_bridge import StreamSettings
from engine.models.wan_dit import CONFIGS, CausalWanDiT
from engine.models.wan_vae import WanVAE, WanVAEConfig
from engine.parallel.pipeline import PipelineRuntime
from engine.parallel.service import ParallelFactory
from engine.pipeline import Pipeline, StreamParams, tensor_to_frames
from engine.sampling import STREAMDIFFUSION_V2
from engine.streaming.config import RuntimeConfig
from engine.streaming.runtime import PromptEncoder, StreamRuntime


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

    def __call__(self, device: torch.device | str = "cpu") -> StreamRuntime:
        torch.manual_seed(0)
        dit = CausalWanDiT(replace(CONFIGS["tiny"], num_layers=self.layers)).to(device).eval()
        vae = WanVAE(WanVAEConfig.tiny()).to(device).eval()
        config = RuntimeConfig(sink_refresh=self.sink_refresh, sink_tau=self.sink_tau)
        return StreamRuntime(dit, vae, PromptEncoder(HashTextEncoder()), STREAMDIFFUSION_V2, config)


@dataclass(frozen=True)
class Scenario:
    """One stream of ``chunks`` chunks with a prompt switch and, optionally, a forced rebalance."""

    chunks: int = 9
    steps: int = 2
    switch_at: int = 4
    refresh_on_switch: bool = False
    rebalance_at: int | None = None
    rebalance_to: tuple[tuple[int, int], ...] = ()

    def reference(self, rt: StreamRuntime) -> tuple[list[torch.Tensor], int]:
        """The single-process engine: StreamRuntime.step chunk after chunk."""
        state = rt.open("s", "oil painting", (32, 32), fidelity(steps=self.steps), seed=3)
        out = []
        for c, frames in enumerate(clip(self.chunks)):
            if c == self.switch_at:
                rt.set_prompt(state, "pencil sketch", refresh_sinks=self.refresh_on_switch)
            out.append(rt.step(state, frames).frames)
        return out, state.sink_refreshes

    def __call__(self, pipe: PipelineRuntime) -> dict[str, object]:
        state = pipe.open("s", "oil painting", (32, 32), fidelity(steps=self.steps), seed=3)
        out = []
        ranges_before = [(r.start, r.stop) for r in pipe.ranges]
        for c, frames in enumerate(clip(self.chunks)):
            if c == self.switch_at:
                pipe.set_prompt(state, "pencil sketch", refresh_sinks=self.refresh_on_switch)
            if c == self.rebalance_at:
                pipe.rebalance([range(a, b) for a, b in self.rebalance_to])
            out += [r.frames for _, r in pipe.push([state], [frames])]
        out += [r.frames for _, r in pipe.drain()]
        return {
            "frames": out,
            "sink_refreshes": state.sink_refreshes,
            "depth": pipe.depth,
            "ranges_before": ranges_before,
            "ranges_after": [(r.start, r.stop) for r in pipe.ranges],
            "forwards": pipe.forwards,
        }


def tiny_pipeline(runtime: StreamRuntime) -> Pipeline:
    """The public Pipeline API over a TinyFactory runtime's model (32x32 frames)."""
    rt = runtime
    return Pipeline(rt.dit, rt.vae, HashTextEncoder(), rt.preset, rt.config, (32, 32), "tiny-parallel")


def uint8_clip(chunks: int) -> list[np.ndarray]:
    return [tensor_to_frames(c) for c in clip(chunks)]


@dataclass(frozen=True)
class ServiceScenario:
    """The server's StreamProcessor seam over the pipeline: chunks in, the same chunks' frames out."""

    chunks: int = 5
    switch_at: int = 3

    def reference(self, runtime: StreamRuntime) -> list[np.ndarray]:
        stream = tiny_pipeline(runtime).open_stream(StreamParams(prompt="oil painting", steps=2, seed=5))
        out = []
        for c, frames in enumerate(uint8_clip(self.chunks)):
            if c == self.switch_at:
                stream.update(prompt="pencil sketch")
            out.append(stream.process(frames))
        return out

    def __call__(self, pipe: PipelineRuntime) -> dict[str, object]:
        factory = ParallelFactory(pipe, tiny_pipeline(pipe.rt))
        processor = factory.open(StreamSettings(prompt="oil painting", steps=2, seed=5))
        out = []
        for c, frames in enumerate(uint8_clip(self.chunks)):
            if c == self.switch_at:
                processor.update(prompt="pencil sketch")
            out.append(processor.process(frames))
        return {"frames": out, "rebalances": pipe.rebalances, "ranges": [(r.start, r.stop) for r in pipe.ranges]}
