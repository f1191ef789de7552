"""fp8 linears: the DiT's big matrix products with float8 (e4m3) weights and activations.

Inside :func:`fp8_linears` every :class:`Fp8Linear` (the DiT blocks' attention q/k/v/o and FFN layers,
engine/models/wan_dit.py) quantises its weight to ``float8_e4m3fn`` with one scale per output channel and
its input with one scale per token (row), multiplies the fp8 values with fp32 accumulation and applies
both scales to the product. Outside it the module is the plain (bf16-cached) linear it always was.

Two implementations of the same arithmetic:

* CUDA with fp8 units (sm89+: Ada, Hopper, Blackwell) and a torch whose ``torch._scaled_mm`` takes
  row-wise scales: the fp8 GEMM itself. :func:`fp8_linear_supported` probes it once per device with a
  tiny call, so the capability is reported only where the kernel really runs.
* Everywhere else: an emulation (quantise, dequantise, matmul in fp32). It gives the same numbers up to
  fp32 rounding (the products of the fp8 values, then the scales), so its error against bf16 can be
  measured on a CPU; it is slower than bf16, so it is a test path, never a serving point
  (``engine.fidelity``: the capability exists on CUDA only).

The fp8 weights are made once per module, at its first fp8 forward, and kept beside the fp32/bf16
weights (made again when the weight changes: a new tensor or an in-place update), so switching a stream
between bf16 and fp8-linear needs no reload. Scales are amax / 448 (e4m3's largest finite value), so no
value saturates; an all-zero row gets scale 1 rather than 0 (no division by zero, its values stay 0).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor, nn

from engine.models.bf16_weights import Bf16CachedLinear, _Copies

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_ALIGN = 16  # torch._scaled_mm wants every dimension of its operands divisible by 16

_active: ContextVar[bool] = ContextVar("fp8_linears", default=False)
_emulate: ContextVar[bool] = ContextVar("fp8_linears_emulate", default=False)


@contextlib.contextmanager
def fp8_linears(emulate: bool = False) -> Iterator[None]:
    """Run every :class:`Fp8Linear` inside the block in fp8 (the fp8 GEMM where the device has it, else
    the emulation); ``emulate``: the emulation even where the kernel exists (its error is the kernel's),
    as does an enclosing :func:`fp8_emulation`."""
    token, etoken = _active.set(True), _emulate.set(emulate or _emulate.get())
    try:
        yield
    finally:
        _emulate.reset(etoken)
        _active.reset(token)


@contextlib.contextmanager
def fp8_emulation() -> Iterator[None]:
    """Inside the block fp8 linears that run (a chunk at precision fp8-linear) take the emulation even
    where the kernel exists: the kernel and the emulation compared on one GPU."""
    token = _emulate.set(True)
    try:
        yield
    finally:
        _emulate.reset(token)


def fp8_linears_active() -> bool:
    return _active.get()


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` ``[M, K]`` -> fp8 values ``[M, K]`` and float32 scales ``[M, 1]`` with ``x ≈ q * scale``."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


_probed: dict[tuple[str, int | None], bool] = {}
_probe_lock = threading.Lock()


def fp8_linear_supported(device: torch.device | str) -> bool:
    """Whether the fp8 GEMM runs on ``device``: CUDA, compute capability 8.9 or newer, and
    ``torch._scaled_mm`` accepting row-wise scales with a bf16 output (a 16x16 probe, once per device)."""
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm") or not torch.cuda.is_available():
        return False
    key = (device.type, device.index if device.index is not None else torch.cuda.current_device())
    with _probe_lock:
        if key not in _probed:
            ok = torch.cuda.get_device_capability(key[1]) >= (8, 9)
            if ok:
                try:
                    a = torch.ones(_ALIGN, _ALIGN, device=device)
                    qa, sa = quantize_rows(a)
                    qb, sb = quantize_rows(a)
                    out = _scaled_mm(qa, qb, sa, sb, torch.bfloat16)
                    ok = bool(torch.allclose(out.float(), torch.full_like(out.float(), float(_ALIGN))))
                except (RuntimeError, TypeError, NotImplementedError):
                    ok = False  # this torch or GPU has no row-wise fp8 GEMM
            _probed[key] = ok
        return _probed[key]


def _scaled_mm(qx: Tensor, qw: Tensor, sx: Tensor, sw: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``(qx * sx) @ (qw * sw)^T`` with the fp8 GEMM: ``qx`` ``[M, K]``, ``qw`` ``[N, K]``, scales
    ``[M, 1]`` and ``[N, 1]``. The kernel wants the second operand column-major, which ``qw.t()`` of a
    row-major weight is, and its scale as ``[1, N]``."""
    return torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw.t(), out_dtype=out_dtype)


class _Fp8Weights:
    """One module's fp8 weight and per-output-channel scales (and, for the emulation, their product in
    fp32), with the weight tensor and version they were made from."""

    def __init__(self) -> None:
        self.source: weakref.ref[Tensor] | None = None
        self.version = -1
        self.q: Tensor | None = None
        self.scale: Tensor | None = None
        self.dequantized: Tensor | None = None
        self.made = 0  # how many times the copies were made (tests: once per weight)
        self.lock = threading.Lock()

    def __deepcopy__(self, memo: dict[int, Any]) -> _Fp8Weights:
        return _Fp8Weights()

    def __reduce__(self) -> tuple[type[_Fp8Weights], tuple[()]]:
        return _Fp8Weights, ()

    def get(self, weight: Tensor, dequantized: bool) -> tuple[Tensor, Tensor, Tensor | None]:
        with self.lock:
            source = None if self.source is None else self.source()
            if self.q is None or source is not weight or weight._version != self.version:
                self.q, self.scale = quantize_rows(weight.detach())
                self.dequantized = None
                self.source, self.version = weakref.ref(weight), weight._version
                self.made += 1
            assert self.scale is not None
            if dequantized and self.dequantized is None:
                self.dequantized = self.q.float() * self.scale
            return self.q, self.scale, self.dequantized


class Fp8Linear(Bf16CachedLinear):
    """An ``nn.Linear`` (same parameters, state-dict keys and hooks: LoRA side paths still apply, in full
    precision) that runs in fp8 inside :func:`fp8_linears` and as a bf16-cached linear elsewhere."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.__dict__["_bf16_copies"] = _Copies()
        self.__dict__["_fp8_weights"] = _Fp8Weights()

    @property
    def fp8_weights(self) -> _Fp8Weights:
        weights: _Fp8Weights = self.__dict__["_fp8_weights"]
        return weights

    def forward(self, x: Tensor) -> Tensor:
        if not _active.get() or torch.is_grad_enabled():
            return super().forward(x)
        return fp8_linear(x, self.weight, self.bias, self.fp8_weights, emulate=_emulate.get())


def _out_dtype(x: Tensor) -> torch.dtype:
    """What the plain linear would return: autocast's dtype inside autocast, else the input's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, cache: _Fp8Weights | None = None,
               emulate: bool = False) -> Tensor:
    """``x @ weight^T + bias`` with both operands in fp8 (per-token and per-output-channel scales)."""
    cache = _Fp8Weights() if cache is None else cache
    out_dtype = _out_dtype(x)
    rows = x.reshape(-1, x.shape[-1])
    qx, sx = quantize_rows(rows)
    n, k = weight.shape
    kernel = not emulate and fp8_linear_supported(x.device) and n % _ALIGN == 0 and k % _ALIGN == 0
    qw, sw, dequantized = cache.get(weight, dequantized=not kernel)
    if kernel:
        m = rows.shape[0]
        pad = -m % _ALIGN  # zero rows to the kernel's multiple of 16 (their scale is 1, their output dropped)
        if pad:
            qx = torch.cat([qx, torch.zeros(pad, k, dtype=FP8_DTYPE, device=qx.device)])
            sx = torch.cat([sx, torch.ones(pad, 1, dtype=sx.dtype, device=sx.device)])
        out = _scaled_mm(qx, qw, sx, sw, torch.bfloat16)[:m].float()
    else:
        assert dequantized is not None
        out = (qx.float() * sx) @ dequantized.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype).reshape(*x.shape[:-1], n)


def fp8_linear_modules(model: nn.Module) -> dict[str, Fp8Linear]:
    """The model's linears that run in fp8 inside :func:`fp8_linears`, by name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}


def drop_emulation_copies(model: nn.Module) -> None:
    """Free the fp32 dequantised weights the emulation keeps (4 bytes per weight: 5 GB for the 1.3B's
    blocks), e.g. after comparing it with the kernel on a GPU; the fp8 weights stay."""
    for module in fp8_linear_modules(model).values():
        with module.fp8_weights.lock:
            module.fp8_weights.dequantized = None
