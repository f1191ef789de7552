"""Deblocking: spread the steps a block decoder leaves on its pixel grid into ramps.

A decoder that maps each latent cell to one block of pixels (the embedded model's TinyVAE: a 1x1
linear path and 1/8-resolution convs, then a pixel shuffle to 8x8 blocks) draws every error of its
latent as a block, and the DiT, which predicts 2x2 latent cells per token, adds seams on a 16-pixel
grid. Measured on held-out photographs, the squared gradient across the 16-pixel grid lines of the
decoded frames was 11-20x that elsewhere (``engine.embedded.block_texture``), and the temporal
stabilizer, blending motion-compensated history, only brought it to 4-8x.

The filter works like the loop filter of a block codec (H.264), along one axis at a time, at every
boundary between two blocks (p3 p2 p1 p0 | q0 q1 q2 q3):

    excess = (q0 − p0) − ½·((p0 − p1) + (q1 − q0))    the step beyond what the local slope predicts
    p_i += strength · excess · (r − i) / (2r + 1)      i = 0 .. r−1 (r = ``reach`` pixels each side)
    q_i −= strength · excess · (r − i) / (2r + 1)

so a step becomes a ramp over 2r + 1 pixel boundaries, and a smooth gradient (no excess) passes
unchanged. Unlike the codec's filter it does not spare large steps: the DiT's seams are as large as
real edges (a filter skipping steps above 60 grey levels still left 5x the energy on the grid), and
smoothing every boundary raised PSNR against the teachers on 8 of 9 looks (docs/default-model.md,
"Block texture"). Cost: a handful of slice operations on the decoded frames (``decode`` stage).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeblockConfig:
    strength: float = 0.9  # share of the excess step removed at each block boundary
    reach: int = 4  # pixels on each side of a boundary that take a share of the step

    def __post_init__(self) -> None:
        if not 0.0 < self.strength <= 1.0:
            raise ValueError(f"deblock strength must be in (0, 1], got {self.strength}")
        if self.reach < 1:
            raise ValueError(f"deblock reach must be at least 1 pixel, got {self.reach}")


@torch.no_grad()
def deblock(frames: torch.Tensor, block: int, config: DeblockConfig) -> torch.Tensor:
    """``frames`` [..., H, W] (float) with the step at every ``block``-pixel boundary spread into a ramp
    (boundaries between rows and between columns); a new tensor."""
    if 2 * config.reach > block:
        raise ValueError(f"deblock reach {config.reach} overlaps the next boundary of {block}-pixel blocks")
    out = frames.clone()
    for dim in (-1, -2):
        if out.shape[dim] > block:
            _ramp_steps(out.movedim(dim, -1), block, config)
    return out


def _ramp_steps(x: torch.Tensor, block: int, config: DeblockConfig) -> None:
    """In place, along the last axis of ``x`` (a view of the frames)."""
    # Boundaries whose ramp fits inside the frame (an engine size is a multiple of the block anyway).
    pos = torch.arange(block, x.shape[-1] - max(config.reach, 2) + 1, block, device=x.device)
    p0, p1, q0, q1 = x[..., pos - 1], x[..., pos - 2], x[..., pos], x[..., pos + 1]
    excess = config.strength * ((q0 - p0) - 0.5 * ((p0 - p1) + (q1 - q0)))
    r = config.reach
    for i in range(r):
        share = excess * ((r - i) / (2 * r + 1))
        x[..., pos - 1 - i] += share
        x[..., pos + i] -= share
