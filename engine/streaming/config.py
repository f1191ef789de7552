"""Configuration of the live stream runtime (StreamDiffusionV2 §4 controls, reference defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.models.wan_dit import SPARSE_BLOCK_TOKENS
from engine.streaming.deblock import DeblockConfig
from engine.streaming.noise import NoiseControllerConfig
from engine.streaming.stabilizer import LookStabilizers, StabilizerConfig

CacheMode = Literal["clean", "per-step"]


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything about *how* a stream is generated that is not a per-chunk fidelity choice.

    cache_mode:
      - "clean": one KV cache; after a chunk is denoised, one more forward on the clean x̂₀ at t = 0
        writes clean K/V for it (CausVid / Self-Forcing).
      - "per-step": one KV cache per denoising step, each written by that step's forward and no
        clean pass (StreamDiffusionV2). This is what makes the stream batch possible: the slot at
        step i only ever reads and writes cache i, so the n steps of n successive chunks run in one
        batched forward with results identical to running them one after another.
    """

    chunk_latent_frames: int = 1  # V2V: 1 latent frame = 4 pixel frames per chunk
    kv_window_frames: int = 6  # latent frames kept in the rolling KV cache, sinks included
    sink_frames: int = 3
    cache_mode: CacheMode = "per-step"
    sink_refresh: bool = True
    sink_tau: float = 0.2  # refresh the least similar sink when its cosine similarity is below this
    rope_refresh: bool = True
    rope_reset_frame: int = 50  # once the RoPE frame position passes this, wrap it back into the window
    noise: NoiseControllerConfig = field(default_factory=NoiseControllerConfig)
    # Key block size of block-sparse attention (FidelityConfig.attention_sparsity > 0), in tokens.
    sparse_block_tokens: int = SPARSE_BLOCK_TOKENS
    # Motion-compensated filter on the decoded frames (engine/streaming/stabilizer.py); None = off.
    # Off by default: the reference recipe is StreamDiffusionV2's; a model config turns it on.
    stabilizer: StabilizerConfig | None = None
    # Its setting per look, for a look-anchored model (LookStabilizers); None: ``stabilizer`` for every stream.
    stabilizer_looks: LookStabilizers | None = None
    # Ramps over the steps on the VAE's block grid of the decoded frames (engine/streaming/deblock.py),
    # before the stabilizer; None = off. A model whose decoder draws blocks (the embedded one) turns it on.
    deblock: DeblockConfig | None = None

    def __post_init__(self) -> None:
        if self.chunk_latent_frames < 1:
            raise ValueError("chunk_latent_frames must be >= 1")
        if self.sink_frames < 0 or self.sink_frames >= self.kv_window_frames:
            raise ValueError(
                f"sink_frames must be in [0, kv_window_frames={self.kv_window_frames}), got {self.sink_frames}"
            )
        if self.kv_window_frames < self.sink_frames + self.chunk_latent_frames:
            raise ValueError("the KV window must hold the sinks plus one chunk")
        if self.cache_mode not in ("clean", "per-step"):
            raise ValueError(f"cache_mode must be 'clean' or 'per-step', got {self.cache_mode!r}")
        if self.stabilizer_looks is not None and self.stabilizer is None:
            raise ValueError("per-look stabilizer settings need the stabilizer on (a 'stabilizer' setting)")
        if self.sparse_block_tokens < 1:
            raise ValueError(f"sparse_block_tokens must be >= 1, got {self.sparse_block_tokens}")
        if self.rope_reset_frame <= self.kv_window_frames:
            raise ValueError("rope_reset_frame must exceed the KV window")
