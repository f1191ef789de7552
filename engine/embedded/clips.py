"""Synthetic camera-like clips for training and evaluating the embedded model.

Every clip is a pure function of its ``ClipSpec`` (source image or procedural seed + motion seed):
frame t is the source seen through a virtual camera (pan, zoom, rotation, hand shake) with moving
sprites on top and a lighting drift, rendered with OpenCV at 256x256. No randomness is drawn per
frame: a motion is a handful of numbers fixed by the seed, so the same spec always gives the same
pixels (tests rely on it, and the teachers' temporal stability is measured on these clips).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import cv2
import numpy as np
import skimage.data

SIZE = 256
# Photographs that scikit-image ships (offline). Held-out clips use sources never seen in training.
TRAIN_IMAGES: tuple[str, ...] = (
    "astronaut", "rocket", "immunohistochemistry", "hubble_deep_field", "retina",
    "colorwheel", "coins", "camera", "brick", "grass", "gravel", "clock", "moon", "page",
)
HELDOUT_IMAGES: tuple[str, ...] = ("coffee", "chelsea")
PROCEDURAL_TRAIN_SEEDS: tuple[int, ...] = tuple(range(0, 40))
PROCEDURAL_HELDOUT_SEEDS: tuple[int, ...] = (1000, 1001)


@dataclass(frozen=True)
class ClipSpec:
    """One clip: ``source`` is a skimage image name or ``procedural:<seed>``; ``motion`` seeds the camera."""

    source: str
    motion: int
    frames: int


@functools.lru_cache(maxsize=64)
def source_image(source: str) -> np.ndarray:
    """The source as uint8 RGB at 384x384 (room for the camera to move without leaving the picture)."""
    if source.startswith("procedural:"):
        return procedural_scene(int(source.split(":", 1)[1]))
    if not hasattr(skimage.data, source):
        raise ValueError(f"unknown clip source {source!r}: not a scikit-image sample or 'procedural:<seed>'")
    img = np.asarray(getattr(skimage.data, source)())
    if img.dtype == bool:
        img = img.astype(np.uint8) * 255
    if img.ndim == 2:
        img = np.repeat(img[..., None], 3, axis=2)
    img = img[..., :3].astype(np.uint8)
    h, w = img.shape[:2]
    side = min(h, w)
    img = img[(h - side) // 2 : (h - side) // 2 + side, (w - side) // 2 : (w - side) // 2 + side]
    return cv2.resize(img, (384, 384), interpolation=cv2.INTER_AREA)


def procedural_scene(seed: int) -> np.ndarray:
    """A 384x384 scene: gradient sky, striped/noisy texture, shapes and face-like blobs."""
    rng = np.random.default_rng(seed)
    n = 384
    yy, xx = np.mgrid[0:n, 0:n].astype(np.float32) / n
    c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    angle = rng.uniform(0, 2 * math.pi)
    g = (np.cos(angle) * xx + np.sin(angle) * yy + 1.5) / 3.0
    img = (c0[None, None] * (1 - g[..., None]) + c1[None, None] * g[..., None]).astype(np.float32)
    # A smooth texture band (stripes or blurred noise) so the teachers see fine structure.
    if rng.random() < 0.5:
        freq = rng.uniform(8, 30)
        tex = 0.5 + 0.5 * np.sin(2 * math.pi * freq * (xx * np.cos(angle * 2) + yy * np.sin(angle * 2)))
    else:
        tex = cv2.GaussianBlur(rng.random((n, n)).astype(np.float32), (0, 0), rng.uniform(1.5, 6))
        tex = (tex - tex.min()) / (np.ptp(tex) + 1e-6)
    img += (tex[..., None] - 0.5) * rng.uniform(20, 80)
    for _ in range(int(rng.integers(4, 10))):
        color = tuple(float(c) for c in rng.uniform(0, 255, 3))
        cx, cy = (int(v) for v in rng.integers(20, n - 20, 2))
        kind = int(rng.integers(0, 3))
        if kind == 0:
            cv2.circle(img, (cx, cy), int(rng.integers(10, 70)), color, -1, cv2.LINE_AA)
        elif kind == 1:
            w, h = (int(v) for v in rng.integers(15, 110, 2))
            cv2.rectangle(img, (cx - w // 2, cy - h // 2), (cx + w // 2, cy + h // 2), color, -1, cv2.LINE_AA)
        else:
            pts = rng.integers(0, n, (int(rng.integers(3, 6)), 2)).astype(np.int32)
            cv2.fillPoly(img, [pts], color, cv2.LINE_AA)
    for _ in range(int(rng.integers(1, 3))):
        _draw_face(img, rng)
    return np.clip(img, 0, 255).astype(np.uint8)


def _draw_face(img: np.ndarray, rng: np.random.Generator) -> None:
    n = img.shape[0]
    cx, cy = (int(v) for v in rng.integers(70, n - 70, 2))
    r = int(rng.integers(35, 70))
    skin = tuple(float(c) for c in rng.uniform([150, 100, 70], [250, 200, 170]))
    cv2.ellipse(img, (cx, cy), (r, int(r * 1.25)), 0, 0, 360, skin, -1, cv2.LINE_AA)
    hair = tuple(float(c) for c in rng.uniform(0, 90, 3))
    cv2.ellipse(img, (cx, cy - int(r * 0.8)), (r, int(r * 0.5)), 0, 180, 360, hair, -1, cv2.LINE_AA)
    for side in (-1, 1):
        eye = (cx + side * r // 2, cy - r // 5)
        cv2.circle(img, eye, max(3, r // 7), (250, 250, 250), -1, cv2.LINE_AA)
        cv2.circle(img, eye, max(2, r // 14), (30, 30, 30), -1, cv2.LINE_AA)
    cv2.ellipse(img, (cx, cy + r // 2), (r // 3, r // 8), 0, 0, 180, (120, 40, 40), 3, cv2.LINE_AA)


@dataclass(frozen=True)
class _Motion:
    pan: tuple[float, float]  # pixels per frame
    zoom: float  # relative scale change per frame
    rot: float  # degrees per frame
    shake: float  # amplitude in pixels of a smooth sum-of-sines jitter
    shake_phase: tuple[float, float, float, float]
    light: float  # brightness drift per frame (multiplicative)
    sprites: tuple[tuple[float, float, float, float, float, int], ...]  # x, y, vx, vy, radius, colour seed


def _motion(seed: int) -> _Motion:
    rng = np.random.default_rng(10_000 + seed)
    kind = seed % 4  # cycle through dominant motions so every split holds each kind
    pan = tuple(float(v) for v in rng.uniform(-3.0, 3.0, 2)) if kind in (0, 3) else (0.0, 0.0)
    zoom = float(rng.uniform(-0.015, 0.015)) if kind in (1, 3) else 0.0
    rot = float(rng.uniform(-1.5, 1.5)) if kind in (2, 3) else 0.0
    sprites = tuple(
        (
            float(rng.uniform(40, 216)), float(rng.uniform(40, 216)),
            float(rng.uniform(-5, 5)), float(rng.uniform(-5, 5)),
            float(rng.uniform(10, 30)), int(rng.integers(0, 1 << 30)),
        )
        for _ in range(int(rng.integers(0, 3)))
    )
    return _Motion(
        pan=(pan[0], pan[1]),
        zoom=zoom,
        rot=rot,
        shake=float(rng.uniform(0.0, 2.5)),
        shake_phase=tuple(float(v) for v in rng.uniform(0, 2 * math.pi, 4)),  # type: ignore[arg-type]
        light=float(rng.uniform(-0.02, 0.02)),
        sprites=sprites,
    )


def render_clip(spec: ClipSpec) -> np.ndarray:
    """The clip's frames as uint8 [T, 256, 256, 3] (RGB)."""
    if spec.frames < 1:
        raise ValueError(f"a clip needs at least one frame, got {spec.frames}")
    src = source_image(spec.source)
    m = _motion(spec.motion)
    out = np.empty((spec.frames, SIZE, SIZE, 3), np.uint8)
    centre = src.shape[0] / 2.0
    for t in range(spec.frames):
        p = m.shake_phase
        jx = m.shake * (math.sin(1.7 * t + p[0]) + 0.5 * math.sin(4.1 * t + p[1]))
        jy = m.shake * (math.sin(1.3 * t + p[2]) + 0.5 * math.sin(3.7 * t + p[3]))
        scale = SIZE / 300.0 * (1.0 + m.zoom * t)
        cam = (centre + m.pan[0] * t + jx, centre + m.pan[1] * t + jy)
        mat = cv2.getRotationMatrix2D(cam, m.rot * t, scale)
        # getRotationMatrix2D keeps ``cam`` fixed; shift it onto the output centre.
        mat[:, 2] += np.array([SIZE / 2.0 - cam[0], SIZE / 2.0 - cam[1]])
        frame = cv2.warpAffine(src, mat, (SIZE, SIZE), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT)
        for x, y, vx, vy, r, cseed in m.sprites:
            color = tuple(float(c) for c in np.random.default_rng(cseed).uniform(0, 255, 3))
            cv2.circle(frame, (int(round(x + vx * t)) % SIZE, int(round(y + vy * t)) % SIZE), int(r), color, -1, cv2.LINE_AA)
        gain = 1.0 + m.light * t
        out[t] = np.clip(frame.astype(np.float32) * gain, 0, 255).astype(np.uint8)
    return out


def train_specs(frames: int = 9, motions_per_source: int = 4) -> list[ClipSpec]:
    """The training split: every training source under ``motions_per_source`` camera motions."""
    sources = list(TRAIN_IMAGES) + [f"procedural:{s}" for s in PROCEDURAL_TRAIN_SEEDS]
    return [ClipSpec(src, i * 7 + k, frames) for i, src in enumerate(sources) for k in range(motions_per_source)]


def heldout_specs(frames: int = 17) -> list[ClipSpec]:
    """The held-out split: unseen sources, unseen motion seeds (one of each motion kind per source)."""
    sources = list(HELDOUT_IMAGES) + [f"procedural:{s}" for s in PROCEDURAL_HELDOUT_SEEDS]
    return [ClipSpec(src, 5000 + 4 * i + k, frames) for i, src in enumerate(sources) for k in range(4)]
