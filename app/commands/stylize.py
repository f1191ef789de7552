"""`diffcast stylize IN OUT --prompt P`: file-to-file video-to-video with the streaming V2V recipe.

The file is streamed through exactly the code path a live stream uses (chunk by chunk, KV cache,
VAE caches, noise controller), so what you see here is what a webcam stream would get.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from app.commands.arguments import add_vae_argument, parse_size
from app.server.config import add_lora_arguments, lora_specs
from engine.fidelity import PRECISION_CHOICES

NAME = "stylize"
HELP = "Stylize a video file with the streaming video-to-video recipe."

log = logging.getLogger(__name__)


def chunk_precision(args: argparse.Namespace) -> str:
    """``--precision`` for ``--device`` (auto: bf16 where the processor has bf16 units, else fp32)."""
    from engine.devices import resolve_precision

    precision = resolve_precision(args.precision, args.device)
    log.info("precision %s", precision)
    return precision


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", type=Path, help="input video file")
    parser.add_argument("output", type=Path, help="output video file (.mp4, .webm, .mkv, ...)")
    parser.add_argument("--prompt", required=True, help="style prompt")
    parser.add_argument("--model", default=None, help="checkpoint path or 'tiny-random'; default: the embedded model")
    add_vae_argument(parser)
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (1-4)")
    parser.add_argument("--noise-scale", type=float, default=None, help="noise strength in (0, 1]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=parse_size, default=None, help="WxH processing size, e.g. 256x256")
    parser.add_argument("--no-stabilize", dest="stabilize", action="store_false",
                        help="turn off the temporal stabilizer (where the model's config enables it)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", choices=PRECISION_CHOICES, default="auto",
                        help="compute precision (default auto: bf16 where the processor has bf16 units, else fp32)")
    add_lora_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from engine.pipeline import ModelNotAvailableError, Pipeline, StreamParams, UnsupportedModeError
    from engine.video_io import VideoInputError, stylize_file

    if not args.input.is_file():
        log.error("input video %s does not exist", args.input)
        return 2
    try:
        loras = lora_specs(args.lora, args.lora_strength)
        pipe = Pipeline.load(args.model, device=args.device, vae=args.vae)
        for lora in loras:
            pipe.load_lora(lora.name, lora.path, lora.strength)
    except (ModelNotAvailableError, ValueError) as exc:  # LoRAError is a ValueError
        log.error("%s", exc)
        return 2
    try:
        pipe.capabilities.require("v2v")
        # Unset steps / noise scale: the model's own operating point (Pipeline.capabilities).
        params = StreamParams(prompt=args.prompt, seed=args.seed, steps=args.steps, noise_scale=args.noise_scale,
                              stabilize=args.stabilize)
        params = pipe.with_knobs(params, precision=chunk_precision(args))
        frames = stylize_file(pipe, args.input, args.output, params, size=args.size, progress=True)
    except (VideoInputError, UnsupportedModeError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    log.info("wrote %d frames to %s", frames, args.output)
    return 0
