"""Bi-Modal Pareto Routing (SlackServe §5.2; papers: docs/references.md).

Offline: keep the Pareto frontier F of (latency, quality) over the per-stream configurations, and the
global floor Q_floor = median quality of ALL candidate configurations (not just the frontier), unless
the profile declares a floor of its own (``FidelityProfile.quality_floor``).
Online, for a chunk with time budget B:
* quality mode: among frontier points with L <= B and Q >= Q_floor, take the highest quality;
* speed-recovery mode (quality mode infeasible): the lowest-latency frontier point with Q >= Q_floor,
  even if it exceeds B; resource reallocation (priority, re-homing) is the next line of defence.

The budget: the largest next-chunk time that keeps the stream out of URGENT after this chunk, i.e.
T <= C + T with C = P - R - T >= a*T  =>  T <= (P - R) / (1 + a). RELAXED and NORMAL streams thus get
quality mode with room to spare; URGENT streams drop to speed-recovery only when even the fastest floor
configuration cannot keep them out of URGENT. ``static`` routing (the baselines and the credit-only
ablation) always returns the reference (highest-quality) configuration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np
import numpy.typing as npt

from engine.serving.profile import ProfilePoint, pareto_frontier, quality_floor


class Mode(Enum):
    QUALITY = "quality"
    SPEED_RECOVERY = "speed-recovery"


@dataclass(frozen=True)
class Route:
    point: ProfilePoint
    index: int  # index into BMPR.frontier
    mode: Mode


class BMPR:
    def __init__(self, candidates: Sequence[ProfilePoint], floor: float | None = None) -> None:
        if not candidates:
            raise ValueError("BMPR needs at least one candidate configuration")
        self.candidates = tuple(candidates)
        self.floor = quality_floor(self.candidates, floor)
        self.frontier = pareto_frontier(self.candidates)
        self._lat = np.array([p.latency_s for p in self.frontier], dtype=np.float64)
        self._first_lat = np.array([p.first_chunk_latency_s for p in self.frontier], dtype=np.float64)
        q = np.array([p.quality for p in self.frontier], dtype=np.float64)
        ok = np.nonzero(q >= self.floor)[0]
        # The frontier is sorted by latency with strictly rising quality, so the floor-satisfying points
        # are a suffix; its first element is the fastest config >= floor (the speed-recovery choice).
        self.fastest_ok = int(ok[0])
        self.best = len(self.frontier) - 1

    @property
    def latencies(self) -> npt.NDArray[np.float64]:
        return self._lat

    @property
    def first_latencies(self) -> npt.NDArray[np.float64]:
        return self._first_lat

    def latency(self, index: int, first_chunk: bool = False) -> float:
        return float(self._first_lat[index] if first_chunk else self._lat[index])

    def budget(self, slack_s: float, inflight_remaining_s: float, urgent_mult: float) -> float:
        return (slack_s - inflight_remaining_s) / (1.0 + urgent_mult)

    def route(self, budget_s: float) -> Route:
        i = int(self.route_many(np.array([budget_s]))[0])
        mode = Mode.QUALITY if self._lat[i] <= budget_s else Mode.SPEED_RECOVERY
        return Route(self.frontier[i], i, mode)

    def route_many(self, budgets_s: npt.NDArray[np.float64]) -> npt.NDArray[np.int64]:
        """Frontier index per budget. Highest quality with L <= B is the last index with L <= B
        (quality rises along the frontier); clamp below at the fastest floor-satisfying point, which
        covers both the quality-mode floor filter and speed-recovery."""
        idx = np.searchsorted(self._lat, budgets_s, side="right") - 1
        return np.maximum(idx, self.fastest_ok).astype(np.int64)
