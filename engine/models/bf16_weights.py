"""bf16 copies of a model's linear and convolution weights, kept between forwards.

Under bf16 autocast every ``nn.Linear`` and ``nn.Conv*`` call casts its fp32 weight to bf16, and
autocast forgets the cast when its region ends: each chunk cast the whole DiT again (5.0 M weights,
2.5 ms on two CPU threads, an eighth of an x0.5 chunk of the embedded model). :func:`keep_bf16_weights`
turns each plain ``nn.Linear`` / ``nn.Conv{1,2,3}d`` of a model into a subclass whose forward, in an
inference-mode bf16 autocast region, hands the op a bf16 copy made once. Autocast would have cast to
exactly that copy, so the results are identical; outside bf16 autocast, or with autograd recording,
the module runs as before. A copy is made again when its weight changes (a new tensor, or an
in-place update, which bumps the tensor's version), and only for modules that run in bf16, so a model
that never does holds no copies.

The modules keep their class's behaviour (``isinstance`` checks still hold), parameters, state-dict
keys and hooks (LoRA side paths are forward hooks, engine/models/lora.py); concurrent forwards on
several threads read the same copies; a deep copy or a pickle of the model starts with none.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.modules.conv import _ConvNd


class _Copies:
    """One module's bf16 weight and bias, and the tensors (and their versions) they were made from."""

    def __init__(self) -> None:
        self.sources: tuple[weakref.ref[Tensor] | None, ...] = (None, None)
        self.versions: tuple[int, ...] = ()
        self.weight: Tensor | None = None
        self.bias: Tensor | None = None
        self.lock = threading.Lock()

    def __deepcopy__(self, memo: dict[int, Any]) -> _Copies:
        return _Copies()

    def __reduce__(self) -> tuple[type[_Copies], tuple[()]]:
        return _Copies, ()

    def get(self, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
        tensors = (weight, bias)
        versions = tuple(-1 if t is None else t._version for t in tensors)
        with self.lock:
            # The same tensor objects (a freed one's address may be reused) at the same versions.
            sources = tuple(None if r is None else r() for r in self.sources)
            if self.weight is None or versions != self.versions or any(
                    a is not b for a, b in zip(sources, tensors, strict=True)):
                self.weight = weight.detach().to(torch.bfloat16)
                self.bias = None if bias is None else bias.detach().to(torch.bfloat16)
                self.sources = tuple(None if t is None else weakref.ref(t) for t in tensors)
                self.versions = versions
            return self.weight, self.bias


def _bf16_copies(module: nn.Linear | _ConvNd, x: Tensor) -> tuple[Tensor, Tensor | None] | None:
    """The module's bf16 weight and bias when this forward runs under inference-mode bf16 autocast."""
    device = x.device.type
    if (not torch.is_autocast_enabled(device) or torch.get_autocast_dtype(device) != torch.bfloat16
            or torch.is_grad_enabled() or module.weight.dtype != torch.float32):
        return None  # the cheapest test first: every fp32 forward of these modules passes here
    copies: _Copies = module.__dict__["_bf16_copies"]
    return copies.get(module.weight, module.bias)


def _conv(module: _ConvNd, x: Tensor, own_forward: Callable[[Tensor], Tensor]) -> Tensor:
    cached = _bf16_copies(module, x)
    return own_forward(x) if cached is None else module._conv_forward(x, *cached)


class Bf16CachedLinear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        cached = _bf16_copies(self, x)
        return super().forward(x) if cached is None else F.linear(x, *cached)


class Bf16CachedConv1d(nn.Conv1d):
    def forward(self, x: Tensor) -> Tensor:
        return _conv(self, x, super().forward)


class Bf16CachedConv2d(nn.Conv2d):
    def forward(self, x: Tensor) -> Tensor:
        return _conv(self, x, super().forward)


class Bf16CachedConv3d(nn.Conv3d):
    def forward(self, x: Tensor) -> Tensor:
        return _conv(self, x, super().forward)


# Only the plain classes: a subclass with a forward of its own (the Wan VAE's causal convolution pads
# from a cache first) keeps it, and autocast casts its weight per call as before.
_CACHED: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: Bf16CachedLinear,
    nn.Conv1d: Bf16CachedConv1d,
    nn.Conv2d: Bf16CachedConv2d,
    nn.Conv3d: Bf16CachedConv3d,
}


def keep_bf16_weights(model: nn.Module) -> int:
    """Switch ``model``'s plain linear and convolution modules to the cached-copy classes (idempotent);
    returns how many modules have them."""
    kept = tuple(_CACHED.values())
    count = 0
    for module in model.modules():
        cached = _CACHED.get(type(module))
        if cached is not None:
            module.__class__ = cached
            module.__dict__["_bf16_copies"] = _Copies()
        count += isinstance(module, kept)
    return count
