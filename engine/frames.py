"""Frames at the engine's edge: uint8 RGB ``[T, H, W, 3]`` (what cameras, files and codecs carry) and
float ``[3, T, H, W]`` in [-1, 1] (what the VAE and the runtime take)."""

from __future__ import annotations

import numpy as np
import torch


def frames_to_tensor(frames: np.ndarray, expected: int | None = None) -> torch.Tensor:
    """uint8 [T, H, W, 3] -> float [3, T, H, W] in [-1, 1], with clear errors for odd input."""
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8:
        raise ValueError(f"frames must be a uint8 numpy array, got {type(frames).__name__} {getattr(frames, 'dtype', '')}")
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be [T, H, W, 3] RGB, got shape {frames.shape}")
    if expected is not None and frames.shape[0] != expected:
        raise ValueError(f"this chunk needs {expected} frames, got {frames.shape[0]}")
    return torch.from_numpy(np.ascontiguousarray(frames)).permute(3, 0, 1, 2).float().div(127.5).sub(1.0)


def tensor_to_frames(frames: torch.Tensor) -> np.ndarray:
    """float [3, T, H, W] in [-1, 1] -> uint8 [T, H, W, 3] (contiguous, so OpenCV takes it as is)."""
    out = frames.detach().float().clamp(-1, 1).add(1.0).mul(127.5).round().to(torch.uint8)
    return np.ascontiguousarray(out.permute(1, 2, 3, 0).cpu().numpy())
