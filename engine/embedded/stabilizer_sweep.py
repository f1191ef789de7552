"""Choose the temporal stabilizer's settings for an embedded model on *training* clips.

    python -m engine.embedded.stabilizer_sweep [--config engine/weights/default.json] [--clips 6] [--threads 2]

Each clip streams once per look through the product's path (``evaluate.stylize_stream``: 1 frame, then
4 at a time), which yields the model's decoded frames before the stabilizer; every candidate setting
then runs over those frames as the runtime runs it (chunk by chunk, one history per stream from its
first frame) and is scored against the teachers as the evaluation scores the shipped output: mean PSNR
over looks and clips, and the warp error over the teachers' (DIS flow on the input, ``warp_error``).
The stabilizer trades the two: a longer history cuts flicker and, once the model is steadier than its
teachers, also averages away detail the teachers have. The pick is the setting with the best PSNR
whose warp ratio stays under ``--max-warp-ratio`` (a margin under the 1x target, since held-out clips
may flicker more). Held-out clips are left for ``engine.embedded.evaluate``, which scores the pick.
"""

from __future__ import annotations

import argparse
import itertools
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from engine.embedded.clips import render_clip, train_specs
from engine.embedded.evaluate import chunk_spans, input_flows, psnr, style_prompts, stylize_stream, warp_error
from engine.embedded.model import DEFAULT_CONFIG
from engine.embedded.teachers import stylize_clip
from engine.frames import frames_to_tensor, tensor_to_frames
from engine.pipeline import Pipeline
from engine.streaming.stabilizer import StabilizerConfig, StabilizerState, TemporalStabilizer

CLIP_FRAMES = 17  # the held-out clips' length: 1 + 4 chunks of 4


@dataclass(frozen=True)
class SweepRow:
    config: StabilizerConfig | None  # None: the stabilizer off (the model's decoded frames)
    psnr: float  # dB against the teachers, mean over looks and clips
    warp_ratio: float  # mean warp error over the teachers' mean warp error (all looks and clips)
    worst_look: str
    worst_psnr: float


def candidates(base: StabilizerConfig, strengths: list[float], motion: list[float],
               change: list[float]) -> list[StabilizerConfig]:
    """Every combination of the three knobs, the rest of ``base`` kept (cut threshold, flow size)."""
    return [replace(base, strength=s, motion_tolerance=m, change_tolerance=c)
            for s, m, c in itertools.product(strengths, motion, change)]


def stabilized(config: StabilizerConfig, frames: np.ndarray, decoded: np.ndarray,
               spans: list[tuple[int, int]]) -> np.ndarray:
    """``decoded`` (uint8 [T, H, W, 3], the model's frames) through a fresh stabilizer at ``config``,
    chunk by chunk as ``StreamRuntime.stabilize`` runs it, with ``frames`` the stream's input."""
    stabilizer, state = TemporalStabilizer(config), StabilizerState()
    chunks = [tensor_to_frames(stabilizer(state, frames_to_tensor(frames[a:b]), frames_to_tensor(decoded[a:b])))
              for a, b in spans]
    return np.concatenate(chunks)


def sweep(pipe: Pipeline, prompts: dict[str, str], configs: list[StabilizerConfig], clips: int) -> list[SweepRow]:
    """Score the stabilizer off and each of ``configs`` on ``clips`` training clips (spread over the
    training sources and motions) x every look."""
    specs = train_specs(CLIP_FRAMES)
    picked = [specs[i] for i in np.linspace(0, len(specs) - 1, clips).round().astype(int)]
    options: list[StabilizerConfig | None] = [None, *configs]
    # Per option and look, per clip: (PSNR, warp error of the output, warp error of the teacher).
    scores: dict[int, dict[str, list[tuple[float, float, float]]]] = {
        k: {style: [] for style in prompts} for k in range(len(options))}
    for ci, spec in enumerate(tqdm(picked, desc="sweep clips")):
        frames = render_clip(spec)
        flows = input_flows(frames)
        spans = chunk_spans(pipe, frames.shape[0])
        for style, prompt in prompts.items():
            teacher = stylize_clip(frames, style)
            warp_teacher = warp_error(teacher, flows)
            decoded = stylize_stream(pipe, frames, prompt, seed=ci).raw
            for k, option in enumerate(options):
                out = decoded if option is None else stabilized(option, frames, decoded, spans)
                scores[k][style].append((psnr(out, teacher), warp_error(out, flows), warp_teacher))
    rows = []
    for k, option in enumerate(options):
        per_look = {style: np.mean([s[0] for s in runs]) for style, runs in scores[k].items()}
        every = [s for runs in scores[k].values() for s in runs]
        worst = min(per_look, key=lambda style: per_look[style])
        rows.append(SweepRow(option, float(np.mean(list(per_look.values()))),
                             float(np.mean([s[1] for s in every]) / np.mean([s[2] for s in every])),
                             worst, float(per_look[worst])))
    return rows


def pick(rows: list[SweepRow], max_warp_ratio: float) -> SweepRow | None:
    """The best PSNR among the settings whose warp ratio is at most ``max_warp_ratio``."""
    ok = [r for r in rows if r.config is not None and r.warp_ratio <= max_warp_ratio]
    return max(ok, key=lambda r: r.psnr) if ok else None


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--clips", type=int, default=6, help="training clips (17 frames each), spread over the split")
    parser.add_argument("--strengths", type=_floats, default=[0.5, 0.6, 0.7, 0.8, 0.9])
    parser.add_argument("--motion-tolerances", type=_floats, default=[0.07, 0.1, 0.15])
    parser.add_argument("--change-tolerances", type=_floats, default=[0.1, 0.15, 0.2, 0.3])
    parser.add_argument("--max-warp-ratio", type=float, default=0.75,
                        help="the pick's ceiling on the warp ratio (the target is 1x on held-out clips, "
                             "which flicker more than training clips)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(args.threads)
    pipe = Pipeline.load(args.config.with_suffix(".safetensors"))
    base = pipe.runtime.config.stabilizer or StabilizerConfig()
    configs = candidates(base, args.strengths, args.motion_tolerances, args.change_tolerances)
    rows = sweep(pipe, style_prompts(args.config), configs, args.clips)
    print("| strength / motion / change tolerance | mean PSNR | warp ratio | worst look |")
    print("| --- | --- | --- | --- |")
    for r in sorted(rows, key=lambda r: -r.psnr):
        name = "none (the model's frames)" if r.config is None else (
            f"{r.config.strength:g} / {r.config.motion_tolerance:g} / {r.config.change_tolerance:g}"
            + (" (the config's)" if r.config == base else ""))
        print(f"| {name} | {r.psnr:.2f} | {r.warp_ratio:.3f} | {r.worst_look} {r.worst_psnr:.2f} |")
    best = pick(rows, args.max_warp_ratio)
    if best is None or best.config is None:
        print(f"\nno setting keeps the warp ratio under {args.max_warp_ratio:g}")
    else:
        print(f"\npick (best PSNR at warp ratio <= {args.max_warp_ratio:g}): strength {best.config.strength:g}, "
              f"motion_tolerance {best.config.motion_tolerance:g}, change_tolerance {best.config.change_tolerance:g}: "
              f"{best.psnr:.2f} dB, warp ratio {best.warp_ratio:.3f}")


if __name__ == "__main__":
    main()
