"""The embedded default model: checkpoint format, loading, prompt -> style resolution, batched streams.

Checkpoint = ``default.safetensors`` (tensors ``vae.*`` = TinyVAE state, ``dit.*`` = CausalWanDiT state)
+ ``default.json`` (``EmbeddedSpec``; its ``to_json`` also writes the ``sampler.steps`` and ``runtime``
views that engine/pipeline.py reads).

This module has no chunk recipe of its own: every stream of this model, at inference
(``engine.pipeline.Pipeline.load()``) and while training (``EmbeddedStream``, the decoder fine-tune's
data), runs through the product's ``StreamRuntime`` (engine/streaming/runtime.py), configured from the
same JSON fields (``engine.pipeline.stream_recipe``).

The DiT is conditioned on the L2-normalised pooled MiniLM embedding of the prompt, as a 1-row context.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from engine.embedded.block_texture import GRID_LOOKS
from engine.embedded.styles import FAR_BELOW, StyleMatch, match_style, pooled_embeddings
from engine.fidelity import FidelityConfig
from engine.models.tiny_vae import TinyVAE, TinyVAEConfig
from engine.models.wan_dit import CausalWanDiT, WanDiTConfig
from engine.pipeline import look_anchors, stream_recipe
from engine.sampling import noise_scale_to_timestep
from engine.streaming.deblock import DeblockConfig
from engine.streaming.runtime import PromptEncoder, StreamRuntime
from engine.streaming.stabilizer import StabilizerConfig
from engine.text import load_text_encoder

WEIGHTS_DIR = Path(__file__).resolve().parent.parent / "weights"
DEFAULT_CONFIG = WEIGHTS_DIR / "default.json"
FORMAT = "diffcast-embedded/1"


@dataclass(frozen=True)
class SamplerSpec:
    # StreamDiffusionV2's schedule (shift 8), so engine/pipeline.py's V2V preset drives the model as trained.
    shift: float = 8.0
    noise_scale: float = 0.2  # V2V s; first timestep = noise_scale_to_timestep(s) = 1000·s − 100
    # Share of the Gaussian draw in the V2V input, (1 − s)·z + input_noise·s·ε (the runtime's
    # ``NoiseControllerConfig.input_noise``); the model is trained with the value it is served with.
    input_noise: float = 1.0
    # Optional later step, standard flow matching; t = 22 is σ ≈ 0.15 at shift 8 (a light refinement).
    refine_timesteps: tuple[float, ...] = (22.0,)
    default_num_steps: int = 1


@dataclass(frozen=True)
class StreamSpec:
    chunk_latent_frames: int = 1
    kv_window_frames: int = 2  # trained with 2-frame block-causal attention: current + previous chunk
    sink_frames: int = 0


# The temporal stabilizer of the embedded model's shipped output: history weight 0.7 and motion tolerance
# 0.15 (the generic 0.9 and 0.1 held the steadier input-noise-0 model at 0.59x its teachers' flicker for
# 0.7 dB of fidelity), chosen on training clips by ``python -m engine.embedded.stabilizer_sweep``
# (docs/stabilizer.md, "Choosing the settings for a model").
STABILIZER = StabilizerConfig(strength=0.7, motion_tolerance=0.15)
# Each look's own setting where it differs from STABILIZER (look name -> StabilizerConfig fields; the
# runtime blends two looks' settings for a prompt between them): the best mean fidelity whose flicker
# over all looks stays under the same ceiling and no look's over its teacher's, chosen on training
# clips by ``stabilizer_sweep --per-look`` (docs/stabilizer.md).
STABILIZER_LOOKS: dict[str, dict[str, float]] = {
    "pencil_sketch": {"strength": 0.8, "motion_tolerance": 0.07},
    "cartoon": {"strength": 0.8},
    "oil_paint": {"motion_tolerance": 0.07},
    "watercolor": {"strength": 0.9, "change_tolerance": 0.15},
    "thermal": {"strength": 0.9, "motion_tolerance": 0.1, "change_tolerance": 0.15},
    "sepia_film": {"motion_tolerance": 0.07, "change_tolerance": 0.2},
    "pixel_art": {"strength": 0.5, "change_tolerance": 0.1},
    "night_vision": {"strength": 0.95, "change_tolerance": 0.2},
    "pop_art": {"strength": 0.9},
    "vaporwave": {"strength": 0.8, "motion_tolerance": 0.07},
    "cyanotype": {"strength": 0.95, "change_tolerance": 0.1},
    "noir": {"strength": 0.8, "motion_tolerance": 0.07, "change_tolerance": 0.2},
    "woodblock": {"strength": 0.8, "change_tolerance": 0.2},
    "cinematic": {"motion_tolerance": 0.07},
    "golden_hour": {"strength": 0.6, "motion_tolerance": 0.1, "change_tolerance": 0.2},
}


@dataclass(frozen=True)
class EmbeddedSpec:
    vae: TinyVAEConfig
    dit: WanDiTConfig
    styles: dict[str, tuple[str, ...]]
    prototypes: dict[str, list[float]]
    too_far_below: float = FAR_BELOW
    # Softmax temperature of the look anchoring (engine/streaming/prompts.py ``LookAnchors``); None: the
    # DiT reads the prompt's raw embedding (models trained before anchoring).
    look_temperature: float | None = None
    text_encoder: str = "minilm"
    text_conditioning: str = "pooled"
    sampler: SamplerSpec = field(default_factory=SamplerSpec)
    stream: StreamSpec = field(default_factory=StreamSpec)
    stabilizer: StabilizerConfig = STABILIZER
    stabilizer_looks: dict[str, dict[str, float]] = field(default_factory=lambda: dict(STABILIZER_LOOKS))
    deblock: DeblockConfig | None = field(default_factory=DeblockConfig)  # None: the decoded frames as they are
    metrics: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["format"] = FORMAT
        if self.deblock is not None:
            # The spared looks by name (the loader turns them into the prototypes the runtime compares a
            # stream's conditioning with), so a look left out or added on export is spared or not with it.
            data["deblock"].pop("spare")
            data["deblock"]["spare_looks"] = [name for name in GRID_LOOKS if name in self.prototypes]
        # Derived views for engine/pipeline.py's loader (StreamDiffusionV2 preset steps, RuntimeConfig
        # fields, stream size); from_json ignores them, the fields above are the source of truth.
        sp = self.sampler
        data["sampler"]["steps"] = [float(noise_scale_to_timestep(sp.noise_scale)), *sp.refine_timesteps]
        data["runtime"] = {
            "chunk_latent_frames": self.stream.chunk_latent_frames,
            "kv_window_frames": self.stream.kv_window_frames,
            "sink_frames": self.stream.sink_frames,
            "cache_mode": "per-step",
            "sink_refresh": False,
            # The motion-aware controller lowers s by up to motion_range on fast motion; keep it inside
            # the trained range (s >= 0.15).
            "noise": {"noise_scale": sp.noise_scale, "motion_range": 0.05, "input_noise": sp.input_noise},
            "stabilizer": data["stabilizer"],
            # By name like the spared looks; a look left out on export takes its setting with it.
            "stabilizer_looks": {k: v for k, v in self.stabilizer_looks.items() if k in self.prototypes},
            "deblock": data["deblock"],
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
        stabilizer_looks = data.pop("stabilizer_looks", {})  # absent: written before per-look settings
        deblock = data.pop("deblock", {})  # absent: written before the stage existed, so the default
        if deblock is not None:
            deblock = {k: v for k, v in deblock.items() if k not in ("spare", "spare_looks")}  # named, see to_json
        return cls(
            stabilizer=stabilizer,
            stabilizer_looks=stabilizer_looks,
            deblock=DeblockConfig(**deblock) if deblock is not None else None,
            vae=TinyVAEConfig.from_dict(data.pop("vae")),
            dit=WanDiTConfig(**dit),
            styles={k: tuple(v) for k, v in data.pop("styles").items()},
            sampler=SamplerSpec(**sampler),
            stream=StreamSpec(**data.pop("stream")),
            **data,
        )


class EmbeddedModel:
    """Tiny VAE + tiny causal DiT + MiniLM conditioning, loaded from the shipped checkpoint."""

    def __init__(self, spec: EmbeddedSpec, vae: TinyVAE, dit: CausalWanDiT) -> None:
        self.spec, self.vae, self.dit = spec, vae.eval(), dit.eval()
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

    def stream_runtime(self) -> StreamRuntime:
        """The product's runtime over this model's modules, configured as ``Pipeline.load`` would configure
        it from this spec's JSON (the training stages hold the modules in memory, not in a file)."""
        data = json.loads(self.spec.to_json())
        preset, config = stream_recipe(data, "embedded")
        prompts = PromptEncoder(load_text_encoder(self.spec.text_encoder), self.spec.text_conditioning,
                                look_anchors(data))
        return StreamRuntime(self.dit, self.vae, prompts, preset, config)


class EmbeddedStream:
    """Streams of one latent clip under several prompts at once (row b of the batch under ``prompts[b]``):
    what the decoder fine-tune (engine/embedded/train.py, stage 5) decodes.

    Every row is a product stream (``StreamRuntime.open``, seeded ``seed`` like a user's) and every
    chunk goes through ``StreamRuntime.denoise_latents`` in one batched forward per step, so training
    sees exactly the chunk recipe the product serves: KV cache, RoPE, noise draws, per-step caches.
    The input is latents, not pixels, so there is no motion to measure: the noise rate is the fixed
    ``noise_scale`` (the motion-aware controller's rate on a static scene).
    """

    def __init__(self, runtime: StreamRuntime, prompts: Sequence[str], size: tuple[int, int], seed: int,
                 noise_scale: float, num_steps: int) -> None:
        fidelity = FidelityConfig(steps=num_steps, kv_window_frames=runtime.config.kv_window_frames,
                                  precision="fp32")
        self.runtime, self.noise_scale = runtime, noise_scale
        self.states = [runtime.open(f"row{b}", prompt, size, fidelity, seed=seed, noise_scale=noise_scale)
                       for b, prompt in enumerate(prompts)]

    @torch.no_grad()
    def denoise(self, z: torch.Tensor) -> torch.Tensor:
        """Input latents [B, C, K, h, w] -> stylised latents x̂₀, one chunk of latent frames at a time."""
        if z.shape[0] != len(self.states):
            raise ValueError(f"{z.shape[0]} latent rows for {len(self.states)} streams")
        f = self.runtime.config.chunk_latent_frames
        if z.shape[2] % f:
            raise ValueError(f"{z.shape[2]} latent frames do not split into chunks of {f}")
        rates = [self.noise_scale] * len(self.states)
        out = []
        for k in range(0, z.shape[2], f):
            chunk = [z[b : b + 1, :, k : k + f] for b in range(len(self.states))]
            out.append(self.runtime.denoise_latents(self.states, chunk, rates))
        return torch.cat(out, dim=2)
