"""Which torch device and weight dtype a command runs on, and how much memory that device has free.

The CLI's ``--device`` and ``--dtype`` flags go through here so that asking for CUDA on a machine
without it fails at once with a sentence saying so, instead of deep inside the first forward.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from engine.fidelity import PRECISION_CHOICES

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N`` as a torch device; a ValueError naming what is missing otherwise."""
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {name!r} ({exc}); use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device {name!r} is not supported here; use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {name!r}: CUDA is not available on this machine (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda or 'none'}, {torch.cuda.device_count()} GPUs visible); use --device cpu"
        )
    index = device.index or 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA devices are visible")
    return torch.device("cuda", index)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` = bf16 on CUDA (how the Wan models are served) and fp32 elsewhere (bf16 matmuls are slow
    on CPUs without bf16 units); or one of :data:`DTYPES` by name."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def has_bf16_units(device: torch.device | str) -> bool:
    """Whether bf16 math is native on ``device``: always on CUDA; on a CPU, AVX512-BF16 or AMX (x86).
    Elsewhere bf16 runs emulated, slower than fp32 (``engine.fidelity.engine_capabilities``)."""
    if torch.device(device).type != "cpu":
        return True
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def resolve_precision(name: str, device: torch.device | str) -> str:
    """A chunk precision for a command's ``--precision``: ``auto`` = bf16 where the device does bf16
    natively (:func:`has_bf16_units`; the same quality against the embedded model's teachers, docs/
    default-model.md), else fp32; ``fp32`` or ``bf16`` as given."""
    if name == "auto":
        return "bf16" if has_bf16_units(device) else "fp32"
    if name not in PRECISION_CHOICES:
        raise ValueError(f"precision must be one of {', '.join(PRECISION_CHOICES)}, got {name!r}")
    return name


def dtype_name(dtype: torch.dtype) -> str:
    return next((name for name, d in DTYPES.items() if d == dtype), str(dtype).removeprefix("torch."))


def available_memory_bytes(device: torch.device | str) -> int | None:
    """Bytes a new allocation can take on ``device`` now: free CUDA memory, or the host's MemAvailable
    (Linux) / free pages; None where it cannot be known (meta: nothing is ever allocated)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def weight_bytes(*models: object) -> int:
    """Bytes of the parameters and buffers of those of ``models`` that are torch modules."""
    return sum(t.numel() * t.element_size() for m in models if isinstance(m, torch.nn.Module)
               for t in (*m.parameters(), *m.buffers()))


def stream_memory(runtime: object) -> tuple[int | None, int]:
    """For admission (engine/serving/device_memory.py): the bytes free on the runtime's device for
    stream states, None on a CPU (host memory is not budgeted unless the operator sets one), and the
    bytes its model's weights take there."""
    device = runtime.device  # type: ignore[attr-defined]
    weights = weight_bytes(runtime.dit, runtime.vae)  # type: ignore[attr-defined]
    return (available_memory_bytes(device) if device.type == "cuda" else None), weights
