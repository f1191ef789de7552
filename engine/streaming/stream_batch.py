"""Stream batch (StreamDiffusionV2 §4.1-4.2): the n denoising steps of n successive chunks in one forward.

Slot i holds a chunk at step i. Every micro-step a new chunk enters slot 0, all occupied slots run
as one batched forward (per-row timestep, RoPE position, prompt and step cache), each row is
re-noised to its next step, and the chunk in the last slot leaves finished: one clean chunk per
forward after a warm-up of n - 1 micro-steps, n-step latency.

Exactness: in per-step cache mode slot i only ever reads and writes the stream's step-i cache, and
every chunk draws its noise (V2V noise, then one re-noise per step) when it enters, in the order
the sequential loop draws it. So the stream batch computes exactly what
:meth:`StreamRuntime.step` computes chunk after chunk; only the forwards are batched. Several
streams batch together too (rows = streams x slots), grouped by cache fill level.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.models.wan_dit import KVCache, PromptCache
from engine.sampling import renoise, v2v_input, x0_from_velocity
from engine.streaming.noise import MotionAwareNoiseController
from engine.streaming.runtime import ChunkResult, StreamRuntime, refresh_sinks
from engine.streaming.state import StreamState


@dataclass
class _Slot:
    state: StreamState
    x: torch.Tensor  # [1, C, F, h, w] at the slot's step
    timesteps: list[float]  # this chunk's schedule (first step from the noise controller)
    noises: list[torch.Tensor]  # one re-noise draw per step transition
    prompt: PromptCache
    frame: int
    rope: int
    noise_rate: float
    inputs: torch.Tensor  # the chunk as sent, for the temporal stabilizer
    restart: bool  # a hard prompt switch came before this chunk (fresh stabilizer history)
    step: int = 0


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
        self.in_flight: list[_Slot] = []
        self.forwards = 0

    def push(self, frames: Sequence[torch.Tensor]) -> list[ChunkResult | None]:
        """Feed one chunk per stream; returns, per stream, the chunk that finished (None in warm-up)."""
        if len(frames) != len(self.states):
            raise ValueError(f"push needs one chunk per stream ({len(self.states)}), got {len(frames)}")
        for state, chunk in zip(self.states, frames, strict=True):
            self.in_flight.append(self._enter(state, chunk))
        return self._micro_step()

    def drain(self) -> list[ChunkResult]:
        """Run micro-steps without new input until every in-flight chunk is finished."""
        done: list[ChunkResult] = []
        while self.in_flight:
            done.extend(r for r in self._micro_step() if r is not None)
        return done

    # -- internals --------------------------------------------------------------------------------

    def _enter(self, state: StreamState, chunk: torch.Tensor) -> _Slot:
        rt = self.runtime
        if state.fidelity.steps != self.depth:
            raise ValueError("a step-count change needs drain() and a new StreamBatch")
        rt._begin_chunk(state)
        inputs, chunk = chunk, rt._resize(chunk, rt.engine_size(state.size, state.fidelity))
        controller = MotionAwareNoiseController(rt._noise_config(state))
        rate = controller.step(chunk, state.noise_controller)
        z = rt.vae.encode_chunk(chunk.unsqueeze(0).to(rt.device, rt.dit.dtype), state.vae_encoder)
        first = controller.first_timestep(rate)
        timesteps = [first, *rt.preset.timesteps(self.depth)[1:]]
        x = v2v_input(z, state.noise.randn(z.shape, dtype=z.dtype, device=rt.device), rate)
        noises = [state.noise.randn(z.shape, dtype=z.dtype, device=rt.device) for _ in range(self.depth - 1)]
        slot = _Slot(state, x, timesteps, noises, state.prompt, state.frame, state.rope_frame, rate, inputs,
                     state.take_stabilizer_restart())
        f = z.shape[2]
        state.frame += f
        state.rope_frame += f
        return slot

    def _micro_step(self) -> list[ChunkResult | None]:
        finished: dict[int, ChunkResult] = {}
        groups: dict[tuple[int, int, float], list[_Slot]] = {}
        for slot in self.in_flight:
            cache = slot.state.kv[slot.step]
            key = (cache.local_end, slot.frame - cache.global_end[0], slot.state.fidelity.attention_sparsity)
            groups.setdefault(key, []).append(slot)
        for rows in groups.values():
            self._forward(rows)
        rt = self.runtime
        still: list[_Slot] = []
        for slot in self.in_flight:
            state = slot.state
            if rt.config.sink_refresh:
                state.sink_refreshes += int(refresh_sinks(state.kv[slot.step], slot.x.shape[2], rt.config.sink_tau))
            if slot.step + 1 < self.depth:
                sigma = float(rt.schedule.sigma(slot.timesteps[slot.step + 1]))
                slot.x = renoise(slot.x, slot.noises[slot.step], sigma)
                slot.step += 1
                still.append(slot)
                continue
            state.chunks += 1
            state.last_noise_rate = slot.noise_rate
            frames = rt.vae.decode_chunk(slot.x, state.vae_decoder)[0].float().clamp(-1, 1)
            frames = rt._resize(frames, state.size)
            finished[id(state)] = rt.stabilize(state, slot.inputs, ChunkResult(frames, slot.noise_rate, slot.timesteps[0], False),
                                           slot.restart)
        self.in_flight = still
        return [finished.get(id(s)) for s in self.states]

    def _forward(self, rows: list[_Slot]) -> None:
        """One batched forward; afterwards each row's ``x`` holds its x̂₀ prediction."""
        rt = self.runtime
        caches = [r.state.kv[r.step] for r in rows]
        cache = caches[0] if len(rows) == 1 else KVCache.concat(caches)
        prompt = rows[0].prompt if len(rows) == 1 else PromptCache.concat([r.prompt for r in rows])
        x = torch.cat([r.x for r in rows])
        f = x.shape[2]
        t = torch.tensor([r.timesteps[r.step] for r in rows], dtype=torch.float32, device=rt.device)
        sparsity = rt.shared_sparsity(r.state.fidelity for r in rows)
        with rt._precision(rows[0].state.fidelity):
            v = rt.dit(x, t[:, None].expand(-1, f), prompt, cache,
                       start_frame=[r.frame for r in rows], rope_start=[r.rope for r in rows],
                       sparsity=sparsity, sparse_block_tokens=rt.config.sparse_block_tokens)
        self.forwards += 1
        sigma = rt.schedule.sigma(t).to(rt.device).view(-1, 1, 1, 1, 1)
        x0 = x0_from_velocity(x, v.to(x.dtype), sigma)
        if len(rows) > 1:
            for row, part in zip(rows, cache.split(), strict=True):
                row.state.kv[row.step] = part
        for i, row in enumerate(rows):
            row.x = x0[i : i + 1]
