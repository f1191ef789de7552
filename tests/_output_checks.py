"""Checks that a stylised video is a real stylisation of its input, not garbage.

Each check compares against an independent reference (the input itself, another look's output),
never against the code's own earlier output, so a test using them fails if the model returned
black or constant frames, the unchanged input, a frozen frame, or noise:

- ``structure_correlation``: the output keeps the input's structure (edges where the input has
  them): Pearson correlation of the two videos' blurred gradient magnitudes.
- ``difference_from``: mean absolute difference to a reference video (the input, another look).
- ``motion_correlation``: the output changes where and when the input moves: correlation of the
  frame-to-frame differences of output and input.
"""

from __future__ import annotations

from typing import Any

import cv2
import numpy as np

# Calibrated on the embedded default model, its 9 looks on 5 held-out clips and the moving test
# pattern at 256 and 128 px (tests/test_output_checks.py holds the checks to it):
#   real output: structure 0.40-0.95 (0.30 for the 16-look model's woodblock on held-out clip 4, whose
#   own teacher scores 0.12 there: posterised layers keep few of the input's edges), motion 0.51-0.98, change 7.4-118, contrast >= 9.5, looks >= 13 apart;
#   noise (random weights): structure and motion |x| <= 0.05; black: contrast 0; the input: change 0;
#   a frozen frame: motion 0.00.
MIN_STRUCTURE = 0.2
MIN_CHANGE = 4.0  # mean |output - input| over 0..255: a look changes the picture
MIN_CONTRAST = 4.0  # per-frame standard deviation: not black, not a flat colour
MIN_MOTION = 0.3
MIN_LOOK_DISTANCE = 8.0


def _gray(video: np.ndarray) -> np.ndarray:
    return video.astype(np.float32).mean(axis=-1)


def fit(video: np.ndarray, like: np.ndarray) -> np.ndarray:
    """``video`` [T, H, W, 3] resized to ``like``'s frame size."""
    h, w = like.shape[1:3]
    if video.shape[1:3] == (h, w):
        return video
    return np.stack([cv2.resize(frame, (w, h), interpolation=cv2.INTER_AREA) for frame in video])


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(-1) - a.mean(), b.reshape(-1) - b.mean()
    denominator = float(np.sqrt((a * a).sum() * (b * b).sum()))
    return float((a * b).sum() / denominator) if denominator > 0 else 0.0


def _edges(video: np.ndarray) -> np.ndarray:
    out = []
    for frame in _gray(video):
        blurred = cv2.GaussianBlur(frame, (0, 0), 1.5)
        out.append(np.hypot(cv2.Sobel(blurred, cv2.CV_32F, 1, 0), cv2.Sobel(blurred, cv2.CV_32F, 0, 1)))
    return np.stack(out)


def structure_correlation(output: np.ndarray, source: np.ndarray) -> float:
    return _corr(_edges(output), _edges(fit(source, output)))


def difference_from(output: np.ndarray, reference: np.ndarray) -> float:
    return float(np.abs(output.astype(np.float32) - fit(reference, output).astype(np.float32)).mean())


def motion_correlation(output: np.ndarray, source: np.ndarray) -> float:
    """Correlation of |Δoutput| and |Δinput| between consecutive frames (blurred, so a look's texture
    does not count as motion)."""
    src = fit(source, output)
    def delta(v: np.ndarray) -> np.ndarray:
        g = np.stack([cv2.GaussianBlur(f, (0, 0), 2.0) for f in _gray(v)])
        return np.abs(np.diff(g, axis=0))
    return _corr(delta(output), delta(src))


def contrast(output: np.ndarray) -> float:
    """The flattest frame's standard deviation."""
    return float(min(frame.std() for frame in output.astype(np.float32)))


def assert_stylized(output: np.ndarray, source: np.ndarray, moving: bool = True) -> None:
    """``output`` [T, h, w, 3] is a stylisation of ``source`` [T, H, W, 3] (same frames, any size):
    not black or flat, not the input, keeps the input's structure and, where the input moves
    (``moving``), moves with it."""
    assert output.shape[0] == source.shape[0], f"{output.shape[0]} frames out for {source.shape[0]} in"
    assert (c := contrast(output)) > MIN_CONTRAST, f"a black or flat frame (std {c:.1f})"
    assert (d := difference_from(output, source)) > MIN_CHANGE, f"the input came back unchanged (|Δ| {d:.1f})"
    assert (s := structure_correlation(output, source)) > MIN_STRUCTURE, f"the input's structure is lost ({s:.2f})"
    if moving:
        assert (m := motion_correlation(output, source)) > MIN_MOTION, f"the output does not follow the motion ({m:.2f})"


def assert_looks_differ(a: np.ndarray, b: np.ndarray) -> None:
    """Two looks of the same input are different pictures."""
    assert (d := difference_from(a, b)) > MIN_LOOK_DISTANCE, f"two looks gave the same picture (|Δ| {d:.1f})"


def held_out_clip(index: int = 1, frames: int = 9) -> np.ndarray:
    """A moving clip the default model never trained on (photographs and procedural scenes moved by
    engine/embedded/clips.py), uint8 [frames, 256, 256, 3]."""
    from engine.embedded.clips import heldout_specs, render_clip

    return render_clip(heldout_specs(max(frames, 9))[index])[:frames]


def run_stream(stream: Any, frames: np.ndarray) -> np.ndarray:
    """``frames`` through a Python API stream chunk by chunk (1 frame, then 4 at a time)."""
    first, size = stream.expected_frames, stream.pipe.chunk_frames
    bounds = [0, first, *range(first + size, len(frames) + 1, size)]
    return np.concatenate([stream.process(frames[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)])


def circles_clip(size: tuple[int, int], frames: int = 9) -> np.ndarray:
    """A camera-sized (``size`` = width, height) clip of circles on a gradient, two of them moving,
    uint8 [frames, H, W, 3]: a stretch turns its circles into ellipses."""
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    out = []
    for t in range(frames):
        image = np.ascontiguousarray(np.stack([xx / w * 200 + 30, yy / h * 180 + 40, np.full_like(xx, 90)], -1)
                                     .astype(np.uint8))
        cv2.circle(image, (w // 2, h // 2), int(0.3 * h), (240, 240, 60), -1, cv2.LINE_AA)
        cv2.circle(image, (w // 2, h // 2), int(0.15 * h), (30, 30, 160), -1, cv2.LINE_AA)
        cv2.circle(image, (int(w * 0.15) + 6 * t, int(h * 0.3)), int(0.1 * h), (250, 80, 80), -1, cv2.LINE_AA)
        cv2.circle(image, (int(w * 0.85), int(h * 0.75) - 4 * t), int(0.08 * h), (40, 200, 40), -1, cv2.LINE_AA)
        out.append(image)
    return np.stack(out)


def aspect_views(source: np.ndarray, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """``source`` [T, H, W, 3] shown at ``size`` (width, height) two ways: undistorted (its centred part
    of ``size``'s aspect, resized) and distorted (its centred square stretched to ``size``: a square
    stream of a wide camera, shown at the camera's aspect)."""
    w, h = size
    src_h, src_w = source.shape[1:3]
    crop_w = round(src_h * w / h) if src_w * h > src_h * w else src_w
    crop_h = round(src_w * h / w) if src_w * h < src_h * w else src_h
    side = min(src_h, src_w)

    def view(cw: int, ch: int) -> np.ndarray:
        x0, y0 = (src_w - cw) // 2, (src_h - ch) // 2
        return np.stack([cv2.resize(f[y0 : y0 + ch, x0 : x0 + cw], (w, h), interpolation=cv2.INTER_AREA) for f in source])

    return view(crop_w, crop_h), view(side, side)


def assert_undistorted(output: np.ndarray, source: np.ndarray, moving: bool = True) -> None:
    """``output`` is a stylisation of ``source`` at ``source``'s aspect, not stretched: its structure
    follows the undistorted view of ``source`` at the output's size far better than a stretched one."""
    undistorted, stretched = aspect_views(source, (output.shape[2], output.shape[1]))
    assert_stylized(output, undistorted, moving)
    good, bad = structure_correlation(output, undistorted), structure_correlation(output, stretched)
    # Calibrated on the default model's looks at 4:3, 16:9 and 3:4: undistorted 0.66-0.92, stretched 0.16-0.30.
    assert good > bad + 0.2, f"the output follows a stretched input ({bad:.2f}) as well as the undistorted one ({good:.2f})"
