"""The engine core's decisions, on the simulator's simulated executor and virtual clock (fast, exact)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.serving.core import StepResult, Work
from engine.serving.ledger import Camera
from engine.serving.live import live_policy_config
from engine.serving.policy import SlackPolicy, policy_presets, resolve_preset
from engine.serving.profile import ProfilePoint, bundled_profile
from engine.serving.snapshot import Rehome, TickPlan
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


def test_two_streams_of_one_batch_rehomed_at_the_same_chunk_boundary() -> None:
    """Both streams of a batch re-homed at its chunk boundary: the first move used to kick the source
    worker at once, which started the partner's next chunk there, and the partner's move then raised
    "has a chunk in flight" out of ``step_done``."""
    policy = SlackPolicy(PROFILE, replace(resolve_preset("slackserve"), max_batch=2, rehoming=False))
    sim = Recording(policy, PROFILE, arrivals(2), SimConfig(workers=1, nodes=1, jitter_cv=0.0))
    step_done = sim.core.step_done
    requested: list[Rehome] = []

    def done(worker_id: int, measured_s: float | None = None, content_s: object = None) -> StepResult:
        job = sim.core.jobs.get(worker_id, ())
        if not requested and len(job) == 2:  # a batch of both streams in flight: move them both
            sim.add_worker()
            sim.add_worker()
            for dst, sid in zip((1, 2), job, strict=True):
                requested.append(Rehome(sid, worker_id, dst, True, 0.0))
                sim.core.request_rehome(requested[-1])
        return step_done(worker_id, measured_s, content_s)  # type: ignore[arg-type]

    sim.core.step_done = done  # type: ignore[method-assign]
    result = sim.run()
    assert len(requested) == 2 and result.rehomes == 2
    assert {sim.core.ledger.entries[m.stream_id].worker for m in requested} == {1, 2}


class Measured(Recording):
    """The simulator as a live engine: each worker's steps take the base profile's time times its
    slowdown, and the core is told each step's time (calibration on, as on the live server)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.core.calibrate = True
        step_done, chunk_started = self.core.step_done, self.core.ledger.chunk_started
        self.scale: dict[int, float] = {}  # each stream's policy scale when its chunk in flight started

        def measured(worker_id: int, measured_s: float | None = None, content_s: object = None) -> StepResult:
            return step_done(worker_id, self.workers[worker_id].step_s, content_s)  # type: ignore[arg-type]

        def started(sid: int, now: float, point: ProfilePoint, *args: float) -> None:
            if self.core.ledger.entries[sid].inflight is None:
                self.scale[sid] = self.core.applied_ratio
            chunk_started(sid, now, point, *args)

        self.core.step_done = measured  # type: ignore[method-assign]
        self.core.ledger.chunk_started = started  # type: ignore[method-assign]

    def execute(self, work: Work) -> float:
        # The simulator times a step by the (calibrated) policy's estimate; a real engine has its own
        # speed: the base profile's time (the estimate at the scale its chunk started with) x slowdown.
        base_s = work.est_step_s / self.scale[work.orders[0].stream_id]
        return super().execute(replace(work, est_step_s=base_s))


def test_calibration_measures_a_step_against_the_profile_its_chunk_started_with() -> None:
    """An engine 8x slower than its profile, chunks of four sequential steps: the policy is rescaled to
    8x once and stays. The later steps of a chunk started before that recalibration were measured
    against the new scale, which compounded the two (it went on to 19, 46, 111x, then back down)."""
    ratios: list[float] = []
    sim = Measured(SlackPolicy(PROFILE, resolve_preset("credit-only")), PROFILE, arrivals(2, frames=81),
                   SimConfig(workers=1, nodes=1, jitter_cv=0.0, slowdown=(8.0,)))
    recalibrate = sim.core.recalibrate

    def recorded(ratio: float) -> None:
        ratios.append(ratio)
        recalibrate(ratio)

    sim.core.recalibrate = recorded  # type: ignore[method-assign]
    sim.run()
    assert ratios and max(ratios) <= 8.0 * 1.01, ratios
    assert sim.core.applied_ratio == pytest.approx(8.0, rel=0.2)
    assert sim.core.worker_speed(0) == pytest.approx(8.0, rel=0.01)


def test_live_streams_move_off_a_slow_worker_by_its_measured_speed() -> None:
    """Three workers, the third 5x slower, six camera-paced live streams (two per worker, as admission
    places them), the live preset: the per-worker calibration sees the slow worker and the tick moves its
    streams to the others; nothing is ever moved onto it. The profile's latencies x10 keep the workers
    busy (on the bare tiny profile a stream alone on the slow worker keeps up, and rightly stays)."""
    profile = replace(PROFILE, fps=8.0, points=tuple(
        replace(p, latency_s=10 * p.latency_s, first_chunk_latency_s=10 * p.first_chunk_latency_s) for p in PROFILE.points))
    policy = SlackPolicy(profile, live_policy_config("slack", 4, True, workers=3))
    camera = Camera(profile.first_chunk_duration_s, profile.chunk_duration_s, 1 / 8.0)
    events = [TraceEvent(0.1 * i, EventKind.ARRIVE, i, 20 * 8, 8.0) for i in range(6)]
    sim = Measured(policy, profile, events, SimConfig(workers=3, nodes=1, state_slots=64, tick_s=0.5, jitter_cv=0.0,
                                                      camera=camera, slowdown=(1.0, 1.0, 5.0)))
    plans: list[TickPlan] = []
    tick = sim.core.tick

    def recorded() -> TickPlan:
        plans.append(tick())
        return plans[-1]

    sim.core.tick = recorded  # type: ignore[method-assign]
    result = sim.run()
    assert [sim.core.worker_speed(w) for w in range(3)] == [pytest.approx(1.0, rel=0.05),
                                                            pytest.approx(1.0, rel=0.05), pytest.approx(5.0, rel=0.05)]
    moves = [m for plan in plans for m in plan.rehomes]
    assert moves and all(m.src == 2 and m.dst != 2 for m in moves)
    assert result.rehomes == 2  # both of its streams, each once
    # Its few steps before its speed was known (the step batch's filling chunks among them) and none after.
    assert result.worker_busy_s[2] < 0.3 * min(result.worker_busy_s[0], result.worker_busy_s[1])


def test_a_simulated_step_batch_holds_a_streams_chunks_until_their_last_step() -> None:
    """At a step-batch point (StreamDiffusionV2's: the steps of successive chunks in one forward) the
    engine holds a chunk until its last step, so a stream's first ``steps - 1`` chunks bring out no
    frames, as the live engine's do (its executors count the frames): the simulator models that, so
    its first-chunk times and slack match the live server's rather than the profile's latency alone."""
    [point] = [p for p in PROFILE.per_stream() if p.config.step_batch and p.config.steps == 3][:1]
    profile = replace(PROFILE, points=(point,))
    sim = Recording(SlackPolicy(profile, resolve_preset("fifo")), profile, arrivals(1, frames=81),
                    SimConfig(workers=1, nodes=1, jitter_cv=0.0))
    [stream] = sim.run().streams
    started = [o for w in sim.works for o in w.orders if o.new_chunk]
    delivered = stream.chunks_on_time + stream.chunks_late
    # 81 frames: a 1-frame chunk and 20 of 4. Every chunk ran once; the first two brought out nothing,
    # so two more ran to bring out the last ones (the engine's later chunks push them out).
    assert delivered == 21 and len(started) == 21 + point.config.steps - 1, (delivered, len(started))
    # The first frames came with the third chunk: three chunk latencies after arrival, not one.
    assert stream.ttfc_s is not None and stream.ttfc_s >= 2 * point.latency_s + point.first_chunk_latency_s
