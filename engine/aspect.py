"""A stream's size from its camera's aspect: the model's pixel budget on the model's size grid.

A model runs on frames whose sides are multiples of its *granularity* (the VAE's spatial compression
times the DiT's patch size: 8 x 2 = 16 px for the embedded default and Wan 2.1) and was made for a
*pixel budget* (its default size's area: 256 x 256 for the embedded default). A stream whose size is
not given runs at the grid size :func:`fit_size` picks for its camera: the one that keeps most of the
picture, scored as

    (its area / the budget) x (the share of the camera's field of view its aspect keeps) ** 2

over every grid size within the budget (never above it: no stream costs more than the model's
default size). The field of view counts twice, since a crop loses content while a smaller area only
softens it. With the 256 x 256 budget: 4:3 -> 288x224, 16:9 -> 336x192, 3:2 -> 304x208, 1:1 ->
256x256, portrait 3:4 -> 224x288. The aspect the grid cannot hit exactly is met by centre-cropping
the few excess camera pixels (:func:`crop_box`, :func:`fit_frame`), never by stretching and never by
padding (padding would be compute spent on nothing). A square size at any budget stays square.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import cv2
import numpy as np

Size = tuple[int, int]  # (width, height) in pixels


class StreamSizes(NamedTuple):
    """A stream's two sizes for one chunk: ``stream``, what it plays out at (its camera's aspect at the
    model's pixel budget, :func:`fit_size`, picked once), and ``engine``, what the model runs the chunk
    at (``stream`` at the chunk's resolution scale). A chunk's frames go in resized straight from the
    camera to ``engine`` and come out resized once to ``stream``."""

    stream: Size
    engine: Size


@functools.lru_cache(maxsize=1024)
def fit_size(source: Size, budget_px: int, granularity: int) -> Size:
    """The (width, height) on the ``granularity`` grid, within ``budget_px`` pixels, that keeps the most
    of a ``source``-sized picture (module docstring); ties go to the larger area."""
    sw, sh = source
    if sw <= 0 or sh <= 0:
        raise ValueError(f"a frame size must be positive, got {sw}x{sh}")
    if granularity <= 0:
        raise ValueError(f"the size granularity must be positive, got {granularity}")
    cells = budget_px // (granularity * granularity)
    if cells < 1:
        raise ValueError(f"a budget of {budget_px} pixels holds no {granularity}x{granularity} cell")
    best: tuple[float, int, Size] | None = None
    for rows in range(1, cells + 1):
        cols_best = cells // rows
        # The width nearest the source's aspect at this height, and its neighbour below (within budget).
        ideal = max(1, min(cols_best, round(rows * sw / sh)))
        for cols in {ideal, max(1, ideal - 1), min(cols_best, ideal + 1)}:
            w, h = cols * granularity, rows * granularity
            kept = min(w * sh, h * sw) / max(w * sh, h * sw)  # the share of the field of view kept
            score = (w * h / budget_px) * kept * kept
            candidate = (score, w * h, (w, h))
            if best is None or candidate[:2] > best[:2]:
                best = candidate
    assert best is not None
    return best[2]


def scaled_size(size: Size, scale: float, granularity: int) -> Size:
    """The engine size of a ``size`` stream at resolution ``scale``: the grid size within ``size`` scaled
    by ``scale`` (its pixel budget) that keeps the most of ``size``'s picture (``size`` itself when it is
    on the grid at scale 1; a square stays square). The engine's rule (StreamRuntime.engine_size), pure
    arithmetic so that a server whose streams run elsewhere (Ray workers) sizes their chunks as they will."""
    budget = int(size[0] * scale) * int(size[1] * scale)
    if budget < granularity * granularity:
        raise ValueError(f"frame size {size} at scale {scale} is too small: the model needs "
                         f"{granularity}x{granularity} pixels at least")
    return fit_size(size, budget, granularity)


def crop_box(source: Size, target: Size) -> tuple[int, int, int, int]:
    """(x, y, width, height) of the centred part of a ``source`` frame with ``target``'s aspect."""
    w, h = source
    width, height = target
    if w * height > h * width:  # too wide
        crop = max(1, round(h * width / height))  # max: a 1-pixel-tall strip still yields an image
        return (w - crop) // 2, 0, crop, h
    if w * height < h * width:  # too tall
        crop = max(1, round(w * height / width))
        return 0, (h - crop) // 2, w, crop
    return 0, 0, w, h


def fit_frame(image: np.ndarray, size: Size) -> np.ndarray:
    """uint8 [H, W, C] -> [size[1], size[0], C]: centre-crop to ``size``'s aspect, then resize (area)."""
    width, height = size
    h, w = image.shape[:2]
    if (w, h) == (width, height):
        return image
    x, y, cw, ch = crop_box((w, h), size)
    return cv2.resize(image[y : y + ch, x : x + cw], (width, height), interpolation=cv2.INTER_AREA)
