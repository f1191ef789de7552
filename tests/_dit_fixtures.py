"""Shared fixture of the DiT/checkpoint tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.models.wan_dit import WanDiTConfig


@pytest.fixture(scope="module", autouse=True)
def dit_single_thread() -> Iterator[None]:
    """Tiny models on 2 shared cores: intra-op threads only contend (measured ~60x slower forwards)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def diffusers_wan(cfg: WanDiTConfig) -> torch.nn.Module:
    """diffusers' Wan 2.1 T2V transformer with ``cfg``'s hyperparameters (default random init, eval mode)."""
    from diffusers import WanTransformer3DModel  # imported here: most DiT tests never need diffusers

    return WanTransformer3DModel(
        patch_size=cfg.patch_size, num_attention_heads=cfg.num_heads, attention_head_dim=cfg.head_dim,
        in_channels=cfg.in_channels, out_channels=cfg.out_channels, text_dim=cfg.text_dim, freq_dim=cfg.freq_dim,
        ffn_dim=cfg.ffn_dim, num_layers=cfg.num_layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=cfg.eps,
    ).eval()
