"""Stylize a video file with the streaming recipe (the same code path as a live stream).

    .venv/bin/python demos/stylize_file.py                              # makes a synthetic clip first
    .venv/bin/python demos/stylize_file.py my_clip.mp4 --prompt "anime cel shading" --out out.mp4

Prints frames, seconds per frame and the output path. The CLI form is `diffcast stylize IN OUT --prompt P`;
the playground's "Video file" tab does the same in a browser.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.client import pattern_frame  # noqa: E402
from engine.pipeline import DEFAULT_MODEL, Pipeline, StreamParams  # noqa: E402
from engine.video_io import VideoWriter, read_frames, stylize_file  # noqa: E402


def synthetic_clip(path: Path, frames: int = 48, size: tuple[int, int] = (320, 240)) -> Path:
    writer = VideoWriter(path, 16.0, size)
    for i in range(frames):
        writer.write(pattern_frame(i, size))
    writer.close()
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", nargs="?", type=Path, help="video file (default: a generated 3 s clip)")
    parser.add_argument("--out", type=Path, default=Path("runs/stylized.mp4"))
    parser.add_argument("--prompt", default="oil painting")
    parser.add_argument("--blend-with", default=None, help="a second prompt, mixed 50/50 (slerp)")
    parser.add_argument("--model", default=None, help="default: the embedded model, else tiny-random")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    model = args.model or ("default" if DEFAULT_MODEL.is_file() else "tiny-random")
    source = args.input or synthetic_clip(args.out.with_name("synthetic_input.mp4"))
    pipe = Pipeline.load(model, device=args.device)
    params = StreamParams(prompt=args.prompt, steps=args.steps)
    if args.blend_with:
        params = params.with_(prompt=(args.prompt, args.blend_with), prompt_weights=(0.5, 0.5), blend_mode="slerp")
    start = time.perf_counter()
    frames = stylize_file(pipe, source, args.out, params, progress=True)
    seconds = time.perf_counter() - start
    _, fps, _ = read_frames(args.out)
    print(f"{model}: {frames} frames from {source} -> {args.out} ({fps:.0f} fps file), "
          f"{1000 * seconds / frames:.0f} ms/frame on {args.device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
