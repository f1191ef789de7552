"""engine/frames.py: the conversions at the engine's edge, against numpy's own arithmetic."""

from __future__ import annotations

import numpy as np
import torch

from engine.frames import frames_to_tensor, tensor_to_frames


def test_tensor_to_frames_matches_numpy_rounding_and_is_contiguous() -> None:
    generator = torch.Generator().manual_seed(0)
    frames = torch.randn(3, 4, 24, 40, generator=generator) * 0.8  # some values past [-1, 1]
    frames[0, 0, 0, :2] = torch.tensor([-3.0, 3.0])
    x = frames.permute(1, 2, 3, 0).numpy()
    expected = np.round((np.clip(x, -1, 1) + np.float32(1)) * np.float32(127.5)).astype(np.uint8)
    out = tensor_to_frames(frames)
    assert out.dtype == np.uint8 and out.shape == (4, 24, 40, 3) and out.flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(out, expected)
    assert out[0, 0, 0, 0] == 0 and out[0, 0, 1, 0] == 255


def test_uint8_frames_survive_the_round_trip() -> None:
    frames = np.random.default_rng(1).integers(0, 256, (2, 16, 8, 3), dtype=np.uint8)
    np.testing.assert_array_equal(tensor_to_frames(frames_to_tensor(frames)), frames)
    np.testing.assert_array_equal(tensor_to_frames(frames_to_tensor(frames).to(torch.bfloat16)).shape, frames.shape)
