"""Argument types the commands share."""

from __future__ import annotations

import argparse
from pathlib import Path


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


def parse_sites(text: str) -> tuple[str, ...]:
    """``--compile-sites``: a comma-separated list of call site names (engine/compiled.py checks them)."""
    return tuple(site.strip() for site in text.split(",") if site.strip())


def add_compile_arguments(parser: argparse.ArgumentParser) -> None:
    """``--compile``, ``--compile-cache DIR``, ``--compile-backend NAME``: torch.compile for the DiT and the
    VAE at the shapes the command runs (engine/compiled.py); the warm-up is reported as the cold start."""
    parser.add_argument("--compile", action="store_true",
                        help="run the DiT and the VAE compiled (torch.compile) at the shapes this command runs (bench: "
                             "its rows; profile: its points; serve: the serving profile's points, in-process engine), "
                             "other shapes eager; the compile warm-up is reported as the cold start")
    parser.add_argument("--compile-cache", type=Path, default=None, metavar="DIR",
                        help="with --compile: where compiled code is kept between runs "
                             "(default $XDG_CACHE_HOME/diffcast/torch-compile, else ~/.cache/diffcast/torch-compile)")
    parser.add_argument("--compile-sites", type=parse_sites, default=("dit", "vae.encode", "vae.decode"), metavar="SITE,...",
                        help="with --compile: the call sites compiled (default all: dit, vae.encode, vae.decode)")
    parser.add_argument("--compile-backend", default="inductor",
                        help="with --compile: torch.compile's backend (default inductor; 'eager' or 'aot_eager' "
                             "trace without generating code, to tell tracing problems from compiler ones)")
