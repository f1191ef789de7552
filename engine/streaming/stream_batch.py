"""Stream batch (StreamDiffusionV2 §4.1-4.2; papers: docs/references.md): the n denoising steps of n successive chunks in one forward.

Slot i holds a chunk at step i. Every micro-step a new chunk enters slot 0, all occupied slots run
as one batched forward (per-row timestep, RoPE position, prompt and step cache), each row is
re-noised to its next step, and the chunk in the last slot leaves finished: one clean chunk per
forward after a warm-up of n - 1 micro-steps, n-step latency.

Exactness: in per-step cache mode slot i only ever reads and writes the stream's step-i cache, and
every chunk draws its noise (V2V noise, then one re-noise per step) when it enters, in the order
the sequential loop draws it. So the stream batch computes exactly what
:meth:`StreamRuntime.run_chunk` computes chunk after chunk; only the forwards are batched. Several
streams batch together too (rows = streams x slots), grouped by cache fill level.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.streaming.runtime import ChunkInFlight, ChunkResult, StreamRuntime
from engine.streaming.state import StreamState


class StreamBatch:
    """Pipelined denoising for one or more streams that share a step count."""

    def __init__(self, runtime: StreamRuntime, states: Sequence[StreamState]) -> None:
        if runtime.config.cache_mode != "per-step":
            raise ValueError("the stream batch needs cache_mode='per-step' (one KV cache per denoising step)")
        steps = {s.fidelity.steps for s in states}
        if len(steps) != 1:
            raise ValueError(f"streams in one stream batch must share the step count, got {sorted(steps)}")
        self.runtime = runtime
        self.states = list(states)
        self.depth = steps.pop()
        self.in_flight: list[ChunkInFlight] = []
        self.forwards = 0

    def push(self, frames: Sequence[torch.Tensor]) -> list[ChunkResult | None]:
        """Feed one chunk per stream; returns, per stream, the chunk that finished (None in warm-up)."""
        if len(frames) != len(self.states):
            raise ValueError(f"push needs one chunk per stream ({len(self.states)}), got {len(frames)}")
        for state, chunk in zip(self.states, frames, strict=True):
            if state.fidelity.steps != self.depth:
                raise ValueError("a step-count change needs drain() and a new StreamBatch")
            resized = state.engine_size not in (None, self.runtime.engine_size(state.size, state.fidelity))
            if resized and any(c.state is state for c in self.in_flight):
                # Entering would rescale the caches under chunks that hold latents of the old size.
                raise ValueError("a resolution change needs drain() first: chunks in flight are at the old size")
            self.in_flight.append(self.runtime.enter_chunk(state, chunk))
        return self._micro_step()

    def drain(self) -> list[ChunkResult]:
        """Run micro-steps without new input until every in-flight chunk is finished."""
        done: list[ChunkResult] = []
        while self.in_flight:
            done.extend(r for r in self._micro_step() if r is not None)
        return done

    def _micro_step(self) -> list[ChunkResult | None]:
        """Every chunk in flight takes one step: one forward per group of equal cache fill level,
        precision and attention sparsity (``ChunkInFlight.batch_key``)."""
        groups: dict[tuple[object, ...], list[ChunkInFlight]] = {}
        for chunk in self.in_flight:
            groups.setdefault(chunk.batch_key(), []).append(chunk)
        for rows in groups.values():
            self.runtime.denoise_step(rows)
            self.forwards += 1
        finished = {id(c.state): self.runtime.finish_chunk(c) for c in self.in_flight if c.done}
        self.in_flight = [c for c in self.in_flight if not c.done]
        return [finished.get(id(s)) for s in self.states]
