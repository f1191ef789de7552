"""Dispatch ordering, step-level preemption, credit-aware eviction and admission on hand-built snapshots."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.serving.derived_profiles import derived_h100_profile
from engine.serving.policy import PolicyConfig, SlackPolicy, policy_presets
from engine.serving.profile import FidelityProfile
from engine.serving.snapshot import AdmissionRequest, Snapshot, StreamView, WorkerView


@pytest.fixture(scope="module")
def profile() -> FidelityProfile:
    return derived_h100_profile()


def static(profile: FidelityProfile, **kw: object) -> SlackPolicy:
    """Static fidelity makes T a known constant (the reference latency) so credits are hand-computable."""
    return SlackPolicy(profile, replace(PolicyConfig(), bmpr=False, **kw))  # type: ignore[arg-type]


def sv(sid: int, slack: float, **kw: object) -> StreamView:
    return StreamView(stream_id=sid, worker_id=0, slack_s=slack, arrival_t=float(sid), **kw)  # type: ignore[arg-type]


W = WorkerView(0, state_slots=8)


def test_dispatch_orders_by_tier_then_credit(profile: FidelityProfile) -> None:
    pol = static(profile)
    T = pol.reference.latency_s
    streams = [sv(1, 6 * T), sv(2, 2.5 * T), sv(3, 2.0 * T), sv(4, 10 * T)]  # credits 5T, 1.5T, 1T, 9T
    d = pol.dispatch(0.0, W, streams)
    assert d.stream_ids == (3,)
    d = pol.dispatch(0.0, W, [s for s in streams if s.stream_id != 3])
    assert d.stream_ids == (2,)
    assert d.point == pol.reference


def test_step_preemption_only_for_a_more_urgent_tier(profile: FidelityProfile) -> None:
    pol = static(profile)
    T = pol.reference.latency_s
    running = sv(1, 5 * T, running=True, inflight_remaining_s=0.5 * T, inflight_point=pol.reference)
    # Running stream: credit 5T - 1.5T = 3.5T (NORMAL). A NORMAL waiter with lower credit does not preempt.
    d = pol.dispatch(0.0, W, [running, sv(2, 3.2 * T)], step_boundary=True)
    assert d.stream_ids == (1,) and not d.preempt
    # An URGENT waiter preempts at a step boundary ...
    d = pol.dispatch(0.0, W, [running, sv(2, 1.5 * T)], step_boundary=True)
    assert d.stream_ids == (2,) and d.preempt
    # ... but never for a policy without step preemption.
    lsf = SlackPolicy(profile, policy_presets()["ts-chunk-lsf"])
    d = lsf.dispatch(0.0, W, [running, sv(2, 1.5 * T)], step_boundary=True)
    assert d.stream_ids == (1,)


def test_preempted_partial_chunk_resumes_with_its_own_config(profile: FidelityProfile) -> None:
    pol = SlackPolicy(profile, PolicyConfig())
    fast = pol.router.frontier[0]
    partial = sv(1, 0.2, inflight_remaining_s=0.1, inflight_point=fast)
    d = pol.dispatch(0.0, W, [partial, sv(2, 20.0)])
    assert d.stream_ids == (1,) and d.point is fast


def test_eviction_takes_highest_credit_resident_first(profile: FidelityProfile) -> None:
    pol = static(profile)
    worker = WorkerView(0, state_slots=3)
    streams = [sv(1, 1.0, resident=False), sv(2, 9.0), sv(3, 4.0), sv(4, 12.0)]
    d = pol.dispatch(0.0, worker, streams)
    assert d.stream_ids == (1,) and d.restore == (1,)
    assert d.evict == (4,)  # 3 residents + 1 incoming in 3 slots: one victim, the highest credit
    d = pol.dispatch(0.0, WorkerView(0, state_slots=2), streams)
    assert d.evict == (4, 2)


def test_lru_eviction_when_credit_eviction_is_off(profile: FidelityProfile) -> None:
    pol = static(profile, credit_eviction=False)
    streams = [sv(1, 1.0, resident=False), sv(2, 9.0, last_run_at=5.0), sv(3, 4.0, last_run_at=1.0),
               sv(4, 12.0, last_run_at=7.0)]
    assert pol.dispatch(0.0, WorkerView(0, state_slots=3), streams).evict == (3,)


def test_fifo_batches_in_arrival_order_with_batch_latency(profile: FidelityProfile) -> None:
    pol = SlackPolicy(profile, policy_presets()["fifo-batch"])
    streams = [sv(i, 1.0 + i) for i in range(6)]
    d = pol.dispatch(0.0, WorkerView(0, state_slots=16), streams)
    assert d.stream_ids == (0, 1, 2, 3)
    assert d.point is not None and d.point.config.stream_batch == 4 and d.point.config.gpus == 4


def test_admission_initial_slack_home_and_rejection(profile: FidelityProfile) -> None:
    pol = SlackPolicy(profile, PolicyConfig())
    assert pol.initial_slack_s == pytest.approx(4 * profile.reference().first_chunk_latency_s)
    workers = [WorkerView(0), WorkerView(1), WorkerView(2)]
    busy = [StreamView(10, 0, 1.0), StreamView(11, 0, 1.0), StreamView(12, 1, 5.0)]
    a = pol.admit(AdmissionRequest(99, 0.0, 8.0), Snapshot(0.0, busy, workers))
    assert a.accepted and a.worker_id == 2 and a.initial_slack_s == pol.initial_slack_s
    # One worker crowded with URGENT streams that all go before a newcomer: the first chunk cannot make it.
    crowded = [StreamView(i, 0, 0.3) for i in range(8)]
    a = pol.admit(AdmissionRequest(99, 0.0, 8.0), Snapshot(0.0, crowded, [WorkerView(0)]))
    assert not a.accepted and a.worker_id is None
    assert "first chunk would be ready" in a.reason and "initial slack" in a.reason
    # Baselines admit regardless.
    fifo = SlackPolicy(profile, policy_presets()["ts-chunk-lsf"])
    assert fifo.admit(AdmissionRequest(99, 0.0, 8.0), Snapshot(0.0, crowded, [WorkerView(0)])).accepted
    assert "no live workers" in pol.admit(AdmissionRequest(1, 0.0, 8.0), Snapshot(0.0, [], [])).reason


def test_tick_produces_consistent_plan(profile: FidelityProfile) -> None:
    pol = SlackPolicy(profile, PolicyConfig())
    streams = [StreamView(i, i % 2, slack_s=0.5 + i) for i in range(6)]
    plan = pol.tick(Snapshot(0.0, streams, [WorkerView(0), WorkerView(1), WorkerView(2)]))
    assert sorted(plan.queues[0] + plan.queues[1]) == list(range(6))
    assert plan.queues[2] == ()
    for sid, credit, point in zip(plan.stream_ids, plan.credits, plan.fidelity, strict=True):
        v = streams[int(sid)]
        assert point is pol.next_point(v.slack_s, 0.0)
        assert credit == pytest.approx(v.slack_s - point.latency_s)
    # Queue order is the dispatch order.
    for w in (0, 1):
        ws = [s for s in streams if s.worker_id == w]
        order = []
        while ws:
            pick = pol.dispatch(0.0, WorkerView(w, state_slots=8), ws).stream_ids[0]
            order.append(pick)
            ws = [s for s in ws if s.stream_id != pick]
        assert tuple(order) == plan.queues[w]
    assert plan.worker_tiers[2] is None


def live_policy() -> SlackPolicy:
    from engine.serving.profile import BUNDLED_PROFILES, load_profile

    # The embedded model's measured ladder: five rungs from x1 (best) to x0.5 (fastest), 20 dB floor.
    return SlackPolicy(load_profile(BUNDLED_PROFILES / "default_cpu_256.json"), replace(PolicyConfig(), live_load=0.85))


def best_within(pol: SlackPolicy, seconds: float) -> float:
    """Independently of the router: the best quality among the profile's single-stream points that take
    at most ``seconds``, else the fastest point's."""
    points = pol.profile.per_stream()
    fitting = [p.quality for p in points if p.latency_s <= seconds]
    return max(fitting) if fitting else min(points, key=lambda p: p.latency_s).quality


@pytest.mark.parametrize("sharing", [1, 4, 6, 8, 12])
def test_live_streams_get_the_best_point_in_their_share_of_the_worker(sharing: int) -> None:
    pol = live_policy()
    share = 0.85 * pol.profile.chunk_duration_s / sharing
    slack = 0.4 * pol.profile.chunk_duration_s  # a short live playout buffer: the slack budget alone is small
    streams = [sv(i, slack) for i in range(sharing)]
    d = pol.dispatch(0.0, W, streams)
    assert d.point is not None and d.point.quality == best_within(pol, share)
    assert pol.next_point(slack, 0.0, sharing=sharing).quality == best_within(pol, share)
    # Without live_load the same slack holds the stream at BMPR's slack budget, a lower rung.
    slack_only = SlackPolicy(pol.profile, PolicyConfig())
    assert slack_only.next_point(slack, 0.0).quality == best_within(pol, slack / 3)
    assert best_within(pol, slack / 3) < best_within(pol, 0.85 * pol.profile.chunk_duration_s)


def test_a_live_stream_keeps_its_point_whatever_its_short_playout_buffer() -> None:
    pol = live_policy()
    top = pol.top_point()
    # Live playout keeps slack near a chunk or less; a stream alone on its worker gets the best point.
    for slack in (0.02, 0.1, 0.3, 2.0):
        assert pol.next_point(slack, 0.0, sharing=1) is top
    # Counted nowhere (sharing 0, the admission's newcomer): BMPR's slack budget, as in the simulator.
    assert pol.next_point(0.02, 0.0).latency_s < top.latency_s


def test_paused_live_streams_take_no_share_and_tick_agrees_with_dispatch() -> None:
    pol = live_policy()
    slack = 0.4 * pol.profile.chunk_duration_s
    streams = [replace(sv(i, slack), paused=i >= 2, runnable=i < 2) for i in range(8)]
    d = pol.dispatch(0.0, W, streams)
    assert d.point is not None and d.point.quality == best_within(pol, 0.85 * pol.profile.chunk_duration_s / 2)
    plan = pol.tick(Snapshot(0.0, streams, [W]))
    for sid, point in zip(plan.stream_ids.tolist(), plan.fidelity, strict=True):
        assert point is pol.next_point(slack, 0.0, sharing=2), sid
