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


def _smoothstep(x: np.ndarray) -> np.ndarray:
    x = np.clip(x, 0.0, 1.0)
    return x * x * (3.0 - 2.0 * x)


def charcoal(frame: np.ndarray) -> np.ndarray:
    """Smudged dark tones and heavy soft strokes on grey-beige paper (darker and broader than the pencil)."""
    g = cv2.GaussianBlur(_gray(frame), (0, 0), 1.5)
    tone = _smoothstep(1.3 * g - 0.1)
    strokes = _soft_edges(g, 2.0, 4.0)
    ink = np.clip(0.12 + 0.8 * tone - 0.6 * strokes, 0.0, 1.0)
    paper = np.array([0.90, 0.87, 0.82], np.float32)
    return _to_u8(ink[..., None] * paper[None, None])


def comic_ink(frame: np.ndarray) -> np.ndarray:
    """Black ink on white paper: solid blacks in the shadows, bold soft outlines, nothing in between."""
    g = cv2.GaussianBlur(_gray(frame), (0, 0), 1.2)
    fill = _smoothstep((g - 0.25) / 0.2)
    lines = _soft_edges(_gray(frame), 1.8, 3.5)
    ink = np.clip(fill * (1.0 - lines), 0.0, 1.0)
    paper = np.array([0.98, 0.97, 0.93], np.float32)
    return _to_u8(0.06 + 0.94 * ink[..., None] * paper[None, None])


def blueprint(frame: np.ndarray) -> np.ndarray:
    """White technical lines on blueprint blue, the faint tones of the scene under them."""
    g = _gray(frame)
    lines = _soft_edges(g, 1.5, 3.5)
    base = np.array([0.08, 0.24, 0.55], np.float32)
    shade = 0.8 + 0.4 * cv2.GaussianBlur(g, (0, 0), 3.0)[..., None]
    white = np.array([0.92, 0.96, 1.0], np.float32)
    a = lines[..., None]
    return _to_u8(base[None, None] * shade * (1 - a) + white[None, None] * a)


def vaporwave(frame: np.ndarray) -> np.ndarray:
    """A pink-purple-cyan grade: shadows violet, mid-tones magenta, highlights cyan, the colours boosted."""
    f = frame.astype(np.float32) / 255.0
    g = cv2.GaussianBlur(_gray(frame), (0, 0), 1.0)[..., None]
    ramp = np.array([[0.18, 0.05, 0.35], [0.95, 0.35, 0.75], [0.45, 0.95, 0.98]], np.float32)
    x = np.clip(g * 2.0, 0.0, 2.0)
    i = np.minimum(np.floor(x), 1).astype(np.int64)[..., 0]
    a = _smoothstep(x[..., 0] - i)[..., None]
    graded = ramp[i] * (1 - a) + ramp[i + 1] * a
    return _to_u8(0.75 * graded + 0.25 * f)


def cyanotype(frame: np.ndarray) -> np.ndarray:
    """Prussian-blue sun print: continuous tone from deep blue shadows to pale cyan-white highlights."""
    g = _smoothstep(cv2.GaussianBlur(_gray(frame), (0, 0), 0.8) * 1.1)[..., None]
    dark = np.array([0.05, 0.18, 0.42], np.float32)
    light = np.array([0.86, 0.93, 0.97], np.float32)
    return _to_u8(dark[None, None] * (1 - g) + light[None, None] * g)


def noir(frame: np.ndarray) -> np.ndarray:
    """High-contrast black-and-white film: a steep S-curve, crushed blacks and a soft glow in the lights."""
    g = _gray(frame)
    s = _smoothstep((cv2.GaussianBlur(g, (0, 0), 0.8) - 0.12) / 0.76)
    glow = cv2.GaussianBlur(s, (0, 0), 4.0)
    out = np.clip(0.85 * s + 0.2 * glow * s, 0.0, 1.0)
    return _to_u8(np.repeat(out[..., None], 3, axis=2))


def woodblock(frame: np.ndarray) -> np.ndarray:
    """A woodblock print: three flat ink layers (indigo, rust, ochre) on cream paper, dark carved outlines."""
    g = cv2.GaussianBlur(_gray(frame), (0, 0), 2.0)
    palette = np.array([[0.12, 0.16, 0.32], [0.62, 0.25, 0.16], [0.85, 0.66, 0.35], [0.95, 0.91, 0.80]], np.float32)
    x = np.clip(g * 3.2, 0.0, 3.0)
    i = np.minimum(np.floor(x), 2).astype(np.int64)
    a = _smoothstep((x - i - 0.6) / 0.4)[..., None]
    layers = palette[i] * (1 - a) + palette[i + 1] * a
    lines = _soft_edges(_gray(frame), 1.8, 3.5)[..., None]
    return _to_u8(layers * (1.0 - 0.8 * lines))


def chalkboard(frame: np.ndarray) -> np.ndarray:
    """White chalk strokes on a dark green board: the edges and the bright areas, dusty and soft."""
    g = _gray(frame)
    lines = _soft_edges(g, 1.8, 3.0)
    fill = 0.35 * _smoothstep((cv2.GaussianBlur(g, (0, 0), 2.0) - 0.5) / 0.4)
    chalk = np.clip(lines + fill, 0.0, 1.0)[..., None]
    board = np.array([0.13, 0.24, 0.18], np.float32)
    white = np.array([0.93, 0.94, 0.90], np.float32)
    return _to_u8(board[None, None] * (1 - chalk) + white[None, None] * chalk)


def x_ray(frame: np.ndarray) -> np.ndarray:
    """An x-ray plate: inverted, softened luminance in cold blue-white, dense areas glowing."""
    g = 1.0 - cv2.GaussianBlur(_gray(frame), (0, 0), 1.2)
    g = _smoothstep(0.1 + 0.9 * g) ** 1.3
    glow = cv2.GaussianBlur(g, (0, 0), 3.0)
    v = np.clip(0.8 * g + 0.25 * glow, 0.0, 1.0)[..., None]
    tint = np.array([0.78, 0.9, 1.0], np.float32)
    return _to_u8(0.04 + 0.96 * v * tint[None, None])


def cinematic(frame: np.ndarray) -> np.ndarray:
    """The teal-and-orange film grade: shadows pushed to teal, skin and highlights to orange, gentle contrast."""
    f = frame.astype(np.float32) / 255.0
    g = cv2.GaussianBlur(_gray(frame), (0, 0), 1.0)[..., None]
    teal = np.array([0.05, 0.32, 0.38], np.float32)
    orange = np.array([1.0, 0.66, 0.38], np.float32)
    tone = _smoothstep(g)
    grade = teal * (1 - tone) + orange * tone
    return _to_u8(np.clip(0.55 * grade + 0.55 * f * (0.35 + 0.9 * g) - 0.03, 0.0, 1.0))


def golden_hour(frame: np.ndarray) -> np.ndarray:
    """Warm late-sun light: a golden cast, lifted and glowing highlights, soft warm shadows."""
    f = frame.astype(np.float32) / 255.0
    warm = f * np.array([1.12, 0.94, 0.66], np.float32)[None, None]
    g = cv2.GaussianBlur(_gray(frame), (0, 0), 5.0)[..., None]
    glow = np.array([1.0, 0.7, 0.3], np.float32)[None, None] * _smoothstep(g) * 0.35
    return _to_u8(np.clip(0.06 + 0.85 * warm + glow, 0.0, 1.0))


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
    "charcoal": charcoal,
    "comic_ink": comic_ink,
    "blueprint": blueprint,
    "vaporwave": vaporwave,
    "cyanotype": cyanotype,
    "noir": noir,
    "woodblock": woodblock,
    "chalkboard": chalkboard,
    "x_ray": x_ray,
    "cinematic": cinematic,
    "golden_hour": golden_hour,
}


def stylize_clip(frames: np.ndarray, style: str) -> np.ndarray:
    """Apply teacher ``style`` to every frame of a uint8 clip [T, H, W, 3]."""
    if style not in TEACHERS:
        raise ValueError(f"unknown style {style!r}; known: {sorted(TEACHERS)}")
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"expected uint8 frames [T, H, W, 3], got {frames.dtype} {frames.shape}")
    teacher = TEACHERS[style]
    return np.stack([teacher(np.ascontiguousarray(f)) for f in frames])
