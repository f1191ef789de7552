"""The per-chunk fidelity knobs the engine runs: one setting of every speed/quality knob for one chunk.

The engine owns this type (the runtime changes a stream's fidelity at a chunk boundary); the serving
policy (engine/serving) reads profiles of these configurations and picks one per chunk.

It is also the one place that says which knob values the engine can run on which device
(:func:`engine_capabilities`, :func:`unsupported_reason`): the runtime refuses what is missing and the
policy drops profile points that need it. Pure Python, so the policy and simulator import it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

# fp32 and bf16: the chunk's compute precision (bf16: autocast over fp32 weights, or bf16 weights).
# fp8: fp8 *attention* (SageAttention-style; no kernel yet, refused everywhere).
# fp8-linear: bf16 as above, and the DiT blocks' big linears (attention q/k/v/o, FFN) with float8 e4m3
# weights (per output channel scales) and activations (per token scales), engine/models/fp8.py; runs
# where torch's fp8 GEMM does (CUDA sm89+), emulated elsewhere for tests only.
# fp8-kv: bf16 as above, and the DiT's self-attention KV cache stored as float8 e4m3 with one scale per
# token and head (engine/models/wan_dit.py, KVCache), dequantised for attention: about half a bf16
# cache's bytes and a quarter of an fp32 one's; plain torch, so it runs on a CPU and on CUDA alike.
# fp8-linear-kv: fp8-linear and fp8-kv together.
PRECISIONS = ("fp32", "bf16", "fp8", "fp8-linear", "fp8-kv", "fp8-linear-kv")
FP8_LINEAR_PRECISION = "fp8-linear"
FP8_KV_PRECISION = "fp8-kv"
FP8_LINEAR_KV_PRECISION = "fp8-linear-kv"
# The one default: the precision every device runs. Commands' ``auto`` (engine.devices.resolve_precision)
# picks bf16 where the processor has bf16 units; profiles name each point's precision.
DEFAULT_PRECISION = "fp32"
# What a command's --precision takes: auto (engine.devices.resolve_precision) or a precision every device runs.
PRECISION_CHOICES = ("auto", "fp32", "bf16")


def fp8_linears_in(precision: str) -> bool:
    """Whether a chunk at ``precision`` runs the DiT's linears in fp8 (fp8-linear, fp8-linear-kv)."""
    return precision in (FP8_LINEAR_PRECISION, FP8_LINEAR_KV_PRECISION)


def fp8_kv_in(precision: str) -> bool:
    """Whether a stream at ``precision`` stores its KV cache in fp8 (fp8-kv, fp8-linear-kv)."""
    return precision in (FP8_KV_PRECISION, FP8_LINEAR_KV_PRECISION)


@dataclass(frozen=True, slots=True)
class FidelityConfig:
    """Every per-chunk knob the engine exposes; all can change at a chunk boundary.

    ``kv_window_frames`` counts latent frames kept in the rolling KV cache (sink frames included);
    ``precision`` is the compute precision of the chunk's forwards (bf16: autocast over fp32 weights
    for the VAE's encode and decode and the DiT; fp8 = SageAttention-style online quantisation of the
    attention, weights stay bf16 so switching needs no reload; fp8-linear = bf16 plus fp8 weights and
    activations in the DiT blocks' linears, the fp8 weights made once beside the others, so switching
    needs no reload either; fp8-kv = bf16 with the self-attention KV cache stored in fp8, converted at
    the chunk boundary where a stream switches to or from it; fp8-linear-kv = both); ``attention_sparsity`` is the fraction of
    attention blocks skipped; ``stream_batch`` is how many streams share one forward; ``step_batch``
    runs the denoising steps of a stream's successive chunks in one forward (StreamDiffusionV2's
    "stream batch", engine/streaming/stream_batch.py): one forward per chunk instead of ``steps``, at
    the price of ``steps - 1`` chunks of extra delay before a chunk's frames come out.
    """

    steps: int = 4
    kv_window_frames: int = 21
    resolution_scale: float = 1.0
    precision: str = DEFAULT_PRECISION
    attention_sparsity: float = 0.0
    stream_batch: int = 1
    gpus: int = 1
    step_batch: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.steps <= 4:
            raise ValueError(f"steps must be in 1..4, got {self.steps}")
        if self.kv_window_frames < 1:
            raise ValueError(f"kv_window_frames must be >= 1, got {self.kv_window_frames}")
        if not 0.0 < self.resolution_scale <= 1.0:
            raise ValueError(f"resolution_scale must be in (0, 1], got {self.resolution_scale}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if not 0.0 <= self.attention_sparsity < 1.0:
            raise ValueError(f"attention_sparsity must be in [0, 1), got {self.attention_sparsity}")
        if self.stream_batch < 1:
            raise ValueError(f"stream_batch must be >= 1, got {self.stream_batch}")
        if self.gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {self.gpus}")
        if self.step_batch and self.steps < 2:
            raise ValueError("step_batch needs 2 or more steps (it runs the steps of successive chunks together)")

    @property
    def sequential_steps(self) -> int:
        """Forwards a worker runs one after another for one chunk: every step, or one with the step batch."""
        return 1 if self.step_batch else self.steps

    def label(self) -> str:
        return (
            f"S{self.steps}/W{self.kv_window_frames}/x{self.resolution_scale:g}/{self.precision}"
            f"/sp{self.attention_sparsity:g}/b{self.stream_batch}" + (f"/g{self.gpus}" if self.gpus > 1 else "")
            + ("/sb" if self.step_batch else "")
        )


# Capability names: what running a configuration can need beyond the device itself. A profile point's
# "needs" lists these plus the torch device type it was made on ("cpu", "cuda").
BF16 = "bf16"
SPARSE_ATTENTION = "sparse-attention"
FP8_ATTENTION = "fp8-attention"
FP8_LINEAR = "fp8-linear"
FP8_KV = "fp8-kv"

_BF16_DEVICES = ("cpu", "cuda")
_FP8_KV_DEVICES = ("cpu", "cuda")  # where torch has float8_e4m3fn tensors (quantise, copy, dequantise)
_MISSING = {
    BF16: "bf16 is not available on {device}; use fp32",
    SPARSE_ATTENTION: "sparse attention is not available on {device}; use attention_sparsity 0",
    FP8_ATTENTION: (
        "fp8 attention needs a kernel this engine does not have yet (SageAttention or torch float8 on CUDA); "
        "use bf16 or fp32"
    ),
    FP8_LINEAR: (
        "fp8 linears need torch's fp8 GEMM (torch._scaled_mm with row-wise scales) on a CUDA GPU with fp8 "
        "units (compute capability 8.9+: Ada, Hopper); {device} has none here (the CPU only emulates it, "
        "for tests); use bf16"
    ),
    FP8_KV: "an fp8 KV cache needs torch float8 tensors, which {device} does not have here; use bf16",
}


def engine_capabilities(device_type: str, bf16_units: bool = True, fp8_units: bool = False) -> frozenset[str]:
    """What this engine runs on a torch device type ("cpu", "cuda", ...).

    The device type itself; bf16 on cpu and cuda, where the processor has bf16 units (``bf16_units``,
    ``engine.devices.has_bf16_units``: a CPU without them emulates bf16 more slowly than fp32 runs, so
    bf16 points profiled on one with them would promise a speed it does not have); block-sparse
    attention everywhere (the DiT's pure-torch reference implementation); fp8 attention nowhere yet;
    fp8 linears on CUDA where the GPU runs torch's fp8 GEMM (``fp8_units``,
    ``engine.models.fp8.fp8_linear_supported``; default False, so a caller that does not know drops
    those points). A CPU never reports them: its emulation is a test path, slower than bf16. An fp8 KV
    cache on cpu and cuda: it is plain torch (quantise on write, dequantise on read), no kernel.
    """
    caps = {device_type, SPARSE_ATTENTION}
    if device_type in _BF16_DEVICES and bf16_units:
        caps.add(BF16)
    if device_type in _FP8_KV_DEVICES:
        caps.add(FP8_KV)
    if device_type == "cuda" and fp8_units:
        caps.add(FP8_LINEAR)
    return frozenset(caps)


def required_capabilities(config: FidelityConfig) -> frozenset[str]:
    """What running ``config`` needs from the engine, whatever the device (fp32 and dense need nothing)."""
    needs = set()
    if config.precision == "bf16":
        needs.add(BF16)
    elif config.precision == "fp8":
        needs.add(FP8_ATTENTION)
    elif config.precision != "fp32":  # the fp8 knobs: the rest of the chunk computes in bf16
        needs.add(BF16)
    if fp8_linears_in(config.precision):
        needs.add(FP8_LINEAR)
    if fp8_kv_in(config.precision):
        needs.add(FP8_KV)
    if config.attention_sparsity > 0.0:
        needs.add(SPARSE_ATTENTION)
    return frozenset(needs)


def missing_capabilities(config: FidelityConfig, device_type: str, fp8_units: bool = False) -> frozenset[str]:
    """What ``config`` needs that the engine lacks on ``device_type`` (empty: it runs); ``fp8_units`` as in
    :func:`engine_capabilities`."""
    return required_capabilities(config) - engine_capabilities(device_type, fp8_units=fp8_units)


def unsupported_reason(config: FidelityConfig, device_type: str, fp8_units: bool = False) -> str | None:
    """Why the engine cannot run ``config`` on ``device_type``, in plain words; None when it can."""
    missing = missing_capabilities(config, device_type, fp8_units)
    if not missing:
        return None
    return "; ".join(_MISSING[name].format(device=device_type) for name in sorted(missing))
