"""Autoscaler: hysteresis band, proportional target, consolidate before scale-in, rebalance on scale-out."""

from __future__ import annotations

import math

import pytest

from engine.serving.autoscale import AutoscaleConfig, desired_worker_count, plan_scaling

CFG = AutoscaleConfig(streams_per_worker=2.0, target_utilisation=0.7, band=0.1, min_workers=1, max_workers=32)


def test_no_flapping_inside_the_band() -> None:
    workers = 10
    # Utilisation between 0.6 and 0.8 of 20 stream slots: 12..16 streams.
    for n in range(12, 17):
        assert desired_worker_count(n, workers, CFG)[0] == workers
    # Oscillating load inside the band never changes the count.
    w = workers
    for n in [12, 16, 13, 15, 12, 16] * 5:
        w = desired_worker_count(n, w, CFG)[0]
        assert w == workers


def test_proportional_target_outside_band() -> None:
    assert desired_worker_count(30, 10, CFG)[0] == math.ceil(30 / (2.0 * 0.7))  # 22
    assert desired_worker_count(4, 10, CFG)[0] == math.ceil(4 / 1.4)  # 3
    # Just outside the band still moves by at least one worker.
    assert desired_worker_count(17, 10, CFG)[0] == 13
    assert desired_worker_count(0, 10, CFG)[0] == 1  # min_workers clamp


def test_scale_in_consolidates_before_releasing() -> None:
    streams = {0: [1, 2, 3], 1: [4, 5], 2: [6], 3: []}
    plan = plan_scaling(streams, draining=(), cfg=CFG)
    assert plan.desired_workers == 4  # 6 streams / 8 slots = 0.75: inside the band, hold
    assert [(m.src, m.dst) for m in plan.moves] == [(0, 3)]  # the idle worker is rebalanced onto
    small = {0: [1, 2], 1: [3], 2: [], 3: []}
    plan = plan_scaling(small, draining=(), cfg=CFG)
    assert plan.desired_workers == 3
    # The empty worker with the lowest id is drained and can be released at once; nothing else moves.
    assert plan.release == (2,)
    busy_in = {0: [1, 2], 1: [3], 2: [7]}
    plan = plan_scaling(busy_in, draining=(), cfg=AutoscaleConfig(2.0, 0.9, 0.05))
    # The least-loaded live workers are drained; their streams move first and they are NOT released yet.
    assert plan.drain and not plan.release
    moved_from = {m.src for m in plan.moves}
    assert moved_from == set(plan.drain)
    assert all(m.dst not in plan.drain for m in plan.moves)


def test_draining_worker_released_only_when_empty() -> None:
    plan = plan_scaling({0: [1], 1: [2, 3], 2: [4]}, draining=(2,), cfg=CFG, move_cap=1)
    assert plan.moves[0].src == 2 and plan.release == () and plan.drain == (2,)
    plan = plan_scaling({0: [1, 4], 1: [2, 3], 2: []}, draining=(2,), cfg=CFG, move_cap=1)
    assert plan.release == (2,)
    plan = plan_scaling({0: [1], 1: [2, 3], 2: [4, 5]}, draining=(2,), cfg=CFG, move_cap=1)
    assert plan.release == () and plan.drain == (2,)


def test_scale_out_rebalances_onto_new_empty_workers() -> None:
    plan = plan_scaling({0: [1, 2, 3], 1: [4, 5], 2: [], 3: []}, draining=(), cfg=AutoscaleConfig(2.0, 0.6, 0.05))
    assert {(m.src, m.dst) for m in plan.moves} == {(0, 2), (0, 3)} or {(m.src, m.dst) for m in plan.moves} == {
        (0, 2), (1, 3)}
    assert all(m.src in (0, 1) for m in plan.moves)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="band"):
        AutoscaleConfig(band=0.8)
