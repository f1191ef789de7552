"""The embedded model at its cameras' aspects: held-out clips seen by 4:3 and 16:9 cameras, against the teachers.

    python -m engine.embedded.evaluate_aspect [--config engine/weights/default.json] [--clips N] [--threads T]

The model was trained on square 256x256 crops; its DiT places tokens by relative (RoPE) positions and
its VAE is convolutional, so nothing in it is tied to a square. This measures what a non-square stream
gets: each held-out clip (engine/embedded/clips.py) is centre-cropped to the aspect and resized to the
size a stream of that aspect runs at (``Pipeline.stream_size``: 288x224 for 4:3, 336x192 for 16:9 on the
default model), as the live server does with a camera's frames; the teacher stylises those very frames
and the model streams them through the product path (``evaluate.stylize_stream``). The square row is the
clips as they are (256x256), scored the same way, in the same run.

The clips are rendered at 256x256, so the wide crops are upscaled a little (x1.13 for 4:3, x1.31 for
16:9): their input is slightly softer than the square one's.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from engine.aspect import fit_frame
from engine.embedded.clips import heldout_specs, render_clip
from engine.embedded.evaluate import input_flows, psnr, style_prompts, stylize_stream, warp_error
from engine.embedded.model import DEFAULT_CONFIG
from engine.embedded.teachers import stylize_clip
from engine.pipeline import Pipeline

log = logging.getLogger(__name__)

ASPECTS: dict[str, tuple[int, int]] = {"1:1": (1, 1), "4:3": (4, 3), "16:9": (16, 9)}


@dataclass(frozen=True)
class AspectScore:
    """One camera aspect's streams against the teachers, means over every look and clip."""

    size: tuple[int, int]  # (width, height) the streams ran at
    psnr: float  # dB, shipped output (after the temporal stabilizer)
    psnr_raw: float  # dB, the model's own decoded frames
    worst_look_psnr: float  # dB, the lowest look's mean (shipped)
    warp_ratio: float  # warp error of the shipped output / the teachers'


def aspect_scores(pipe: Pipeline, prompts: dict[str, str], clips: int | None = None,
                  aspects: dict[str, tuple[int, int]] = ASPECTS) -> dict[str, AspectScore]:
    """Score every look (``prompts``: style name -> prompt) on the held-out clips seen at each aspect."""
    specs = heldout_specs()[:clips]
    sizes = {name: pipe.stream_size(ratio) for name, ratio in aspects.items()}
    looks: dict[str, dict[str, list[float]]] = {name: {style: [] for style in prompts} for name in aspects}
    raw: dict[str, list[float]] = {name: [] for name in aspects}
    warps: dict[str, list[tuple[float, float]]] = {name: [] for name in aspects}  # (model, teacher)
    for ci, spec in enumerate(tqdm(specs, desc="aspect clips")):
        clip = render_clip(spec)
        for name, size in sizes.items():
            frames = np.stack([fit_frame(frame, size) for frame in clip])
            flows = input_flows(frames)
            for style, prompt in prompts.items():
                teacher = stylize_clip(frames, style)
                run = stylize_stream(pipe, frames, prompt, seed=ci)
                if run.shipped.shape[1:3] != (size[1], size[0]):
                    raise RuntimeError(f"a {name} stream came back at {run.shipped.shape[1:3]}, not {size}")
                looks[name][style].append(psnr(run.shipped, teacher))
                raw[name].append(psnr(run.raw, teacher))
                warps[name].append((warp_error(run.shipped, flows), warp_error(teacher, flows)))
    result = {}
    for name, size in sizes.items():
        means = [float(np.mean(values)) for values in looks[name].values()]
        model_warp, teacher_warp = (float(np.mean(w)) for w in zip(*warps[name], strict=True))
        result[name] = AspectScore(size, float(np.mean(means)), float(np.mean(raw[name])), min(means),
                                   model_warp / teacher_warp)
    return result

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--clips", type=int, default=None, help="only the first N held-out clips")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("engine.streaming.runtime").setLevel(logging.WARNING)  # a line per stream's size otherwise
    torch.set_num_threads(args.threads)
    pipe = Pipeline.load(args.config.with_suffix(".safetensors"))
    scores = aspect_scores(pipe, style_prompts(args.config), args.clips)
    print("| camera | stream size | PSNR (dB) | raw PSNR (dB) | worst look (dB) | warp ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, s in scores.items():
        print(f"| {name} | {s.size[0]}x{s.size[1]} | {s.psnr:.2f} | {s.psnr_raw:.2f} | {s.worst_look_psnr:.2f} "
              f"| {s.warp_ratio:.2f} |")


if __name__ == "__main__":
    main()
