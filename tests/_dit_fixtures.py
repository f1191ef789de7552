"""Shared fixture of the DiT/checkpoint tests."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

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


def write_random_lora(path: Path, model: torch.nn.Module, modules: Sequence[str], rank: int = 2, alpha: float = 1.0,
                      seed: int = 7, size: float = 0.2) -> dict[str, torch.Tensor]:
    """A LoRA file in the original Wan layout (``diffusion_model.<module>.lora_down/lora_up/alpha``) with
    random factors on ``modules`` of every block; returns the weight deltas at strength 1 (ΔW = alpha/rank·BA)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    blocks = len(model.get_submodule("blocks"))
    for block in range(blocks):
        for module in modules:
            name = f"blocks.{block}.{module}"
            out_f, in_f = model.get_submodule(name).weight.shape
            down, up = torch.randn(rank, in_f, generator=g) * size, torch.randn(out_f, rank, generator=g) * size
            tensors.update({f"diffusion_model.{name}.lora_down.weight": down,
                            f"diffusion_model.{name}.lora_up.weight": up,
                            f"diffusion_model.{name}.alpha": torch.tensor(alpha)})
            deltas[name + ".weight"] = alpha / rank * up @ down
    save_file(tensors, str(path))
    return deltas
