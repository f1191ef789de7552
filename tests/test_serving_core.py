"""The engine core's decisions, on the simulator's simulated executor and virtual clock (fast, exact)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.serving.core import Work
from engine.serving.fidelity import bundled_profile
from engine.serving.policy import SlackPolicy, policy_presets, resolve_preset
from engine.sim.simulator import SimConfig, Simulator
from engine.sim.workload import EventKind, TraceEvent

PROFILE = bundled_profile("tiny-random_cpu_128")


class Recording(Simulator):
    """The simulator, recording every work order the core hands its executor."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.works: list[Work] = []
        self.peak_resident = 0

    def execute(self, work: Work) -> float:
        self.works.append(work)
        resident = sum(1 for e in self.core.ledger.entries.values() if e.resident and e.active)
        self.peak_resident = max(self.peak_resident, resident)
        return super().execute(work)


def arrivals(n: int, frames: int = 161, at: float = 0.0) -> list[TraceEvent]:
    return [TraceEvent(at, EventKind.ARRIVE, i, frames=frames, fps=PROFILE.fps) for i in range(n)]


def run(policy: SlackPolicy, events: list[TraceEvent], workers: int = 1, **sim: object) -> Recording:
    recording = Recording(policy, PROFILE, events, SimConfig(workers=workers, nodes=1, jitter_cv=0.0, **sim))  # type: ignore[arg-type]
    recording.run()
    return recording


def test_presets_resolve_with_the_slack_alias() -> None:
    assert resolve_preset("slack") == policy_presets()["slackserve"]
    assert resolve_preset("fifo").name == "fifo"
    with pytest.raises(ValueError, match="unknown policy 'fast'.*slackserve"):
        resolve_preset("fast")


def test_fifo_streams_take_turns_at_their_own_fixed_fidelity() -> None:
    sim = run(SlackPolicy(PROFILE, resolve_preset("fifo")), arrivals(3))
    starts = [o.stream_id for w in sim.works for o in w.orders if o.new_chunk]
    # Round robin: in every window of 3 consecutive chunk starts, each stream appears once.
    for i in range(0, 3 * 10, 3):
        assert sorted(starts[i : i + 3]) == [0, 1, 2], starts[i : i + 3]
    points = {o.point for w in sim.works for o in w.orders}
    assert points == {PROFILE.reference()}  # no fidelity routing
    assert sim.core.counters.preemptions == 0


def test_user_step_ceiling_caps_every_chunk() -> None:
    policy = SlackPolicy(PROFILE, resolve_preset("slackserve"))
    sim = Recording(policy, PROFILE, arrivals(1, frames=321), SimConfig(workers=1, nodes=1, jitter_cv=0.0))
    sim.run()
    uncapped = {o.point.config.steps for w in sim.works for o in w.orders}
    assert max(uncapped) == 4  # with slack to spare BMPR takes the 4-step reference

    capped = Recording(SlackPolicy(PROFILE, resolve_preset("slackserve")), PROFILE, [],
                       SimConfig(workers=1, nodes=1, jitter_cv=0.0))
    capped.core.arrive(7, 20.0, max_steps=1)
    capped.run()
    steps = {o.point.config.steps for w in capped.works for o in w.orders}
    assert steps == {1}
    assert capped.core.stats[7].top_quality == max(p.quality for p in PROFILE.per_stream() if p.config.steps == 1)


def test_cross_user_batching_joins_streams_routed_to_the_same_point() -> None:
    preset = replace(resolve_preset("slackserve"), max_batch=2)
    sim = run(SlackPolicy(PROFILE, preset), arrivals(2))
    batched = [w for w in sim.works if len(w.orders) == 2]
    assert batched, "no forward carried two streams"
    for w in batched:
        assert len({(o.point.config.steps, o.point.config.kv_window_frames, o.point.config.resolution_scale)
                     for o in w.orders}) == 1
    # The ledger charged the batch as a batch (the profile has no batch points: b x single).
    assert any(o.point.config.stream_batch == 2 for w in batched for o in w.orders)


def test_state_slots_evict_the_highest_credit_stream_and_restore_it() -> None:
    sim = run(SlackPolicy(PROFILE, resolve_preset("slackserve")), arrivals(3), state_slots=2)
    assert sim.core.counters.evictions > 0 and sim.core.counters.restores > 0
    for w in sim.works:
        # A stream is never evicted while it runs, and everything that runs is resident.
        assert not set(w.evict) & set(w.stream_ids)
    assert sim.peak_resident <= 2


def test_step_preemption_parks_a_relaxed_chunk_for_a_newcomer() -> None:
    early = arrivals(1, frames=2561)
    # Newcomers at staggered times: some arrive while the first stream's chunk has steps to go.
    late = [TraceEvent(2.0 + 0.7 * k + 0.0013 * k, EventKind.ARRIVE, 9 + k, frames=33, fps=PROFILE.fps) for k in range(5)]
    # The engine is faster than the camera: the first stream runs far ahead of its playout (RELAXED);
    # at the reference fidelity (no BMPR, so a newcomer cannot look relaxed by picking a faster point)
    # a newcomer's credit is 3 chunk times (NORMAL): it goes first, even mid-chunk.
    assert PROFILE.reference().latency_s < PROFILE.chunk_duration_s
    sim = run(SlackPolicy(PROFILE, resolve_preset("credit-only")), early + late)
    assert sim.core.counters.preemptions >= 1
    preempting = [w for w in sim.works if w.preempted]
    assert preempting and all(w.preempted == (0,) and w.orders[0].stream_id >= 9 for w in preempting)
    # The parked chunk resumes later (a step that is not a chunk start for stream 0).
    after = sim.works[sim.works.index(preempting[0]) + 1 :]
    assert any(o.stream_id == 0 and not o.new_chunk for w in after for o in w.orders)


def test_a_rehome_at_a_batch_chunk_boundary_waits_for_the_whole_batch() -> None:
    """A stream of a cross-user batch re-homed when the batch's chunk ends: its source worker is
    scheduled only after every chunk of the batch is done (it once saw a partner's finished chunk as
    one still in flight, ran a step for it, and the ledger failed with "no chunk in flight")."""
    base = bundled_profile("tiny-random_cpu_128")
    profile = replace(base, fps=8.0, points=tuple(
        replace(p, latency_s=30 * p.latency_s, first_chunk_latency_s=30 * p.first_chunk_latency_s) for p in base.points))
    policy = SlackPolicy(profile, replace(resolve_preset("slackserve"), max_batch=4))
    events = [TraceEvent(t, EventKind.ARRIVE, sid, frames, 8.0) for sid, (t, frames) in enumerate(
        [(1.13, 77), (2.83, 83), (2.87, 74), (2.87, 92), (3.81, 87), (3.91, 48)])]
    events += [TraceEvent(5.95, EventKind.PAUSE, 2), TraceEvent(7.95, EventKind.RESUME, 2),
               TraceEvent(8.02, EventKind.PROMPT_SWITCH, 1), TraceEvent(9.26, EventKind.PROMPT_SWITCH, 4)]
    result = Simulator(policy, profile, sorted(events, key=lambda e: e.t),
                       SimConfig(workers=2, nodes=1, state_slots=64, tick_s=0.5)).run()
    assert result.rehomes >= 1
    assert all(s.chunks_on_time + s.chunks_late > 0 for s in result.streams)
