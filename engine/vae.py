"""The one VAE interface every stream VAE implements (Wan 2.1 VAE, the tiny embedded VAE).

A stream VAE is driven chunk by chunk. All temporal context lives in an explicit cache object
owned by the caller (the stream state), so a stream can be moved, offloaded or serialised.
Pixels are float tensors in [-1, 1], shape [B, 3, T, H, W]; latents are *normalised*
(zero-mean, unit-variance per channel), shape [B, C, t, h, w].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
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


def check_chunk_frames(frames: torch.Tensor, frames_seen: int, temporal_compression: int,
                       spatial_compression: int) -> None:
    """A ValueError in plain words unless ``frames`` is a chunk ``encode_chunk`` takes after ``frames_seen``
    frames of its stream: [B, 3, T, H, W], H and W multiples of the spatial compression, T = 1 + k·tc on a
    stream's first chunk and k·tc afterwards."""
    tc, sc = temporal_compression, spatial_compression
    if frames.ndim != 5 or frames.shape[1] != 3:
        raise ValueError(f"frames must be [B, 3, T, H, W], got {tuple(frames.shape)}")
    t, h, w = frames.shape[2:]
    if h % sc or w % sc:
        raise ValueError(f"frame height and width must be multiples of {sc}, got {h}x{w}")
    first = frames_seen == 0
    if t == 0 or (t % tc != 1 if first else t % tc != 0):
        want = f"1 + {tc}k frames on a stream's first chunk" if first else f"a multiple of {tc} frames"
        raise ValueError(f"encode_chunk needs {want} (frames seen so far: {frames_seen}), got {t}")


# Several streams' chunks through one VAE call ---------------------------------------------------------
#
# The DiT already runs several users' chunks as one batch; the VAE ran once per stream (four streams took
# 4.2x one stream's encode and decode on an H100, the DiT 2.7x). A stream's cache is a dataclass of
# tensors with a batch dimension of one; caches at the same point of their streams (same frames seen, same
# keys and shapes) stack along that dimension, run as one, and split back into each stream's own cache
# object, so the result is the per-stream calls' up to the rounding a larger batch may take.


class CacheMismatchError(ValueError):
    """Caches that are not at the same point of their streams cannot share one call."""


def encode_batch(vae: StreamVAE, frames: torch.Tensor, caches: Sequence[Any]) -> torch.Tensor:
    """``frames`` [B, 3, T, H, W], row ``i`` the next chunk of the stream whose cache is ``caches[i]``:
    one encode call for all of them; each cache updated as its own call would."""
    if len(caches) == 1:
        return vae.encode_chunk(frames, caches[0])
    merged = stack_caches(caches)
    out = vae.encode_chunk(frames, merged)
    unstack_cache(merged, caches)
    return out


def decode_batch(vae: StreamVAE, latents: torch.Tensor, caches: Sequence[Any],
                 guide: torch.Tensor | None = None) -> torch.Tensor:
    """The decoding counterpart of :func:`encode_batch` (``guide`` row ``i`` for stream ``i``)."""
    if len(caches) == 1:
        return vae.decode_chunk(latents, caches[0], guide)
    merged = stack_caches(caches)
    out = vae.decode_chunk(latents, merged, guide)
    unstack_cache(merged, caches)
    return out


def stack_caches(caches: Sequence[Any]) -> Any:
    """One cache whose tensors are the caches' tensors stacked along the batch dimension."""
    first = caches[0]
    if not dataclasses.is_dataclass(first) or isinstance(first, type):
        raise TypeError(f"a stream VAE cache must be a dataclass, got {type(first).__name__}")
    values = {}
    for f in dataclasses.fields(first):
        column = [getattr(c, f.name) for c in caches]
        values[f.name] = _stack(f.name, column)
    return type(first)(**values)


def unstack_cache(merged: Any, caches: Sequence[Any]) -> None:
    """Write row ``i`` of ``merged`` back into ``caches[i]`` (its own object: the stream state keeps it).
    Rows are copies, not views of the stacked tensor, so each stream's cache owns its memory (parking one
    stream copies its rows only, and the batch's tensor is freed)."""
    for f in dataclasses.fields(merged):
        value = getattr(merged, f.name)
        for i, cache in enumerate(caches):
            setattr(cache, f.name, _row(value, i))


def _stack(name: str, column: list[Any]) -> Any:
    first = column[0]
    if isinstance(first, torch.Tensor):
        if any(not isinstance(v, torch.Tensor) or v.shape != first.shape for v in column):
            raise CacheMismatchError(f"cache field {name!r} differs in shape between streams")
        return torch.cat(column)
    if isinstance(first, dict):
        if any(not isinstance(v, dict) or v.keys() != first.keys() for v in column):
            raise CacheMismatchError(f"cache field {name!r} holds other keys in different streams")
        return {k: _stack(f"{name}.{k}", [v[k] for v in column]) for k in first}
    if any(v != first for v in column):  # frames seen, kind, None: the streams must be at the same point
        raise CacheMismatchError(f"cache field {name!r} differs between streams: {column}")
    return first


def _row(value: Any, i: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[i : i + 1].clone()
    if isinstance(value, dict):
        return {k: _row(v, i) for k, v in value.items()}
    return value
