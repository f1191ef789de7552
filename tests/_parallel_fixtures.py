"""Picklable pieces for the pipeline-parallel tests: spawned ranks import this module by name.

The model is the runtime tests' tiny DiT with more blocks (so 4 ranks each get at least one) plus
the tiny Wan VAE and the seeded hash text encoder; every rank seeds and builds the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from _runtime_fixtures import HashTextEncoder, clip, fidelity

from engine.models.wan_dit import CONFIGS, CausalWanDiT
from engine.models.wan_vae import WanVAE, WanVAEConfig
from engine.parallel.pipeline import PipelineRuntime
from engine.sampling import STREAMDIFFUSION_V2
from engine.streaming.config import RuntimeConfig
from engine.streaming.runtime import PromptEncoder, StreamRuntime


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
