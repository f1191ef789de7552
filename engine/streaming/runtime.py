"""The live stream runtime: one chunk in, one stylised chunk out, for one or many streams.

The core loop of a V2V chunk (StreamDiffusionV2 recipe), top to bottom:

    frames --VAE encode--> z --noise controller--> s, t0
    x = s*eps + (1-s)*z                                  (v2v_input)
    for each step i with timestep t_i (t_0 from the controller):
        v  = DiT(x, t_i, prompt, KV cache)               (one batched forward for all rows)
        x0 = x - sigma(t_i) * v
        x  = (1 - sigma(t_{i+1})) * x0 + sigma(t_{i+1}) * eps_i     (fresh noise, not on the last step)
    [clean mode: DiT(x0, t=0) once more, to write clean K/V]
    adaptive sink refresh, RoPE refresh, counters
    x0 --VAE decode--> frames --temporal stabilizer (if configured)--> out

Rows of one forward are streams that share a fidelity configuration and a cache fill level; each
row keeps its own KV cache, RoPE position, prompt and noise, so batching never mixes streams.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from engine.fidelity import FidelityConfig, unsupported_reason
from engine.models.wan_dit import CausalWanDiT, KVCache, PromptCache
from engine.sampling import NoiseSource, SamplerPreset, renoise, v2v_input, x0_from_velocity
from engine.streaming.config import RuntimeConfig
from engine.streaming.noise import MotionAwareNoiseController, NoiseControllerConfig
from engine.streaming.prompts import BlendMode, PromptTransition, blend
from engine.streaming.stabilizer import TemporalStabilizer
from engine.streaming.state import StreamState
from engine.vae import StreamVAE

log = logging.getLogger(__name__)


class RopeOverflowError(RuntimeError):
    """A stream's temporal RoPE position would leave the model's position table."""


class PromptEncoder:
    """Text -> conditioning embeddings [1, L, text_dim], with prompt blending.

    ``conditioning`` is how the model was trained to read text: "tokens" (Wan: the encoder's token
    states) or "pooled" (the embedded model: one row, the L2-normalised sentence embedding).
    """

    def __init__(self, text_encoder: object, conditioning: str = "tokens") -> None:
        if conditioning not in ("tokens", "pooled"):
            raise ValueError(f"text conditioning must be 'tokens' or 'pooled', got {conditioning!r}")
        self._text = text_encoder
        self.conditioning = conditioning

    def pooled(self, prompts: Sequence[str]) -> torch.Tensor:
        """L2-normalised sentence embeddings [N, dim]."""
        pooled = self._text.pooled(list(prompts))  # type: ignore[attr-defined]
        return torch.nn.functional.normalize(pooled.float(), dim=-1)

    def embed(self, prompts: Sequence[str], weights: Sequence[float] | None = None, mode: BlendMode = "linear") -> torch.Tensor:
        if not prompts:
            raise ValueError("at least one prompt is needed")
        if self.conditioning == "pooled":
            tokens = self.pooled(prompts)[:, None, :]
        else:
            tokens = self._text.encode(list(prompts))  # type: ignore[attr-defined]
        rows = [tokens[i : i + 1] for i in range(tokens.shape[0])]
        if len(rows) == 1:
            return rows[0]
        return blend(rows, list(weights) if weights is not None else [1.0] * len(rows), mode)


@dataclass(frozen=True)
class StageTimings:
    """Wall time of the last chunk's stages (for the whole batch of streams)."""

    encode_s: float = 0.0
    dit_s: float = 0.0
    decode_s: float = 0.0
    stabilize_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.encode_s + self.dit_s + self.decode_s + self.stabilize_s


@dataclass(frozen=True)
class ChunkResult:
    frames: torch.Tensor  # [3, T, H, W] in [-1, 1]
    noise_rate: float
    first_timestep: float
    sink_refreshed: bool


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
        self.vae = vae
        self.prompts = prompts
        self.preset = preset
        self.schedule = preset.schedule
        self.config = config
        self.device = dit.device
        self.stabilizer = TemporalStabilizer(config.stabilizer) if config.stabilizer is not None else None
        self.last_timings = StageTimings()

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
    ) -> StreamState:
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        self.check_fidelity(fidelity)
        self._check_size(size, fidelity)
        replace(self.config.noise, noise_scale=noise_scale)  # validates the noise strength
        embedding = self.prompts.embed(prompts, weights, blend_mode)
        return StreamState(
            noise_scale=noise_scale,
            stream_id=stream_id,
            fidelity=fidelity,
            size=size,
            embedding=embedding,
            prompt=self.dit.encode_prompt(embedding),
            noise=NoiseSource(seed),
            vae_encoder=self.vae.new_encoder_cache(),
            vae_decoder=self.vae.new_decoder_cache(),
            stabilize=stabilize,
        )

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
            state.prompt = self.dit.encode_prompt(target)
            # A hard cut to a new look: the stabilizer's history is of the old one.
            state.restart_stabilizer = True
        state.force_sink_refresh = refresh_sinks

    def set_fidelity(self, state: StreamState, fidelity: FidelityConfig) -> None:
        """Takes effect at the next chunk boundary (the next call of :meth:`step`)."""
        self.check_fidelity(fidelity)
        self._check_size(state.size, fidelity)
        state.fidelity = fidelity

    def check_fidelity(self, fidelity: FidelityConfig) -> None:
        if fidelity.steps > len(self.preset.steps):
            raise ValueError(f"steps={fidelity.steps} exceeds the {len(self.preset.steps)} steps of preset {self.preset.name}")
        reason = unsupported_reason(fidelity, self.device.type)
        if reason is not None:
            raise ValueError(f"fidelity {fidelity.label()} cannot run here: {reason}")
        if fidelity.kv_window_frames < self.config.sink_frames + self.config.chunk_latent_frames:
            raise ValueError(
                f"kv_window_frames={fidelity.kv_window_frames} cannot hold {self.config.sink_frames} sinks plus a chunk"
            )

    def _check_size(self, size: tuple[int, int], fidelity: FidelityConfig) -> None:
        w, h = self.engine_size(size, fidelity)
        if w <= 0 or h <= 0:
            raise ValueError(f"frame size {size} at scale {fidelity.resolution_scale} is too small")

    def engine_size(self, size: tuple[int, int], fidelity: FidelityConfig) -> tuple[int, int]:
        """Pixel size the model runs at: ``size`` scaled, rounded down to what VAE and patches divide."""
        multiple = self.vae.spatial_compression * self.dit.config.patch_size[1]
        w = int(size[0] * fidelity.resolution_scale) // multiple * multiple
        h = int(size[1] * fidelity.resolution_scale) // multiple * multiple
        return w, h

    # -- chunks -----------------------------------------------------------------------------------

    def step(self, state: StreamState, frames: torch.Tensor) -> ChunkResult:
        """V2V: one chunk of input frames [3, T, H, W] in [-1, 1] -> the stylised chunk."""
        return self.step_batch([state], [frames])[0]

    def step_batch(self, states: Sequence[StreamState], frames: Sequence[torch.Tensor]) -> list[ChunkResult]:
        """V2V for several streams in one batched forward per denoising step.

        The streams must share steps, KV window and engine size, and have the same cache fill level
        (any two streams past warm-up do); otherwise call :meth:`step` per stream.
        """
        if len(states) != len(frames) or not states:
            raise ValueError("step_batch needs one frame chunk per stream")
        t0 = time.perf_counter()
        latents, rates = [], []
        restarts = [state.take_stabilizer_restart() for state in states]
        for state, chunk in zip(states, frames, strict=True):
            chunk = self._resize(chunk, self.engine_size(state.size, state.fidelity))
            controller = MotionAwareNoiseController(self._noise_config(state))
            rates.append(controller.step(chunk, state.noise_controller))
            latents.append(self.vae.encode_chunk(chunk.unsqueeze(0).to(self.device, self.dit.dtype), state.vae_encoder))
        t1 = time.perf_counter()
        x0 = self.denoise_latents(states, latents, rates)
        t2 = time.perf_counter()
        results = self._decode(states, x0, rates)
        t3 = time.perf_counter()
        results = [self.stabilize(state, chunk, result, restart)
                   for state, chunk, result, restart in zip(states, frames, results, restarts, strict=True)]
        self.last_timings = StageTimings(encode_s=t1 - t0, dit_s=t2 - t1, decode_s=t3 - t2,
                                         stabilize_s=time.perf_counter() - t3)
        return results

    def denoise_latents(
        self, states: Sequence[StreamState], latents: Sequence[torch.Tensor], rates: Sequence[float]
    ) -> torch.Tensor:
        """The latent core of a V2V chunk: noise the input latents, denoise, update the stream state.

        ``latents`` are the VAE latents of each stream's chunk [1, C, F, h, w]; ``rates`` the noise
        rates from the motion-aware controller. Returns x̂₀ for all rows [B, C, F, h, w].
        """
        controller = MotionAwareNoiseController(self.config.noise)
        starts = [controller.first_timestep(rate) for rate in rates]
        for state in states:
            self._begin_chunk(state)
        x = torch.cat(
            [
                v2v_input(z, s.noise.randn(z.shape, dtype=z.dtype, device=self.device), rate)
                for z, s, rate in zip(latents, states, rates, strict=True)
            ]
        )
        x0 = self._denoise(states, x, starts)
        self._advance(states, x0.shape[2], rates, starts)
        return x0

    def generate(self, state: StreamState) -> ChunkResult:
        """T2V: the next chunk of a text-to-video stream (CausVid / Self-Forcing recipe, no input video)."""
        return self.generate_batch([state])[0]

    def generate_batch(self, states: Sequence[StreamState]) -> list[ChunkResult]:
        w, h = self.engine_size(states[0].size, states[0].fidelity)
        c = self.vae.latent_channels
        sc = self.vae.spatial_compression
        f = self.config.chunk_latent_frames
        for state in states:
            self._begin_chunk(state)
        x = torch.cat([s.noise.randn((1, c, f, h // sc, w // sc), device=self.device) for s in states])
        first = float(self.preset.timesteps(states[0].fidelity.steps)[0])
        x0 = self._denoise(states, x, [first] * len(states))
        self._advance(states, f, [1.0] * len(states), [first] * len(states))
        return self._decode(states, x0, [1.0] * len(states))

    # -- internals --------------------------------------------------------------------------------

    def _noise_config(self, state: StreamState) -> NoiseControllerConfig:
        return replace(self.config.noise, noise_scale=state.noise_scale)

    def _begin_chunk(self, state: StreamState) -> None:
        """Chunk-boundary bookkeeping: prompt transition, cache geometry, RoPE position."""
        if state.transition is not None:
            state.embedding = state.transition.next_embedding()
            state.prompt = self.dit.encode_prompt(state.embedding)
            if state.transition.finished:
                state.transition = None
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

    def _fit_caches(self, state: StreamState) -> None:
        """Make the KV caches match the stream's fidelity (count of step caches, window size)."""
        w, h = self.engine_size(state.size, state.fidelity)
        sc = self.vae.spatial_compression
        frame_tokens = self.dit.config.frame_tokens(h // sc, w // sc)
        window = state.fidelity.kv_window_frames
        wanted = state.fidelity.steps if self.config.cache_mode == "per-step" else 1
        if state.kv and state.kv[0].frame_tokens != frame_tokens:
            raise ValueError("the engine size of a stream cannot change mid-stream")
        if state.kv and state.kv[0].window_frames != window:
            state.kv = [resize_window(c, window) for c in state.kv]
        if not state.kv:
            state.kv = [
                self.dit.new_kv_cache(1, frame_tokens, window, self.config.sink_frames) for _ in range(wanted)
            ]
        # A step added mid-stream starts from the deepest step's context (StreamDiffusionV2 likewise
        # initialises every step cache from one warm-up pass).
        while len(state.kv) < wanted:
            state.kv.append(state.kv[-1].to(self.device))
        del state.kv[wanted:]

    def _denoise(self, states: Sequence[StreamState], x: torch.Tensor, first_timesteps: Sequence[float]) -> torch.Tensor:
        steps = states[0].fidelity.steps
        if any(s.fidelity.steps != steps for s in states):
            raise ValueError("streams batched together must share the number of steps")
        sparsity = self.shared_sparsity(s.fidelity for s in states)
        block_tokens = self.config.sparse_block_tokens
        timesteps = list(self.preset.timesteps(steps))
        f = x.shape[2]
        prompt = states[0].prompt if len(states) == 1 else PromptCache.concat([s.prompt for s in states])
        start = [s.frame for s in states]
        rope = [s.rope_frame for s in states]
        x0 = x
        with self._precision(states[0].fidelity):
            for i in range(steps):
                t_rows = [first_timesteps[r] if i == 0 else timesteps[i] for r in range(len(states))]
                t = torch.tensor(t_rows, device=self.device, dtype=torch.float32)[:, None].expand(-1, f)
                cache_index = i if self.config.cache_mode == "per-step" else 0
                with _batched_cache(states, cache_index) as cache:
                    v = self.dit(x, t, prompt, cache, start_frame=start, rope_start=rope, sparsity=sparsity,
                                 sparse_block_tokens=block_tokens)
                sigma = self.schedule.sigma(t[:, 0]).to(self.device).view(-1, 1, 1, 1, 1)
                x0 = x0_from_velocity(x, v.to(x.dtype), sigma)
                if i + 1 < steps:
                    next_sigma = float(self.schedule.sigma(timesteps[i + 1]))
                    noise = torch.cat([s.noise.randn(x0[:1].shape, dtype=x0.dtype, device=self.device) for s in states])
                    x = renoise(x0, noise, next_sigma)
            if self.config.cache_mode == "clean":
                zero = torch.zeros(len(states), f, device=self.device)
                with _batched_cache(states, 0) as cache:
                    self.dit(x0, zero, prompt, cache, start_frame=start, rope_start=rope, sparsity=sparsity,
                             sparse_block_tokens=block_tokens)
        return x0

    def _advance(self, states: Sequence[StreamState], frames: int, rates: Sequence[float], starts: Sequence[float]) -> None:
        """After a chunk's denoising: adaptive sink refresh, positions and counters."""
        for row, state in enumerate(states):
            refreshed = False
            if self.config.sink_refresh or state.force_sink_refresh:
                tau = float("inf") if state.force_sink_refresh else self.config.sink_tau
                for cache in state.kv:
                    refreshed |= refresh_sinks(cache, frames, tau)
                state.force_sink_refresh = False
            state.sink_refreshes += int(refreshed)
            state.last_sink_refresh = refreshed
            state.frame += frames
            state.rope_frame += frames
            state.chunks += 1
            state.last_noise_rate = rates[row]
            state.last_first_timestep = starts[row]

    def _decode(self, states: Sequence[StreamState], x0: torch.Tensor, rates: Sequence[float]) -> list[ChunkResult]:
        results = []
        for row, state in enumerate(states):
            frames = self.vae.decode_chunk(x0[row : row + 1], state.vae_decoder)[0].float().clamp(-1, 1)
            frames = self._resize(frames, state.size)
            results.append(ChunkResult(frames, rates[row], state.last_first_timestep, state.last_sink_refresh))
        return results

    def stabilize(self, state: StreamState, inputs: torch.Tensor, result: ChunkResult, restart: bool) -> ChunkResult:
        """The temporal stabilizer stage on a finished chunk (``inputs``: the chunk as the stream sent it;
        ``restart``: the chunk began after a hard prompt switch, so the old look's history is dropped)."""
        stabilizer = self.stabilizer if state.stabilize else None
        if restart or stabilizer is None:  # while off, keep no history: switching on starts afresh
            state.stabilizer.reset()
        if stabilizer is None:
            return result
        return replace(result, frames=stabilizer(state.stabilizer, self._resize(inputs, state.size), result.frames))

    @staticmethod
    def _resize(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """[3, T, H, W] -> [3, T, size[1], size[0]] (area-averaged down, bilinear up)."""
        w, h = size
        if frames.shape[-1] == w and frames.shape[-2] == h:
            return frames
        mode = "area" if frames.shape[-1] > w else "bilinear"
        out = torch.nn.functional.interpolate(frames.permute(1, 0, 2, 3).float(), size=(h, w), mode=mode)
        return out.permute(1, 0, 2, 3)

    @staticmethod
    def shared_sparsity(fidelities: Iterable[FidelityConfig]) -> float:
        """The attention sparsity of one forward over streams at ``fidelities``: they must agree, since a
        forward applies one key-selection rule to all its rows."""
        sparsity = {f.attention_sparsity for f in fidelities}
        if len(sparsity) != 1:
            raise ValueError(f"streams batched together must share attention_sparsity, got {sorted(sparsity)}")
        return sparsity.pop()

    @contextlib.contextmanager
    def _precision(self, fidelity: FidelityConfig) -> Iterator[None]:
        if fidelity.precision == "bf16" and self.dit.dtype == torch.float32:
            with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16):
                yield
        else:
            yield


@contextlib.contextmanager
def _batched_cache(states: Sequence[StreamState], index: int) -> Iterator[KVCache]:
    """One cache over all rows for a forward; the rows are written back to their streams after it."""
    if len(states) == 1:
        yield states[0].kv[index]
        return
    merged = KVCache.concat([s.kv[index] for s in states])
    yield merged
    for state, part in zip(states, merged.split(), strict=True):
        state.kv[index] = part


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
    k, v = cache.read_frame(newest)
    cache.replace_frame(worst, k, v)
    return True


def resize_window(cache: KVCache, window: int) -> KVCache:
    """A cache with a different window: sinks kept, the most recent frames kept, the oldest dropped."""
    t = cache.frame_tokens
    keep = min(cache.local_end, window)
    recent = keep - min(cache.sink_frames, keep)
    src_recent = slice((cache.local_end - recent) * t, cache.local_end * t)
    k, v = [], []
    for old_k, old_v in zip(cache.k, cache.v, strict=True):
        new_k = old_k.new_zeros((old_k.shape[0], window * t, *old_k.shape[2:]))
        new_v = old_v.new_zeros((old_v.shape[0], window * t, *old_v.shape[2:]))
        sink_tokens = min(cache.sink_frames, keep) * t
        new_k[:, :sink_tokens] = old_k[:, :sink_tokens]
        new_v[:, :sink_tokens] = old_v[:, :sink_tokens]
        new_k[:, sink_tokens : sink_tokens + recent * t] = old_k[:, src_recent]
        new_v[:, sink_tokens : sink_tokens + recent * t] = old_v[:, src_recent]
        k.append(new_k)
        v.append(new_v)
    return replace(cache, k=k, v=v, window_frames=window, local_end=keep)
