"""Argument types the commands share."""

from __future__ import annotations

import argparse


def parse_size(text: str) -> tuple[int, int]:
    """``WIDTHxHEIGHT`` as a (width, height) pair of positive integers."""
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size must look like 256x256 (WIDTHxHEIGHT), got {text!r}") from None
    if w <= 0 or h <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return w, h


def add_vae_argument(parser: argparse.ArgumentParser) -> None:
    """``--vae SPEC``: the stream VAE of a Wan model (engine/vae_choice.py), chosen when the model loads."""
    parser.add_argument(
        "--vae", default=None, metavar="SPEC",
        help="Wan models only (a diffcast.json directory or random:): 'wan' (the Wan 2.1 VAE), a local taew2_1 "
             ".pth/.safetensors file (Wan's encoder, the TAEHV tiny decoder), 'tiny:FILE' (the tiny VAE both ways); "
             "FILE may be 'tiny-random' (random weights); default: the manifest's choice, else 'wan' (docs/vae.md)",
    )
