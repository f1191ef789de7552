"""Which processors do bf16 natively (the serving policy keeps bf16 rungs only there: tests/test_profiler.py)."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from engine.devices import has_bf16_units


def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"),
                    reason="the kernel's CPU flags are read on x86 Linux")
def test_bf16_units_are_what_the_kernel_reports() -> None:
    flags = _cpu_flags()
    assert has_bf16_units("cpu") == bool(flags & {"avx512_bf16", "amx_bf16"})

