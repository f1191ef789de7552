"""BMPR on hand-built frontiers: quality mode, speed-recovery mode, the median floor."""

from __future__ import annotations

import numpy as np
import pytest

from engine.fidelity import FidelityConfig
from engine.serving.bmpr import BMPR, Mode
from engine.serving.profile import ProfilePoint


def pts() -> list[ProfilePoint]:
    # (latency, quality): a fast-but-ugly point below the floor, three frontier points above it, and
    # two dominated points that still count toward the median floor.
    raw = [(0.2, 70.0), (0.4, 81.0), (0.6, 83.0), (0.9, 84.0), (0.7, 82.0), (0.95, 79.0)]
    return [ProfilePoint(FidelityConfig(steps=1 + i % 4, kv_window_frames=1 + i), lat, lat, q, 0.0)
            for i, (lat, q) in enumerate(raw)]


def test_floor_is_median_over_all_candidates_including_dominated() -> None:
    b = BMPR(pts())
    assert b.floor == pytest.approx(np.median([70, 81, 83, 84, 82, 79]))  # 81.5
    assert [p.latency_s for p in b.frontier] == [0.2, 0.4, 0.6, 0.9]


def test_quality_mode_picks_best_quality_within_budget() -> None:
    b = BMPR(pts())
    r = b.route(0.65)
    assert r.mode is Mode.QUALITY and r.point.latency_s == 0.6
    r = b.route(5.0)
    assert r.mode is Mode.QUALITY and r.point.quality == 84.0


def test_speed_recovery_takes_fastest_config_above_floor_not_fastest_overall() -> None:
    b = BMPR(pts())
    # Budget 0.45: (0.4, 81) fits but is below the 81.5 floor, (0.2, 70) too: quality mode is empty.
    r = b.route(0.45)
    assert r.mode is Mode.SPEED_RECOVERY
    assert r.point.latency_s == 0.6 and r.point.quality >= b.floor
    r = b.route(0.1)
    assert r.mode is Mode.SPEED_RECOVERY and r.point.latency_s == 0.6


def test_vectorised_routing_matches_bruteforce_rule() -> None:
    cands = pts()
    b = BMPR(cands)
    rng = np.random.default_rng(1)
    budgets = rng.uniform(0.0, 1.2, size=500)
    idx = b.route_many(budgets)
    for B, i in zip(budgets, idx, strict=True):
        ok = [p for p in b.frontier if p.quality >= b.floor]
        within = [p for p in ok if p.latency_s <= B]
        want = max(within, key=lambda p: p.quality) if within else min(ok, key=lambda p: p.latency_s)
        assert b.frontier[int(i)] is want


def test_budget_keeps_stream_out_of_urgent() -> None:
    b = BMPR(pts())
    # With P=3, R=0.3, alpha=2 the budget is 0.9: a 0.9 s chunk leaves credit 1.8 = 2T (NORMAL).
    assert b.budget(3.0, 0.3, 2.0) == pytest.approx(0.9)


def test_empty_candidates_rejected() -> None:
    with pytest.raises(ValueError, match="at least one"):
        BMPR([])


def test_a_declared_floor_replaces_the_median_and_is_clamped_to_the_best_candidate() -> None:
    b = BMPR(pts(), floor=75.0)
    assert b.floor == 75.0
    r = b.route(0.45)  # (0.4, 81) fits and clears the declared floor, though not the median one
    assert r.mode is Mode.QUALITY and r.point.latency_s == 0.4
    assert b.route(0.1).point.latency_s == 0.4  # speed recovery stops at the floor: (0.2, 70) stays out
    assert BMPR(pts(), floor=99.0).floor == 84.0  # above every candidate: the best one is the floor


def test_the_default_models_ladder_routes_down_to_its_shipping_bar() -> None:
    """The shipped profile declares the embedded model's shipping bar (20 dB against the teachers) as
    its floor, so the policy uses every rung that clears it, not only those above the median."""
    import json

    from engine.serving.policy import SlackPolicy
    from engine.serving.profile import BUNDLED_PROFILES, load_profile

    path = BUNDLED_PROFILES / "default_cpu_256.json"
    raw = json.loads(path.read_text())
    for capabilities in ({"cpu", "bf16"}, {"cpu"}):  # a CPU with bf16 units, one without
        points = [p for p in raw["points"] if set(p["needs"]) <= capabilities]
        # By hand: the points no other point beats on both latency and quality, at or above the bar.
        clearing = sorted(p["latency_s"] for p in points if p["quality"] >= raw["quality_floor"] and not any(
            q["latency_s"] <= p["latency_s"] and q["quality"] >= p["quality"] and q is not p for q in points))
        assert len(clearing) >= 5
        policy = SlackPolicy(load_profile(path).runnable(capabilities))
        reachable = {policy.router.route(budget).point.latency_s for budget in np.linspace(0.0, 1.0, 201)}
        assert sorted(reachable) == clearing
