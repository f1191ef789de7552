"""The deblocking filter against pictures whose right answer is known without it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.embedded.block_texture import grid_energy_ratio
from engine.pipeline import stream_recipe
from engine.streaming.deblock import DeblockConfig, deblock


def _smooth(size: int = 64, seed: int = 0) -> torch.Tensor:
    """[3, H, W]: sums of sinusoids, no grid."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64)
    img = np.zeros((3, size, size))
    for _ in range(8):
        fx, fy = rng.uniform(-0.3, 0.3, 2)
        img += rng.uniform(0.02, 0.08, (3, 1, 1)) * np.sin(fx * xx + fy * yy + rng.uniform(0, 6.3))
    return torch.from_numpy(img).float()


def _block_offsets(size: int = 64, block: int = 8, seed: int = 1) -> torch.Tensor:
    """[3, H, W]: one constant per ``block``-pixel block, what a block decoder's errors look like."""
    cells = torch.from_numpy(np.random.default_rng(seed).uniform(-0.2, 0.2, (3, size // block, size // block))).float()
    return cells.repeat_interleave(block, dim=1).repeat_interleave(block, dim=2)


def _hwc(x: torch.Tensor) -> np.ndarray:
    return x.movedim(0, -1).numpy()


def test_a_step_on_a_boundary_becomes_a_straight_ramp() -> None:
    row = torch.zeros(1, 16)
    row[:, 8:] = 1.0
    out = deblock(row, 8, 1.0, 2)
    # p1 p0 | q0 q1 move onto the line from 0 (column 5) to 1 (column 10): 1/5, 2/5, 3/5, 4/5.
    expected = torch.tensor([0, 0, 0, 0, 0, 0, 0.2, 0.4, 0.6, 0.8, 1, 1, 1, 1, 1, 1])
    torch.testing.assert_close(out[0], expected)


def test_a_smooth_gradient_and_pixels_away_from_boundaries_are_left_alone() -> None:
    yy, xx = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
    ramp = (0.03 * xx - 0.02 * yy)[None].expand(3, -1, -1)
    torch.testing.assert_close(deblock(ramp, 8, 1.0, 4), ramp)
    # A step between columns 3 and 4 (inside a block, beyond the reach of 2): nothing to do.
    step = torch.zeros(3, 16, 16)
    step[..., 4:] = 1.0
    torch.testing.assert_close(deblock(step, 8, 1.0, 2), step)


def test_block_offsets_are_removed_and_the_picture_kept() -> None:
    clean = _smooth()
    blocky = clean + _block_offsets()
    out = deblock(blocky, 8, 1.0, 4)
    assert grid_energy_ratio(_hwc(blocky), 8) > 5.0
    assert grid_energy_ratio(_hwc(out), 8) < 1.2
    # Closer to the picture under the blocks than the blocky one was (what is left is the blocks'
    # mean offset, spread smoothly: no step anywhere).
    assert (out - clean).diff(dim=-1).abs().max() < 0.5 * (blocky - clean).diff(dim=-1).abs().max()
    # The input was not modified in place.
    torch.testing.assert_close(blocky, clean + _block_offsets())


def test_video_chunks_are_filtered_frame_by_frame() -> None:
    frames = torch.stack([_smooth(seed=s) + _block_offsets(seed=s) for s in range(4)], dim=1)  # [3, T, H, W]
    out = deblock(frames, 8, 0.9, 4)
    for t in range(4):
        torch.testing.assert_close(out[:, t], deblock(frames[:, t], 8, 0.9, 4))


@pytest.mark.parametrize("settings", [{"strength": 0.0}, {"strength": 1.5}, {"reach": 0},
                                      {"spare_from": 0.7, "spare_full": 0.6}])
def test_bad_settings_are_refused(settings: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        DeblockConfig(**settings)  # type: ignore[arg-type]


def test_a_look_drawn_on_the_grid_is_spared() -> None:
    grid_look = torch.nn.functional.normalize(torch.randn(384), dim=0)
    other = torch.nn.functional.normalize(torch.randn(384), dim=0)
    other = torch.nn.functional.normalize(other - (other @ grid_look) * grid_look, dim=0)  # orthogonal to it
    config = DeblockConfig(strength=0.8, spare=(tuple(grid_look.tolist()),), spare_from=0.5, spare_full=0.7)
    assert config.strength_for(grid_look[None, None]) == 0.0
    assert config.strength_for(other[None, None]) == pytest.approx(0.8)
    # Cosine 0.6 to the spared look: halfway between spare_from and spare_full, half the strength.
    between = 0.6 * grid_look + 0.8 * other
    assert config.strength_for(between[None, None]) == pytest.approx(0.4)
    assert DeblockConfig(strength=0.8).strength_for(grid_look[None, None]) == 0.8
    with pytest.raises(ValueError, match="384-d"):
        config.strength_for(torch.randn(1, 1, 16))


def test_a_reach_past_the_next_boundary_is_refused() -> None:
    with pytest.raises(ValueError, match="overlaps"):
        deblock(torch.zeros(3, 32, 32), 8, 1.0, 5)


def test_a_model_config_turns_it_on_or_off_and_names_the_looks_it_spares() -> None:
    looks = {"pixel_art": [1.0, 0.0], "cartoon": [0.0, 1.0]}
    _, runtime = stream_recipe({"runtime": {"deblock": {"strength": 0.5, "reach": 3, "spare_looks": ["cartoon"]}},
                                "prototypes": looks}, "m")
    assert runtime.deblock == DeblockConfig(strength=0.5, reach=3, spare=((0.0, 1.0),))
    _, runtime = stream_recipe({"runtime": {"deblock": None}}, "m")
    assert runtime.deblock is None
    # A file written before the stage existed: its TinyVAE draws blocks all the same; pixel art is spared.
    assert stream_recipe({"runtime": {}, "prototypes": looks}, "m")[1].deblock == DeblockConfig(spare=((1.0, 0.0),))
    assert stream_recipe({"runtime": {}}, "m")[1].deblock == DeblockConfig()
