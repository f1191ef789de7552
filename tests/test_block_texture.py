"""The block-texture measure against pictures built for it and against a loop over every boundary."""

from __future__ import annotations

import numpy as np
import pytest

from engine.embedded.block_texture import grid_energy_ratio


def _smooth(size: int = 128, seed: int = 0) -> np.ndarray:
    """A picture with detail at every scale and no grid: sums of sinusoids with off-grid periods."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    img = np.zeros((size, size, 3))
    for _ in range(12):
        fx, fy = rng.uniform(-0.6, 0.6, 2)
        img += rng.uniform(5, 20, 3) * np.sin(fx * xx + fy * yy + rng.uniform(0, 6.3))[..., None]
    return img + 128


def _blocks(size: int, period: int, offset: int, seed: int = 1) -> np.ndarray:
    """A constant offset per ``period``-pixel block, the blocks starting at ``offset``."""
    rng = np.random.default_rng(seed)
    cells = rng.uniform(-20, 20, (size // period + 2, size // period + 2, 3))
    idx = (np.arange(size) - offset) // period + 1
    return cells[idx][:, idx]


def _loop_ratio(img: np.ndarray, period: int) -> float:
    """The definition, written out: every boundary between two neighbouring pixels, one at a time."""
    h, w, _ = img.shape
    on, off = [], []
    for y in range(h):
        for x in range(1, w):
            (on if x % period == 0 else off).extend((img[y, x] - img[y, x - 1]) ** 2)
    for y in range(1, h):
        for x in range(w):
            (on if y % period == 0 else off).extend((img[y, x] - img[y - 1, x]) ** 2)
    return float(np.mean(on) / np.mean(off))


def test_matches_the_definition_boundary_by_boundary() -> None:
    img = np.random.default_rng(3).integers(0, 256, (37, 45, 3)).astype(np.uint8)
    img[:, 16:] += 9  # a step on the grid, so the two sides differ
    assert grid_energy_ratio(img) == pytest.approx(_loop_ratio(img.astype(np.float64), 16), rel=1e-9)
    assert grid_energy_ratio(img, period=8) == pytest.approx(_loop_ratio(img.astype(np.float64), 8), rel=1e-9)


def test_a_picture_without_a_grid_scores_about_one() -> None:
    assert 0.85 < grid_energy_ratio(_smooth()) < 1.15


def test_planted_block_steps_score_high() -> None:
    blocky = _smooth() + _blocks(128, 16, 0)
    assert grid_energy_ratio(blocky) > 3.0


def test_a_grid_shifted_off_the_16_pixel_lines_is_not_counted() -> None:
    shifted = _smooth() + _blocks(128, 16, 8)
    # The steps sit between the grid lines: only the energy elsewhere grows.
    assert grid_energy_ratio(shifted) < grid_energy_ratio(_smooth()) < 1.15
    assert grid_energy_ratio(shifted[8:, 8:]) > 3.0  # cropped by 8 px, the same steps lie on the grid


def test_a_video_is_measured_over_all_its_frames() -> None:
    frames = np.stack([_smooth(seed=s) for s in range(3)])
    frames[1] += _blocks(128, 16, 0)
    one = grid_energy_ratio(frames[1])
    assert 1.0 < grid_energy_ratio(frames) < one


@pytest.mark.parametrize("shape,period", [((64, 64), 16), ((16, 64, 3), 16), ((64, 64, 3), 1)])
def test_bad_input_is_refused(shape: tuple[int, ...], period: int) -> None:
    with pytest.raises(ValueError):
        grid_energy_ratio(np.zeros(shape), period)
