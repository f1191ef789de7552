"""The one VAE interface every stream VAE implements (Wan 2.1 VAE, the tiny embedded VAE).

A stream VAE is driven chunk by chunk. All temporal context lives in an explicit cache object
owned by the caller (the stream state), so a stream can be moved, offloaded or serialised.
Pixels are float tensors in [-1, 1], shape [B, 3, T, H, W]; latents are *normalised*
(zero-mean, unit-variance per channel), shape [B, C, t, h, w].
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class StreamVAE(Protocol):
    latent_channels: int
    temporal_compression: int  # pixel frames per latent frame in steady state (Wan: 4)
    spatial_compression: int  # pixels per latent cell along H and W (Wan: 8)

    def new_encoder_cache(self) -> Any:
        """Fresh causal state for encoding one stream."""

    def new_decoder_cache(self) -> Any:
        """Fresh causal state for decoding one stream."""

    def encode_chunk(self, frames: torch.Tensor, cache: Any) -> torch.Tensor:
        """Encode the next pixel frames of a stream; updates ``cache`` in place.

        The first call of a stream takes 1 + k*temporal_compression frames (Wan: 1 frame, then 4s);
        later calls take multiples of ``temporal_compression``.
        """

    @property
    def reads_input(self) -> bool:
        """Whether the decoder also reads the chunk's input frames (``decode_chunk``'s ``guide``)."""

    def decode_chunk(self, latents: torch.Tensor, cache: Any, guide: torch.Tensor | None = None) -> torch.Tensor:
        """Decode the next latent frames of a stream; updates ``cache`` in place.

        A stream's first latent frame decodes to 1 pixel frame, every later one to
        ``temporal_compression`` frames (Wan: 1, then 4 per latent). ``guide``: the chunk's input frames
        as ``encode_chunk`` took them, for a decoder that ``reads_input`` (others refuse it).
        """
