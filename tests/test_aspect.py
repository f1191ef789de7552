"""A stream's size from its camera's aspect (engine/aspect.py): the rule, and a crop that never stretches."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from engine.aspect import crop_box, fit_frame, fit_size

BUDGET, GRID = 256 * 256, 16  # the embedded default model's


@pytest.mark.parametrize(("camera", "expected"), [
    ((640, 480), (288, 224)), ((1280, 720), (336, 192)), ((1920, 1080), (336, 192)), ((720, 480), (304, 208)),
    ((256, 256), (256, 256)), ((480, 640), (224, 288)), ((720, 1280), (192, 336)), ((160, 120), (288, 224)),
])
def test_common_cameras_get_the_documented_sizes(camera: tuple[int, int], expected: tuple[int, int]) -> None:
    assert fit_size(camera, BUDGET, GRID) == expected


@pytest.mark.parametrize("budget", [BUDGET, 128 * 128, 192 * 192, 832 * 480, 150 * 150])
def test_sizes_are_on_the_grid_within_the_budget_close_to_the_aspect_and_stable(budget: int) -> None:
    for width in range(48, 2000, 37):
        for height in (120, 240, 480, 720, 1080):
            if not 0.25 <= width / height <= 4:  # a camera, not a strip
                continue
            w, h = fit_size((width, height), budget, GRID)
            assert w % GRID == 0 and h % GRID == 0 and w * h <= budget
            assert w * h >= 0.7 * budget  # nothing small chosen for its exact aspect
            # The aspect within what a grid step on the shorter side can miss (3.6 % for 4:3 at 288x224).
            assert abs(np.log((w / h) / (width / height))) < 1.5 * GRID / min(w, h)
            # A stream's own size maps to itself: the server's fitted frames and the engine agree.
            assert fit_size((w, h), budget, GRID) == (w, h)


def test_a_square_stays_square_at_every_scale() -> None:
    for side in range(16, 400, 8):
        expected = side // GRID * GRID
        if expected:
            assert fit_size((256, 256), side * side, GRID) == (expected, expected)


def test_a_budget_without_one_cell_is_refused() -> None:
    with pytest.raises(ValueError, match="holds no"):
        fit_size((640, 480), 200, GRID)
    with pytest.raises(ValueError, match="positive"):
        fit_size((0, 480), BUDGET, GRID)


def test_fitting_crops_the_excess_and_keeps_a_circle_round() -> None:
    image = np.zeros((480, 640, 3), np.uint8)
    cv2.circle(image, (320, 240), 150, (255, 255, 255), -1, cv2.LINE_AA)
    assert crop_box((640, 480), (288, 224)) == (11, 0, 617, 480)  # 23 columns of 640 cropped, none stretched
    for size in ((288, 224), (336, 192), (256, 256), (224, 288)):
        out = fit_frame(image, size)
        assert out.shape == (size[1], size[0], 3)
        ys, xs = np.nonzero(out[..., 0] > 127)
        width, height = xs.max() - xs.min() + 1, ys.max() - ys.min() + 1
        assert abs(width / height - 1.0) < 0.03, f"at {size} the circle is {width}x{height}"
