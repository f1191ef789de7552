"""Autoscaling controller (TurboServe-style; docs/references.md): hysteresis, proportional target, consolidate, rebalance.

* Utilisation u = active streams / (K * workers), K = streams one worker sustains in real time.
* Inside the band |u - target| <= delta the worker count is held (no flapping on small swings).
* Outside it, the proportional target is ceil(N / (K * target)), clamped to [min, max] and moved at
  least one worker in the direction of the error.
* Scale-in consolidates first: the least-loaded workers are marked draining, their streams re-homed to
  the rest, and a worker is released only once it is empty. Scale-out rebalances: each new (empty) worker
  takes one stream from the most-loaded worker that has at least two.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    streams_per_worker: float = 1.0
    target_utilisation: float = 0.7
    band: float = 0.1
    min_workers: int = 1
    max_workers: int = 64

    def __post_init__(self) -> None:
        if self.streams_per_worker <= 0:
            raise ValueError(f"streams_per_worker must be > 0, got {self.streams_per_worker}")
        if not 0 < self.target_utilisation <= 1 or not 0 <= self.band < self.target_utilisation:
            raise ValueError(f"need 0 < target <= 1 and 0 <= band < target, got {self.target_utilisation}, {self.band}")
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(f"need 1 <= min_workers <= max_workers, got {self.min_workers}, {self.max_workers}")


@dataclass(frozen=True, slots=True)
class Move:
    stream_id: int
    src: int
    dst: int


@dataclass(frozen=True)
class ScalePlan:
    desired_workers: int
    utilisation: float
    drain: tuple[int, ...] = ()
    release: tuple[int, ...] = ()
    moves: tuple[Move, ...] = ()


def desired_worker_count(active_streams: int, workers: int, cfg: AutoscaleConfig) -> tuple[int, float]:
    capacity = cfg.streams_per_worker * max(workers, 1)
    u = active_streams / capacity
    if abs(u - cfg.target_utilisation) <= cfg.band + 1e-9:  # inclusive band, float-safe
        return workers, u
    target = math.ceil(active_streams / (cfg.streams_per_worker * cfg.target_utilisation))
    if u > cfg.target_utilisation:
        target = max(target, workers + 1)
    else:
        target = min(target, workers - 1)
    return min(cfg.max_workers, max(cfg.min_workers, target)), u


def plan_scaling(
    streams_by_worker: Mapping[int, Sequence[int]],
    draining: Sequence[int],
    cfg: AutoscaleConfig,
    move_cap: int = 2,
) -> ScalePlan:
    """One controller step over the current membership. ``streams_by_worker`` lists every live worker
    (draining ones included) with its streams, lowest-credit first."""
    live = [w for w in streams_by_worker if w not in draining]
    n_streams = sum(len(v) for v in streams_by_worker.values())
    desired, u = desired_worker_count(n_streams, len(live), cfg)
    pending = {w: list(v) for w, v in streams_by_worker.items()}
    load = {w: len(v) for w, v in pending.items()}
    drain = list(draining)
    if desired < len(live):
        extra = len(live) - desired
        victims = sorted(live, key=lambda w: (load[w], w))[:extra]
        drain += victims
        live = [w for w in live if w not in victims]
    moves: list[Move] = []
    if live:
        for w in drain:
            for _ in range(min(move_cap, len(pending[w]))):
                s = pending[w].pop(0)
                dst = min(live, key=lambda x: (load[x], x))
                moves.append(Move(s, w, dst))
                load[dst] += 1
                load[w] -= 1
        if desired <= len(live):
            empties = [w for w in live if load[w] == 0]
            for dst in empties:
                src = max(live, key=lambda x: (load[x], -x))
                if load[src] < 2:
                    break
                moved = pending[src].pop(0)
                moves.append(Move(moved, src, dst))
                load[src] -= 1
                load[dst] += 1
    # Release only workers that are empty now; ones emptied by this plan's moves go on the next step,
    # after the executor has actually moved their streams.
    release = tuple(w for w in drain if not streams_by_worker[w])
    return ScalePlan(
        desired_workers=desired,
        utilisation=u,
        drain=tuple(w for w in drain if w not in release),
        release=release,
        moves=tuple(moves),
    )
