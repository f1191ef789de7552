"""The live stream runtime: one chunk in, one stylised chunk out, for one or many streams.

The core loop of a V2V chunk (StreamDiffusionV2 recipe), top to bottom:

    frames --VAE encode--> z --noise controller--> s, t0
    x = s*a*eps + (1-s)*z                                (v2v_input; a = input_noise, 1 by default)
    for each step i with timestep t_i (t_0 from the controller):
        v  = DiT(x, t_i, prompt, KV cache)               (one batched forward for all rows)
        x0 = x - sigma(t_i) * v
        x  = (1 - sigma(t_{i+1})) * x0 + sigma(t_{i+1}) * eps_i     (fresh noise, not on the last step)
    [clean mode: DiT(x0, t=0) once more, to write clean K/V]
    adaptive sink refresh, RoPE refresh, counters
    x0 --VAE decode--> frames --temporal stabilizer (if configured)--> out

Rows of one forward are streams that share a fidelity configuration and a cache fill level; each
row keeps its own KV cache, RoPE position, prompt and noise, so batching never mixes streams.

A chunk whose x̂₀ is not finite (NaN or inf, whatever the cause) comes out black and is reported
(``ChunkResult.fault``, :meth:`StreamRuntime.take_fault`) for its owner to reset the stream; the other
rows of its batch never see it (docs/security.md, "Numeric faults stay in their stream").
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, TypeVar

import cv2
import numpy as np
import torch

from engine.aspect import StreamSizes, crop_box, fit_size, scaled_size
from engine.fidelity import FidelityConfig, fp8_kv_in, fp8_linears_in, unsupported_reason
from engine.frames import unit_range
from engine.models.bf16_weights import keep_bf16_weights
from engine.models.fp8 import FP8_DTYPE, fp8_linear_supported, fp8_linears
from engine.models.lora import LoRABank, check_strengths
from engine.models.wan_dit import CausalWanDiT, KVCache, PromptCache
from engine.sampling import NoiseSource, SamplerPreset, renoise, v2v_input, x0_from_velocity
from engine.streaming.config import RuntimeConfig
from engine.streaming.deblock import deblock
from engine.streaming.noise import MotionAwareNoiseController, NoiseControllerConfig
from engine.streaming.prompts import BlendMode, LookAnchors, PromptTransition, blend, mix_weights, prompt_cuts
from engine.streaming.rescale import rescale_state
from engine.streaming.stabilizer import StabilizerConfig, TemporalStabilizer
from engine.streaming.stage_timer import StageTimer, StageTimings
from engine.streaming.state import StreamState
from engine.vae import CacheMismatchError, StreamVAE, decode_batch, encode_batch

log = logging.getLogger(__name__)


class RopeOverflowError(RuntimeError):
    """A stream's temporal RoPE position would leave the model's position table."""


class PromptEncoder:
    """Text -> conditioning embeddings [1, L, text_dim], with prompt blending.

    ``conditioning`` is how the model was trained to read text: "tokens" (Wan: the encoder's token
    states) or "pooled" (the embedded model: one row, the L2-normalised sentence embedding).
    """

    def __init__(self, text_encoder: object, conditioning: str = "tokens", anchors: LookAnchors | None = None) -> None:
        if conditioning not in ("tokens", "pooled"):
            raise ValueError(f"text conditioning must be 'tokens' or 'pooled', got {conditioning!r}")
        if anchors is not None and conditioning != "pooled":
            raise ValueError("look anchoring needs pooled text conditioning")
        self._text = text_encoder
        self.conditioning = conditioning
        self.anchors = anchors

    def pooled(self, prompts: Sequence[str]) -> torch.Tensor:
        """L2-normalised sentence embeddings [N, dim]."""
        pooled = self._text.pooled(list(prompts))  # type: ignore[attr-defined]
        return torch.nn.functional.normalize(pooled.float(), dim=-1)

    def cuts(self, prompt: str) -> torch.Tensor | None:
        """The pooled embeddings of ``prompt``'s cuts into two parts [K, 2, dim] (``prompt_cuts``), what
        look anchoring reads to find two looks a prompt names; None when it has none."""
        cuts = prompt_cuts(prompt)
        if not cuts:
            return None
        return self.pooled([part for cut in cuts for part in cut]).reshape(len(cuts), 2, -1)

    def named_looks(self, prompt: str) -> tuple[str, str] | None:
        """The two looks ``prompt`` names (``LookAnchors.named``); None without look anchoring."""
        if self.anchors is None:
            return None
        return self.anchors.named(self.pooled([prompt])[0], self.cuts(prompt))

    def looks(self, prompts: Sequence[str], weights: Sequence[float] | None = None) -> list[tuple[str, float]]:
        """The looks prompts (mixed by ``weights``) are served as, with their shares of the blend (sum 1,
        largest first, shares under 1 % left out); empty without look anchoring."""
        mix = mix_weights(len(prompts), weights)
        if self.anchors is None:
            return []
        shares: dict[str, float] = {}
        for prompt, weight in zip(prompts, mix, strict=True):
            for name, share in self.anchors.weights(self.pooled([prompt])[0], self.cuts(prompt)):
                shares[name] = shares.get(name, 0.0) + weight * share
        return sorted(((n, s) for n, s in shares.items() if s >= 0.01), key=lambda item: -item[1])

    def embed(self, prompts: Sequence[str], weights: Sequence[float] | None = None, mode: BlendMode = "linear") -> torch.Tensor:
        if not prompts:
            raise ValueError("at least one prompt is needed")
        if self.conditioning == "pooled":
            pooled = self.pooled(prompts)
            if self.anchors is not None:
                pooled = self.anchors.anchor(pooled, [self.cuts(p) for p in prompts])
            tokens = pooled[:, None, :]
        else:
            tokens = self._text.encode(list(prompts))  # type: ignore[attr-defined]
        rows = [tokens[i : i + 1] for i in range(tokens.shape[0])]
        if len(rows) == 1:
            return rows[0]
        return blend(rows, list(weights) if weights is not None else [1.0] * len(rows), mode)


@dataclass(frozen=True)
class ChunkResult:
    frames: torch.Tensor  # [3, T, H, W] in [-1, 1]
    noise_rate: float
    first_timestep: float
    sink_refreshed: bool
    # Why the chunk came out black (its x̂₀ was not finite: reset the stream, its caches may hold the
    # cause); None when it did not.
    fault: str | None = None


@dataclass(eq=False)
class ChunkInFlight:
    """A chunk between entering (:meth:`StreamRuntime.enter_chunk`) and finishing: its latents at the
    current step, the schedule and noise drawn for it, and where it sits in its stream."""

    host_fields: ClassVar[tuple[str, ...]] = ("inputs",)  # the stabilizer reads them with OpenCV (parcel.py)

    state: StreamState
    x: torch.Tensor  # [1, C, F, h, w] at step ``step`` (x̂₀ once done)
    timesteps: list[float]  # this chunk's schedule (the first from the noise controller)
    noises: list[torch.Tensor]  # one re-noise draw per step transition
    prompt: PromptCache  # cross-attention K/V when it entered
    frame: int  # absolute latent frame index of its first frame
    rope: int  # temporal RoPE position of its first frame
    noise_rate: float
    tau: float | None  # adaptive sink refresh threshold after each forward (None: no refresh)
    # The input frames [3, T, H, W] at the engine size (the stabilizer follows their motion): uint8 where
    # they came as a camera's bytes, else float in [-1, 1]; None: T2V.
    inputs: torch.Tensor | None
    restart: bool  # a hard prompt switch came before it: the stabilizer starts a fresh history
    fidelity: FidelityConfig  # the stream's fidelity when it entered (it keeps it until it finishes)
    step: int = 0
    refreshed: bool = False
    loras: dict[str, float] = field(default_factory=dict)  # the stream's LoRA strengths when it entered
    # The input frames [1, 3, T, H, W] at the engine size, as the VAE encoder took them, for a decoder
    # that reads them (``vae.reads_input``); None otherwise and for T2V.
    guide: torch.Tensor | None = None

    @property
    def steps_left(self) -> int:
        return len(self.timesteps) - self.step

    @property
    def done(self) -> bool:
        return self.step >= len(self.timesteps)

    def batch_key(self, per_step: bool = True) -> tuple[object, ...]:
        """Chunks with equal keys may share one forward: same precision and sparsity, and the cache
        they use now at the same fill level, geometry and storage (a stream that switched to or from
        fp8-kv converted its caches while an older chunk of it was still in flight)."""
        cache = self.state.kv[self.step if per_step else 0] if self.state.kv else None
        fill = (cache.local_end, self.frame - cache.global_end[0], cache.frame_tokens, cache.window_frames,
                cache.dtype) if cache is not None else None
        fid = self.fidelity
        return (fid.precision, fid.attention_sparsity, tuple(self.x.shape[1:]), fill)


class StreamRuntime:
    def __init__(
        self,
        dit: CausalWanDiT,
        vae: StreamVAE,
        prompts: PromptEncoder,
        preset: SamplerPreset,
        config: RuntimeConfig,
    ) -> None:
        self.dit = dit
        self.loras = LoRABank.of(dit)  # the LoRAs loaded on ``dit`` (docs/lora.md); streams pick strengths
        self.vae = vae
        for model in (dit, vae):
            if isinstance(model, torch.nn.Module):
                keep_bf16_weights(model)  # bf16 chunks (:meth:`precision`) cast the weights once, not per chunk
        self.prompts = prompts
        self.preset = preset
        self.schedule = preset.schedule
        self.config = config
        self.device = dit.device
        self.stabilizer = TemporalStabilizer(config.stabilizer) if config.stabilizer is not None else None
        self.timer = StageTimer(self.device)  # stage boundaries of run_chunks, read through last_timings
        # Stream id -> (non-finite chunks, the latest one's reason) since :meth:`take_fault` took them.
        self._faults: dict[str, tuple[int, str]] = {}

    # -- stream lifecycle ---------------------------------------------------------------------------

    def open(
        self,
        stream_id: str,
        prompt: str | Sequence[str],
        size: tuple[int, int],
        fidelity: FidelityConfig,
        seed: int = 0,
        weights: Sequence[float] | None = None,
        blend_mode: BlendMode = "linear",
        noise_scale: float = 0.8,
        stabilize: bool = True,
        loras: Mapping[str, float] | None = None,
        fit_input: bool = False,
    ) -> StreamState:
        """A new stream's state. ``loras``: strength per loaded LoRA (absent ones 0), see :meth:`set_loras`.
        ``fit_input``: the stream's size follows its first chunk's aspect at ``size``'s pixel budget
        (:meth:`adopt_input_size`); otherwise it stays ``size``."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        self.check_fidelity(fidelity)
        self._check_size(size, fidelity)
        replace(self.config.noise, noise_scale=noise_scale)  # validates the noise strength
        strengths = self.checked_loras(loras or {})
        embedding = self.prompts.embed(prompts, weights, blend_mode)
        return StreamState(
            noise_scale=noise_scale,
            stream_id=stream_id,
            fidelity=fidelity,
            size=size,
            embedding=embedding,
            prompt=self.encode_prompt(embedding, strengths),
            noise=NoiseSource(seed),
            vae_encoder=self.vae.new_encoder_cache(),
            vae_decoder=self.vae.new_decoder_cache(),
            stabilize=stabilize,
            loras=strengths,
            fit_input=fit_input,
        )

    def encode_prompt(self, embedding: torch.Tensor, loras: Mapping[str, float]) -> PromptCache:
        """Cross-attention K/V of a text embedding for a stream with LoRA strengths ``loras`` (a LoRA on the
        text embedding or the cross-attention K/V projections changes them)."""
        with self.loras.rows([loras]):
            return self.dit.encode_prompt(embedding)

    def set_loras(self, state: StreamState, loras: Mapping[str, float]) -> None:
        """Change the strengths of the LoRAs named in ``loras`` (the others keep theirs; 0 turns one off)
        from the next chunk on, without a reload: only this stream's rows of later forwards change."""
        strengths = self.checked_loras({**state.loras, **loras})
        state.prompt = self.encode_prompt(state.embedding, strengths)
        state.loras = strengths

    def checked_loras(self, loras: Mapping[str, float]) -> dict[str, float]:
        """``loras`` checked (finite, bounded, loaded), without the ones at strength 0."""
        strengths = check_strengths(loras)
        self.loras.strengths([strengths])  # names every LoRA that is not loaded
        return {name: s for name, s in strengths.items() if s != 0.0}

    def set_prompt(
        self,
        state: StreamState,
        prompt: str | Sequence[str],
        weights: Sequence[float] | None = None,
        blend_mode: BlendMode = "linear",
        transition_chunks: int = 0,
        refresh_sinks: bool = False,
    ) -> None:
        """Switch prompt without restarting: only the cross-attention K/V change.

        With ``transition_chunks`` > 0 the conditioning moves to the new prompt over that many chunks.
        ``refresh_sinks`` re-anchors the sink frames to the next chunk so old-style anchors fade faster.
        """
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        target = self.prompts.embed(prompts, weights, blend_mode)
        if transition_chunks > 0:
            state.transition = PromptTransition(state.embedding, target, transition_chunks, mode="slerp")
        else:
            state.transition = None
            state.embedding = target
            state.prompt = self.encode_prompt(target, state.loras)
            # A hard cut to a new look: the stabilizer's history is of the old one.
            state.restart_stabilizer = True
        state.force_sink_refresh = refresh_sinks

    def set_look(
        self,
        state: StreamState,
        prompt: str | Sequence[str],
        weights: Sequence[float] | None = None,
        blend_mode: BlendMode = "linear",
        loras: Mapping[str, float] | None = None,
        noise_scale: float | None = None,
        transition_chunks: int = 0,
    ) -> None:
        """Move to a look (a cue: prompt or blend, LoRA strengths, noise strength) together over
        ``transition_chunks`` chunks (0: a cut), from where the stream is now: mid-transition that is the
        blend its last chunk ran with, so firing a look during a transition never jumps. ``loras`` names
        the strengths it sets (the others keep theirs; 0 turns one off); None keeps them, as does
        ``noise_scale`` None. Everything is checked before anything changes."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        target = self.prompts.embed(prompts, weights, blend_mode)
        target_loras = self.checked_loras({**state.loras, **(loras or {})})
        target_noise = state.noise_scale if noise_scale is None else noise_scale
        replace(self.config.noise, noise_scale=target_noise)  # validates the noise strength
        if transition_chunks > 0:
            state.transition = PromptTransition(state.embedding, target, transition_chunks, mode="slerp",
                                                loras_source=dict(state.loras), loras_target=target_loras,
                                                noise_source=state.noise_scale, noise_target=target_noise)
            return
        state.transition = None
        state.embedding, state.loras, state.noise_scale = target, target_loras, target_noise
        state.prompt = self.encode_prompt(target, target_loras)
        state.restart_stabilizer = True  # a hard cut to a new look: the stabilizer's history is of the old one

    def set_fidelity(self, state: StreamState, fidelity: FidelityConfig) -> None:
        """Takes effect at the next chunk boundary (the next call of :meth:`run_chunk`)."""
        self.check_fidelity(fidelity)
        self._check_size(state.size, fidelity)
        state.fidelity = fidelity

    def check_fidelity(self, fidelity: FidelityConfig) -> None:
        if fidelity.steps > len(self.preset.steps):
            raise ValueError(f"steps={fidelity.steps} exceeds the {len(self.preset.steps)} steps of preset {self.preset.name}")
        reason = unsupported_reason(fidelity, self.device.type, fp8_units=fp8_linear_supported(self.device))
        if reason is not None:
            raise ValueError(f"fidelity {fidelity.label()} cannot run here: {reason}")
        if fidelity.kv_window_frames < self.config.sink_frames + self.config.chunk_latent_frames:
            raise ValueError(
                f"kv_window_frames={fidelity.kv_window_frames} cannot hold {self.config.sink_frames} sinks plus a chunk"
            )
        if fidelity.step_batch and self.config.cache_mode != "per-step":
            raise ValueError("step_batch needs one KV cache per denoising step (cache_mode 'per-step')")

    def _check_size(self, size: tuple[int, int], fidelity: FidelityConfig) -> None:
        self.engine_size(size, fidelity)  # a ValueError for a size too small to run

    @property
    def size_granularity(self) -> int:
        """Pixels a frame's sides must be multiples of: the VAE's spatial compression times the DiT's patch."""
        _, ph, pw = self.dit.config.patch_size
        return self.vae.spatial_compression * math.lcm(ph, pw)

    def engine_size(self, size: tuple[int, int], fidelity: FidelityConfig) -> tuple[int, int]:
        """Pixel size the model runs at: the size on the model's grid within ``size`` scaled by the
        fidelity's ``resolution_scale`` (its pixel budget) that keeps the most of ``size``'s picture
        (engine/aspect.py, :func:`scaled_size`: ``size`` itself when it is on the grid at scale 1)."""
        return scaled_size(size, fidelity.resolution_scale, self.size_granularity)

    def sizes(self, state: StreamState, frame_size: tuple[int, int], fidelity: FidelityConfig) -> StreamSizes:
        """The stream's size and the engine size of its next chunk at ``fidelity``, for frames of
        ``frame_size`` (the camera's): what a server resizes a chunk's frames to before it enters (once,
        straight from the camera's size), so that :meth:`enter_chunks` resizes nothing. A stream that takes
        its size from its input takes it from ``frame_size`` here (:meth:`adopt_input_size`)."""
        self.adopt_input_size(state, frame_size)
        return StreamSizes(state.size, self.engine_size(state.size, fidelity))

    def adopt_input_size(self, state: StreamState, frame_size: tuple[int, int]) -> None:
        """A stream opened with ``fit_input`` takes its size from its first chunk's frames (``frame_size``,
        width and height): the grid size at its pixel budget closest to their aspect (engine/aspect.py).
        The one place a stream's size is decided: a server asks it through :meth:`sizes` with its
        camera's size before the first chunk (whose frames then come at the engine size), a caller of
        :meth:`enter_chunks` with raw frames gets it from them. Later chunks of another size are
        centre-cropped and resized to the stream's size: the stream keeps its size, caches and context
        (a reset picks the size again from the next chunk)."""
        if not state.fit_input:
            return
        state.fit_input = False
        if state.engine_size is not None:  # caches already hold another size (a parked or moved stream)
            return
        budget = state.size[0] * state.size[1]
        size = fit_size(frame_size, budget, self.size_granularity)
        if size != state.size:
            log.info("stream %s: %dx%d input -> stream size %dx%d", state.stream_id, *frame_size, *size)
        state.size = size
        self._check_size(size, state.fidelity)

    # -- the chunk recipe: public stages -----------------------------------------------------------
    #
    # Every way of running chunks is these stages grouped differently: one chunk after another
    # (step), several streams in one forward (step_batch), the steps of successive chunks in one
    # forward (stream_batch.StreamBatch), the ranks of a pipeline (engine/parallel), and a serving
    # executor that stops between denoising steps to let a more urgent stream run (preemption).

    def enter_chunk(self, state: StreamState, frames: torch.Tensor, local_caches: bool = True) -> ChunkInFlight:
        """Stage 1: a V2V chunk of input frames [3, T, H, W] (float in [-1, 1], or a camera's uint8,
        `engine.frames.frames_as_uint8`, fitted to the engine size before it is converted) enters:
        motion-aware noise level, VAE encode, every noise draw of the chunk, positions. See
        :meth:`enter_latents`."""
        return self.enter_chunks([state], [frames], local_caches)[0]

    def enter_chunks(self, states: Sequence[StreamState], frames: Sequence[torch.Tensor],
                     local_caches: bool = True) -> list[ChunkInFlight]:
        """:meth:`enter_chunk` for several streams, their encodes in one VAE call where their encoder caches
        are at one point (same engine size, chunk length and precision: `engine.vae.encode_batch`)."""
        entries = []
        for state, clip in zip(states, frames, strict=True):
            restart = state.take_stabilizer_restart()
            self.adopt_input_size(state, (clip.shape[-1], clip.shape[-2]))
            if local_caches:
                self.fit_engine_size(state)  # before the encode: the VAE cache must be at the chunk's size
            fitted = fit_frames(clip, self.engine_size(state.size, state.fidelity))
            engine_frames = unit_range(fitted)
            rate = MotionAwareNoiseController(self._noise_config(state)).step(engine_frames, state.noise_controller)
            pixels = engine_frames.unsqueeze(0).to(self.device, self.dit.dtype)
            # The chunk keeps its input as it came (a camera's bytes stay bytes): the stabilizer reads bytes.
            entries.append((state, fitted, rate, pixels, restart))
        latents: list[torch.Tensor | None] = [None] * len(entries)
        for rows in _groups(entries, lambda e: (tuple(e[3].shape), e[0].fidelity.precision)):
            with self.precision(entries[rows[0]][0].fidelity.precision):
                # In the DiT's dtype whatever the encoder computed in, so the chunk's noise draws are too.
                z = _batched(encode_batch, self.vae, torch.cat([entries[i][3] for i in rows]),
                             [entries[i][0].vae_encoder for i in rows])
            for j, i in enumerate(rows):
                latents[i] = z[j].to(self.dit.dtype)
        chunks = []
        for (state, fitted, rate, pixels, restart), z_row in zip(entries, latents, strict=True):
            assert z_row is not None
            chunk = self.enter_latents(state, z_row, rate, fitted, restart, local_caches)
            if self.vae.reads_input:
                chunk.guide = pixels
            chunks.append(chunk)
        return chunks

    def enter_latents(
        self,
        state: StreamState,
        z: torch.Tensor,
        rate: float,
        inputs: torch.Tensor | None = None,
        restart: bool = False,
        local_caches: bool = True,
    ) -> ChunkInFlight:
        """Stage 1 from VAE latents ``z`` [1, C, F, h, w] and the controller's noise rate.

        All of the chunk's noise is drawn here, in the order the sequential loop uses it (V2V noise,
        then one re-noise per step transition), so grouping the later stages differently never changes
        a stream's result. ``local_caches=False``: the KV caches and prompt K/V live elsewhere (the
        ranks of a pipeline), so they are not fitted here.
        """
        self._begin_chunk(state, local_caches)
        steps = state.fidelity.steps
        first = MotionAwareNoiseController(self.config.noise).first_timestep(rate)
        timesteps = [first, *self.preset.timesteps(steps)[1:]]
        # Drawn whatever input_noise is, so a stream's later draws do not depend on it.
        eps = state.noise.randn(z.shape, dtype=z.dtype, device=self.device)
        x = v2v_input(z, self.config.noise.input_noise * eps, rate)
        noises = [state.noise.randn(z.shape, dtype=z.dtype, device=self.device) for _ in range(steps - 1)]
        return self._admit_chunk(state, x, timesteps, noises, rate, inputs, restart)

    def enter_generated(self, state: StreamState) -> ChunkInFlight:
        """Stage 1 of a T2V chunk (CausVid / Self-Forcing recipe): pure noise, the preset's steps."""
        self._begin_chunk(state, True)
        w, h = self.engine_size(state.size, state.fidelity)
        sc = self.vae.spatial_compression
        shape = (1, self.vae.latent_channels, self.config.chunk_latent_frames, h // sc, w // sc)
        x = state.noise.randn(shape, device=self.device)
        timesteps = list(self.preset.timesteps(state.fidelity.steps))
        noises = [state.noise.randn(shape, dtype=x.dtype, device=self.device) for _ in timesteps[1:]]
        return self._admit_chunk(state, x, timesteps, noises, 1.0, None, False)

    def _admit_chunk(self, state: StreamState, x: torch.Tensor, timesteps: list[float], noises: list[torch.Tensor],
                     rate: float, inputs: torch.Tensor | None, restart: bool) -> ChunkInFlight:
        tau: float | None = None
        if state.force_sink_refresh:
            tau, state.force_sink_refresh = float("inf"), False
        elif self.config.sink_refresh:
            tau = self.config.sink_tau
        chunk = ChunkInFlight(state, x, timesteps, noises, state.prompt, state.frame, state.rope_frame, rate, tau,
                              inputs, restart, state.fidelity, loras=dict(state.loras))
        state.frame += x.shape[2]
        state.rope_frame += x.shape[2]
        return chunk

    def denoise_step(self, chunks: Sequence[ChunkInFlight]) -> None:
        """Stage 2: one batched DiT forward that moves every chunk one denoising step on.

        Rows may be at different steps (the stream batch) and of different streams; they must share
        precision, attention sparsity and their caches' fill level (``ChunkInFlight.batch_key``).
        Afterwards each row holds x̂₀ (its last step) or its re-noised input for the next step.
        """
        if not chunks:
            return
        if any(c.done for c in chunks):
            raise ValueError("a finished chunk cannot take another denoising step")
        per_step = self.config.cache_mode == "per-step"
        caches = [c.state.kv[c.step if per_step else 0] for c in chunks]
        x = torch.cat([c.x for c in chunks])
        f = x.shape[2]
        t = torch.tensor([c.timesteps[c.step] for c in chunks], device=self.device, dtype=torch.float32)
        prompt = chunks[0].prompt if len(chunks) == 1 else PromptCache.concat([c.prompt for c in chunks])
        start, rope = [c.frame for c in chunks], [c.rope for c in chunks]
        sparse = {"sparsity": self.shared_sparsity(c.fidelity for c in chunks),
                  "sparse_block_tokens": self.config.sparse_block_tokens}
        with self.precision(chunks[0].fidelity.precision):
            with _batched_cache(caches) as (cache, written), self.loras.rows([c.loras for c in chunks]):
                v = self.dit(x, t[:, None].expand(-1, f), prompt, cache, start_frame=start, rope_start=rope, **sparse)
            _write_back(chunks, written, per_step)
            sigma = self.schedule.sigma(t).to(self.device).view(-1, 1, 1, 1, 1)
            x0 = x0_from_velocity(x, v.to(x.dtype), sigma)
            finishing = [i for i, c in enumerate(chunks) if c.step + 1 == len(c.timesteps)]
            if not per_step and finishing:
                # Clean mode: one more forward on x̂₀ at t = 0 writes the chunk's clean K/V.
                rows = [chunks[i] for i in finishing]
                clean = torch.cat([x0[i : i + 1] for i in finishing])
                zero = torch.zeros(len(rows), f, device=self.device)
                prompt = rows[0].prompt if len(rows) == 1 else PromptCache.concat([c.prompt for c in rows])
                with _batched_cache([c.state.kv[0] for c in rows]) as (cache, written), \
                        self.loras.rows([c.loras for c in rows]):
                    self.dit(clean, zero, prompt, cache, start_frame=[c.frame for c in rows],
                             rope_start=[c.rope for c in rows], **sparse)
                _write_back(rows, written, False)
        for i, c in enumerate(chunks):
            if per_step or c.step + 1 == len(c.timesteps):
                written_cache = c.state.kv[c.step if per_step else 0]
                if c.tau is not None:
                    c.refreshed |= refresh_sinks(written_cache, f, c.tau)
            if c.step + 1 < len(c.timesteps):
                c.x = renoise(x0[i : i + 1], c.noises[c.step], float(self.schedule.sigma(c.timesteps[c.step + 1])))
            else:
                c.x = x0[i : i + 1]
            c.step += 1

    def decode_chunk(self, chunk: ChunkInFlight) -> ChunkResult:
        """Stage 3: the finished chunk's x̂₀ through the VAE decoder, at the engine size (the size the
        model drew it at; :meth:`finish_frames` fits it to the stream's); counters."""
        return self.decode_chunks([chunk])[0]

    def decode_chunks(self, chunks: Sequence[ChunkInFlight]) -> list[ChunkResult]:
        """:meth:`decode_chunk` for several streams, their decodes in one VAE call where their decoder
        caches are at one point (`engine.vae.decode_batch`). A chunk whose x̂₀ is not finite comes out
        black, with the reason (:meth:`_non_finite`)."""
        for chunk in chunks:
            if not chunk.done:
                raise ValueError(f"chunk of stream {chunk.state.stream_id} has {chunk.steps_left} steps left")
        faults = self._non_finite(chunks)
        decoded: list[torch.Tensor | None] = [None] * len(chunks)
        # A stream's first chunk decodes to fewer frames than its later ones: never in one call with them.
        key = lambda c: (tuple(c.x.shape), c.fidelity.precision, c.guide is None, c.frame == 0)  # noqa: E731
        for rows in _groups(chunks, key):
            guides = [chunks[i].guide for i in rows]
            with self.precision(chunks[rows[0]].fidelity.precision):
                rows_out = _batched(decode_batch, self.vae, torch.cat([chunks[i].x for i in rows]),
                                    [chunks[i].state.vae_decoder for i in rows],
                                    None if guides[0] is None else torch.cat(guides))  # type: ignore[arg-type]
            for j, i in enumerate(rows):
                decoded[i] = rows_out[j][0]
        results = []
        for i, (chunk, frames_row) in enumerate(zip(chunks, decoded, strict=True)):
            assert frames_row is not None
            if i in faults:
                frames = torch.full(frames_row.shape, -1.0, device=frames_row.device)
            else:
                frames = self._deblocked(frames_row, self.deblock_strength(chunk.state))
            self.account(chunk)
            results.append(ChunkResult(frames, chunk.noise_rate, chunk.timesteps[0], chunk.refreshed,
                                       faults.get(i)))
        return results

    def take_fault(self, stream_id: str) -> tuple[int, str] | None:
        """How many of the stream's chunks came out non-finite since the last call, and the latest one's
        reason; None when none did. The live server tells the stream's owner (app/server/serving/executors.py)."""
        return self._faults.pop(stream_id, None)

    def _non_finite(self, chunks: Sequence[ChunkInFlight]) -> dict[int, str]:
        """The finished chunks whose x̂₀ is not finite, by index, with the reason (also kept for
        :meth:`take_fault`). One sum per chunk and one device sync for all (decoding syncs soon anyway):
        the sum is NaN or inf exactly when a value is, or when the values are past any latent's range
        (beyond 1e33), and one pass where ``isfinite().all()`` takes two (a 16x3x60x104 chunk on one CPU
        thread: 26 us against 1.5 ms). Such a chunk is decoded as zeros in its place: the decoder's cache
        stays finite, and a decode batched with other rows is the one it would be with a clean chunk there.

        The stream's state is left as it is: its KV caches may hold the cause (the chunk's keys and
        values were written from it), and emptying them in place would break their frame bookkeeping
        (KVCache.reserve). Its owner resets the stream (``Stream.reset``; the live server does it itself,
        app/server/serving/executors.py); a cause outside the state (its weights, a LoRA) shows again after."""
        if not chunks:
            return {}
        finite = torch.stack([c.x.sum(dtype=torch.float32) for c in chunks]).isfinite().tolist()
        faults = {}
        for i, (chunk, ok) in enumerate(zip(chunks, finite, strict=True)):
            if ok:
                continue
            state = chunk.state
            chunk.x = torch.zeros_like(chunk.x)
            faults[i] = f"chunk {state.chunks} came out non-finite (NaN or inf) and was dropped (black frames)"
            log.warning("stream %s: %s", state.stream_id, faults[i])
            self._faults[state.stream_id] = (self._faults.get(state.stream_id, (0, ""))[0] + 1, faults[i])
        return faults

    def decode_latents(self, x0: torch.Tensor, decoder: object, deblock_strength: float = 0.0,
                       guide: torch.Tensor | None = None, precision: str = "fp32") -> torch.Tensor:
        """x̂₀ [1, C, F, h, w] -> frames [3, T, H, W] in [-1, 1] at the engine size, deblocked at
        ``deblock_strength`` (the stream's :meth:`deblock_strength`; a pipeline's last rank calls this
        with its own decoder caches); ``guide``: the chunk's input frames for a decoder that reads them
        (:attr:`ChunkInFlight.guide`); ``precision``: the chunk's (:meth:`precision`)."""
        with self.precision(precision):
            frames = self.vae.decode_chunk(x0, decoder, guide)[0]
        return self._deblocked(frames, deblock_strength)

    def _deblocked(self, frames: torch.Tensor, deblock_strength: float) -> torch.Tensor:
        """Decoded frames [3, T, H, W] as float32 in [-1, 1], deblocked at the stream's strength."""
        frames = frames.float().clamp(-1, 1)
        if self.config.deblock is not None and deblock_strength > 0:
            with self.timer.span():
                # At the engine size, where the blocks sit on the grid (a resize would move them off it).
                frames = deblock(frames, self.vae.spatial_compression, deblock_strength, self.config.deblock.reach)
                frames = frames.clamp(-1, 1)
        return frames

    def deblock_strength(self, state: StreamState) -> float:
        """How strongly the stream's decoded frames are deblocked (0: not at all): the config's strength,
        less for a stream whose prompt asks for a look drawn on the grid."""
        if self.config.deblock is None:
            return 0.0
        return self.config.deblock.strength_for(state.embedding)

    @staticmethod
    def account(chunk: ChunkInFlight) -> None:
        """A stream's counters once its chunk is finished."""
        state = chunk.state
        state.chunks += 1
        state.sink_refreshes += int(chunk.refreshed)
        state.last_sink_refresh = chunk.refreshed
        state.last_noise_rate = chunk.noise_rate
        state.last_first_timestep = chunk.timesteps[0]

    def finish_chunk(self, chunk: ChunkInFlight) -> ChunkResult:
        """Stages 3 and 4: decode, then the temporal stabilizer and the fit to the stream's size."""
        return self.finish_chunks([chunk])[0]

    def finish_chunks(self, chunks: Sequence[ChunkInFlight]) -> list[ChunkResult]:
        """:meth:`finish_chunk` for several streams' chunks (one each), decoded together where they can be."""
        results = self.decode_chunks(chunks)
        return [self.finish_frames(c.state, c.inputs, r, c.restart) for c, r in zip(chunks, results, strict=True)]

    # -- the stages grouped: sequential chunks and cross-user batches -------------------------------

    def run_chunk(self, state: StreamState, frames: torch.Tensor) -> ChunkResult:
        """V2V: one chunk of input frames [3, T, H, W] (float in [-1, 1] or uint8, :meth:`enter_chunk`)
        -> the stylised chunk."""
        return self.run_chunks([state], [frames])[0]

    def run_chunks(self, states: Sequence[StreamState], frames: Sequence[torch.Tensor]) -> list[ChunkResult]:
        """V2V for several streams in one batched forward per denoising step.

        The streams must share steps, precision, sparsity and engine size, and have the same cache
        fill level (any two streams past warm-up do); otherwise call :meth:`run_chunk` per stream.
        """
        if len(states) != len(frames) or not states:
            raise ValueError("run_chunks needs one frame chunk per stream")
        timer = self.timer
        timer.start()
        chunks = self.enter_chunks(states, frames)
        timer.boundary("entered")
        self.run_to_end(chunks)
        timer.boundary("denoised")
        results = self.decode_chunks(chunks)
        timer.boundary("decoded")
        results = [self.finish_frames(c.state, c.inputs, r, c.restart) for c, r in zip(chunks, results, strict=True)]
        timer.boundary("end")
        return results

    @property
    def last_timings(self) -> StageTimings:
        """The stage times of the last :meth:`run_chunks` call, resolved from its marks on this read
        (engine/streaming/stage_timer.py: CUDA events, no device-wide sync while the chunk ran)."""
        return self.timer.last()

    def clock(self) -> float:
        """``time.perf_counter()`` once the device has finished the work queued so far, for a harness that
        times whole chunks (a benchmark's chunk latency); the runtime's own stage boundaries never sync
        (:attr:`last_timings`). A no-op sync on the CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def run_to_end(self, chunks: Sequence[ChunkInFlight]) -> None:
        """Denoising steps until every chunk is finished (the chunks share their step count)."""
        if len({c.steps_left for c in chunks}) > 1:
            raise ValueError("chunks denoised together must have the same number of steps left")
        while chunks and not chunks[0].done:
            self.denoise_step(chunks)

    def denoise_latents(
        self, states: Sequence[StreamState], latents: Sequence[torch.Tensor], rates: Sequence[float]
    ) -> torch.Tensor:
        """The latent core of a V2V chunk: noise the input latents, denoise, update the stream state.

        ``latents`` are the VAE latents of each stream's chunk [1, C, F, h, w]; ``rates`` the noise
        rates from the motion-aware controller. Returns x̂₀ for all rows [B, C, F, h, w].
        """
        chunks = [self.enter_latents(s, z, r) for s, z, r in zip(states, latents, rates, strict=True)]
        self.run_to_end(chunks)
        for c in chunks:
            self.account(c)
        return torch.cat([c.x for c in chunks])

    def generate(self, state: StreamState) -> ChunkResult:
        """T2V: the next chunk of a text-to-video stream (CausVid / Self-Forcing recipe, no input video)."""
        return self.generate_batch([state])[0]

    def generate_batch(self, states: Sequence[StreamState]) -> list[ChunkResult]:
        chunks = [self.enter_generated(state) for state in states]
        self.run_to_end(chunks)
        return [self.finish_frames(c.state, None, self.decode_chunk(c), False) for c in chunks]

    # -- internals --------------------------------------------------------------------------------

    def _noise_config(self, state: StreamState) -> NoiseControllerConfig:
        # The controller runs before the chunk begins (_begin_chunk), so a transition's noise strength is
        # the one of the chunk about to begin.
        upcoming = state.transition.noise_scale(ahead=1) if state.transition is not None else None
        return replace(self.config.noise, noise_scale=state.noise_scale if upcoming is None else upcoming)

    def _begin_chunk(self, state: StreamState, local_caches: bool) -> None:
        """Chunk-boundary bookkeeping: prompt transition, cache geometry, RoPE position."""
        if state.transition is not None:
            state.embedding = state.transition.next_embedding()
            loras, noise_scale = state.transition.loras(), state.transition.noise_scale()
            if loras is not None:
                state.loras = loras
            if noise_scale is not None:
                state.noise_scale = noise_scale
            if local_caches:
                state.prompt = self.encode_prompt(state.embedding, state.loras)
            if state.transition.finished:
                state.transition = None
        if local_caches:
            self._fit_caches(state)
        f = self.config.chunk_latent_frames
        limit = self.dit.config.rope_max_positions
        if self.config.rope_refresh and state.rope_frame + f > self.config.rope_reset_frame:
            # Wrap back into the window; cached keys keep the rotation they were written with.
            state.rope_frame = state.fidelity.kv_window_frames - f
            state.rope_resets += 1
        if state.rope_frame + f > limit:
            raise RopeOverflowError(
                f"stream {state.stream_id}: RoPE frame position {state.rope_frame + f} exceeds the model's "
                f"{limit} positions after {state.chunks} chunks; enable rope_refresh"
            )

    def fit_engine_size(self, state: StreamState) -> None:
        """Carry the stream's caches to the engine size its fidelity asks for (a resolution change)."""
        size = self.engine_size(state.size, state.fidelity)
        if state.engine_size is None:
            state.engine_size = size  # the first chunk: nothing is cached at another size yet
        elif state.engine_size != size:
            rescale_state(state, self.dit.config, self.vae.spatial_compression, size)

    def kv_dtype(self, precision: str) -> torch.dtype:
        """How a stream at ``precision`` stores its KV cache: fp8 (fp8-kv) or the weights' dtype."""
        return FP8_DTYPE if fp8_kv_in(precision) else self.dit.dtype

    def _fit_caches(self, state: StreamState) -> None:
        """Make the caches match the stream's fidelity (engine size, count of step caches, window size,
        storage: a switch to or from fp8-kv converts the cached keys and values, context kept)."""
        self.fit_engine_size(state)
        w, h = self.engine_size(state.size, state.fidelity)
        sc = self.vae.spatial_compression
        frame_tokens = self.dit.config.frame_tokens(h // sc, w // sc)
        window = state.fidelity.kv_window_frames
        wanted = state.fidelity.steps if self.config.cache_mode == "per-step" else 1
        dtype = self.kv_dtype(state.fidelity.precision)
        if state.kv and state.kv[0].window_frames != window:
            state.kv = [resize_window(c, window) for c in state.kv]
        if state.kv and state.kv[0].dtype != dtype:
            state.kv = [c.to(dtype=dtype) for c in state.kv]
        if not state.kv:
            state.kv = [
                self.dit.new_kv_cache(1, frame_tokens, window, self.config.sink_frames, dtype=dtype)
                for _ in range(wanted)
            ]
        # A step added mid-stream starts from the deepest step's context (StreamDiffusionV2 likewise
        # initialises every step cache from one warm-up pass).
        while len(state.kv) < wanted:
            state.kv.append(state.kv[-1].to(self.device))
        del state.kv[wanted:]

    def finish_frames(self, state: StreamState, inputs: torch.Tensor | None, result: ChunkResult,
                      restart: bool) -> ChunkResult:
        """Stage 4: a decoded chunk leaves the engine. The temporal stabilizer (V2V, where the model has
        one and the stream wants it) runs at the size the decoder drew the frames, on the chunk's input
        frames (``inputs``; fitted to that size if they are not at it; None for T2V); then the frames
        are fitted to the stream's size. A rung below x1 thus filters its own, smaller frames: the same
        picture for a fraction of the cost, since the upscale adds no detail to steady. ``restart``: the
        chunk began after a hard prompt switch, so the old look's history is dropped; so is it at a chunk
        that came out black (``result.fault``), which is not filtered."""
        stabilizer = self.stabilizer if state.stabilize and inputs is not None and result.fault is None else None
        if restart or stabilizer is None:  # while off, keep no history: switching on starts afresh
            state.stabilizer.reset()
        frames = result.frames
        if stabilizer is not None and inputs is not None:
            size = (frames.shape[-1], frames.shape[-2])
            frames = stabilizer(state.stabilizer, fit_frames(inputs, size), frames, self.stabilizer_config(state))
        return replace(result, frames=fit_frames(frames, state.size))

    def stabilizer_config(self, state: StreamState) -> StabilizerConfig | None:
        """The stabilizer's setting for the stream: its look's (or its two looks' blend) where the model
        has per-look settings, else the config's; None without a stabilizer."""
        looks = self.config.stabilizer_looks
        if looks is None:
            return self.config.stabilizer
        return looks.for_conditioning(state.embedding)

    @staticmethod
    def shared_sparsity(fidelities: Iterable[FidelityConfig]) -> float:
        """The attention sparsity of one forward over streams at ``fidelities``: they must agree, since a
        forward applies one key-selection rule to all its rows."""
        sparsity = {f.attention_sparsity for f in fidelities}
        if len(sparsity) != 1:
            raise ValueError(f"streams batched together must share attention_sparsity, got {sorted(sparsity)}")
        return sparsity.pop()

    @contextlib.contextmanager
    def precision(self, precision: str) -> Iterator[None]:
        """The compute precision of a chunk's model forwards (the VAE's encode and decode, the DiT's
        steps): bf16 autocast over fp32 weights (convolutions and matrix products in bf16, the
        reductions and the outputs' sums as autocast keeps them, in fp32); fp8-linear: the same, and the
        DiT blocks' linears in fp8 (engine/models/fp8.py; :meth:`check_fidelity` admits it only where
        the fp8 GEMM runs, so here it is the kernel, or the emulation a test asks for); fp8-kv: bf16, the
        KV cache's fp8 storage being the cache's own (:meth:`kv_dtype`, fitted at the chunk boundary)."""
        bf16 = precision == "bf16" or fp8_linears_in(precision) or fp8_kv_in(precision)
        with contextlib.ExitStack() as stack:
            if bf16 and self.dit.dtype == torch.float32:
                stack.enter_context(torch.autocast(device_type=self.device.type, dtype=torch.bfloat16))
            if fp8_linears_in(precision):
                stack.enter_context(fp8_linears())
            yield


@contextlib.contextmanager
def _batched_cache(caches: Sequence[KVCache]) -> Iterator[tuple[KVCache, list[KVCache]]]:
    """One cache over all rows for a forward; ``written`` then holds each row's cache to keep."""
    if len(caches) == 1:
        yield caches[0], list(caches)
        return
    merged = KVCache.concat(list(caches))
    written: list[KVCache] = []
    yield merged, written
    written.extend(merged.split())


def _write_back(chunks: Sequence[ChunkInFlight], written: Sequence[KVCache], per_step: bool) -> None:
    for c, part in zip(chunks, written, strict=True):
        c.state.kv[c.step if per_step else 0] = part


def refresh_sinks(cache: KVCache, chunk_frames: int, tau: float) -> bool:
    """Adaptive sink refresh (StreamDiffusionV2 §4.1): replace the least similar sink by the new chunk.

    Similarity is the cosine between the mean key/value of each sink frame and of the newest frame,
    averaged over rows. Only when the least similar sink is below ``tau`` is it replaced, and only once
    the newest frame is not itself a sink.
    """
    sinks = cache.sink_frames
    newest = cache.local_end - 1
    if sinks == 0 or newest < sinks or cache.local_end < sinks + chunk_frames:
        return False
    mean_k, mean_v = cache.frame_means()  # [layers, B, frames, heads, hd]
    feats = torch.cat([mean_k, mean_v], dim=-1).permute(1, 2, 0, 3, 4).flatten(2)  # [B, frames, D]
    sim = torch.nn.functional.cosine_similarity(feats[:, :sinks], feats[:, newest : newest + 1], dim=-1).mean(0)
    worst = int(torch.argmin(sim))
    if float(sim[worst]) >= tau:
        return False
    cache.copy_frame(newest, worst)
    return True


def resize_window(cache: KVCache, window: int) -> KVCache:
    """A cache with a different window: sinks kept, the most recent frames kept, the oldest dropped."""
    t = cache.frame_tokens
    keep = min(cache.local_end, window)
    recent = keep - min(cache.sink_frames, keep)
    src_recent = slice((cache.local_end - recent) * t, cache.local_end * t)
    sink_tokens = min(cache.sink_frames, keep) * t

    def resized(old: torch.Tensor) -> torch.Tensor:  # keys, values, and in fp8 their scales alike
        new = old.new_zeros((old.shape[0], window * t, *old.shape[2:]))
        new[:, :sink_tokens] = old[:, :sink_tokens]
        new[:, sink_tokens : sink_tokens + recent * t] = old[:, src_recent]
        return new

    return cache.map_buffers(resized, window_frames=window, local_end=keep)


def fit_frames(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """[3, T, H, W] -> [3, T, size[1], size[0]] in the same dtype (float in [-1, 1] or uint8):
    centre-cropped to ``size``'s aspect (engine/aspect.py, never stretched), then area-averaged down or
    bilinear up."""
    w, h = size
    if frames.shape[-1] == w and frames.shape[-2] == h:
        return frames
    x, y, cw, ch = crop_box((frames.shape[-1], frames.shape[-2]), size)
    frames = frames[..., y : y + ch, x : x + cw]
    if cw == w and ch == h:
        return frames
    if frames.device.type == "cpu" and frames.dtype in (torch.float32, torch.uint8):
        return _fit_frames_cv2(frames, size, down=cw > w)
    mode = "area" if cw > w else "bilinear"
    out = torch.nn.functional.interpolate(frames.permute(1, 0, 2, 3).float(), size=(h, w), mode=mode)
    if frames.dtype == torch.uint8:
        out = out.round_().clamp_(0, 255).to(torch.uint8)
    return out.permute(1, 0, 2, 3)


def _fit_frames_cv2(frames: torch.Tensor, size: tuple[int, int], down: bool) -> torch.Tensor:
    """fit_frames on the CPU: OpenCV resizes each frame in its [H, W, 3] layout, several times faster
    than torch's interpolate, whose area mode is an adaptive average pool (runs twice per chunk of a
    rung below x1 on the engine thread). Bilinear up is torch's to float rounding; area down weighs
    each source pixel by the share of it an output pixel covers, where torch's pool averages
    overlapping whole-pixel windows. uint8 frames (a camera's, `engine.frames.frames_as_uint8`) are
    resized as bytes, a view of their [T, H, W, 3] buffer: no transpose, a quarter of the memory."""
    hwc = frames.permute(1, 2, 3, 0).contiguous().numpy()  # [T, H, W, 3]
    out = np.empty((hwc.shape[0], size[1], size[0], 3), dtype=hwc.dtype)
    interpolation = cv2.INTER_AREA if down else cv2.INTER_LINEAR
    for i, frame in enumerate(hwc):
        cv2.resize(frame, size, dst=out[i], interpolation=interpolation)
    return torch.from_numpy(out).permute(3, 0, 1, 2)


_T = TypeVar("_T")


def _groups(items: Sequence[_T], key: Callable[[_T], Hashable]) -> list[list[int]]:
    """Indices of ``items`` grouped by ``key``, in first-seen order."""
    groups: dict[Hashable, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(key(item), []).append(i)
    return list(groups.values())


def _batched(call: Callable[..., torch.Tensor], vae: StreamVAE, x: torch.Tensor, caches: list[Any],
             *rest: Any) -> list[torch.Tensor]:
    """Each row's output ([1, ...]) of one VAE call for the rows of ``x``; one call per row where their
    caches are not at one point (a stream just rescaled, say), which stacking them would refuse before
    touching any; their outputs may then differ in length."""
    try:
        out = call(vae, x, caches, *rest)
        return [out[i : i + 1] for i in range(len(caches))]
    except CacheMismatchError:
        return [call(vae, x[i : i + 1], [c], *(None if r is None else r[i : i + 1] for r in rest))
                for i, c in enumerate(caches)]
