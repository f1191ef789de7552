"""Latency/quality profiles for Wan-2.1-1.3B causal models on one H100, derived from published figures.

These stand in until the engine's profiler measures the real model (then its JSON replaces them).
Every point carries ``source="derived"``. How the numbers are obtained (docs/simulation.md has the table):

* StreamDiffusionV2 (1 H100, 1.3B): 480p reaches 20.5 / 18.0 / 15.7 / 14.0 FPS at 1-4 denoising steps,
  512x512 reaches 26.2 / 24.0 / 21.5 / 19.4 FPS. A least-squares fit ms/frame = a + b*steps per
  resolution separates a fixed part (VAE, text, I/O: ``a``) from a per-step DiT part (``b``). Other
  resolutions interpolate ``a`` and ``b`` linearly in pixel count between the two measured sizes.
* A chunk is 3 latent frames = 12 pixel frames (first chunk 9); seconds/chunk = 12 * (a + b*S) / 1000.
  The first chunk decodes 9 frames, so its fixed part is scaled by 9/12.
* Those FPS figures use the default 21-frame KV window (Self-Forcing / SlackServe W = 7 chunks) and bf16.
  The DiT step splits into a linear part and an attention part; from FLOP counts at 480p (4,680 query
  tokens against 32,760 keys, 1.3B params) attention is ~70 % of a step. Attention cost scales with
  (3 + W) keys per query; fp8 attention (SageAttention2) runs the attention part at 0.55x; sparsity rho
  runs it at (1 - rho) plus a 10 % of-skipped-work overhead.
* Stream batching (StreamDiffusionV2 eq. 2, memory-bound): L(B) ~ (1 + B)/2 * L(1).
* StreamDiffusionV2's pipeline-parallel stream batch on 4 H100s reaches ~40 FPS at 480p with 4 steps
  (42.26 FPS at 1 step). A pipeline does not shorten one chunk (every chunk still passes every stage and
  step), it overlaps several: a 4-GPU worker with batch B takes max(L_1gpu, 12*B/40) s per iteration.
* Quality is a modelled VBench-like score: 84.0 for the reference (4 steps, W=21, bf16, dense, full
  resolution; Self-Forcing reports VBench 84.3) minus per-knob penalties ordered as SlackServe's Fig. 10
  and appendix A describe (steps and window cost most, fp8 and mild sparsity little). They are placeholders
  for the profiler's measured scores, not measurements.
* State (KV cache) bytes = 2 (k, v) * 30 layers * 1536 * 2 bytes * tokens/frame * W frames.
* Every point lists what it needs (``"needs"``): "cuda", plus "bf16", "fp8-attention" or
  "sparse-attention" as its knobs require. fp8 points stay in the files (they are SlackServe's grid) but no
  engine runs them yet, so planners drop them (``FidelityProfile.engine_runnable``).

Regenerate the bundled files with ``python -m engine.serving.derived_profiles``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.fidelity import FidelityConfig, required_capabilities
from engine.serving.profile import BUNDLED_PROFILES, FidelityProfile, ProfilePoint, profile_device_type

# Published single-H100 FPS for the 1.3B model at steps 1..4 (StreamDiffusionV2 Fig. 9 / tables).
SDV2_FPS: dict[tuple[int, int], tuple[float, float, float, float]] = {
    (832, 480): (20.47, 17.97, 15.68, 14.0),
    (512, 512): (26.21, 24.02, 21.51, 19.43),
}
REFERENCE_WINDOW = 21
ATTENTION_FRACTION = 0.70
FP8_ATTENTION_SPEED = 0.55
SPARSE_OVERHEAD = 0.10
KV_BYTES_PER_TOKEN_FRAME = 2 * 30 * 1536 * 2  # k and v, 30 blocks, dim 1536, bf16

STEP_PENALTY = {4: 0.0, 3: 0.15, 2: 0.5, 1: 1.6}
WINDOW_PENALTY = {21: 0.0, 9: 0.35, 3: 1.0}
SPARSITY_PENALTY = {0.0: 0.0, 0.6: 0.1, 0.8: 0.35, 0.9: 0.8}
FP8_PENALTY = 0.15
LOW_RES_PENALTY_PER_UNIT = 3.6  # 0.75x resolution (upscaled back) costs 0.9
REFERENCE_QUALITY = 84.0
SDV2_PIPELINE_FPS = {(832, 480): 40.0, (512, 512): 60.0}  # 4-GPU pipeline, 4 steps
SDV2_PIPELINE_GPUS = 4
DEVICE = "H100-80GB"
BUNDLED = {"wan2.1-1.3b_h100_480p": (832, 480), "wan2.1-1.3b_h100_512": (512, 512)}


@dataclass(frozen=True)
class FrameCostModel:
    """ms per pixel frame = fixed_ms + step_ms * steps, at the reference window and bf16."""

    fixed_ms: float
    step_ms: float


def fit_frame_cost(fps_by_steps: tuple[float, ...]) -> FrameCostModel:
    steps = np.arange(1, len(fps_by_steps) + 1, dtype=np.float64)
    ms = 1000.0 / np.asarray(fps_by_steps, dtype=np.float64)
    slope, intercept = np.polyfit(steps, ms, 1)
    return FrameCostModel(fixed_ms=float(intercept), step_ms=float(slope))


def frame_cost_at(width: int, height: int) -> FrameCostModel:
    """Interpolate (in pixel count) between the two published resolutions."""
    (r0, f0), (r1, f1) = sorted(SDV2_FPS.items(), key=lambda kv: kv[0][0] * kv[0][1])
    m0, m1 = fit_frame_cost(f0), fit_frame_cost(f1)
    p0, p1 = r0[0] * r0[1], r1[0] * r1[1]
    w = (width * height - p0) / (p1 - p0)
    return FrameCostModel(
        fixed_ms=max(1.0, m0.fixed_ms + w * (m1.fixed_ms - m0.fixed_ms)),
        step_ms=max(0.1, m0.step_ms + w * (m1.step_ms - m0.step_ms)),
    )


def _attention_scale(cfg: FidelityConfig) -> float:
    keys = (3 + cfg.kv_window_frames) / (3 + REFERENCE_WINDOW)
    prec = FP8_ATTENTION_SPEED if cfg.precision == "fp8" else 1.0
    sparse = (1.0 - cfg.attention_sparsity) + SPARSE_OVERHEAD * cfg.attention_sparsity
    return keys * prec * sparse


def _needs(cfg: FidelityConfig) -> tuple[str, ...]:
    return tuple(sorted({profile_device_type(DEVICE)} | required_capabilities(cfg)))


def derive_point(
    cfg: FidelityConfig,
    resolution: tuple[int, int],
    chunk_pixel_frames: int = 12,
    first_chunk_pixel_frames: int = 9,
) -> ProfilePoint:
    w = int(round(resolution[0] * cfg.resolution_scale))
    h = int(round(resolution[1] * cfg.resolution_scale))
    cost = frame_cost_at(w, h)
    step_ms = cost.step_ms * ((1 - ATTENTION_FRACTION) + ATTENTION_FRACTION * _attention_scale(cfg))
    batch = (1 + cfg.stream_batch) / 2.0
    chunk_ms = chunk_pixel_frames * (cost.fixed_ms + step_ms * cfg.steps) * batch
    first_ms = (first_chunk_pixel_frames * cost.fixed_ms + chunk_pixel_frames * step_ms * cfg.steps) * batch
    quality = (
        REFERENCE_QUALITY
        - STEP_PENALTY[cfg.steps]
        - WINDOW_PENALTY.get(cfg.kv_window_frames, 0.0)
        - SPARSITY_PENALTY.get(cfg.attention_sparsity, 0.0)
        - (FP8_PENALTY if cfg.precision == "fp8" else 0.0)
        - LOW_RES_PENALTY_PER_UNIT * (1.0 - cfg.resolution_scale)
    )
    tokens_per_frame = (h // 16) * (w // 16)  # VAE /8 then patch /2
    return ProfilePoint(
        config=cfg,
        latency_s=chunk_ms / 1000.0,
        first_chunk_latency_s=first_ms / 1000.0,
        quality=quality,
        state_bytes=float(KV_BYTES_PER_TOKEN_FRAME * tokens_per_frame * cfg.kv_window_frames * cfg.stream_batch),
        source="derived",
        needs=_needs(cfg),
    )


def pipeline_point(batch: int, resolution: tuple[int, int]) -> ProfilePoint:
    single = derive_point(FidelityConfig(steps=4, precision="bf16"), resolution)
    fps = SDV2_PIPELINE_FPS[resolution]
    config = FidelityConfig(steps=4, precision="bf16", stream_batch=batch, gpus=SDV2_PIPELINE_GPUS)
    return ProfilePoint(
        config=config,
        latency_s=max(single.latency_s, 12 * batch / fps),
        first_chunk_latency_s=max(single.first_chunk_latency_s, 9 * batch / fps),
        quality=single.quality,
        state_bytes=single.state_bytes * batch,
        source="derived",
        needs=_needs(config),
    )


def derived_h100_profile(resolution: tuple[int, int] = (832, 480), fps: float = 16.0) -> FidelityProfile:
    """The knob grid SlackServe profiles (steps x window x precision x sparsity) plus resolution and batch."""
    grid = itertools.product((1, 2, 3, 4), WINDOW_PENALTY, ("bf16", "fp8"), SPARSITY_PENALTY, (1.0, 0.75))
    points = [
        derive_point(FidelityConfig(steps=s, kv_window_frames=w, precision=p, attention_sparsity=r, resolution_scale=x),
                     resolution)
        for s, w, p, r, x in grid
    ]
    points += [derive_point(FidelityConfig(steps=4, precision="bf16", stream_batch=b), resolution) for b in (2, 3, 4)]
    if resolution in SDV2_PIPELINE_FPS:
        points += [pipeline_point(b, resolution) for b in (1, 2, 3, 4)]
    return FidelityProfile(
        model="wan2.1-t2v-1.3b-causal",
        device=DEVICE,
        resolution=resolution,
        chunk_latent_frames=3,
        chunk_pixel_frames=12,
        first_chunk_pixel_frames=9,
        fps=fps,
        points=tuple(points),
        source="derived from StreamDiffusionV2 single-H100 FPS (480p, 512x512) and SlackServe's knob grid; "
        "quality is modelled, see docs/simulation.md",
        notes=(
            "replace with the profiler's measured JSON when available",
            "fp8 points (needs fp8-attention) need an fp8 attention kernel (SageAttention or torch float8 on "
            "CUDA) that the engine does not have yet: planners drop them (FidelityProfile.engine_runnable)",
        ),
    )


def write_bundled(directory: Path = BUNDLED_PROFILES) -> list[Path]:
    """(Re)write the bundled derived profiles; returns the paths written."""
    paths = []
    for name, resolution in BUNDLED.items():
        path = directory / f"{name}.json"
        derived_h100_profile(resolution).save(path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for written in write_bundled():
        print(written)
