"""Frames at the engine's edge: uint8 RGB ``[T, H, W, 3]`` (what cameras, files and codecs carry) and
float ``[3, T, H, W]`` in [-1, 1] (what the VAE takes; the runtime also takes uint8 ``[3, T, H, W]``)."""

from __future__ import annotations

import numpy as np
import torch


def _checked(frames: np.ndarray, expected: int | None) -> np.ndarray:
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8:
        raise ValueError(f"frames must be a uint8 numpy array, got {type(frames).__name__} {getattr(frames, 'dtype', '')}")
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be [T, H, W, 3] RGB, got shape {frames.shape}")
    if expected is not None and frames.shape[0] != expected:
        raise ValueError(f"this chunk needs {expected} frames, got {frames.shape[0]}")
    return np.ascontiguousarray(frames)


def frames_to_tensor(frames: np.ndarray, expected: int | None = None) -> torch.Tensor:
    """uint8 [T, H, W, 3] -> float [3, T, H, W] in [-1, 1], with clear errors for odd input."""
    return unit_range(frames_as_uint8(frames, expected))


def frames_as_uint8(frames: np.ndarray, expected: int | None = None) -> torch.Tensor:
    """uint8 [T, H, W, 3] -> uint8 [3, T, H, W], a view of the same pixels (no copy), with
    :func:`frames_to_tensor`'s checks. The runtime takes it as it takes float frames and fits it to
    the engine size before converting: below resolution scale 1 the float passes then run on a
    quarter of the pixels or fewer, and the resize on bytes (``StreamRuntime.enter_chunks``)."""
    return torch.from_numpy(_checked(frames, expected)).permute(3, 0, 1, 2)


def unit_range(frames: torch.Tensor) -> torch.Tensor:
    """Frames [3, T, H, W] as float in [-1, 1]: uint8 ones scaled, float ones as they are."""
    if frames.dtype == torch.uint8:
        return frames.float().div_(127.5).sub_(1.0)
    return frames


def tensor_to_frames(frames: torch.Tensor) -> np.ndarray:
    """float [3, T, H, W] in [-1, 1] -> uint8 [T, H, W, 3] (contiguous, so OpenCV takes it as is)."""
    # The arithmetic runs in place on a channels-last buffer, so the transpose is one strided copy of
    # floats and the uint8 result is contiguous as it stands: 2.5x faster than transposing the uint8
    # result at the end (it runs twice per chunk on the engine thread), bit-identical.
    source = frames.detach().float()
    out = torch.empty((*source.shape[1:], source.shape[0]), dtype=torch.float32, device=source.device)
    torch.clamp(source, -1, 1, out=out.permute(3, 0, 1, 2))
    return out.add_(1.0).mul_(127.5).round_().to(torch.uint8).cpu().numpy()
