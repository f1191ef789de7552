"""Block ranges and the block scheduler: pure functions on hand-built per-block timings."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.parallel.partition import (
    BlockScheduler,
    StageTiming,
    balance_ranges,
    check_ranges,
    even_ranges,
    stage_times,
)


def brute_force_best(costs: list[float], fixed: list[float]) -> float:
    """Smallest max stage time over every contiguous partition (independent enumeration)."""
    n, ranks = len(costs), len(fixed)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), ranks - 1):
        bounds = [0, *cuts, n]
        ranges = [range(bounds[r], bounds[r + 1]) for r in range(ranks)]
        best = min(best, max(stage_times(ranges, costs, fixed)))
    return best


def test_even_ranges_cover_all_blocks() -> None:
    assert even_ranges(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert even_ranges(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match="every rank needs at least one block"):
        even_ranges(3, 4)


def test_check_ranges_names_the_gap() -> None:
    with pytest.raises(ValueError, match="rank 1 has range\\(3, 8\\)"):
        check_ranges([range(0, 2), range(3, 8)], 8)
    with pytest.raises(ValueError, match="end at 6, the model has 8"):
        check_ranges([range(0, 2), range(2, 6)], 8)


def test_vae_heavy_end_ranks_get_fewer_blocks() -> None:
    # Fig. 13(a): rank 0 also VAE-encodes (3 block-times), the last rank decodes (5 block-times).
    costs = [1.0] * 30
    ranges = balance_ranges(costs, [3.0, 0.0, 0.0, 5.0])
    assert max(stage_times(ranges, costs, [3.0, 0.0, 0.0, 5.0])) == 10.0  # 38 block-times / 4 ranks -> 10
    assert len(ranges[0]) <= 7 and len(ranges[3]) <= 5
    assert max(stage_times(even_ranges(30, 4), costs, [3.0, 0.0, 0.0, 5.0])) == 12.0


def test_uneven_block_costs() -> None:
    # One expensive block (e.g. a block with a bigger attention window): it gets a rank to itself.
    costs = [1.0, 1.0, 6.0, 1.0, 1.0, 1.0]
    assert balance_ranges(costs, [0.0, 0.0, 0.0]) == [range(0, 2), range(2, 3), range(3, 6)]


@settings(max_examples=60, deadline=None)
@given(
    costs=st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=1, max_size=9),
    fixed=st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=1, max_size=4),
)
def test_balance_is_optimal(costs: list[float], fixed: list[float]) -> None:
    if len(costs) < len(fixed):
        return
    ranges = check_ranges(balance_ranges(costs, fixed), len(costs))
    assert max(stage_times(ranges, costs, fixed)) == pytest.approx(brute_force_best(costs, fixed), abs=1e-9)


def test_scheduler_moves_blocks_off_the_slow_rank() -> None:
    sched = BlockScheduler([range(0, 4), range(4, 8)], min_gain=0.1)
    assert sched.propose() is None  # nothing measured yet
    # Blocks cost 1 s each everywhere; rank 0 also spends 3 s in VAE encode + embedding.
    sched.observe([StageTiming(0, blocks_s=4.0, other_s=3.0), StageTiming(1, blocks_s=4.0, other_s=0.0)])
    assert sched.block_costs == [1.0] * 8
    assert sched.propose() == [range(0, 2), range(2, 8)]  # max stage 7 s -> 6 s
    assert BlockScheduler([range(0, 4), range(4, 8)], min_gain=0.2).propose() is None


def test_scheduler_needs_a_real_gain() -> None:
    sched = BlockScheduler([range(0, 4), range(4, 8)], min_gain=0.1)
    sched.observe([StageTiming(0, 4.0, 0.2), StageTiming(1, 4.0, 0.0)])
    assert sched.propose() is None  # 4.2 s -> 4.2 s at best (moving a block makes rank 1 slower)


def test_scheduler_smooths_and_tracks_new_ranges() -> None:
    sched = BlockScheduler([range(0, 2), range(2, 4)], smoothing=0.5)
    sched.observe([StageTiming(0, 2.0, 0.0), StageTiming(1, 2.0, 0.0)])
    sched.set_ranges([range(0, 1), range(1, 4)])
    sched.observe([StageTiming(0, 3.0, 0.0), StageTiming(1, 3.0, 0.0)])
    assert sched.block_costs == [2.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="one timing per rank"):
        sched.observe([StageTiming(0, 1.0, 0.0)])


def test_the_prediction_is_the_slowest_stage_of_the_best_split_by_hand() -> None:
    """30 blocks of 4 ms, 40 ms of encode on the first rank and 60 ms of decode on the last, a 10 ms
    hand-off: on one rank a chunk takes 220 ms; on four, the best split (by brute force over every cut)
    leaves a slowest stage the prediction must equal, and two ranks sit between."""
    from engine.parallel.partition import predict_pipeline

    costs = [0.004] * 30
    one = predict_pipeline(costs, 0.04, 0.06, 1, boundary_bytes=1e6, link_bytes_per_s=1e8, chunk_frames=4)
    assert one.chunk_s == pytest.approx(0.22) and one.fps == pytest.approx(4 / 0.22) and one.transfer_s == 0
    four = predict_pipeline(costs, 0.04, 0.06, 4, boundary_bytes=1e6, link_bytes_per_s=1e8, chunk_frames=4)
    assert four.transfer_s == pytest.approx(0.01)
    best = min(
        max(0.04 + 0.01 + 0.004 * a, 0.01 + 0.004 * (b - a), 0.01 + 0.004 * (c - b), 0.06 + 0.004 * (30 - c))
        for a, b, c in itertools.combinations(range(1, 30), 3)
    )
    assert four.chunk_s == pytest.approx(best) and [len(r) for r in four.ranges] != [8, 8, 7, 7]
    assert sum(len(r) for r in four.ranges) == 30
    two = predict_pipeline(costs, 0.04, 0.06, 2, boundary_bytes=1e6, link_bytes_per_s=1e8, chunk_frames=4)
    assert one.chunk_s > two.chunk_s > four.chunk_s
