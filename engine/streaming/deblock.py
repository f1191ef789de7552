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
real edges (a filter skipping steps above 60 grey levels still left 2.4-6.5x the energy on the grid).
What it spares instead is a look drawn on the grid (pixel art's cells), recognised by the stream's
conditioning (``DeblockConfig.spare``). The defaults (the whole excess, 2 pixels each side) were
chosen on the held-out photographs: a 4-pixel reach smoothed as well but cost up to 0.55 dB against
the teachers once the temporal stabilizer had run (docs/default-model.md, "Block texture").
Cost: a handful of slice operations on the decoded frames, timed as its own stage (``deblock_ms``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeblockConfig:
    """``spare``: unit text embeddings (the model's pooled conditioning) of looks whose grid is part of
    the look (pixel art draws 8-px cells): a stream whose conditioning is within cosine similarity
    ``spare_full`` of one is not filtered, and from ``spare_from`` on the filter weakens linearly."""

    strength: float = 1.0  # share of the excess step removed at each block boundary
    reach: int = 2  # pixels on each side of a boundary that take a share of the step
    spare: tuple[tuple[float, ...], ...] = ()
    spare_from: float = 0.5
    spare_full: float = 0.6

    def __post_init__(self) -> None:
        if not 0.0 < self.strength <= 1.0:
            raise ValueError(f"deblock strength must be in (0, 1], got {self.strength}")
        if self.reach < 1:
            raise ValueError(f"deblock reach must be at least 1 pixel, got {self.reach}")
        if not self.spare_from < self.spare_full:
            raise ValueError(f"deblock spare_from {self.spare_from} must be below spare_full {self.spare_full}")

    def strength_for(self, conditioning: torch.Tensor) -> float:
        """The strength for a stream conditioned on ``conditioning`` ([..., dim]; its rows' mean)."""
        if not self.spare:
            return self.strength
        looks = torch.tensor(self.spare, dtype=torch.float32)
        e = conditioning.detach().float().cpu().reshape(-1, conditioning.shape[-1]).mean(dim=0)
        if e.shape[0] != looks.shape[1]:
            raise ValueError(f"spared looks are {looks.shape[1]}-d embeddings, the stream's conditioning {e.shape[0]}-d")
        similarity = float((looks @ torch.nn.functional.normalize(e, dim=0)).max())
        spared = min(1.0, max(0.0, (similarity - self.spare_from) / (self.spare_full - self.spare_from)))
        return self.strength * (1.0 - spared)


@torch.no_grad()
def deblock(frames: torch.Tensor, block: int, strength: float, reach: int) -> torch.Tensor:
    """``frames`` [..., H, W] (float) with ``strength`` of the excess step at every ``block``-pixel boundary
    spread into a ramp over ``reach`` pixels each side (boundaries between rows and between columns);
    a new tensor."""
    if 2 * reach > block:
        raise ValueError(f"deblock reach {reach} overlaps the next boundary of {block}-pixel blocks")
    out = frames.clone()
    for dim in (-1, -2):
        if out.shape[dim] > block:
            _ramp_steps(out.movedim(dim, -1), block, strength, reach)
    return out


def _ramp_steps(x: torch.Tensor, block: int, strength: float, r: int) -> None:
    """In place, along the last axis of ``x`` (a view of the frames), at the boundaries between its
    whole blocks (an engine size is a multiple of the block)."""
    n = x.shape[-1] // block
    cells = x[..., : n * block].unflatten(-1, (n, block))  # a view: slices, no gathers (7x faster)
    left, right = cells[..., :-1, :], cells[..., 1:, :]  # the two blocks of each boundary
    p0, p1, q0, q1 = left[..., block - 1], left[..., block - 2], right[..., 0], right[..., 1]
    excess = strength * ((q0 - p0) - 0.5 * ((p0 - p1) + (q1 - q0)))
    for i in range(r):
        share = excess * ((r - i) / (2 * r + 1))
        left[..., block - 1 - i] += share
        right[..., i] -= share
