"""The public Python API of the engine: load a model, open a stream, process chunks, reset.

    from engine.pipeline import Pipeline, StreamParams

    pipe = Pipeline.load()                        # the embedded default model (or a path, "tiny-random", "random:...")
    pipe.capabilities                             # modes ("v2v", "t2v"), looks, noise scale and steps it runs at
    stream = pipe.open_stream(StreamParams(prompt="oil painting", seed=0))  # noise, steps: the model's own
    out = stream.process(frames)                  # uint8 [T, H, W, 3] RGB -> uint8 [T, h, w, 3] RGB
    stream.update(prompt="pencil sketch", transition_chunks=2)   # no restart
    pipe.load_lora("ink", "ink.safetensors")      # a LoRA, applied per stream (docs/lora.md)
    stream.update(loras={"ink": 0.7})             # live, no reload
    stream.reset()

``frames`` holds ``pipe.first_chunk_frames`` frames on a stream's first call and
``pipe.chunk_frames`` frames after that. A stream's size is ``StreamParams.size`` where given; else
its first chunk picks it: ``pipe.stream_size((W, H))``, the size on the model's grid
(``pipe.size_granularity``) within its pixel budget (``pipe.pixel_budget``, the area of
``pipe.default_size``) closest to the frames' aspect (engine/aspect.py: 640x480 -> 288x224 and
1280x720 -> 336x192 on the embedded default). Frames of any other size are centre-cropped to the
stream's aspect and resized, never stretched; outputs come back at the stream's size (``stream.size``).
This module is a stable contract: the service, the CLI and outside checks call it.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch

from engine.aspect import fit_size
from engine.capabilities import ModelCapabilities, look_name
from engine.capabilities import UnsupportedModeError as UnsupportedModeError  # part of this API
from engine.embedded.block_texture import GRID_LOOKS
from engine.fidelity import FidelityConfig
from engine.frames import frames_as_uint8, tensor_to_frames
from engine.models.lora import LoRA, LoRABank, check_strengths
from engine.models.wan_dit import CONFIGS, CausalWanDiT, WanDiTConfig
from engine.sampling import SELF_FORCING, STREAMDIFFUSION_V2, SamplerPreset
from engine.streaming.config import RuntimeConfig
from engine.streaming.deblock import DeblockConfig
from engine.streaming.noise import NoiseControllerConfig
from engine.streaming.prompts import BlendMode, LookAnchors
from engine.streaming.runtime import ChunkResult, PromptEncoder, StreamRuntime
from engine.streaming.stabilizer import LookStabilizers, StabilizerConfig
from engine.streaming.state import StreamState
from engine.vae import StreamVAE
from engine.vae_choice import VAEChoice

log = logging.getLogger(__name__)

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
DEFAULT_MODEL = WEIGHTS_DIR / "default.safetensors"
MAX_PROMPT_CHARS = 1000


class ModelNotAvailableError(RuntimeError):
    """The requested model cannot be loaded (missing files, not trained yet, ...)."""


def model_capabilities(model: str | Path | None) -> ModelCapabilities:
    """A model's capabilities read from its config without loading weights (generic ones where the
    model has no diffcast config: Wan checkpoints run both modes)."""
    path: Path | None = None
    if model is None or str(model) == "default":
        path = DEFAULT_MODEL
    elif str(model).endswith(".safetensors"):
        path = Path(model)
    config_file = path.with_suffix(".json") if path is not None else None
    if config_file is None or not config_file.is_file():
        return ModelCapabilities()
    return ModelCapabilities.from_config(json.loads(config_file.read_text()))


@dataclass(frozen=True)
class StreamParams:
    prompt: str | tuple[str, ...]
    noise_scale: float | None = None  # None: the loaded model's own (Pipeline.capabilities)
    steps: int | None = None  # None: the loaded model's own
    seed: int = 0
    prompt_weights: tuple[float, ...] | None = None
    blend_mode: BlendMode = "linear"
    size: tuple[int, int] | None = None  # (width, height); None = from the first chunk's aspect
    mode: Literal["v2v", "t2v"] = "v2v"  # t2v: text-to-video with the Self-Forcing recipe, no input
    # The per-chunk knobs to open with (None: the model's own, at ``steps``); a serving policy changes
    # them per chunk with ``Stream.set_fidelity``. Its steps are the stream's steps.
    fidelity: FidelityConfig | None = None
    stabilize: bool = True  # the temporal stabilizer, where the model's runtime config has one
    # LoRA strengths by name, over the pipeline's defaults (Pipeline.load_lora); 0 turns one off.
    loras: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "loras", check_strengths(self.loras))  # a plain dict of finite, bounded numbers
        prompts = (self.prompt,) if isinstance(self.prompt, str) else self.prompt
        if not prompts or any(not p.strip() for p in prompts):
            raise ValueError("prompt must be non-empty")
        too_long = [len(p) for p in prompts if len(p) > MAX_PROMPT_CHARS]
        if too_long:
            raise ValueError(f"prompt is {max(too_long)} characters; the limit is {MAX_PROMPT_CHARS}")
        if self.prompt_weights is not None and len(self.prompt_weights) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(self.prompt_weights)} prompt weights")
        # The blend divides by the weights' sum: a NaN, an Infinity or an overflowing sum makes every
        # later frame of the stream NaN (black).
        if self.prompt_weights is not None and (
            any(not w >= 0 for w in self.prompt_weights) or not 0 < sum(self.prompt_weights) < math.inf
        ):
            raise ValueError(f"prompt weights must be finite, non-negative and of a finite positive sum, got "
                             f"{self.prompt_weights}")
        if self.mode not in ("v2v", "t2v"):
            raise ValueError(f"mode must be 'v2v' or 't2v', got {self.mode!r}")
        if self.noise_scale is not None and not 0.1 < self.noise_scale <= 1.0:
            raise ValueError(f"noise_scale must be in (0.1, 1.0], got {self.noise_scale}")
        if self.fidelity is not None:
            if self.steps is None:
                object.__setattr__(self, "steps", self.fidelity.steps)
            elif self.steps != self.fidelity.steps:
                raise ValueError(f"steps={self.steps} but the fidelity's steps are {self.fidelity.steps}")

    @property
    def prompts(self) -> tuple[str, ...]:
        return (self.prompt,) if isinstance(self.prompt, str) else tuple(self.prompt)

    def with_(self, **changes: Any) -> StreamParams:
        return replace(self, **changes)


@dataclass(frozen=True)
class StyleRegistry:
    """The looks a small model was trained on: prompts far from all of them get a notice."""

    names: tuple[str, ...]
    prototypes: torch.Tensor  # [styles, dim], L2-normalised pooled text embeddings
    too_far_below: float

    def notice(self, prompts: PromptEncoder, prompt: str) -> str | None:
        """A message naming the nearest styles when ``prompt`` is far from every trained style (a prompt
        naming two looks is near both, however far its whole embedding lands)."""
        from engine.embedded.styles import match_style

        match = match_style(prompt, prompts.pooled([prompt])[0], list(self.names), self.prototypes, self.too_far_below)
        return match.message() if match.too_far and prompts.named_looks(prompt) is None else None


class Pipeline:
    """A loaded model (DiT + stream VAE + text encoder + sampler recipe) that serves streams."""

    def __init__(
        self,
        dit: CausalWanDiT,
        vae: StreamVAE,
        text_encoder: object,
        preset: SamplerPreset,
        runtime: RuntimeConfig,
        default_size: tuple[int, int],
        name: str,
        styles: StyleRegistry | None = None,
        text_conditioning: str = "tokens",
        anchors: LookAnchors | None = None,
    ) -> None:
        self.name = name
        self.default_size = default_size
        self.capabilities = ModelCapabilities()
        self.styles = styles
        prompts = PromptEncoder(text_encoder, text_conditioning, anchors)
        self.loras = LoRABank.of(dit)
        self.lora_strengths: dict[str, float] = {}  # what a stream gets unless its StreamParams say otherwise
        self.runtime = StreamRuntime(dit, vae, prompts, preset, runtime)
        # Text-to-video streams share the weights but follow the CausVid / Self-Forcing recipe:
        # 3-latent-frame chunks from pure noise, 4 warped steps, one KV cache written by a clean pass.
        t2v = RuntimeConfig(
            chunk_latent_frames=3,
            kv_window_frames=max(runtime.kv_window_frames, 9),
            sink_frames=3,
            cache_mode="clean",
            sink_refresh=False,
            rope_reset_frame=max(runtime.rope_reset_frame, 60),
        )
        self.t2v_runtime = StreamRuntime(dit, vae, prompts, SELF_FORCING, t2v)
        self.first_chunk_frames = 1
        self.chunk_frames = vae.temporal_compression * runtime.chunk_latent_frames

    # -- loading ----------------------------------------------------------------------------------

    @classmethod
    def load(cls, model: str | Path | None = None, device: str = "cpu", dtype: torch.dtype = torch.float32,
             vae: str | None = None) -> Pipeline:
        """``None``: the embedded default; ``"tiny-random"``: a tiny random-weight model (tests);
        ``"random:wan2.1-1.3b"`` / ``"random:wan2.1-14b"`` / ``"random:tiny"``: the Wan 2.1 architecture
        with random weights and no download (engine/random_model.py; on ``device="meta"`` shapes only);
        a ``.safetensors`` file with a ``.json`` beside it (diffcast format); or a model directory
        with a ``diffcast.json`` manifest pointing at real Wan/CausVid/StreamDiffusionV2 files.

        ``vae`` (Wan models only): the stream VAE, as ``--vae`` takes it (engine/vae_choice.py: ``wan``, a
        taew2_1 file for Wan's encoder with the tiny decoder, ``tiny:FILE``, ``tiny-random``)."""
        from engine.vae_choice import vae_choice_for

        try:
            choice = vae_choice_for(None if model is None else str(model), vae)  # refused for other models
        except ValueError as exc:
            raise ModelNotAvailableError(str(exc)) from None
        if model is None or str(model) == "default":
            if not DEFAULT_MODEL.is_file():
                raise ModelNotAvailableError(
                    f"the embedded default model is not available ({DEFAULT_MODEL} is missing); "
                    "train it with `diffcast train-default`, or pass --model PATH (or 'tiny-random' for a "
                    "random-weight test model that produces noise-like output)"
                )
            return _load_diffcast_file(DEFAULT_MODEL, device, dtype)
        if str(model) == "tiny-random":
            return _tiny_random(device, dtype)
        if str(model).startswith("random:"):
            return _random_weights(str(model), device, dtype, choice)
        path = Path(model)
        if path.is_file() and path.suffix == ".safetensors" and path.with_suffix(".json").is_file():
            return _load_diffcast_file(path, device, dtype)
        if path.is_dir() and (path / "diffcast.json").is_file():
            return _load_manifest(path, device, dtype, choice)
        raise ModelNotAvailableError(
            f"cannot load model {model!r}: expected 'default', 'tiny-random', 'random:wan2.1-1.3b' (or another "
            "random: model), a diffcast .safetensors file "
            "with its .json beside it, or a directory with a diffcast.json manifest (see docs/api.md)"
        )

    # -- LoRAs ------------------------------------------------------------------------------------

    def load_lora(self, name: str, path: str | Path, strength: float = 1.0) -> LoRA:
        """Load a LoRA file (diffusers/PEFT or original Wan/kohya keys, docs/lora.md) onto the DiT's side
        path, without touching its weights; new streams get it at ``strength`` unless their params say
        otherwise. Raises :class:`engine.models.lora.LoRAError` for a file that does not fit the model."""
        from engine.lora_files import load_lora

        check_strengths({name: strength})
        lora = load_lora(path, self.loras, name)
        self.lora_strengths[name] = float(strength)
        return lora

    def lora_info(self) -> list[dict[str, Any]]:
        """The loaded LoRAs: name, rank, patched layers, and the strength new streams get."""
        return [{**info, "strength": self.lora_strengths[info["name"]]} for info in self.loras.info()]

    # -- streams ----------------------------------------------------------------------------------

    @property
    def size_granularity(self) -> int:
        """Pixels a stream's sides are multiples of (the VAE's spatial compression times the DiT's patch)."""
        return self.runtime.size_granularity

    @property
    def pixel_budget(self) -> int:
        """Pixels per frame a stream runs at, at most: the area of the model's default size."""
        return self.default_size[0] * self.default_size[1]

    def stream_size(self, frame_size: tuple[int, int]) -> tuple[int, int]:
        """The size a stream whose frames are ``frame_size`` (width, height) runs at when its params
        give none: on the model's grid, within its pixel budget, closest to the frames' aspect."""
        return fit_size(frame_size, self.pixel_budget, self.size_granularity)

    def runtime_for(self, params: StreamParams) -> StreamRuntime:
        return self.t2v_runtime if params.mode == "t2v" else self.runtime

    def operating_point(self, params: StreamParams) -> tuple[float, int]:
        """(noise scale, steps) of ``params``, this model's own where ``params`` leaves them unset."""
        caps = self.capabilities
        return (caps.noise_scale if params.noise_scale is None else params.noise_scale,
                caps.steps if params.steps is None else params.steps)

    def resolve(self, params: StreamParams) -> StreamParams:
        """``params`` with the controls it leaves unset (noise scale, steps) at this model's own."""
        noise_scale, steps = self.operating_point(params)
        return params.with_(noise_scale=noise_scale, steps=steps)

    def fidelity_for(self, params: StreamParams, **knobs: Any) -> FidelityConfig:
        """The knobs a stream of ``params`` opens with (``params.fidelity``, else this model's own at the
        stream's steps), with ``knobs`` (FidelityConfig fields) replaced."""
        config = params.fidelity or FidelityConfig(
            steps=self.operating_point(params)[1],
            kv_window_frames=self.runtime_for(params).config.kv_window_frames,
        )
        return replace(config, **knobs) if knobs else config

    def with_knobs(self, params: StreamParams, **knobs: Any) -> StreamParams:
        """``params`` opening with ``knobs`` (FidelityConfig fields, e.g. ``precision``) over the
        knobs it would open with."""
        fidelity = self.fidelity_for(params, **knobs)
        return params.with_(steps=fidelity.steps, fidelity=fidelity)

    def open_stream(self, params: StreamParams, stream_id: str | None = None) -> Stream:
        """A new stream; UnsupportedModeError (a ValueError) for a mode this model lacks."""
        self.capabilities.require(params.mode)
        return Stream(self, self.resolve(params), stream_id or uuid.uuid4().hex)

    def prompt_notice(self, prompts: tuple[str, ...]) -> str | None:
        """For a model trained on a few styles: a message when no prompt is near any of them."""
        if self.styles is None:
            return None
        notices = [self.styles.notice(self.runtime.prompts, p) for p in prompts]
        return None if any(n is None for n in notices) else notices[0]

    def prompt_looks(self, prompts: tuple[str, ...], weights: Sequence[float] | None = None) -> list[tuple[str, float]]:
        """For a model that anchors prompts to its looks: the looks the prompts are served as, by name as
        users type them, with their shares of the blend (largest first); empty for any other model."""
        return [(look_name(n), share) for n, share in self.runtime.prompts.looks(prompts, weights)]


class StreamHost(Protocol):
    """What holds a stream's state between chunks and changes its controls: the in-process
    `StreamRuntime`, or the pipeline ranks' `engine.parallel.ring.RingRuntime` (rank 0 of `--gpus N`)."""

    def open(self, stream_id: str, prompt: str | Sequence[str], size: tuple[int, int], fidelity: FidelityConfig,
             seed: int = 0, weights: Sequence[float] | None = None, blend_mode: BlendMode = "linear",
             noise_scale: float = 0.8, stabilize: bool = True, loras: Mapping[str, float] | None = None,
             fit_input: bool = False) -> StreamState: ...

    def check_fidelity(self, fidelity: FidelityConfig) -> None: ...

    def set_fidelity(self, state: StreamState, fidelity: FidelityConfig) -> None: ...

    def checked_loras(self, loras: Mapping[str, float]) -> dict[str, float]: ...

    def set_loras(self, state: StreamState, loras: Mapping[str, float]) -> None: ...

    def set_prompt(self, state: StreamState, prompt: str | Sequence[str], weights: Sequence[float] | None = None,
                   blend_mode: BlendMode = "linear", transition_chunks: int = 0, refresh_sinks: bool = False) -> None: ...

    def set_look(self, state: StreamState, prompt: str | Sequence[str], weights: Sequence[float] | None = None,
                 blend_mode: BlendMode = "linear", loras: Mapping[str, float] | None = None,
                 noise_scale: float | None = None, transition_chunks: int = 0) -> None: ...


# The controls of `StreamControls.update` that are per-chunk knobs (FidelityConfig fields); the rest
# are the stream's own controls (prompt, noise, seed, ...).
FIDELITY_CONTROLS = ("steps", "kv_window_frames", "precision", "resolution_scale", "attention_sparsity", "step_batch")


class StreamControls:
    """One stream's controls, written once for every engine that holds streams: open a state, change
    its prompt, look, LoRA strengths, noise, seed and fidelity at a chunk boundary, start over.
    `Stream` (the in-process engine) adds running chunks; the pipeline ranks' processor
    (app/server/serving/engine_bridge.py) runs them through the ring."""

    def __init__(self, pipe: Pipeline, params: StreamParams, stream_id: str, host: StreamHost | None = None) -> None:
        self.pipe = pipe
        self.id = stream_id
        self.params = params
        self.host: StreamHost = host or pipe.runtime_for(params)
        self.state = self._open(params)
        self.notice = self._notice(params)

    def _notice(self, params: StreamParams) -> str | None:
        notice = self.pipe.prompt_notice(params.prompts)
        if notice:
            log.warning("stream %s: %s", self.id, notice)
        return notice

    def _open(self, params: StreamParams) -> StreamState:
        return self.host.open(
            self.id,
            list(params.prompts),
            params.size or self.pipe.default_size,
            self.pipe.fidelity_for(params),
            seed=params.seed,
            weights=params.prompt_weights,
            blend_mode=params.blend_mode,
            noise_scale=self.pipe.operating_point(params)[0],
            stabilize=params.stabilize,
            loras={**self.pipe.lora_strengths, **params.loras},
            fit_input=params.size is None and params.mode == "v2v",
        )

    @property
    def fidelity(self) -> FidelityConfig:
        """The per-chunk knobs the stream's next chunk runs with."""
        config: FidelityConfig = self.state.fidelity
        return config

    def update(
        self,
        prompt: str | tuple[str, ...] | list[str] | None = None,
        prompt_weights: tuple[float, ...] | list[float] | None = None,
        blend_mode: BlendMode | None = None,
        transition_chunks: int = 0,
        refresh_sinks: bool = False,
        noise_scale: float | None = None,
        steps: int | None = None,
        seed: int | None = None,
        kv_window_frames: int | None = None,
        precision: str | None = None,
        stabilize: bool | None = None,
        resolution_scale: float | None = None,
        attention_sparsity: float | None = None,
        step_batch: bool | None = None,
        loras: Mapping[str, float] | None = None,
    ) -> None:
        """Change controls; everything takes effect at the next chunk boundary, without a restart.

        ``loras`` sets the strengths of the LoRAs it names (the others keep theirs; 0 turns one off).

        ``resolution_scale`` (0, 1] moves the engine to the stream's size times the scale; the stream
        keeps its context (its caches are resampled, see docs/api.md) and outputs stay at its size.
        """
        changes: dict[str, Any] = {}
        if prompt is not None:
            changes["prompt"] = prompt if isinstance(prompt, str) else tuple(prompt)
            changes["prompt_weights"] = tuple(prompt_weights) if prompt_weights is not None else None
        elif prompt_weights is not None:
            changes["prompt_weights"] = tuple(prompt_weights)
        if blend_mode is not None:
            changes["blend_mode"] = blend_mode
        for key, value in (("noise_scale", noise_scale), ("seed", seed), ("stabilize", stabilize)):
            if value is not None:
                changes[key] = value
        knobs: dict[str, Any] = {key: value for key, value in zip(FIDELITY_CONTROLS, (
            steps, kv_window_frames, precision, resolution_scale, attention_sparsity, step_batch), strict=True)
            if value is not None}
        fidelity = replace(self.fidelity, **knobs)  # validates the knobs
        if loras is not None:
            changes["loras"] = {**self.params.loras, **loras}
        new = self.params.with_(**changes, steps=fidelity.steps, fidelity=fidelity)  # validates
        if new.mode != self.params.mode:
            raise ValueError("a stream's mode (v2v / t2v) is fixed when it opens")
        host = self.host
        noise_scale = self.pipe.operating_point(new)[0]
        replace(self.pipe.runtime_for(new).config.noise, noise_scale=noise_scale)  # validates the noise strength
        # Steps, window and engine size (a scale too small for the stream's size) and LoRA names are
        # checked before anything changes, so a refused update changes nothing.
        host.check_fidelity(fidelity)
        if loras is not None:
            host.checked_loras(loras)  # names a LoRA that is not loaded
        host.set_fidelity(self.state, fidelity)
        new_look = "prompt" in changes or "prompt_weights" in changes or "blend_mode" in changes
        if new_look and transition_chunks > 0:
            # A gradual change of look (a cue) takes the LoRA strengths and the noise strength along with
            # the text conditioning, from where the stream is now (docs/cues.md).
            host.set_look(self.state, list(new.prompts), new.prompt_weights, new.blend_mode, loras=loras,
                          noise_scale=noise_scale, transition_chunks=transition_chunks)
            self.state.force_sink_refresh = refresh_sinks
            self.notice = self._notice(new)
        else:
            if loras is not None:
                host.set_loras(self.state, loras)
            if new_look:
                host.set_prompt(self.state, list(new.prompts), new.prompt_weights, new.blend_mode,
                                refresh_sinks=refresh_sinks)
                self.notice = self._notice(new)
            self.state.noise_scale = noise_scale
        self.state.stabilize = new.stabilize
        if seed is not None and seed != self.params.seed:
            from engine.sampling import NoiseSource

            self.state.noise = NoiseSource(seed)
        self.params = new

    def set_fidelity(self, config: FidelityConfig) -> None:
        """Every per-chunk knob of ``config`` (what a serving policy picks), from the next chunk on."""
        self.host.set_fidelity(self.state, config)  # validates
        self.params = replace(self.params, steps=config.steps, fidelity=config)

    def reset(self) -> None:
        """Start over (fresh caches and noise) with the current controls."""
        self.state = self._open(self.params)


class Stream(StreamControls):
    """One live stream: feed chunks of frames, get stylised chunks back."""

    def __init__(self, pipe: Pipeline, params: StreamParams, stream_id: str) -> None:
        super().__init__(pipe, params, stream_id)
        self.last: ChunkResult | None = None

    @property
    def runtime(self) -> StreamRuntime:
        return self.pipe.runtime_for(self.params)

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of the stream's output frames: ``StreamParams.size``, else the model's default
        size until the first chunk sets it from the input's aspect."""
        size: tuple[int, int] = self.state.size
        return size

    @property
    def expected_frames(self) -> int:
        """Frames the next chunk entering needs: the first chunk of a stream is shorter (a chunk
        counts from when it enters, so a step batch's chunks in flight count too)."""
        return self.pipe.chunk_frames if self.state.frame else self.pipe.first_chunk_frames

    def process(self, frames: np.ndarray) -> np.ndarray:
        """V2V: uint8 RGB frames [T, H, W, 3] -> stylised uint8 RGB frames [T, h, w, 3]."""
        if self.params.mode != "v2v":
            raise ValueError("this is a text-to-video stream; call generate(), not process()")
        chunk = frames_as_uint8(frames, self.expected_frames)
        self.last = self.runtime.run_chunk(self.state, chunk)
        return tensor_to_frames(self.last.frames)

    def generate(self) -> np.ndarray:
        """T2V: the next chunk of a text-to-video stream (no input; open it with mode="t2v")."""
        if self.params.mode != "t2v":
            raise ValueError("this is a video-to-video stream; open it with StreamParams(mode='t2v') to generate")
        self.last = self.runtime.generate(self.state)
        return tensor_to_frames(self.last.frames)

    def reset(self) -> None:
        super().reset()
        self.last = None

    def stats(self) -> dict[str, Any]:
        s = self.state
        return {
            "chunks": s.chunks,
            "frame": s.frame,
            "rope_frame": s.rope_frame,
            "noise_rate": s.last_noise_rate,
            "sink_refreshes": s.sink_refreshes,
            "rope_resets": s.rope_resets,
            "steps": s.fidelity.steps,
            "fidelity": s.fidelity.label(),
            "stabilizer": s.stabilize and self.runtime.stabilizer is not None,
            "notice": self.notice,
            "loras": dict(s.loras),
        }


# -- loaders ------------------------------------------------------------------------------------------


def _tiny_random(device: str, dtype: torch.dtype) -> Pipeline:
    """Random weights at test size: the real architecture end to end, fast enough for service tests.

    The stream VAE is the embedded model's tiny VAE (2D convs + temporal memory), which runs an
    order of magnitude faster on a CPU than the Wan VAE topology at the same width.
    """
    from engine.models.tiny_vae import TinyVAE, TinyVAEConfig
    from engine.text import load_text_encoder

    torch.manual_seed(0)
    dit = CausalWanDiT(CONFIGS["tiny"]).to(device=device, dtype=dtype).eval()
    vae = TinyVAE(TinyVAEConfig(latent_channels=CONFIGS["tiny"].in_channels)).to(device=device, dtype=dtype).eval()
    text = load_text_encoder("minilm", device=device)
    runtime = RuntimeConfig()
    return Pipeline(dit, vae, text, STREAMDIFFUSION_V2, runtime, (128, 128), "tiny-random")


def _random_weights(spec: str, device: str, dtype: torch.dtype, vae_choice: VAEChoice | None = None) -> Pipeline:
    """A ``random:`` model: the real Wan 2.1 DiT and VAE at full size with random weights, the hashed
    umT5-shaped text stand-in, StreamDiffusionV2's recipe (the manifest defaults) at the model's size.
    ``vae_choice``: the stream VAE where it is not the Wan VAE (its tiny VAE from a file, or random).

    Refused up front, before anything is allocated, where the weights do not fit the device's free memory.
    """
    from engine.devices import available_memory_bytes, resolve_device
    from engine.random_model import build_dit, build_vae, materialise_problem, random_model
    from engine.text import CachedTextEncoder, HashedTextEncoder

    try:
        model = random_model(spec)
        if torch.device(device).type == "cuda":
            resolve_device(str(device))  # a clear error where CUDA is missing
    except (KeyError, ValueError) as exc:
        raise ModelNotAvailableError(exc.args[0]) from None
    problem = materialise_problem(model, dtype, available_memory_bytes(device), str(device))
    if problem is not None:
        raise ModelNotAvailableError(problem)
    dit = build_dit(model.dit, device, dtype)
    choice = vae_choice or VAEChoice()
    try:
        vae = choice.build(lambda: build_vae(model.vae, device, dtype), model.taehv, device, dtype)
    except (FileNotFoundError, ValueError) as exc:
        raise ModelNotAvailableError(str(exc)) from None
    # The stand-in's rows go where the DiT reads them (meta has no data: the text stays on the CPU there).
    text_device = "cpu" if torch.device(device).type == "meta" else device
    text = CachedTextEncoder(HashedTextEncoder(model.dit.text_dim, model.dit.text_len, text_device))
    name = spec if choice.mode == "wan" else f"{spec} ({choice.mode} VAE: {choice.tiny})"
    log.info("built %s with random weights (%s on %s)", name, dtype, device)
    return Pipeline(dit, vae, text, STREAMDIFFUSION_V2, RuntimeConfig(), model.size, name)


def _runtime_from_json(data: dict[str, Any]) -> RuntimeConfig:
    data = dict(data)
    noise = NoiseControllerConfig(**data.pop("noise", {}))
    stabilizer = data.pop("stabilizer", None)
    deblock = data.pop("deblock", None)
    return RuntimeConfig(noise=noise, stabilizer=StabilizerConfig(**stabilizer) if stabilizer is not None else None,
                         deblock=DeblockConfig(**{**deblock, "spare": tuple(map(tuple, deblock.get("spare", ())))})
                         if deblock is not None else None, **data)


def stream_recipe(config: dict[str, Any], name: str) -> tuple[SamplerPreset, RuntimeConfig]:
    """The sampler preset and runtime configuration a diffcast model config asks for.

    The one reading of a config's ``sampler`` and ``runtime`` fields: the loader below and the embedded
    model's training-time streams (engine/embedded/model.py) both build their runtime from it, so the
    decoder fine-tune streams exactly the recipe the product serves.
    """
    sampler = config.get("sampler", {})
    preset = STREAMDIFFUSION_V2
    if "steps" in sampler:
        steps = tuple(float(s) for s in sampler["steps"])
        default_steps = int(sampler.get("default_num_steps", min(preset.default_num_steps or len(steps), len(steps))))
        preset = SamplerPreset(name, float(sampler.get("shift", preset.shift)), steps, warp=False,
                               default_num_steps=default_steps)
    runtime = dict(config.get("runtime", {}))
    # Every diffcast file decodes with the TinyVAE, which draws each latent cell as an 8x8 block: its
    # streams are deblocked unless the config says otherwise ("deblock": null), sparing the looks drawn
    # on that grid. The spared looks are named in the file ("spare_looks") and reach the runtime as
    # their prototypes, the embeddings a stream's conditioning is compared with.
    deblock = runtime.get("deblock", {"spare_looks": list(GRID_LOOKS)})
    if deblock is not None:
        deblock = dict(deblock)
        looks = config.get("prototypes", {})
        deblock["spare"] = tuple(tuple(looks[name]) for name in deblock.pop("spare_looks", ()) if name in looks)
    runtime["deblock"] = deblock
    # Per-look stabilizer settings are named by look too, and reach the runtime with every look's
    # prototype: the runtime places a stream on the arc between two looks by its conditioning.
    overrides = runtime.pop("stabilizer_looks", None)
    if overrides:
        runtime["stabilizer_looks"] = _look_stabilizers(config, runtime.get("stabilizer"), overrides)
    return preset, _runtime_from_json(runtime)


def _look_stabilizers(config: dict[str, Any], base: dict[str, Any] | None,
                      overrides: dict[str, dict[str, Any]]) -> LookStabilizers:
    """Every look's stabilizer setting: the config's (``runtime.stabilizer``) with the look's own fields
    from ``runtime.stabilizer_looks`` (look name -> fields) over it."""
    if base is None:
        raise ValueError("runtime.stabilizer_looks needs runtime.stabilizer (the setting the looks change)")
    if not config.get("prototypes"):
        raise ValueError("runtime.stabilizer_looks needs a model with looks (a 'prototypes' table)")
    names, prototypes = _prototypes(config)
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise ValueError(f"runtime.stabilizer_looks names looks the model does not have: {', '.join(unknown)}")
    settings = []
    for name in names:
        try:
            settings.append(StabilizerConfig(**{**base, **overrides.get(name, {})}))
        except TypeError as e:
            raise ValueError(f"runtime.stabilizer_looks[{name!r}]: {e}") from None
    return LookStabilizers(tuple(tuple(row) for row in prototypes.tolist()), tuple(settings))


def look_anchors(config: dict[str, Any]) -> LookAnchors | None:
    """The look anchoring a diffcast model config asks for (``look_temperature`` with ``prototypes``);
    None for a config without it (models trained before anchoring read their raw prompt embedding)."""
    temperature = config.get("look_temperature")
    if temperature is None or not config.get("prototypes"):
        return None
    return LookAnchors(*_prototypes(config), float(temperature))


def _prototypes(config: dict[str, Any]) -> tuple[tuple[str, ...], torch.Tensor]:
    """A config's look names and their L2-normalised prototype embeddings [looks, dim]."""
    names = tuple(config["prototypes"])
    return names, torch.nn.functional.normalize(torch.tensor([config["prototypes"][n] for n in names]), dim=-1)


def _load_diffcast_file(path: Path, device: str, dtype: torch.dtype) -> Pipeline:
    """One safetensors file (keys ``dit.*``, ``vae.*``) plus a JSON config beside it."""
    from safetensors.torch import load_file

    from engine.models.tiny_vae import TinyVAE, TinyVAEConfig
    from engine.text import load_text_encoder

    config = json.loads(path.with_suffix(".json").read_text())
    try:
        dit_fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in config["dit"].items()}
        dit_cfg = WanDiTConfig(**dit_fields)
        vae_cfg = TinyVAEConfig.from_dict(config["vae"])
    except (KeyError, TypeError) as exc:
        raise ModelNotAvailableError(f"{path.with_suffix('.json')} is not a diffcast model config: {exc}") from exc
    state = load_file(str(path))
    dit_state = {k[4:]: v for k, v in state.items() if k.startswith("dit.")}
    vae_state = {k[4:]: v for k, v in state.items() if k.startswith("vae.")}
    dit = CausalWanDiT(dit_cfg)
    vae = TinyVAE(vae_cfg)
    for name, module, sd in (("dit", dit, dit_state), ("vae", vae, vae_state)):
        result = module.load_state_dict(sd, strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise ModelNotAvailableError(
                f"{path}: {name} weights do not match its config: missing {result.missing_keys[:10]}, "
                f"unexpected {result.unexpected_keys[:10]}"
            )
    dit = dit.to(device=device, dtype=dtype).eval()
    vae = vae.to(device=device, dtype=dtype).eval()
    preset, runtime = stream_recipe(config, path.stem)
    styles, anchors = None, None
    if config.get("prototypes"):
        styles = StyleRegistry(*_prototypes(config), float(config["too_far_below"]))
        anchors = look_anchors(config)
    text = load_text_encoder(config.get("text_encoder", "minilm"), device=device)
    size = tuple(config.get("size", (256, 256)))
    pipe = Pipeline(dit, vae, text, preset, runtime, (int(size[0]), int(size[1])), path.stem, styles,
                    text_conditioning=config.get("text_conditioning", "tokens"), anchors=anchors)
    pipe.capabilities = ModelCapabilities.from_config(config)
    return pipe


@dataclass(frozen=True)
class Manifest:
    """``diffcast.json`` in a model directory: where the real checkpoint files are."""

    dit: str
    vae: str
    text_encoder: str
    dit_config: str = "wan-1.3b"
    preset: str = "streamdiffusion_v2"
    size: tuple[int, int] = (832, 480)
    ema: bool | None = None
    runtime: dict[str, Any] = field(default_factory=dict)
    tiny_vae: str | None = None  # a taew2_1 file in the directory (engine/vae_choice.py)
    vae_mode: str | None = None  # "wan" | "tiny" | "wan-encoder-tiny-decoder"; default: the last with tiny_vae


def _load_manifest(root: Path, device: str, dtype: torch.dtype, vae_choice: VAEChoice | None = None) -> Pipeline:
    """``vae_choice`` (``--vae``) overrides the manifest's ``tiny_vae`` / ``vae_mode``."""
    from engine import sampling
    from engine.checkpoint import load_wan_dit
    from engine.models.taehv import TAEHVConfig
    from engine.models.wan_vae import load_wan_vae
    from engine.text import load_text_encoder

    raw = json.loads((root / "diffcast.json").read_text())
    try:
        manifest = Manifest(**raw)
    except TypeError as exc:
        raise ModelNotAvailableError(f"{root / 'diffcast.json'}: {exc}; fields are {list(asdict(Manifest('', '', '')))}") from exc
    presets = sampling.PRESETS
    if manifest.preset not in presets:
        raise ModelNotAvailableError(f"unknown sampler preset {manifest.preset!r}; choose from {sorted(presets)}")
    try:
        choice = vae_choice or VAEChoice.from_manifest(manifest.tiny_vae, manifest.vae_mode, root)
    except ValueError as exc:
        raise ModelNotAvailableError(str(exc)) from None
    dit = load_wan_dit(root / manifest.dit, manifest.dit_config, device=device, dtype=dtype, ema=manifest.ema).eval()
    try:
        vae = choice.build(lambda: load_wan_vae(root / manifest.vae, device=device, dtype=dtype).eval(),
                           TAEHVConfig(), device, dtype)
    except (FileNotFoundError, ValueError) as exc:  # a VAE file missing or not of its layout
        raise ModelNotAvailableError(str(exc)) from None
    spec = manifest.text_encoder if manifest.text_encoder == "minilm" else str(root / manifest.text_encoder)
    text = load_text_encoder(spec, device=device)
    runtime = _runtime_from_json(manifest.runtime)
    return Pipeline(dit, vae, text, presets[manifest.preset], runtime, tuple(manifest.size), root.name)  # type: ignore[arg-type]
