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
