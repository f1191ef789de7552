"""engine/frames.py: the conversions at the engine's edge, against numpy's own arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
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


def test_uint8_frames_are_a_view_of_the_camera_buffer_and_convert_as_the_float_path() -> None:
    from engine.frames import frames_as_uint8, unit_range

    frames = np.random.default_rng(2).integers(0, 256, (3, 8, 12, 3), dtype=np.uint8)
    view = frames_as_uint8(frames, 3)
    assert view.dtype == torch.uint8 and view.shape == (3, 3, 8, 12)
    assert view.data_ptr() == frames.__array_interface__["data"][0]  # no copy
    expected = frames.transpose(3, 0, 1, 2).astype(np.float32) / np.float32(127.5) - np.float32(1)
    np.testing.assert_allclose(unit_range(view).numpy(), expected, atol=1e-6)
    floats = frames_to_tensor(frames)
    assert unit_range(floats) is floats
    with pytest.raises(ValueError, match="needs 2 frames"):
        frames_as_uint8(frames, 2)
