"""`diffcast train-default`: reproduce the embedded default model from scratch on a CPU.

One command runs every stage of engine.embedded.train (synthetic clips + teachers, tiny VAE, latents,
tiny causal DiT, decoder fine-tune, export). Each stage checkpoints into ``--workdir``; rerunning the command resumes
where an interrupted run stopped.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

NAME = "train-default"
HELP = "Train the embedded default model (tiny VAE + causal DiT) from scratch on CPU."

log = logging.getLogger(__name__)


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.embedded.model import WEIGHTS_DIR

    parser.add_argument("--out", type=Path, default=WEIGHTS_DIR,
                        help="where default.safetensors and default.json go (default: the shipped location)")
    parser.add_argument("--workdir", type=Path, default=Path("runs/train-default"),
                        help="data cache and resumable checkpoints (~4.5 GB of frames)")
    parser.add_argument("--vae-steps", type=_positive, default=None)
    parser.add_argument("--dit-steps", type=_positive, default=None)
    parser.add_argument("--tune-rounds", type=int, default=None,
                        help="DiT tune rounds after the main phase (each draws styles in proportion to their loss)")
    parser.add_argument("--decoder-steps", type=_positive, default=None,
                        help="steps of the decoder fine-tune on the DiT's outputs")
    parser.add_argument("--threads", type=_positive, default=1,
                        help="torch threads (1 on a shared machine: more threads contend badly)")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from engine.embedded.train import TrainConfig, train_default

    cfg = TrainConfig(workdir=args.workdir, threads=args.threads, seed=args.seed)
    if args.vae_steps is not None:
        cfg.vae_steps = args.vae_steps
    if args.dit_steps is not None:
        cfg.dit_steps = args.dit_steps
    if args.tune_rounds is not None:
        if args.tune_rounds < 0:
            raise SystemExit(f"--tune-rounds must be >= 0, got {args.tune_rounds}")
        cfg.dit_tune_rounds = args.tune_rounds
    if args.decoder_steps is not None:
        cfg.decoder_steps = args.decoder_steps
    path = train_default(cfg, args.out)
    log.info("wrote %s and %s", path, path.with_suffix(".safetensors"))
    return 0
