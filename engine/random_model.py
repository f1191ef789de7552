"""Full-size Wan 2.1 models with random weights and no download: ``random:wan2.1-1.3b``, ``random:wan2.1-14b``.

For measuring speed and memory where the real checkpoints are not at hand (a fresh GPU machine with no
network): the real DiT and Wan 2.1 VAE architectures at their real sizes and a text-encoder stand-in
with umT5-XXL's output shape (:class:`engine.text.HashedTextEncoder`). Output is noise-like; every cost
that does not depend on the weights' values is the real one. ``random:tiny`` is the same recipe at test
size (the tiny DiT config with the Wan VAE topology at 4 channels).

Weights are never initialised the slow way (nn.Linear's per-module kaiming init of 1.4B values takes
minutes on a CPU): the modules are built on the ``meta`` device, which allocates nothing, moved with
``to_empty`` onto the target device and filled in place by one seeded generator on that device, at the
scale of the real initialisation. On ``meta`` they stay shapes only: that is how the 14B's parameter
count and memory are worked out on a machine that cannot hold it (engine/memory.py).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TypeVar

import torch
from torch import nn

from engine.models.taehv import TAEHV, TAEHVConfig
from engine.models.wan_dit import CONFIGS, CausalWanDiT, LayerNorm, RMSNorm, WanDiTConfig
from engine.models.wan_vae import WanVAE, WanVAEConfig, for_device

log = logging.getLogger(__name__)

RANDOM_PREFIX = "random:"


@dataclass(frozen=True)
class RandomModel:
    """One random-weight model: its DiT and VAE configs and the frame size it is served at."""

    name: str
    dit: WanDiTConfig
    vae: WanVAEConfig
    size: tuple[int, int]  # (width, height)
    taehv: TAEHVConfig = TAEHVConfig()  # the tiny VAE ``--vae tiny-random`` builds beside the Wan VAE

    @property
    def spec(self) -> str:
        return RANDOM_PREFIX + self.name


RANDOM_MODELS: dict[str, RandomModel] = {
    m.name: m
    for m in (
        RandomModel("wan2.1-1.3b", CONFIGS["wan-1.3b"], WanVAEConfig(), (832, 480)),
        RandomModel("wan2.1-14b", CONFIGS["wan-14b"], WanVAEConfig(), (832, 480)),
        RandomModel("tiny", CONFIGS["tiny"], WanVAEConfig.tiny(), (64, 64), TAEHVConfig.tiny()),
    )
}


def is_random_spec(model: object) -> bool:
    return isinstance(model, str) and model.startswith(RANDOM_PREFIX)


def random_model(spec: str) -> RandomModel:
    """``"random:wan2.1-1.3b"`` -> its :class:`RandomModel`; a KeyError listing the names otherwise."""
    name = spec.removeprefix(RANDOM_PREFIX)
    if name not in RANDOM_MODELS:
        known = ", ".join(RANDOM_PREFIX + n for n in RANDOM_MODELS)
        raise KeyError(f"unknown random-weight model {spec!r}; choose from {known}")
    return RANDOM_MODELS[name]


# -- building ------------------------------------------------------------------------------------------


def build_dit(config: WanDiTConfig, device: torch.device | str = "meta", dtype: torch.dtype = torch.float32,
              seed: int = 0) -> CausalWanDiT:
    """The DiT with random weights in ``dtype`` on ``device`` (shapes only on ``meta``)."""
    with torch.device("meta"):
        model = CausalWanDiT(config)
    model = _materialise(model, device, dtype)
    if model.device.type != "meta":
        _fill_dit(model, _generator(model.device, seed))
    return model.eval().requires_grad_(False)  # inference only, like every served model


def build_vae(config: WanVAEConfig, device: torch.device | str = "meta", dtype: torch.dtype = torch.float32,
              seed: int = 1) -> WanVAE:
    """The Wan 2.1 VAE topology with random weights in ``dtype`` on ``device`` (shapes only on ``meta``)."""
    with torch.device("meta"):
        model = WanVAE(config)
    model = _materialise(model, device, dtype)
    if model.latents_mean.device.type != "meta":
        _fill_vae(model, _generator(model.latents_mean.device, seed))
    return for_device(model.eval().requires_grad_(False))


def build_taehv(config: TAEHVConfig, device: torch.device | str = "meta", dtype: torch.dtype = torch.float32,
                seed: int = 2) -> TAEHV:
    """The TAEHV tiny VAE (engine/models/taehv.py) with random weights in ``dtype`` on ``device``."""
    with torch.device("meta"):
        model = TAEHV(config)
    model = _materialise(model, device, dtype)
    on = next(model.parameters()).device
    if on.type != "meta":
        _fill_taehv(model, _generator(on, seed))
    return model.eval().requires_grad_(False)


_M = TypeVar("_M", bound=nn.Module)


def _materialise(model: _M, device: torch.device | str, dtype: torch.dtype) -> _M:
    model = model.to(dtype=dtype)  # still meta: free
    device = torch.device(device)
    return model if device.type == "meta" else model.to_empty(device=device)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    # One generator on the target device: on a GPU the fill never goes through host memory.
    return torch.Generator(device=device).manual_seed(seed)


def _uniform_(p: torch.Tensor, std: float, generator: torch.Generator) -> None:
    bound = std * math.sqrt(3.0)  # U(-b, b) has standard deviation b / sqrt(3)
    p.uniform_(-bound, bound, generator=generator)


@torch.no_grad()
def _fill_dit(model: CausalWanDiT, generator: torch.Generator) -> None:
    """Wan's own initialisation scale (``WanModel.init_weights``): Xavier-uniform linears and patch
    embedding, std 0.02 text and time MLPs, zero biases, unit norms, modulation ~ 1/sqrt(dim).
    Unlike Wan, the output head is random too: Wan zeroes it, which would make every velocity 0."""
    dim = model.config.dim
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, (RMSNorm, LayerNorm)):
                p.fill_(1.0 if name == "weight" else 0.0)
            elif name == "bias":
                p.zero_()
            elif name == "modulation":
                _uniform_(p, dim**-0.5, generator)
            elif module_name.startswith(("text_embedding", "time_embedding")):
                _uniform_(p, 0.02, generator)
            else:
                fan_out, fan_in = p.shape[0], p[0].numel()
                _uniform_(p, math.sqrt(2.0 / (fan_in + fan_out)), generator)


@torch.no_grad()
def _fill_vae(model: WanVAE, generator: torch.Generator) -> None:
    """PyTorch's default conv scale (weights and biases U(+-1/sqrt(fan_in))), unit RMS-norm gains, and the
    latent normalisation buffers from the config (``to_empty`` left them uninitialised)."""
    for _module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if name == "gamma":
                p.fill_(1.0)
            else:
                weight = getattr(module, "weight", p)
                fan_in = weight[0].numel()
                bound = fan_in**-0.5
                p.uniform_(-bound, bound, generator=generator)
    cfg = model.config
    shape = (1, cfg.z_dim, 1, 1, 1)
    like = model.latents_mean
    model.latents_mean = torch.tensor(cfg.latents_mean, dtype=like.dtype, device=like.device).reshape(shape)
    model.latents_std = torch.tensor(cfg.latents_std, dtype=like.dtype, device=like.device).reshape(shape)


@torch.no_grad()
def _fill_taehv(model: TAEHV, generator: torch.Generator) -> None:
    """Weights at LeCun scale (variance 1/fan_in) and zero biases: the norm-free ReLU stack then neither
    dies nor saturates over its depth, so random-weight frames vary like real ones do (a measure of
    speed and memory, not of quality)."""
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        else:
            _uniform_(p, p[0].numel() ** -0.5, generator)


# -- sizes -------------------------------------------------------------------------------------------


@lru_cache(maxsize=8)
def dit_parameter_count(config: WanDiTConfig) -> int:
    """Parameters of the DiT, counted on a ``meta`` build (no memory)."""
    return sum(p.numel() for p in build_dit(config, "meta").parameters())


@lru_cache(maxsize=8)
def vae_parameter_count(config: WanVAEConfig) -> int:
    """Parameters of the Wan VAE, counted on a ``meta`` build (no memory)."""
    return sum(p.numel() for p in build_vae(config, "meta").parameters())


def weight_bytes(model: RandomModel, dtype: torch.dtype) -> int:
    """Bytes of the DiT and VAE weights in ``dtype`` (the text stand-in has none)."""
    return (dit_parameter_count(model.dit) + vae_parameter_count(model.vae)) * dtype.itemsize


def materialise_problem(model: RandomModel, dtype: torch.dtype, available: int | None, device: str) -> str | None:
    """Why ``model`` cannot be built in ``dtype`` on a device with ``available`` free bytes; None when it can."""
    need = weight_bytes(model, dtype)
    if available is None or need <= available:
        return None
    gb = 1e9
    return (
        f"{model.spec} needs {need / gb:.1f} GB for its weights in {str(dtype).removeprefix('torch.')} "
        f"(DiT {dit_parameter_count(model.dit) / 1e9:.2f}B + VAE {vae_parameter_count(model.vae) / 1e6:.0f}M "
        f"parameters) but {device} has {available / gb:.1f} GB free; build it on 'meta' for shape and memory "
        "arithmetic (`diffcast bench memory`), pick a smaller dtype, or use a device with more memory"
    )
