"""Service credit and tier boundaries."""

from __future__ import annotations

import numpy as np
import pytest

from engine.serving.credit import Tier, TierThresholds, classify, classify_many, service_credit


def test_credit_is_slack_minus_inflight_and_next_chunk() -> None:
    assert service_credit(5.0, 0.5, 0.8) == pytest.approx(3.7)


@pytest.mark.parametrize(
    ("credit", "tier"),
    [(-1.0, Tier.URGENT), (1.99, Tier.URGENT), (2.0, Tier.NORMAL), (4.0, Tier.NORMAL), (4.01, Tier.RELAXED)],
)
def test_tier_boundaries_at_2T_and_4T(credit: float, tier: Tier) -> None:
    assert classify(credit, 1.0) is tier


def test_custom_thresholds_and_validation() -> None:
    th = TierThresholds(urgent_mult=1.0, relaxed_mult=2.0)
    assert classify(1.5, 1.0, th) is Tier.NORMAL
    assert classify(2.5, 1.0, th) is Tier.RELAXED
    with pytest.raises(ValueError, match="urgent_mult"):
        TierThresholds(urgent_mult=3.0, relaxed_mult=2.0)


def test_vectorised_classification_matches_scalar() -> None:
    rng = np.random.default_rng(0)
    c = rng.uniform(-2, 8, 1000)
    t = rng.uniform(0.3, 1.2, 1000)
    got = classify_many(c, t)
    assert [Tier(int(x)) for x in got] == [classify(float(a), float(b)) for a, b in zip(c, t, strict=True)]
