"""Block ranges per pipeline rank and the DiT block scheduler (StreamDiffusionV2 §4.3, Fig. 13).

Every rank runs one contiguous range of DiT blocks. Rank 0 also does the VAE encode and the
patch/time/text embedding and the last rank the head, x̂₀, re-noise and VAE decode, so an even split
of blocks leaves the end ranks slower than the middle ones and the pipeline runs at the pace of its
slowest stage. The scheduler turns measured per-rank times into per-block cost estimates and picks
the contiguous partition that minimises the largest stage time.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)


def even_ranges(num_blocks: int, ranks: int) -> list[range]:
    """Contiguous ranges, sizes differing by at most one (earlier ranks get the extra blocks)."""
    if ranks < 1 or num_blocks < ranks:
        raise ValueError(f"cannot split {num_blocks} blocks over {ranks} ranks (every rank needs at least one block)")
    base, extra = divmod(num_blocks, ranks)
    out, start = [], 0
    for r in range(ranks):
        size = base + (1 if r < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def check_ranges(ranges: Sequence[range], num_blocks: int) -> list[range]:
    """Validate that ``ranges`` cover ``[0, num_blocks)`` contiguously, one non-empty range per rank."""
    if not ranges:
        raise ValueError("need at least one block range")
    start = 0
    for r, blocks in enumerate(ranges):
        if blocks.step != 1 or blocks.start != start or len(blocks) < 1:
            raise ValueError(
                f"block ranges must be non-empty, contiguous and start at 0: rank {r} has {blocks}, expected a "
                f"range starting at {start} ({[(b.start, b.stop) for b in ranges]})"
            )
        start = blocks.stop
    if start != num_blocks:
        raise ValueError(f"block ranges end at {start}, the model has {num_blocks} blocks")
    return [range(b.start, b.stop) for b in ranges]


def stage_times(ranges: Sequence[range], block_costs: Sequence[float], fixed_costs: Sequence[float]) -> list[float]:
    """Predicted time of each stage: its fixed (non-block) work plus its blocks' costs."""
    return [fixed + sum(block_costs[b] for b in blocks) for blocks, fixed in zip(ranges, fixed_costs, strict=True)]


def balance_ranges(block_costs: Sequence[float], fixed_costs: Sequence[float]) -> list[range]:
    """Contiguous partition of the blocks over ``len(fixed_costs)`` ranks minimising the largest stage time.

    Stage r costs ``fixed_costs[r]`` plus the costs of its blocks; every rank gets at least one block.
    Exact dynamic programme, O(ranks * blocks^2) (30 blocks, a handful of ranks: microseconds). Ties
    between optimal partitions are broken deterministically, so the same estimates give the same answer.
    """
    n, ranks = len(block_costs), len(fixed_costs)
    if ranks < 1 or n < ranks:
        raise ValueError(f"cannot split {n} blocks over {ranks} ranks (every rank needs at least one block)")
    if any(c < 0 for c in (*block_costs, *fixed_costs)):
        raise ValueError("block and fixed costs must be non-negative")
    prefix = [0.0]
    for c in block_costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[r][j]: smallest possible max stage time with blocks [0, j) on ranks [0, r]; cut[r][j] its start.
    best = [[inf] * (n + 1) for _ in range(ranks)]
    cut = [[0] * (n + 1) for _ in range(ranks)]
    for j in range(1, n + 1):
        best[0][j] = fixed_costs[0] + prefix[j]
    for r in range(1, ranks):
        for j in range(r + 1, n + 1):
            for i in range(r, j):  # rank r runs [i, j)
                cost = max(best[r - 1][i], fixed_costs[r] + prefix[j] - prefix[i])
                if cost < best[r][j] - 1e-15:
                    best[r][j], cut[r][j] = cost, i
    bounds, j = [n], n
    for r in range(ranks - 1, 0, -1):
        j = cut[r][j]
        bounds.append(j)
    bounds.append(0)
    bounds.reverse()
    return [range(bounds[r], bounds[r + 1]) for r in range(ranks)]


@dataclass(frozen=True)
class PipelinePrediction:
    """What N ranks would do with one GPU's measured costs (docs/parallel.md, "Predicting N GPUs")."""

    ranks: int
    ranges: list[range]
    stage_s: list[float]  # each rank's work per micro-step, its hand-off of the activations included
    chunk_s: float  # one chunk out every this often once the ring is full: the slowest stage
    fps: float  # frames per second for ``chunk_frames`` frames a chunk
    transfer_s: float  # one hand-off of the activations between two ranks


def predict_pipeline(block_costs: Sequence[float], first_s: float, last_s: float, ranks: int,
                     boundary_bytes: float, link_bytes_per_s: float, chunk_frames: int) -> PipelinePrediction:
    """The throughput of ``ranks`` pipeline ranks from one GPU's figures: the DiT's ``block_costs`` (seconds
    per block per micro-step), the work only the first rank does (``first_s``: VAE encode, embeddings)
    and only the last (``last_s``: head, x̂₀, VAE decode), and the activations a rank hands the next
    (``boundary_bytes``) over a link of ``link_bytes_per_s``. Blocks split as the scheduler would
    (:func:`balance_ranges`); every rank but the last also sends once per micro-step, which this counts as
    not overlapped with compute (the ring's sends are asynchronous: an upper bound on their cost). With
    the micro-steps of ``ranks`` chunks in flight, a chunk leaves the ring every slowest-stage time."""
    if ranks < 1 or link_bytes_per_s <= 0 or chunk_frames < 1:
        raise ValueError(f"need ranks >= 1, a positive link bandwidth and chunk frames, got {ranks}, "
                         f"{link_bytes_per_s}, {chunk_frames}")
    transfer = boundary_bytes / link_bytes_per_s if ranks > 1 else 0.0
    fixed = [0.0] * ranks
    fixed[0] += first_s
    fixed[-1] += last_s
    for r in range(ranks - 1):
        fixed[r] += transfer
    ranges = balance_ranges(block_costs, fixed)
    stages = stage_times(ranges, block_costs, fixed)
    chunk = max(stages)
    return PipelinePrediction(ranks, ranges, stages, chunk, chunk_frames / chunk if chunk > 0 else 0.0, transfer)


@dataclass(frozen=True)
class StageTiming:
    """What one rank measured for one micro-step: time in its blocks and in its other work."""

    rank: int
    blocks_s: float
    other_s: float


class BlockScheduler:
    """Per-block cost estimates from measured stage times, and the rebalance they call for.

    A rank measures its blocks as a whole; its time is spread evenly over its blocks (DiT blocks have
    identical shapes, so within a rank they cost the same) and smoothed with an exponential moving
    average. ``propose`` returns a new partition only when it predicts the slowest stage to get at
    least ``min_gain`` (relative) faster, so measurement noise does not make blocks (and their KV
    caches) shuttle back and forth.
    """

    def __init__(self, ranges: Sequence[range], smoothing: float = 0.5, min_gain: float = 0.1) -> None:
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if min_gain < 0:
            raise ValueError(f"min_gain must be >= 0, got {min_gain}")
        num_blocks = ranges[-1].stop if ranges else 0
        self.ranges = check_ranges(ranges, num_blocks)
        self.smoothing = smoothing
        self.min_gain = min_gain
        self.block_costs: list[float] | None = None
        self.fixed_costs: list[float] | None = None

    def set_ranges(self, ranges: Sequence[range]) -> None:
        self.ranges = check_ranges(ranges, self.ranges[-1].stop)

    def observe(self, timings: Sequence[StageTiming]) -> None:
        """Fold one micro-step's measurements (one per rank) into the estimates."""
        if sorted(t.rank for t in timings) != list(range(len(self.ranges))):
            raise ValueError(f"need one timing per rank 0..{len(self.ranges) - 1}, got ranks {[t.rank for t in timings]}")
        blocks = [0.0] * self.ranges[-1].stop
        fixed = [0.0] * len(self.ranges)
        for t in timings:
            fixed[t.rank] = t.other_s
            for b in self.ranges[t.rank]:
                blocks[b] = t.blocks_s / len(self.ranges[t.rank])
        a = self.smoothing
        if self.block_costs is None or self.fixed_costs is None:
            self.block_costs, self.fixed_costs = blocks, fixed
            return
        self.block_costs = [a * new + (1 - a) * old for new, old in zip(blocks, self.block_costs, strict=True)]
        self.fixed_costs = [a * new + (1 - a) * old for new, old in zip(fixed, self.fixed_costs, strict=True)]

    def propose(self) -> list[range] | None:
        """A better partition, or None when the current one is within ``min_gain`` of the best."""
        if self.block_costs is None or self.fixed_costs is None:
            return None
        now = max(stage_times(self.ranges, self.block_costs, self.fixed_costs))
        best = balance_ranges(self.block_costs, self.fixed_costs)
        then = max(stage_times(best, self.block_costs, self.fixed_costs))
        if best == self.ranges or then > now * (1.0 - self.min_gain):
            return None
        log.info("block scheduler: max stage %.4fs -> %.4fs with %s", now, then, [(r.start, r.stop) for r in best])
        return best
