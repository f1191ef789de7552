"""Deterministic style filters (the teachers the embedded model is distilled from).

Each teacher maps one uint8 RGB frame [H, W, 3] to a stylised uint8 RGB frame of the same size,
with OpenCV/numpy only and no randomness: the same frame always gives the same output, so a
teacher's flicker on a clip comes from the clip alone. Filters favour smooth, structure-following
looks (soft edges, area-averaged quantisation) because both the model and its temporal-stability
target are measured against them.
"""

from __future__ import annotations

from collections.abc import Callable

import cv2
import numpy as np

Teacher = Callable[[np.ndarray], np.ndarray]


def _gray(frame: np.ndarray) -> np.ndarray:
    return cv2.cvtColor(frame, cv2.COLOR_RGB2GRAY).astype(np.float32) / 255.0


def _soft_edges(gray: np.ndarray, blur: float, gain: float) -> np.ndarray:
    """Edge strength in [0, 1] from the gradient of a blurred grey image (soft, no thresholding)."""
    g = cv2.GaussianBlur(gray, (0, 0), blur)
    mag = np.sqrt(cv2.Sobel(g, cv2.CV_32F, 1, 0, ksize=3) ** 2 + cv2.Sobel(g, cv2.CV_32F, 0, 1, ksize=3) ** 2)
    return np.clip(mag * gain, 0.0, 1.0)


def _to_u8(img: np.ndarray) -> np.ndarray:
    return np.clip(img * 255.0 + 0.5, 0, 255).astype(np.uint8)


def pencil_sketch(frame: np.ndarray) -> np.ndarray:
    """Colour-dodge of grey over its blurred inverse: graphite lines on warm paper."""
    g = _gray(frame)
    blur = cv2.GaussianBlur(1.0 - g, (0, 0), 4.0)
    sketch = np.clip(g / np.maximum(1.0 - blur, 1e-3), 0.0, 1.0) ** 2.0
    sketch = cv2.GaussianBlur(sketch, (0, 0), 0.7)
    paper = np.array([0.97, 0.95, 0.90], np.float32)
    return _to_u8(sketch[..., None] * paper[None, None])


def cartoon(frame: np.ndarray) -> np.ndarray:
    """Flat colours (bilateral smoothing + soft quantisation) with dark soft outlines."""
    smooth = frame
    for _ in range(2):
        smooth = cv2.bilateralFilter(smooth, 7, 40, 5)
    f = smooth.astype(np.float32) / 255.0
    levels = 5.0
    q = np.floor(f * levels) / levels + 0.5 / levels
    q = cv2.GaussianBlur(q, (0, 0), 1.0)
    edges = _soft_edges(_gray(frame), 1.5, 3.0)
    return _to_u8(q * (1.0 - 0.85 * edges[..., None]))


def oil_paint(frame: np.ndarray) -> np.ndarray:
    """Median-smoothed strokes, boosted saturation, embossed relief under a warm varnish."""
    med = cv2.medianBlur(cv2.medianBlur(frame, 7), 5)
    hsv = cv2.cvtColor(med, cv2.COLOR_RGB2HSV).astype(np.float32)
    hsv[..., 1] = np.clip(hsv[..., 1] * 1.5, 0, 255)
    f = cv2.cvtColor(hsv.astype(np.uint8), cv2.COLOR_HSV2RGB).astype(np.float32) / 255.0
    g = cv2.GaussianBlur(_gray(med), (0, 0), 1.2)
    relief = cv2.Sobel(g, cv2.CV_32F, 1, 1, ksize=3)
    varnish = np.array([1.08, 0.96, 0.78], np.float32)
    return _to_u8(f * varnish[None, None] * (1.0 + 1.5 * relief[..., None]))


def watercolor(frame: np.ndarray) -> np.ndarray:
    """Edge-aware stylisation, washed-out pigment on bright paper."""
    styl = cv2.stylization(frame, sigma_s=40, sigma_r=0.5).astype(np.float32) / 255.0
    gray = styl.mean(axis=2, keepdims=True)
    washed = 0.65 * styl + 0.35 * gray
    return _to_u8(0.75 * washed + 0.25)


def neon(frame: np.ndarray) -> np.ndarray:
    """Glowing coloured edges on black: hue follows the source colour, brightness the edge strength."""
    g = _gray(frame)
    edges = _soft_edges(g, 1.2, 4.0)
    glow = np.clip(edges + 1.5 * cv2.GaussianBlur(edges, (0, 0), 3.0), 0.0, 1.0)
    hsv = cv2.cvtColor(frame, cv2.COLOR_RGB2HSV).astype(np.float32)
    hsv[..., 1] = 255.0
    hsv[..., 2] = 255.0
    vivid = cv2.cvtColor(hsv.astype(np.uint8), cv2.COLOR_HSV2RGB).astype(np.float32) / 255.0
    return _to_u8(vivid * glow[..., None])


def thermal(frame: np.ndarray) -> np.ndarray:
    """Blurred luminance through the inferno colour map (a heat camera)."""
    g = cv2.GaussianBlur(cv2.cvtColor(frame, cv2.COLOR_RGB2GRAY), (0, 0), 2.0)
    return cv2.cvtColor(cv2.applyColorMap(g, cv2.COLORMAP_INFERNO), cv2.COLOR_BGR2RGB)


_SEPIA = np.array([[0.393, 0.769, 0.189], [0.349, 0.686, 0.168], [0.272, 0.534, 0.131]], np.float32)


def sepia_film(frame: np.ndarray) -> np.ndarray:
    """Sepia tone and a faded contrast curve (no grain: grain would be per-frame noise; no vignette:
    an overlay fixed to the frame edges is not a property of the content, and a model that sees only
    relative positions cannot place it)."""
    f = frame.astype(np.float32) / 255.0
    s = np.clip(f @ _SEPIA.T, 0.0, 1.0)
    return _to_u8(0.08 + 0.84 * (s * s * (3.0 - 2.0 * s)))


def pixel_art(frame: np.ndarray) -> np.ndarray:
    """8x8-pixel blocks (area average) with a reduced, saturated palette."""
    h, w = frame.shape[:2]
    small = cv2.resize(frame, (w // 8, h // 8), interpolation=cv2.INTER_AREA).astype(np.float32) / 255.0
    q = np.round(small * 6.0) / 6.0
    return cv2.resize(_to_u8(q), (w, h), interpolation=cv2.INTER_NEAREST)


def night_vision(frame: np.ndarray) -> np.ndarray:
    """Green phosphor monochrome with gain and a soft bloom (no goggle mask, for the vignette's reason)."""
    g = cv2.GaussianBlur(_gray(frame), (0, 0), 1.0)
    g = np.clip(1.4 * g + 0.35 * cv2.GaussianBlur(g, (0, 0), 6.0) - 0.05, 0.0, 1.0)
    tint = np.array([0.25, 1.0, 0.35], np.float32)
    return _to_u8(g[..., None] * tint[None, None])


def pop_art(frame: np.ndarray) -> np.ndarray:
    """Posterised luminance mapped onto four bold poster colours."""
    g = cv2.GaussianBlur(_gray(frame), (0, 0), 1.5)
    palette = np.array([[0.10, 0.05, 0.35], [0.90, 0.10, 0.45], [1.0, 0.80, 0.10], [0.55, 0.95, 0.95]], np.float32)
    x = np.clip(g * 3.0, 0.0, 3.0)
    i = np.minimum(np.floor(x), 2).astype(np.int64)
    # A smooth step between bands instead of a hard cut keeps the look stable under motion.
    a = np.clip((x - i - 0.65) / 0.35, 0.0, 1.0)[..., None]
    a = a * a * (3.0 - 2.0 * a)
    return _to_u8(palette[i] * (1 - a) + palette[i + 1] * a)


TEACHERS: dict[str, Teacher] = {
    "pencil_sketch": pencil_sketch,
    "cartoon": cartoon,
    "oil_paint": oil_paint,
    "watercolor": watercolor,
    "neon": neon,
    "thermal": thermal,
    "sepia_film": sepia_film,
    "pixel_art": pixel_art,
    "night_vision": night_vision,
    "pop_art": pop_art,
}


def stylize_clip(frames: np.ndarray, style: str) -> np.ndarray:
    """Apply teacher ``style`` to every frame of a uint8 clip [T, H, W, 3]."""
    if style not in TEACHERS:
        raise ValueError(f"unknown style {style!r}; known: {sorted(TEACHERS)}")
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"expected uint8 frames [T, H, W, 3], got {frames.dtype} {frames.shape}")
    teacher = TEACHERS[style]
    return np.stack([teacher(np.ascontiguousarray(f)) for f in frames])
