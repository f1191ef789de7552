"""The embedded default model at inference: checkpoint format, loading, and chunk-by-chunk stylisation.

Checkpoint = ``default.safetensors`` (tensors ``vae.*`` = TinyVAE state, ``dit.*`` = CausalWanDiT state)
+ ``default.json`` (``EmbeddedSpec``). Streaming recipe per chunk (StreamDiffusionV2 V2V, 1 latent frame
= 4 pixel frames; the first chunk is 1 pixel frame... or 1 + 4k):

    z  = vae.encode_chunk(frames)                      normalised latents
    x  = v2v_input(z, ε, s)                            s·ε + (1 − s)·z, s = noise_scale
    t₁ = noise_scale_to_timestep(s); v = dit(x, t₁, prompt, kv_cache, start_frame=k)
    x̂₀ = x − σ(t₁)·v                                   σ from FlowMatchSchedule(shift)
    (optional refinement: x = renoise(x̂₀, ε′, σ(t₂)); x̂₀ = x − σ(t₂)·dit(x, t₂, ...), same cache slot)
    frames_out = vae.decode_chunk(x̂₀)

The product path adds the temporal stabilizer the spec configures (``spec.stabilizer``,
engine/streaming/stabilizer.py) after the decoder; ``evaluate.stylize_stream`` applies it the same way.

The DiT is conditioned on the L2-normalised pooled MiniLM embedding of the prompt, as a 1-row context.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from engine.embedded.styles import StyleMatch, match_style, pooled_embeddings
from engine.models.tiny_vae import TinyVAE, TinyVAECache, TinyVAEConfig
from engine.models.wan_dit import CausalWanDiT, KVCache, PromptCache, WanDiTConfig
from engine.sampling import (
    FlowMatchSchedule,
    NoiseSource,
    noise_scale_to_timestep,
    renoise,
    v2v_input,
    x0_from_velocity,
)
from engine.streaming.stabilizer import StabilizerConfig

WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"
DEFAULT_CONFIG = WEIGHTS_DIR / "default.json"
FORMAT = "diffcast-embedded/1"


@dataclass(frozen=True)
class SamplerSpec:
    # StreamDiffusionV2's schedule (shift 8), so engine/pipeline.py's V2V preset drives the model as trained.
    shift: float = 8.0
    noise_scale: float = 0.2  # V2V s; first timestep = noise_scale_to_timestep(s) = 1000·s − 100
    # Optional later step, standard flow matching; t = 22 is σ ≈ 0.15 at shift 8 (a light refinement).
    refine_timesteps: tuple[float, ...] = (22.0,)
    default_num_steps: int = 1


@dataclass(frozen=True)
class StreamSpec:
    chunk_latent_frames: int = 1
    kv_window_frames: int = 2  # trained with 2-frame block-causal attention: current + previous chunk
    sink_frames: int = 0


@dataclass(frozen=True)
class EmbeddedSpec:
    vae: TinyVAEConfig
    dit: WanDiTConfig
    styles: dict[str, tuple[str, ...]]
    prototypes: dict[str, list[float]]
    too_far_below: float = 0.35
    text_encoder: str = "minilm"
    text_conditioning: str = "pooled"
    sampler: SamplerSpec = field(default_factory=SamplerSpec)
    stream: StreamSpec = field(default_factory=StreamSpec)
    stabilizer: StabilizerConfig = field(default_factory=StabilizerConfig)
    metrics: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["format"] = FORMAT
        # Derived views for engine/pipeline.py's loader (StreamDiffusionV2 preset steps, RuntimeConfig
        # fields, stream size); from_json ignores them, the fields above are the source of truth.
        sp = self.sampler
        data["sampler"]["steps"] = timesteps_for(sp, sp.noise_scale, 1 + len(sp.refine_timesteps))
        data["runtime"] = {
            "chunk_latent_frames": self.stream.chunk_latent_frames,
            "kv_window_frames": self.stream.kv_window_frames,
            "sink_frames": self.stream.sink_frames,
            "cache_mode": "per-step",
            "sink_refresh": False,
            # The motion-aware controller lowers s by up to motion_range on fast motion; keep it inside
            # the trained range (s >= 0.15).
            "noise": {"noise_scale": sp.noise_scale, "motion_range": 0.05},
            "stabilizer": data["stabilizer"],
        }
        data["size"] = [256, 256]
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> EmbeddedSpec:
        data = json.loads(text)
        if data.pop("format", None) != FORMAT:
            raise ValueError(f"not a {FORMAT} config")
        dit: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data.pop("dit").items()}
        sampler = data.pop("sampler")
        sampler.pop("steps", None)
        sampler["refine_timesteps"] = tuple(sampler["refine_timesteps"])
        data.pop("runtime", None)
        data.pop("size", None)
        stabilizer = StabilizerConfig(**data.pop("stabilizer", {}))
        return cls(
            stabilizer=stabilizer,
            vae=TinyVAEConfig.from_dict(data.pop("vae")),
            dit=WanDiTConfig(**dit),
            styles={k: tuple(v) for k, v in data.pop("styles").items()},
            sampler=SamplerSpec(**sampler),
            stream=StreamSpec(**data.pop("stream")),
            **data,
        )


def timesteps_for(spec: SamplerSpec, noise_scale: float, num_steps: int) -> list[float]:
    if not 1 <= num_steps <= 1 + len(spec.refine_timesteps):
        raise ValueError(f"num_steps must be in [1, {1 + len(spec.refine_timesteps)}], got {num_steps}")
    return [float(noise_scale_to_timestep(noise_scale))] + list(spec.refine_timesteps[: num_steps - 1])


class EmbeddedModel:
    """Tiny VAE + tiny causal DiT + MiniLM conditioning, loaded from the shipped checkpoint."""

    def __init__(self, spec: EmbeddedSpec, vae: TinyVAE, dit: CausalWanDiT) -> None:
        self.spec, self.vae, self.dit = spec, vae.eval(), dit.eval()
        self.schedule = FlowMatchSchedule(spec.sampler.shift)
        self.style_names = list(spec.prototypes)
        self.protos = torch.tensor([spec.prototypes[n] for n in self.style_names])

    @classmethod
    def load(cls, config_path: Path | str = DEFAULT_CONFIG) -> EmbeddedModel:
        config_path = Path(config_path)
        if not config_path.exists():
            raise FileNotFoundError(f"embedded model config {config_path} does not exist")
        spec = EmbeddedSpec.from_json(config_path.read_text())
        weights = load_file(str(config_path.with_suffix(".safetensors")))
        vae, dit = TinyVAE(spec.vae), CausalWanDiT(spec.dit)
        vae.load_state_dict({k[4:]: v.float() for k, v in weights.items() if k.startswith("vae.")})
        dit.load_state_dict({k[4:]: v.float() for k, v in weights.items() if k.startswith("dit.")})
        return cls(spec, vae, dit)

    def match(self, prompt: str) -> StyleMatch:
        """Nearest trained styles for a prompt, and whether it is too far from all of them."""
        return match_style(prompt, pooled_embeddings([prompt])[0], self.style_names, self.protos,
                           self.spec.too_far_below)

    def open_stream(self, prompt: str, seed: int = 0, noise_scale: float | None = None,
                    num_steps: int | None = None) -> EmbeddedStream:
        context = pooled_embeddings([prompt])[:, None, :]
        return EmbeddedStream(self, self.dit.encode_prompt(context), seed,
                              self.spec.sampler.noise_scale if noise_scale is None else noise_scale,
                              self.spec.sampler.default_num_steps if num_steps is None else num_steps)


@dataclass
class ChunkTimings:
    encode_s: float
    dit_s: float
    decode_s: float


class EmbeddedStream:
    """State of one stream: VAE caches, DiT KV cache, prompt K/V, noise; ``process`` one chunk at a time."""

    def __init__(self, model: EmbeddedModel, prompt: PromptCache, seed: int, noise_scale: float,
                 num_steps: int) -> None:
        self.model, self.prompt = model, prompt
        self.noise = NoiseSource(seed)
        self.timesteps = timesteps_for(model.spec.sampler, noise_scale, num_steps)
        self.noise_scale = noise_scale
        self.enc: TinyVAECache = model.vae.new_encoder_cache()
        self.dec: TinyVAECache = model.vae.new_decoder_cache()
        self.kv: KVCache | None = None
        self.frame = 0  # latent frames generated so far
        self.last_timings = ChunkTimings(0.0, 0.0, 0.0)

    @torch.no_grad()
    def process(self, frames: torch.Tensor) -> torch.Tensor:
        """Pixel frames [B, 3, T, H, W] in [-1, 1] (T = 1 + 4k first, then 4k) -> stylised frames."""
        m = self.model
        t0 = time.perf_counter()
        z = m.vae.encode_chunk(frames, self.enc)
        t1 = time.perf_counter()
        x0 = self.denoise(z)
        t2 = time.perf_counter()
        pixels = m.vae.decode_chunk(x0, self.dec)
        t3 = time.perf_counter()
        self.last_timings = ChunkTimings(t1 - t0, t2 - t1, t3 - t2)
        return pixels

    @torch.no_grad()
    def denoise(self, z: torch.Tensor) -> torch.Tensor:
        """Input latents [B, C, K, h, w] -> stylised latents x̂₀, one latent frame at a time through the KV cache."""
        m = self.model
        if self.kv is None:
            ph, pw = m.spec.dit.patch_size[1:]
            st = m.spec.stream
            self.kv = m.dit.new_kv_cache(z.shape[0], (z.shape[3] // ph) * (z.shape[4] // pw),
                                         st.kv_window_frames, st.sink_frames)
        out = []
        for k in range(z.shape[2]):
            zk = z[:, :, k : k + 1]
            x = v2v_input(zk, self.noise.randn(zk.shape), self.noise_scale)
            x0 = zk
            for i, t in enumerate(self.timesteps):
                if i:
                    x = renoise(x0, self.noise.randn(zk.shape), m.schedule.sigma(t))
                v = m.dit(x, torch.full((zk.shape[0], 1), t), self.prompt, kv_cache=self.kv,
                          start_frame=self.frame, rope_start=self.frame % 512)
                x0 = x0_from_velocity(x, v, m.schedule.sigma(t))
            out.append(x0)
            self.frame += 1
        return torch.cat(out, dim=2)
