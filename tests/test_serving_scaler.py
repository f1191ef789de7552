"""The autoscaler that acts, on the simulator's workers and virtual clock (engine/serving/scaler.py):
workers are added under load and the new ones take streams; scale-in waits out its cooldown, drains the
least-loaded workers by re-homing their streams at chunk boundaries, and removes a worker only once no
stream lives on it; re-homing off a slow worker respects the per-tick caps and each stream's cooldown."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from engine.serving.autoscale import AutoscaleConfig
from engine.serving.policy import SlackPolicy, policy_presets
from engine.serving.profile import FidelityProfile, bundled_profile
from engine.serving.rehoming import RehomingConfig
from engine.serving.snapshot import TickPlan
from engine.sim.simulator import SimConfig, Simulator
from engine.sim.workload import EventKind, TraceEvent

FPS = 16.0


@pytest.fixture(scope="module")
def profile() -> FidelityProfile:
    return bundled_profile()


def trace(arrive: list[float], leave: dict[int, float], content_s: float = 200.0) -> list[TraceEvent]:
    events = [TraceEvent(t, EventKind.ARRIVE, i, int(content_s * FPS), FPS) for i, t in enumerate(arrive)]
    events += [TraceEvent(t, EventKind.LEAVE, i) for i, t in leave.items()]
    return sorted(events, key=lambda e: e.t)


class Watched(Simulator):
    """Records what the worker pool was asked to do, and what the cluster looked like then."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.log: list[tuple[float, str, int]] = []

    def set_draining(self, worker_id: int, draining: bool) -> None:
        self.log.append((self.now, "drain" if draining else "undrain", worker_id))
        super().set_draining(worker_id, draining)

    def remove_worker(self, worker_id: int) -> None:
        hosted = [s.sid for s in self.streams.values() if s.worker == worker_id and s.active]
        assert not hosted, f"worker {worker_id} removed with streams {hosted} on it"
        assert self.workers[worker_id].draining, "a worker is drained before it is removed"
        self.log.append((self.now, "remove", worker_id))
        super().remove_worker(worker_id)


def test_scales_out_under_load_then_drains_and_removes_after_the_cooldown(profile: FidelityProfile) -> None:
    cooldown = 30.0
    scale = AutoscaleConfig(streams_per_worker=2.0, target_utilisation=0.7, band=0.1, min_workers=1, max_workers=4)
    events = trace([0.0, 2.0, 4.0, 6.0, 8.0, 10.0], leave={i: 60.0 for i in range(4)})
    sim = Watched(SlackPolicy(profile, policy_presets()["slackserve"]), profile, events,
                  SimConfig(workers=1, nodes=1, tick_s=3.0, autoscale=scale, scale_in_cooldown_s=cooldown))
    result = sim.run()
    scaler = sim.core.scaler
    assert scaler is not None
    ups = [e for e in scaler.events if e.direction == "up"]
    downs = [e for e in scaler.events if e.direction == "down"]
    assert len(ups) >= 2 and all(e.t < 60.0 for e in ups)  # workers added while the streams arrived
    # The new workers took streams: more than one worker did work.
    assert sum(1 for busy in result.worker_busy_s.values() if busy > 0) >= 3
    # Scale-in: only after the 4 streams left, never within the cooldown of the last scale-out, and each
    # removed worker was drained first (Watched.remove_worker checks it was empty and draining).
    drains = [(t, w) for t, kind, w in sim.log if kind == "drain"]
    assert drains and all(t >= 60.0 and t - max(e.t for e in ups) >= cooldown for t, _ in drains)
    removed = [w for _, kind, w in sim.log if kind == "remove"]
    assert downs and len(removed) == len(downs) and set(removed) <= {w for _, w in drains}
    assert [t for t, kind, _ in sim.log if kind == "remove"][0] > drains[0][0]
    # The 2 streams left ask for ceil(2 / (2 * 0.7)) = 2 workers; they kept playing to the end.
    assert len(sim.workers) == 2
    assert not result.rejected
    survivors = [s for s in result.streams if s.sid >= 4]
    assert all(s.chunks_on_time + s.chunks_late > 0 and not s.left for s in survivors)


def test_rehoming_off_a_slow_worker_respects_caps_and_cooldown(profile: FidelityProfile) -> None:
    caps = RehomingConfig(send_cap=1, recv_cap=1, cooldown_s=20.0)
    policy = SlackPolicy(profile, replace(policy_presets()["slackserve"], rehome=caps))
    # Worker 0 is 3x slower than the profile says: its streams fall behind and are moved off it.
    events = trace([0.0, 0.5, 1.0, 1.5, 2.0, 2.5], leave={}, content_s=60.0)
    sim = Simulator(policy, profile, events, SimConfig(workers=4, nodes=1, tick_s=1.0, slowdown=(3.0,), jitter_cv=0.0))
    plans: list[TickPlan] = []
    tick = sim.core.tick

    def recorded() -> TickPlan:
        plans.append(tick())
        return plans[-1]

    sim.core.tick = recorded  # type: ignore[method-assign]
    result = sim.run()
    moves = [(plan.now, m) for plan in plans for m in plan.rehomes]
    assert any(m.src == 0 for _, m in moves), "nothing was re-homed off the slow worker"
    for plan in plans:  # per tick: each sender sends at most send_cap streams, each receiver takes recv_cap
        assert max(Counter(m.src for m in plan.rehomes).values(), default=0) <= caps.send_cap
        assert max(Counter(m.dst for m in plan.rehomes).values(), default=0) <= caps.recv_cap
    by_stream: dict[int, list[float]] = {}
    for t, m in moves:
        by_stream.setdefault(m.stream_id, []).append(t)
    for times in by_stream.values():  # a moved stream is not moved again within the cooldown
        assert all(b - a >= caps.cooldown_s for a, b in zip(times, times[1:], strict=False)), times
    assert result.rehomes == len(moves)  # every planned move was carried out at a chunk boundary
    slow_share = result.worker_busy_s[0] / sum(result.worker_busy_s.values())
    assert slow_share < 0.5  # the slow worker did not keep the work
