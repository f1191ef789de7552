"""Shared fixture of the DiT/checkpoint tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def dit_single_thread() -> Iterator[None]:
    """Tiny models on 2 shared cores: intra-op threads only contend (measured ~60x slower forwards)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
