"""Pipeline-parallel stream batch: the DiT's blocks split over N ranks, micro-steps travelling a ring.

Schedule (StreamDiffusionV2 §4.2, Fig. 7). A micro-step is one batched forward of the stream batch
(rows = chunks at different denoising steps). Rank r runs blocks ``ranges[r]`` of every micro-step and
hands the activations (tokens, the per-frame modulation e/e0, the latents, the little row metadata)
to rank r + 1 with ``isend``; rank 0 also does the VAE encode and the patch/time/text embedding, the
last rank the head, x̂₀, re-noise and VAE decode, and sends the re-noised latents and the finished
frames back to rank 0, closing the ring.

With ``depth`` micro-steps in flight a chunk cannot take its next step in the very next micro-step
(its x̂₀ is still on its way round the ring), so a chunk entering at micro-step m runs step i in
micro-step ``m + i*depth``. Micro-step m thus holds the chunks entered at m, m - depth, ...; slot i is
still "the chunk at step i". Every rank processes micro-steps in order, so per-step KV cache i of a
stream is written by chunk c before chunk c + 1 reads it, on every block: the results equal the
single-process engine's (:meth:`StreamRuntime.run_chunk` chunk after chunk, per-step cache mode).

Adaptive sink refresh compares the newest frame's mean keys/values over *all* blocks with the sinks',
so its decision exists only after the last rank, and the same stream's next chunk must not run
before it is applied. With ``RuntimeConfig.sink_refresh`` the ring therefore runs one micro-step at
a time (depth 1: exact, but no overlap); forced refreshes (a prompt switch with ``refresh_sinks``)
make just their micro-steps barriers. Each rank adds its blocks' partial dot products and norms to
the message; the last rank decides and the decision travels with the next micro-step.

Each rank owns the KV caches (and the prompt cross-attention K/V) of its own blocks for every stream.
:meth:`RingRuntime.rebalance` drains the ring, then moves blocks between ranks with P2P: their
KV caches, and their weights when ranks hold only their own blocks (``weights="own"``). A rank's
compute and its share of the state live in :mod:`engine.parallel.stage`; see docs/parallel.md.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from engine.fidelity import FidelityConfig
from engine.models.wan_dit import PromptCache
from engine.parallel.comm import Channel, Message
from engine.parallel.partition import BlockScheduler, StageTiming, check_ranges
from engine.parallel.stage import Stage, WeightsMode
from engine.sampling import NoiseSource
from engine.streaming.prompts import BlendMode, PromptTransition
from engine.streaming.rescale import rescale_state
from engine.streaming.runtime import ChunkInFlight, ChunkResult, StreamRuntime
from engine.streaming.state import StreamState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RingOptions:
    """How the ranks split the model.

    weights: "all" = every rank keeps the whole DiT (a rebalance moves only KV caches); "own" = a rank
    keeps only its blocks' weights (a rebalance also moves the moved blocks' weights).
    rebalance_every: micro-steps between block-scheduler checks (0 = only explicit rebalances).
    min_gain: the scheduler rebalances only when it predicts the slowest stage this much faster.
    """

    ranges: tuple[tuple[int, int], ...] | None = None
    weights: WeightsMode = "all"
    rebalance_every: int = 0
    min_gain: float = 0.1

    def __post_init__(self) -> None:
        if self.weights not in ("all", "own"):
            raise ValueError(f"weights must be 'all' or 'own', got {self.weights!r}")
        if self.rebalance_every < 0:
            raise ValueError(f"rebalance_every must be >= 0, got {self.rebalance_every}")


@dataclass
class _Slot:
    """A chunk in the ring: the runtime's chunk (positions, schedule, noise) plus its prompt version."""

    chunk: ChunkInFlight
    version: int

    @property
    def state(self) -> StreamState:
        return self.chunk.state


class RingRuntime:
    """Rank 0's side: streams enter here, micro-steps leave for the ring, finished chunks come back.

    Same controls as :class:`StreamRuntime` (``open``, ``set_prompt``, ``set_fidelity``); chunks go in
    with :meth:`push` and come out, ``steps * depth`` micro-steps later, from :meth:`push` or
    :meth:`drain`, as ``(state, ChunkResult)`` pairs in the order they finish.
    """

    def __init__(self, runtime: StreamRuntime, channel: Channel, world: int, ranges: Sequence[range],
                 options: RingOptions = RingOptions()) -> None:
        if runtime.config.cache_mode != "per-step":
            raise ValueError("the pipeline needs cache_mode='per-step' (one KV cache per denoising step)")
        self.rt = runtime
        self.channel = channel
        self.world = world
        self.options = options
        self.stage = Stage(runtime, 0, world, ranges, options.weights)
        self.scheduler = BlockScheduler(self.stage.ranges, min_gain=options.min_gain)
        # Exact adaptive sink refresh needs every rank's keys before the stream's next chunk: no overlap.
        self.depth = 1 if runtime.config.sink_refresh else world
        self.micro_steps = 0  # micro-step clock (ticks without rows count: the ring still advances)
        self.forwards = 0  # micro-steps that carried rows
        self.rebalances = 0
        self._sent: dict[int, list[_Slot]] = {}
        self._outstanding: deque[int] = deque()
        self._barriers: set[int] = set()
        self._continuing: dict[int, list[_Slot]] = {}
        self._refresh: list[tuple[str, int, int, int]] = []
        self._done: list[tuple[StreamState, ChunkResult]] = []
        self._versions: dict[str, tuple[Tensor, int, dict[str, float]]] = {}  # embedding, version, LoRAs
        self._new_prompts: list[tuple[str, int, Tensor, dict[str, float]]] = []
        self._known_prompts: set[tuple[str, int]] = set()
        self._steps: dict[str, int] = {}
        self._enter_s = 0.0
        self._streamwise = False  # inside run(): one chunk per stream in flight, no barriers needed

    @property
    def ranges(self) -> list[range]:
        return list(self.stage.ranges)

    # -- stream controls (the single-process runtime's, minus its KV caches) --------------------------

    def open(self, stream_id: str, prompt: str | Sequence[str], size: tuple[int, int], fidelity: FidelityConfig,
             seed: int = 0, weights: Sequence[float] | None = None, blend_mode: BlendMode = "linear",
             noise_scale: float = 0.8, stabilize: bool = True, loras: Mapping[str, float] | None = None,
             fit_input: bool = False) -> StreamState:
        """Like :meth:`StreamRuntime.open`, but the prompt's cross-attention K/V live on the ranks."""
        if stream_id in self._steps:
            raise ValueError(f"stream {stream_id!r} is already open in this pipeline")
        rt = self.rt
        rt.check_fidelity(fidelity)
        rt.engine_size(size, fidelity)  # a ValueError for a size too small to run
        dataclasses.replace(rt.config.noise, noise_scale=noise_scale)  # validates the noise strength
        strengths = rt.checked_loras(loras or {})
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        return StreamState(
            stream_id=stream_id,
            fidelity=fidelity,
            size=size,
            embedding=rt.prompts.embed(prompts, weights, blend_mode),
            prompt=PromptCache([], []),  # each rank holds its own blocks' K/V (see Stage.add_prompt)
            noise=NoiseSource(seed),
            vae_encoder=rt.vae.new_encoder_cache(),
            vae_decoder=None,  # the last rank decodes
            noise_scale=noise_scale,
            stabilize=stabilize,
            loras=strengths,
            fit_input=fit_input,
        )

    def set_loras(self, state: StreamState, loras: Mapping[str, float]) -> None:
        """Like :meth:`StreamRuntime.set_loras`; the ranks re-encode the prompt K/V with the next chunk."""
        state.loras = self.rt.checked_loras({**state.loras, **loras})

    def set_prompt(self, state: StreamState, prompt: str | Sequence[str], weights: Sequence[float] | None = None,
                   blend_mode: BlendMode = "linear", transition_chunks: int = 0, refresh_sinks: bool = False) -> None:
        """Like :meth:`StreamRuntime.set_prompt`; the new text tokens go round the ring with the next chunk."""
        target = self.rt.prompts.embed([prompt] if isinstance(prompt, str) else list(prompt), weights, blend_mode)
        if transition_chunks > 0:
            state.transition = PromptTransition(state.embedding, target, transition_chunks, mode="slerp")
        else:
            state.transition, state.embedding = None, target
            state.restart_stabilizer = True
        state.force_sink_refresh = refresh_sinks

    def set_look(self, state: StreamState, prompt: str | Sequence[str], weights: Sequence[float] | None = None,
                 blend_mode: BlendMode = "linear", loras: Mapping[str, float] | None = None,
                 noise_scale: float | None = None, transition_chunks: int = 0) -> None:
        """Like :meth:`StreamRuntime.set_look`, except that only the text conditioning glides: the LoRA
        strengths and the noise strength change at the next chunk (each rank re-encodes its blocks'
        prompt K/V once per prompt version, not per chunk of a transition)."""
        strengths = self.rt.checked_loras({**state.loras, **(loras or {})})
        self.set_prompt(state, prompt, weights, blend_mode, transition_chunks=transition_chunks)
        state.loras = strengths
        if noise_scale is not None:
            state.noise_scale = noise_scale

    def check_fidelity(self, fidelity: FidelityConfig) -> None:
        self.rt.check_fidelity(fidelity)

    def checked_loras(self, loras: Mapping[str, float]) -> dict[str, float]:
        return self.rt.checked_loras(loras)

    def set_fidelity(self, state: StreamState, fidelity: FidelityConfig) -> None:
        """Like :meth:`StreamRuntime.set_fidelity`: from the stream's next chunk on. A new step count or
        engine size needs the stream's chunks out of the ring first (see :meth:`_refit`)."""
        self.rt.set_fidelity(state, fidelity)

    def close_stream(self, state: StreamState) -> None:
        """Drop a finished stream's caches on every rank (drain its chunks first)."""
        sid = state.stream_id
        if self._in_flight(state):
            raise ValueError(f"stream {sid!r} still has chunks in flight; drain() first")
        self._control({"op": "forget", "sid": sid})
        self.stage.forget(sid)
        self._refresh = [r for r in self._refresh if r[0] != sid]  # its caches are gone on every rank
        self._versions.pop(sid, None)
        self._steps.pop(sid, None)
        self._known_prompts = {k for k in self._known_prompts if k[0] != sid}

    # -- chunks -------------------------------------------------------------------------------------

    def push(self, states: Sequence[StreamState], frames: Sequence[Tensor]) -> list[tuple[StreamState, ChunkResult]]:
        """Feed one chunk per stream ([3, T, H, W] in [-1, 1]); returns the chunks that finished meanwhile."""
        if len(states) != len(frames) or not states:
            raise ValueError("push needs one frame chunk per stream")
        if len({s.stream_id for s in states}) != len(states):
            raise ValueError("push got the same stream twice; feed one chunk per stream per call")
        t0 = time.perf_counter()
        slots = [self._enter(s, f) for s, f in zip(states, frames, strict=True)]
        self._enter_s = time.perf_counter() - t0
        self._micro_step(slots)
        return self._take_done()

    def run(self, states: Sequence[StreamState], frames: Sequence[Tensor]) -> list[tuple[StreamState, ChunkResult]]:
        """One chunk of each stream through the ring and back, with the ranks working at once.

        The streams are dealt round-robin into ``world`` micro-steps in a row, so while rank r runs
        one group's blocks rank r + 1 runs the previous group's (a cross-user batch is what fills the
        pipeline). Each stream has exactly one chunk in flight, so its next chunk cannot overtake a
        sink decision: the ring runs at full depth even with adaptive sink refresh on, exactly. Needs
        an empty ring (nothing pushed and not drained); returns every chunk, in finishing order.
        """
        if self._outstanding or self._continuing:
            raise ValueError("run() needs an empty ring; drain() the chunks pushed before")
        if len(states) != len(frames) or not states:
            raise ValueError("run needs one frame chunk per stream")
        groups = min(self.world, len(states))
        exact_depth, self.depth, self._streamwise = self.depth, self.world, True
        try:
            done = []
            for g in range(groups):
                done += self.push(states[g::groups], frames[g::groups])
            return done + self.drain()
        except Exception:
            self._abandon()
            raise
        finally:
            self.depth, self._streamwise = exact_depth, False

    def _abandon(self) -> None:
        """A chunk of a run failed (out of memory in a forward, a chunk that cannot enter): the
        micro-steps already sent come back, so every rank stays in step with rank 0, and the chunks
        in flight are dropped, so the ring serves the next call. The run's streams are left mid-chunk
        on the ranks: the caller closes them."""
        while self._outstanding:
            self.channel.recv(self.world - 1)
            self._outstanding.popleft()
        self._sent.clear()
        self._continuing.clear()
        self._barriers.clear()
        self._done.clear()

    def drain(self) -> list[tuple[StreamState, ChunkResult]]:
        """Run micro-steps without new input until every chunk in flight has finished."""
        while self._outstanding or self._continuing:
            self._micro_step([])
        return self._take_done()

    def rebalance(self, ranges: Sequence[range] | None = None) -> bool:
        """Move blocks between ranks: to ``ranges``, or to the scheduler's proposal (if any).

        Drains the ring first (the in-flight micro-steps finish; their chunks stay in flight), so every
        cache that moves holds all writes before the switch. Returns whether the partition changed.
        """
        target = self.scheduler.propose() if ranges is None else check_ranges(ranges, len(self.rt.dit.blocks))
        if target is None or target == self.stage.ranges:
            return False
        if len(target) != self.world:
            raise ValueError(f"{len(target)} block ranges for {self.world} ranks")
        self._receive_until(self._outstanding[-1] if self._outstanding else -1)
        self._control({"op": "rebalance", "ranges": [(r.start, r.stop) for r in target]})
        self.stage.rebalance(target, self.channel)
        self.scheduler.set_ranges(target)
        self.rebalances += 1
        log.info("pipeline rebalanced to %s", [(r.start, r.stop) for r in target])
        return True

    def shutdown(self) -> None:
        """Finish what is in flight and stop the other ranks."""
        self.drain()
        self._control({"op": "stop"})
        self.channel.flush()

    # -- internals ----------------------------------------------------------------------------------

    def _control(self, meta: dict[str, Any]) -> None:
        if self.world > 1:
            self.channel.send(1, Message(meta))

    def _enter(self, state: StreamState, chunk: Tensor) -> _Slot:
        """A new chunk: the runtime's first stage (prompt/RoPE bookkeeping, VAE encode, noise draws);
        the KV caches and prompt K/V it would fit live on the ranks instead."""
        self.rt.adopt_input_size(state, (chunk.shape[-1], chunk.shape[-2]))  # before the ranks see its size
        steps, size = state.fidelity.steps, self.rt.engine_size(state.size, state.fidelity)
        if self._steps.setdefault(state.stream_id, steps) != steps or state.engine_size not in (None, size):
            self._refit(state, steps, size)
        state.engine_size = size
        entered = self.rt.enter_chunk(state, chunk, local_caches=False)
        return _Slot(entered, self._prompt_version(state))

    def _refit(self, state: StreamState, steps: int, size: tuple[int, int]) -> None:
        """Between two chunks of a stream, a new step count or engine size (``resolution_scale``): every
        rank fits its share of the stream's caches as the single-process engine does at a chunk
        boundary (``StreamRuntime.fit_engine_size``, then ``_fit_caches``): its blocks' KV caches are
        rescaled (engine/streaming/rescale.py), then extra step caches dropped and added steps copied
        from the deepest; the last rank rescales the VAE decoder cache, rank 0 the encoder cache and
        the noise controller's frame. Pending sink decisions of the stream are applied first."""
        sid = state.stream_id
        if self._in_flight(state):
            raise ValueError(
                f"stream {sid!r} changed its step count or engine size while a chunk of it is in flight; the "
                "ranks hold its per-step caches, so drain() before changing steps or resolution_scale"
            )
        refresh = [r for r in self._refresh if r[0] == sid]
        self._refresh = [r for r in self._refresh if r[0] != sid]
        sizes = (state.engine_size, size) if state.engine_size not in (None, size) else None
        fit = {"op": "fit", "sid": sid, "steps": steps, "refresh": refresh, "sizes": sizes}
        self._control(fit)
        self.stage.fit(fit)
        if sizes is not None:
            rescale_state(state, self.rt.dit.config, self.rt.vae.spatial_compression, size)
        self._steps[sid] = steps

    def _in_flight(self, state: StreamState) -> bool:
        return any(s.state is state for slots in (*self._sent.values(), *self._continuing.values()) for s in slots)

    def _prompt_version(self, state: StreamState) -> int:
        """The version of the stream's prompt K/V on the ranks: a new one for a new embedding or new LoRA
        strengths (a LoRA on the text embedding or the cross-attention K/V changes them)."""
        sid = state.stream_id
        known = self._versions.get(sid)
        if known is not None and known[0] is state.embedding and known[2] == state.loras:
            return known[1]
        version = 0 if known is None else known[1] + 1
        loras = dict(state.loras)
        self._versions[sid] = (state.embedding, version, loras)
        with self.rt.loras.rows([loras]):
            text = self.rt.dit.embed_text(state.embedding)
        self._new_prompts.append((sid, version, text, loras))
        return version

    def _micro_step(self, new: list[_Slot]) -> None:
        m = self.micro_steps
        if self._outstanding and self._outstanding[-1] in self._barriers:
            self._receive_until(self._outstanding[-1])
        self._receive_until(m - self.depth)
        rows = self._continuing.pop(m - self.depth, []) + new
        self.micro_steps += 1
        if not rows:
            return
        msg = self._build(m, rows)
        self.forwards += 1
        out = self.stage.compute(msg)
        if not self._streamwise and any(s.chunk.tau is not None for s in rows):
            self._barriers.add(m)
        if self.world == 1:
            self._handle_return(out)
        else:
            self.channel.send(1, out)
            self._outstanding.append(m)
        every = self.options.rebalance_every
        if every and self.micro_steps % every == 0:
            self.rebalance()

    def _build(self, m: int, rows: list[_Slot]) -> Message:
        """Group the rows by cache fill level and geometry (token count, KV window, sinks), precision and
        attention sparsity (one batched forward each) and describe them."""
        groups: dict[tuple[int, int, tuple[int, int, int, str], str, float], list[tuple[int, dict[str, Any]]]] = {}
        tensors: dict[str, Tensor] = {}
        self._sent[m] = rows
        for key, slot in enumerate(rows):
            s, st = slot.chunk, slot.state
            w, h = self.rt.engine_size(st.size, st.fidelity)
            sc = self.rt.vae.spatial_compression
            geom = (self.rt.dit.config.frame_tokens(h // sc, w // sc), st.fidelity.kv_window_frames,
                    self.rt.config.sink_frames, st.fidelity.precision)
            last = s.step + 1 == len(s.timesteps)
            row = {"key": key, "sid": st.stream_id, "step": s.step, "last": last, "t": s.timesteps[s.step],
                   "t_next": None if last else s.timesteps[s.step + 1], "frame": s.frame, "rope": s.rope,
                   "ver": slot.version, "geom": geom, "tau": s.tau, "loras": s.loras,
                   "deblock": self.rt.deblock_strength(st)}
            cache = self.stage.cache_for(row)
            fill = (cache.local_end, s.frame - cache.global_end[0], geom, st.fidelity.precision,
                    st.fidelity.attention_sparsity)
            groups.setdefault(fill, []).append((key, row))
            if not last:
                tensors[f"noise.{key}"] = s.noises[s.step]
            elif s.guide is not None:
                tensors[f"guide.{key}"] = s.guide  # the last rank decodes, reading the input frames
        meta_groups = []
        for gi, ((_, _, _, precision, sparsity), members) in enumerate(groups.items()):
            tensors[f"x.{gi}"] = torch.cat([rows[key].chunk.x for key, _ in members])
            meta_groups.append({"rows": [row for _, row in members], "precision": precision, "sparsity": sparsity})
        for sid, version, text, _ in self._new_prompts:
            tensors[f"ctx.{sid}.{version}"] = text
        prompts = [(sid, version, loras) for sid, version, _, loras in self._new_prompts]
        self._known_prompts.update((sid, version) for sid, version, _ in prompts)
        self._new_prompts = []
        live = {(s.state.stream_id, s.version) for slots in (*self._sent.values(), *self._continuing.values())
                for s in slots}
        live.update((sid, v) for sid, (_, v, _) in self._versions.items())
        dead = self._known_prompts - live
        self._known_prompts -= dead
        drop: dict[str, list[int]] = {}
        for sid, version in sorted(dead):
            drop.setdefault(sid, []).append(version)
        meta = {"op": "step", "m": m, "groups": meta_groups, "prompts": prompts, "drop_prompts": list(drop.items()),
                "refresh": self._refresh, "sink": {}, "timings": [], "enter_s": self._enter_s}
        self._refresh = []
        self._enter_s = 0.0
        return Message(meta, tensors)

    def _receive_until(self, m: int) -> None:
        while self._outstanding and self._outstanding[0] <= m:
            msg = self.channel.recv(self.world - 1)
            expected = self._outstanding.popleft()
            if msg.meta.get("op") != "return" or msg.meta["m"] != expected:
                raise RuntimeError(f"ring out of order: expected the return of micro-step {expected}, got {msg.meta}")
            self._handle_return(msg)

    def _handle_return(self, msg: Message) -> None:
        meta, ts = msg.meta, msg.tensors
        m = meta["m"]
        rows = self._sent.pop(m)
        self._barriers.discard(m)
        by_key = {(s.state.stream_id, s.chunk.step): s.chunk for s in rows}  # before the steps advance
        going_on = []
        for key in meta["continue"]:
            slot = rows[key]
            slot.chunk.x = ts[f"xn.{key}"]
            slot.chunk.step += 1
            going_on.append(slot)
        if going_on:
            self._continuing[m] = going_on
        for sid, step, worst, newest in meta["refresh"]:
            by_key[(sid, step)].refreshed = True
            self._refresh.append((sid, step, worst, newest))
        for key in meta["finished"]:
            chunk = rows[key].chunk
            chunk.step += 1
            self.rt.account(chunk)
            result = ChunkResult(ts[f"frames.{key}"], chunk.noise_rate, chunk.timesteps[0], chunk.refreshed)
            self._done.append((chunk.state, self.rt.finish_frames(chunk.state, chunk.inputs, result, chunk.restart)))
        self.scheduler.observe([StageTiming(rank, blocks, other) for rank, blocks, other in meta["timings"]])

    def _take_done(self) -> list[tuple[StreamState, ChunkResult]]:
        done, self._done = self._done, []
        return done
