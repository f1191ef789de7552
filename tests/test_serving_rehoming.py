"""Re-homing planner: senders/receivers, caps, cooldown, intra-node preference, lowest-credit choice."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from engine.serving.credit import Tier
from engine.serving.rehoming import ClusterArrays, RehomingConfig, plan_rehomes
from engine.serving.transfer import Link, TransferModel

U, N, R = int(Tier.URGENT), int(Tier.NORMAL), int(Tier.RELAXED)


def arrays(streams: list[tuple[int, int, float, float]], nodes: list[int], slots: int = 8) -> ClusterArrays:
    """streams: (worker index, tier, credit, last_rehomed_at); stream ids are 100 + position."""
    n = len(streams)
    return ClusterArrays(
        stream_ids=np.arange(100, 100 + n, dtype=np.int64),
        stream_worker=np.array([s[0] for s in streams], dtype=np.int64),
        tiers=np.array([s[1] for s in streams], dtype=np.int8),
        credits=np.array([s[2] for s in streams], dtype=np.float64),
        last_rehomed_at=np.array([s[3] for s in streams], dtype=np.float64),
        state_bytes=np.full(n, 6e9),
        worker_ids=np.arange(len(nodes), dtype=np.int64),
        worker_node=np.array(nodes, dtype=np.int64),
        worker_slots=np.full(len(nodes), slots, dtype=np.int64),
        worker_draining=np.zeros(len(nodes), dtype=np.bool_),
    )


OLD = -1e9


def test_caps_two_out_per_sender_one_in_per_receiver() -> None:
    # Worker 0 has 4 URGENT streams; workers 1-4 are empty receivers on the same node.
    a = arrays([(0, U, c, OLD) for c in (0.3, -0.2, 0.1, 0.5)], nodes=[0, 0, 0, 0, 0])
    plan = plan_rehomes(a, 100.0, RehomingConfig(), TransferModel())
    assert len(plan) == 2
    assert [r.stream_id for r in plan] == [101, 102]  # lowest credit first
    assert len({r.dst for r in plan}) == 2


def test_receiver_takes_at_most_one_per_tick_across_senders() -> None:
    streams = [(0, U, 0.1, OLD), (0, U, 0.2, OLD), (1, U, 0.1, OLD), (1, U, 0.2, OLD)]
    a = arrays(streams, nodes=[0, 0, 0])
    plan = plan_rehomes(a, 100.0, RehomingConfig(), TransferModel())
    assert len(plan) == 1 and plan[0].dst == 2


def test_cooldown_blocks_recently_moved_streams() -> None:
    a = arrays([(0, U, -1.0, 90.0), (0, U, 0.4, OLD)], nodes=[0, 0])
    plan = plan_rehomes(a, 100.0, RehomingConfig(cooldown_s=60.0), TransferModel())
    assert [r.stream_id for r in plan] == [101]  # 100 is cheaper but moved 10 s ago
    plan = plan_rehomes(a, 151.0, RehomingConfig(cooldown_s=60.0), TransferModel())
    assert [r.stream_id for r in plan] == [100]


def test_receivers_exclude_workers_with_urgent_or_normal_streams() -> None:
    streams = [(0, U, 0.1, OLD), (0, U, 0.2, OLD), (1, N, 3.0, OLD), (2, R, 9.0, OLD)]
    plan = plan_rehomes(arrays(streams, nodes=[0, 0, 0]), 100.0, RehomingConfig(), TransferModel())
    assert [r.dst for r in plan] == [2]


def test_lone_urgent_stream_is_not_a_sender() -> None:
    plan = plan_rehomes(arrays([(0, U, -1.0, OLD)], nodes=[0, 0]), 100.0, RehomingConfig(), TransferModel())
    assert plan == ()


def test_intra_node_receivers_first_and_cost_by_link() -> None:
    tm = TransferModel()
    # Worker 0 on node 0; worker 1 (node 1) and worker 2 (node 0) are both empty.
    a = arrays([(0, U, 0.1, OLD), (0, U, 0.2, OLD), (0, U, 0.3, OLD)], nodes=[0, 1, 0])
    plan = plan_rehomes(a, 100.0, RehomingConfig(), tm)
    assert [(r.dst, r.intra_node) for r in plan] == [(2, True), (1, False)]
    assert plan[0].residual_s == tm.residual_s(6e9, Link.INTRA_NODE)
    assert plan[1].residual_s == tm.residual_s(6e9, Link.INTER_NODE)
    assert plan[0].residual_s < plan[1].residual_s


# ---- the live rule (RehomingConfig.balance_speed): measured speed x streams ----------------------------

LIVE = RehomingConfig(balance_speed=True)


def with_speeds(a: ClusterArrays, speeds: list[float]) -> ClusterArrays:
    return replace(a, worker_speed=np.array(speeds, dtype=np.float64))


def test_live_rule_moves_streams_off_a_slow_worker_where_the_tier_rule_finds_no_receiver() -> None:
    # Live streams are URGENT on every worker (they cannot get ahead of their camera): 2 per worker,
    # worker 2 five times slower than its peers.
    a = with_speeds(arrays([(w, U, 0.1 * i, OLD) for i, w in enumerate((0, 0, 1, 1, 2, 2))], nodes=[0, 0, 0]),
                    [1.0, 1.0, 5.0])
    assert plan_rehomes(a, 100.0, RehomingConfig(), TransferModel()) == ()  # no worker without URGENT streams
    plan = plan_rehomes(a, 100.0, LIVE, TransferModel())
    assert sorted((r.stream_id, r.src, r.dst) for r in plan) == [(104, 2, 0), (105, 2, 1)]


def test_live_rule_leaves_balanced_workers_alone() -> None:
    two_one = arrays([(0, U, 0.1, OLD), (0, U, 0.2, OLD), (1, U, 0.1, OLD)], nodes=[0, 0])
    assert plan_rehomes(with_speeds(two_one, [1.0, 1.0]), 100.0, LIVE, TransferModel()) == ()
    # Within the margin: worker 0 measured 40 % slower, 2 x 1.4 = 2.8 < 1.5 x 2 x 1.0.
    assert plan_rehomes(with_speeds(two_one, [1.4, 1.0]), 100.0, LIVE, TransferModel()) == ()
    assert plan_rehomes(with_speeds(two_one, [1.6, 1.0]), 100.0, LIVE, TransferModel())[0].dst == 1
    # A lone stream gains nothing on an equal worker, and moves off a much slower one.
    lone = arrays([(0, U, 0.1, OLD)], nodes=[0, 0])
    assert plan_rehomes(with_speeds(lone, [1.0, 1.0]), 100.0, LIVE, TransferModel()) == ()
    assert [r.dst for r in plan_rehomes(with_speeds(lone, [3.0, 1.0]), 100.0, LIVE, TransferModel())] == [1]


def test_live_rule_counts_an_unmeasured_worker_as_the_median_one() -> None:
    # A new, empty worker (no step measured yet) takes a stream from the busiest worker.
    a = with_speeds(arrays([(w, U, 0.1 * i, OLD) for i, w in enumerate((0, 0, 0, 1, 1, 1))], nodes=[0, 0, 0]),
                    [1.0, 1.2, np.nan])
    assert [(r.src, r.dst) for r in plan_rehomes(a, 100.0, LIVE, TransferModel())] == [(1, 2)]
    # Nothing measured at all: stream counts alone.
    unmeasured = arrays([(0, U, 0.1, OLD), (0, U, 0.2, OLD), (0, U, 0.3, OLD)], nodes=[0, 0])
    assert [(r.src, r.dst) for r in plan_rehomes(unmeasured, 100.0, LIVE, TransferModel())] == [(0, 1)]


def test_live_rule_keeps_caps_cooldown_draining_and_slots() -> None:
    # Worker 0 is slow with four streams; stream 100 moved 10 s ago; workers 1-3 are empty and fast, but
    # 1 is draining and 2 has no free state slot.
    a = arrays([(0, U, -1.0, 90.0), (0, U, 0.1, OLD), (0, U, 0.2, OLD), (0, U, 0.3, OLD)], nodes=[0, 0, 0, 0, 0],
               slots=8)
    a = replace(with_speeds(a, [5.0, 1.0, 1.0, 1.0, 1.0]), worker_draining=np.array([False, True, False, False, False]),
                worker_slots=np.array([8, 8, 0, 8, 8]))
    plan = plan_rehomes(a, 100.0, RehomingConfig(balance_speed=True, cooldown_s=60.0), TransferModel())
    assert [(r.stream_id, r.dst) for r in plan] == [(101, 3), (102, 4)]  # send cap 2, one per receiver
