"""Carry a stream's state to another engine size at a chunk boundary (a mid-stream resolution change).

The engine runs the model at the stream's size times ``FidelityConfig.resolution_scale``; everything a
stream caches between chunks at that size is moved to the new size here, so the stream goes on with
its context instead of restarting:

* DiT KV caches: keys are cached after the 3D RoPE rotation, so each cached frame's keys are first
  rotated back along rows and columns (the frame part stays: positions along time do not change),
  keys and values are resampled on the token grid (area average when shrinking, bilinear when
  growing), and the keys are rotated again for their positions on the new grid. Sinks, window and
  fill level (``local_end``, ``global_end``) stay as they are; only ``frame_tokens`` changes. An fp8
  cache (precision fp8-kv) is dequantised first and quantised again after.
* Stream VAE caches (encoder and decoder): every cached feature map is resampled; each one's spatial
  size is the frame size divided by its level's downsampling, so it scales with the frame size.
* The noise controller's last input frame, which is kept at the engine size.
* The temporal stabilizer's history (last input frame and last shown frame), which it keeps at the
  engine size too (it filters the decoded frames before they are fitted to the stream's size), so a
  rung change goes on filtering instead of starting a fresh history.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.models.taehv import TAEHVCache
from engine.models.tiny_vae import TinyVAECache
from engine.models.wan_dit import KVCache, WanDiTConfig, apply_rope, grid_rope_tables, unapply_rope
from engine.models.wan_vae import WanVAECache
from engine.streaming.state import StreamState

log = logging.getLogger(__name__)

Size = tuple[int, int]  # (width, height) in pixels


def rescale_state(state: StreamState, dit_config: WanDiTConfig, spatial_compression: int, engine_size: Size) -> None:
    """Move ``state``'s caches from ``state.engine_size`` to ``engine_size`` (width, height), in place.

    ``spatial_compression`` is the stream VAE's (pixels per latent cell). Call it between chunks only:
    a chunk in flight holds latents of the old size.
    """
    old = state.engine_size
    if old is None:
        raise ValueError(f"stream {state.stream_id}: its caches have no engine size recorded, nothing to rescale from")
    if old == engine_size:
        return
    old_grid = token_grid(dit_config, spatial_compression, old)
    new_grid = token_grid(dit_config, spatial_compression, engine_size)
    state.kv = [rescale_kv_cache(cache, dit_config, old_grid, new_grid) for cache in state.kv]
    state.vae_encoder = rescale_vae_cache(state.vae_encoder, old, engine_size)
    state.vae_decoder = rescale_vae_cache(state.vae_decoder, old, engine_size)
    controller = state.noise_controller
    if controller.last_frame is not None:
        controller.last_frame = resample_grid(controller.last_frame, (engine_size[1], engine_size[0]))
    history = state.stabilizer
    if history.prev_in is not None and history.prev_out is not None:
        rows_cols = (engine_size[1], engine_size[0])
        history.prev_in = _resample_image(history.prev_in, rows_cols).round().clamp(0, 255).to(torch.uint8)
        history.prev_out = _resample_image(history.prev_out, rows_cols)
    state.engine_size = engine_size
    log.info("stream %s: engine size %dx%d -> %dx%d after %d chunks", state.stream_id, *old, *engine_size, state.chunks)


def token_grid(dit_config: WanDiTConfig, spatial_compression: int, engine_size: Size) -> tuple[int, int]:
    """(rows, columns) of DiT tokens per latent frame at an engine size (width, height)."""
    w, h = engine_size
    ph, pw = dit_config.patch_size[1:]
    if w % (spatial_compression * pw) or h % (spatial_compression * ph):
        raise ValueError(f"engine size {w}x{h} is not a multiple of the VAE cell times the patch size")
    return h // spatial_compression // ph, w // spatial_compression // pw


def rescale_kv_cache(cache: KVCache, dit_config: WanDiTConfig, old_grid: tuple[int, int],
                     new_grid: tuple[int, int]) -> KVCache:
    """A copy of ``cache`` with every filled frame moved from the ``old_grid`` to the ``new_grid`` of tokens.

    Grids are (rows, columns) of tokens per frame; tokens are in frame, row, column order.
    """
    rows, cols = old_grid
    if rows * cols != cache.frame_tokens:
        raise ValueError(f"a {rows}x{cols} token grid does not match the cache's {cache.frame_tokens} tokens per frame")
    if new_grid == old_grid:
        return cache.to()
    if cache.fp8:  # resampled in float32, stored in fp8 again with each new token's own scales
        return rescale_kv_cache(cache.to(dtype=torch.float32), dit_config, old_grid, new_grid).to(dtype=cache.dtype)
    device = cache.k[0].device if cache.k else torch.device("cpu")
    old_rope = grid_rope_tables(dit_config, rows, cols, device)
    new_rope = grid_rope_tables(dit_config, *new_grid, device)
    new_tokens = new_grid[0] * new_grid[1]

    def move(buffer: Tensor, keys: bool) -> Tensor:
        out = buffer.new_zeros((buffer.shape[0], cache.window_frames * new_tokens, *buffer.shape[2:]))
        if cache.local_end == 0:
            return out
        filled = buffer[:, : cache.local_end * cache.frame_tokens].float()
        if keys:
            filled = unapply_rope(filled.unflatten(1, (cache.local_end, -1)), *old_rope).flatten(1, 2)
        frames = _resample_frames(filled, cache.local_end, old_grid, new_grid)
        if keys:
            frames = apply_rope(frames.unflatten(1, (cache.local_end, -1)), *new_rope).flatten(1, 2)
        out[:, : frames.shape[1]] = frames.to(buffer.dtype)
        return out

    k = [move(t, keys=True) for t in cache.k]
    v = [move(t, keys=False) for t in cache.v]
    return dataclasses.replace(cache, k=k, v=v, frame_tokens=new_tokens, global_end=list(cache.global_end))


def _resample_frames(tokens: Tensor, frames: int, old_grid: tuple[int, int], new_grid: tuple[int, int]) -> Tensor:
    """``[B, frames*rows*cols, heads, hd]`` -> ``[B, frames*rows'*cols', heads, hd]``, each frame resampled."""
    b, _, heads, hd = tokens.shape
    # [B*F, rows, cols, heads*hd] viewed as NCHW is a channels-last tensor: no copy, and interpolation is
    # several times faster in that layout than with one channel per map.
    grid = tokens.reshape(b * frames, *old_grid, heads * hd).permute(0, 3, 1, 2)
    out = resample_grid(grid, new_grid)
    return out.permute(0, 2, 3, 1).reshape(b, frames * new_grid[0] * new_grid[1], heads, hd)


def rescale_vae_cache(cache: object, old_size: Size, new_size: Size) -> object:
    """A stream VAE's encoder or decoder cache with its feature maps moved from ``old_size`` to ``new_size``.

    Knows the tiny VAE's (the previous frame's features, ``[B, C, H/8, W/8]``), the Wan 2.1 VAE's
    (each causal conv's last input frames, ``[B, C, T, h, w]`` at its level's resolution) and TAEHV's
    (each memory block's last input, ``[B, C, h, w]`` at its level's). ``None`` (no cache held here)
    passes through.
    """
    if cache is None:
        return None
    if isinstance(cache, TinyVAECache):
        if cache.extra:
            raise ValueError(f"cannot rescale a TinyVAECache whose extra tensors {sorted(cache.extra)} have no known layout")
        prev = None if cache.prev is None else _resample_feature_map(cache.prev, old_size, new_size)
        return dataclasses.replace(cache, prev=prev, extra={})
    if isinstance(cache, WanVAECache):
        tensors = {name: _resample_feature_map(t, old_size, new_size) for name, t in cache.tensors.items()}
        return WanVAECache(cache.kind, tensors, cache.frames_seen)
    if isinstance(cache, TAEHVCache):  # each memory block's last input, [B, C, h, w] at its level
        memory = {name: _resample_feature_map(t, old_size, new_size) for name, t in cache.memory.items()}
        return TAEHVCache(cache.kind, memory, cache.frames_seen)
    raise TypeError(f"cannot rescale a VAE cache of type {type(cache).__name__}: its tensor layout is not known")


def _resample_feature_map(t: Tensor, old_size: Size, new_size: Size) -> Tensor:
    """A feature map ``[..., h, w]`` of a frame of ``old_size``, resampled to the same level of ``new_size``."""
    h, w = t.shape[-2:]
    (old_w, old_h), (new_w, new_h) = old_size, new_size
    if (h * new_h) % old_h or (w * new_w) % old_w:
        raise ValueError(f"a {h}x{w} cache map of a {old_w}x{old_h} frame has no exact size at {new_w}x{new_h}")
    return resample_grid(t, (h * new_h // old_h, w * new_w // old_w))


def _resample_image(image: Tensor, size: tuple[int, int]) -> Tensor:
    """An [H, W, C] image (the stabilizer's layout) resampled to ``size`` (rows, cols), in float32."""
    return resample_grid(image.float().permute(2, 0, 1), size).permute(1, 2, 0).contiguous()


def resample_grid(x: Tensor, size: tuple[int, int]) -> Tensor:
    """Resample the last two dims of ``x`` to ``size`` (rows, cols): area average down, bilinear up.

    Every map (each index of the leading dims) is resampled on its own. When one axis shrinks and the
    other grows, each axis gets its own pass with its own mode, so the shrinking one is never
    point-sampled. Computed in float32, returned in ``x``'s dtype; a 4D ``x`` keeps its memory format.
    """
    h, w = x.shape[-2:]
    if (h, w) == size:
        return x.clone()
    lead = x.shape[:-2]
    if x.numel() == 0:  # e.g. a Wan upsampler's "started, no history yet" marker: no frames to move
        return x.new_zeros((*lead, *size))
    out = x.float() if x.ndim == 4 else x.float().reshape(1, math.prod(lead), h, w)
    if (size[0] <= h) != (size[1] <= w):
        out = _interpolate(out, (size[0], w))
    out = _interpolate(out, size)
    return out.reshape(*lead, *size).to(x.dtype)


def _interpolate(x: Tensor, size: tuple[int, int]) -> Tensor:
    h, w = x.shape[-2:]
    if (h, w) == size:
        return x
    if size[0] <= h and size[1] <= w:
        return F.interpolate(x, size=size, mode="area")
    return F.interpolate(x, size=size, mode="bilinear", align_corners=False)
