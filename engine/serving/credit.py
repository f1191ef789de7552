"""Service credit and urgency tiers (SlackServe §3.1, §4.1; papers: docs/references.md).

C = P - (R + T): P playout slack, R remaining time of the chunk in flight (0 when not running),
T profiled time of the next chunk under its chosen fidelity. URGENT C < a*T, NORMAL a*T <= C <= b*T,
RELAXED C > b*T (defaults a = 2, b = 4; the paper's sensitivity sweep uses b = 2a).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import numpy.typing as npt


class Tier(IntEnum):
    """Lower value = more urgent; dispatch order sorts by (tier, credit)."""

    URGENT = 0
    NORMAL = 1
    RELAXED = 2


@dataclass(frozen=True, slots=True)
class TierThresholds:
    urgent_mult: float = 2.0
    relaxed_mult: float = 4.0

    def __post_init__(self) -> None:
        if not 0 <= self.urgent_mult <= self.relaxed_mult:
            raise ValueError(
                f"need 0 <= urgent_mult <= relaxed_mult, got {self.urgent_mult}, {self.relaxed_mult}"
            )


def service_credit(slack_s: float, inflight_remaining_s: float, next_chunk_s: float) -> float:
    return slack_s - (inflight_remaining_s + next_chunk_s)


def classify(credit: float, next_chunk_s: float, th: TierThresholds = TierThresholds()) -> Tier:
    if credit < th.urgent_mult * next_chunk_s:
        return Tier.URGENT
    if credit > th.relaxed_mult * next_chunk_s:
        return Tier.RELAXED
    return Tier.NORMAL


def classify_many(
    credit: npt.NDArray[np.float64], next_chunk_s: npt.NDArray[np.float64], th: TierThresholds = TierThresholds()
) -> npt.NDArray[np.int8]:
    """Vectorised ``classify``; returns Tier values as int8."""
    tiers = np.full(credit.shape, int(Tier.NORMAL), dtype=np.int8)
    tiers[credit < th.urgent_mult * next_chunk_s] = int(Tier.URGENT)
    tiers[credit > th.relaxed_mult * next_chunk_s] = int(Tier.RELAXED)
    return tiers
