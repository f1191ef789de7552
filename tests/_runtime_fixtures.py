"""Tiny real components for runtime tests: the engine's own DiT and Wan VAE at test size.

The text encoder here maps each prompt to a fixed pseudo-random embedding (seeded by the prompt):
the runtime's behaviour does not depend on what the text means, only on the conditioning changing.
"""

from __future__ import annotations

import hashlib

import torch

from engine.fidelity import FidelityConfig
from engine.models.tiny_vae import TinyVAE, TinyVAEConfig
from engine.models.wan_dit import CONFIGS, CausalWanDiT
from engine.models.wan_vae import WanVAE, WanVAEConfig
from engine.sampling import STREAMDIFFUSION_V2
from engine.streaming.config import RuntimeConfig
from engine.streaming.runtime import PromptEncoder, StreamRuntime


class HashTextEncoder:
    dim = CONFIGS["tiny"].text_dim
    max_length = 4

    def encode(self, prompts: list[str]) -> torch.Tensor:
        rows = []
        for p in prompts:
            seed = int.from_bytes(hashlib.sha256(p.encode()).digest()[:4], "little")
            g = torch.Generator().manual_seed(seed)
            rows.append(torch.randn(1, self.max_length, self.dim, generator=g))
        return torch.cat(rows)


def tiny_runtime(guided_vae: bool = False, **config: object) -> StreamRuntime:
    """The tiny DiT and Wan VAE; ``guided_vae``: a tiny VAE whose decoder reads the input frames instead."""
    torch.manual_seed(0)
    dit = CausalWanDiT(CONFIGS["tiny"]).eval()
    vae: WanVAE | TinyVAE = guided_tiny_vae() if guided_vae else WanVAE(WanVAEConfig.tiny()).eval()
    return StreamRuntime(dit, vae, PromptEncoder(HashTextEncoder()), STREAMDIFFUSION_V2, RuntimeConfig(**config))  # type: ignore[arg-type]


def guided_tiny_vae() -> TinyVAE:
    """A tiny VAE for the tiny DiT whose decoder reads the input frames, every path (the guide paths
    start at zero) random, so the picture depends on the input frames beyond the latents."""
    vae = TinyVAE(TinyVAEConfig(latent_channels=CONFIGS["tiny"].in_channels, enc_channels=8, dec_channels=8,
                                guided=True, guide_basis=2))
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return vae.eval()


def fidelity(steps: int = 2, window: int = 6) -> FidelityConfig:
    return FidelityConfig(steps=steps, kv_window_frames=window, precision="fp32")


def clip(chunks: int, size: int = 32, seed: int = 0) -> list[torch.Tensor]:
    """A moving gradient: first chunk 1 frame, then 4-frame chunks, pixels in [-1, 1]."""
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(3, size, size, generator=g) * 2 - 1
    out, t = [], 0
    for c in range(chunks):
        n = 1 if c == 0 else 4
        frames = torch.stack([torch.roll(base, shifts=t + i, dims=2) for i in range(n)], dim=1)
        out.append(frames)
        t += n
    return out
