"""The autoscaler that acts: at each control tick it adds and removes the executor's workers.

The plan is the autoscaler's (engine/serving/autoscale.py ``plan_scaling``: hysteresis around a target
utilisation, within ``min_workers`` / ``max_workers``); this carries it out through the engine core:

* scale out: the executor starts workers (a Ray actor loads its model replica first: a pending worker
  counts toward the target until it joins);
* scale in, at most once per ``cooldown_s`` after the last scale event: the least-loaded workers are
  marked draining (admission and re-homing skip them), their streams re-homed to the others at chunk
  boundaries, and a worker is removed only once no stream lives on it.

The live server's Ray executor (app/server/serving/cluster_executor.py) and the simulator (engine/sim/) both
run it; only the executor's way of starting and stopping a worker differs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from engine.serving.autoscale import AutoscaleConfig, plan_scaling
from engine.serving.profile import FidelityProfile
from engine.serving.snapshot import Rehome, TickPlan, WorkerView

if TYPE_CHECKING:
    from engine.serving.core import EngineCore

log = logging.getLogger(__name__)


class WorkerPool(Protocol):
    """What an executor whose workers can come and go offers the scaler."""

    def worker_views(self) -> list[WorkerView]: ...

    def pending_workers(self) -> int:
        """Workers being started (not yet serving)."""
        ...

    def add_worker(self) -> None:
        """Start one worker; it joins ``worker_views`` when it is ready."""
        ...

    def set_draining(self, worker_id: int, draining: bool) -> None: ...

    def remove_worker(self, worker_id: int) -> None:
        """Stop a worker no stream lives on."""
        ...


@dataclass(frozen=True)
class ScaleEvent:
    t: float
    direction: str  # "up" or "down"
    worker_id: int | None  # the worker removed (down); None for a worker being started (up)
    workers: int  # serving workers after the event


@dataclass
class Scaler:
    config: AutoscaleConfig
    pool: WorkerPool
    cooldown_s: float = 60.0  # scale-in waits this long after the last scale event (no flapping)
    move_cap: int = 2  # streams moved off each draining worker per tick
    # K (streams one worker sustains) from the policy's current profile: live, the core recalibrates
    # the profile to the measured engine speed, and K follows. None: ``config.streams_per_worker``.
    capacity: Callable[[FidelityProfile], float] | None = None
    last_event_t: float | None = None  # the first step counts as one: no scale-in right at start
    events: list[ScaleEvent] = field(default_factory=list)
    drains: list[tuple[float, int]] = field(default_factory=list)  # (t, worker) each drain began

    def step(self, core: EngineCore, plan: TickPlan) -> None:
        now = plan.now
        if self.last_event_t is None:
            self.last_event_t = now
        config = self.config
        if self.capacity is not None:
            config = replace(config, streams_per_worker=self.capacity(core.policy.profile))
        views = self.pool.worker_views()
        credit = {int(sid): float(c) for sid, c in zip(plan.stream_ids.tolist(), plan.credits.tolist(), strict=True)}
        by_worker: dict[int, list[int]] = {v.worker_id: [] for v in views}
        for sid, entry in core.ledger.entries.items():
            if entry.active and entry.worker in by_worker:
                by_worker[entry.worker].append(sid)
        for sids in by_worker.values():
            sids.sort(key=lambda s: credit.get(s, 0.0))
        draining = [v.worker_id for v in views if v.draining]
        scale = plan_scaling(by_worker, draining, config, self.move_cap)
        serving = len(views) - len(draining) + self.pool.pending_workers()
        if scale.desired_workers > serving:
            self._scale_out(scale.desired_workers - serving, draining, now, len(views))
            return
        victims = [wid for wid in (*scale.drain, *scale.release) if wid not in draining]
        if victims and now - self.last_event_t < self.cooldown_s:
            return  # scale-in waits out the cooldown
        for wid in victims:
            self.pool.set_draining(wid, True)
            self.drains.append((now, wid))
            log.info("autoscaler: draining worker %d (%d streams)", wid, len(by_worker[wid]))
        for move in scale.moves:
            core.request_rehome(Rehome(move.stream_id, move.src, move.dst, intra_node=True, residual_s=0.0))
        for wid in scale.release:
            if wid not in draining:
                continue  # drained this tick: removed at the next one, once nothing is dispatched there
            self.pool.remove_worker(wid)
            self.last_event_t = now
            self.events.append(ScaleEvent(now, "down", wid, len(self.pool.worker_views())))
            log.info("autoscaler: removed worker %d", wid)

    def _scale_out(self, count: int, draining: list[int], now: float, workers: int) -> None:
        for wid in draining[:count]:  # a draining worker is the cheapest one to get back
            self.pool.set_draining(wid, False)
        for _ in range(count - min(count, len(draining))):
            self.pool.add_worker()
            self.events.append(ScaleEvent(now, "up", None, workers + 1))
            log.info("autoscaler: adding a worker (%d serving)", workers)
        self.last_event_t = now
