"""`diffcast train-default`: reproduce the embedded default model from scratch on a CPU, or teach a
shipped one new looks.

One command runs every stage of engine.embedded.train (synthetic clips + teachers, tiny VAE, latents,
tiny causal DiT, decoder fine-tune, export). Each stage checkpoints into ``--workdir``; ``--resume``
continues where an interrupted run stopped (without it a work directory holding checkpoints is
refused, so two runs never mix). ``--finetune-from CONFIG`` starts from a shipped checkpoint and
trains only the looks it lacks (plus a replay of its own), which takes a fraction of a full run;
with ``--guide-decoder`` it keeps the looks and fine-tunes a decoder that also reads the input frames;
with ``--input-noise`` it re-tunes the DiT (and the decoder on its outputs) to a new V2V input noise.
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


def _block_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated block sizes in pixels, got {text!r}") from None
    if any(size < 2 or size > 256 for size in sizes):
        raise argparse.ArgumentTypeError(f"block sizes must be 2 to 256 pixels, got {text!r}")
    return sizes


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
    parser.add_argument("--warp-weight", type=float, default=0.0,
                        help="weight of the motion-compensated temporal loss (along the clips' optical flow) "
                             "in the VAE, DiT and decoder stages; 0 = off (docs/default-model.md, 'Flicker')")
    parser.add_argument("--decoder-warp-weight", type=float, default=None,
                        help="the decoder stage's weight of that loss (default: --warp-weight), e.g. 3 with no "
                             "--warp-weight: the term in the decoder only, the shipped checkpoint's recipe")
    parser.add_argument("--threads", type=_positive, default=1,
                        help="torch threads (1 on a shared machine: more threads contend badly)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true",
                        help="continue the run whose checkpoints --workdir holds (each stage from its last checkpoint)")
    parser.add_argument("--finetune-from", type=Path, default=None, metavar="CONFIG",
                        help="a shipped model's .json: keep its VAE encoder and DiT, train the looks it lacks")
    parser.add_argument("--looks-steps", type=_positive, default=None,
                        help="with --finetune-from: DiT steps of the new-looks phase before the tune rounds")
    parser.add_argument("--guide-decoder", action="store_true",
                        help="with --finetune-from: keep the model's looks and DiT, and fine-tune a decoder that "
                             "also reads the input frames (docs/default-model.md, 'Guided decoder')")
    parser.add_argument("--guide-blurs", type=_block_sizes, default=(),
                        help="guided decoder: also map box-blurred copies of the input, e.g. 4,16 (block sizes in px)")
    parser.add_argument("--warp-looks", type=lambda t: tuple(n.strip() for n in t.split(",") if n.strip()), default=(),
                        help="decoder stage: only these looks' samples carry the warp term, e.g. thermal,noir "
                             "(default: every look)")
    parser.add_argument("--input-noise", type=float, default=None,
                        help="share of Gaussian noise in the V2V input the DiT is trained for, 0 to 1 (0: a "
                             "deterministic restyle); with --finetune-from the DiT is re-tuned to it "
                             "(default: the base model's, 1 on a full run; docs/default-model.md, 'Input noise')")
    parser.add_argument("--guide-per-group", action="store_true",
                        help="guided decoder: one affine map per latent frame (4 pixel frames) instead of per frame")


def run(args: argparse.Namespace) -> int:
    from engine.embedded.train import (
        STYLE_NAMES,
        TrainConfig,
        WorkdirInUseError,
        check_workdir,
        finetune_looks,
        guide_decoder,
        train_default,
    )

    try:
        check_workdir(args.workdir, args.resume)
    except WorkdirInUseError as exc:
        raise SystemExit(str(exc)) from None
    if args.looks_steps is not None and args.finetune_from is None:
        raise SystemExit("--looks-steps only applies with --finetune-from")
    if args.guide_decoder and args.finetune_from is None:
        raise SystemExit("--guide-decoder only applies with --finetune-from (a full run trains a guided decoder anyway)")
    if args.guide_decoder and args.looks_steps is not None:
        raise SystemExit("--guide-decoder trains the decoder only; --looks-steps does not apply")
    if (args.guide_blurs or args.guide_per_group) and args.finetune_from is not None and not args.guide_decoder:
        # A looks fine-tune keeps its base's decoder as it is; only a new guided decoder takes these.
        raise SystemExit("--guide-blurs and --guide-per-group shape a new guided decoder: with --finetune-from "
                         "they need --guide-decoder")
    if not 0.0 <= args.warp_weight <= 100.0:  # NaN fails both comparisons
        raise SystemExit(f"--warp-weight must be a number from 0 to 100, got {args.warp_weight}")
    if args.decoder_warp_weight is not None and not 0.0 <= args.decoder_warp_weight <= 100.0:
        raise SystemExit(f"--decoder-warp-weight must be a number from 0 to 100, got {args.decoder_warp_weight}")
    unknown = sorted(set(args.warp_looks) - set(STYLE_NAMES))
    if unknown:
        raise SystemExit(f"--warp-looks: no teacher for {', '.join(unknown)}; the looks are {', '.join(STYLE_NAMES)}")
    if args.input_noise is not None:
        if not 0.0 <= args.input_noise <= 1.0:  # NaN fails both comparisons
            raise SystemExit(f"--input-noise must be a number from 0 to 1, got {args.input_noise}")
        if args.guide_decoder:
            raise SystemExit("--guide-decoder keeps the base's DiT; --input-noise re-tunes it: run them one after another")
    cfg = TrainConfig(workdir=args.workdir, threads=args.threads, seed=args.seed, warp_weight=args.warp_weight,
                      decoder_warp_weight=args.decoder_warp_weight, warp_looks=args.warp_looks,
                      guide_blurs=args.guide_blurs, guide_per_group=args.guide_per_group,
                      input_noise=args.input_noise)
    if cfg.warp_looks and not cfg.decoder_warp:
        raise SystemExit("--warp-looks needs a --warp-weight (or --decoder-warp-weight) above 0")
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
    if args.finetune_from is not None:
        if not args.finetune_from.is_file():
            raise SystemExit(f"--finetune-from {args.finetune_from}: no such model config (a .json next to its .safetensors)")
        if args.looks_steps is not None:
            cfg.looks_steps = args.looks_steps
        try:
            if args.guide_decoder:
                path = guide_decoder(cfg, args.finetune_from, args.out)
            else:
                path = finetune_looks(cfg, args.finetune_from, args.out)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    else:
        path = train_default(cfg, args.out)
    log.info("wrote %s and %s", path, path.with_suffix(".safetensors"))
    return 0
