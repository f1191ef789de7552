"""Discrete-event simulator (Vidur-style heapq loop, virtual clock) around the engine core.

The simulator is an *executor* of the same ``EngineCore`` (engine/serving/core.py) the live server
runs: admission, dispatch, preemption, eviction/restore, re-homing and the control tick are the
core's code; the simulator only supplies simulated workers and a clock. Workers execute chunks
step by step with profiled latencies times seeded jitter, so step-level preemption, offload/restore
and re-homing costs all land on the virtual clock.
"""

from __future__ import annotations

import heapq
import logging
import math
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from engine.serving.autoscale import AutoscaleConfig
from engine.serving.core import EngineCore, Work
from engine.serving.credit import Tier
from engine.serving.ledger import Camera, StreamEntry, StreamLedger
from engine.serving.playout import Stall
from engine.serving.policy import SlackPolicy
from engine.serving.profile import FidelityProfile
from engine.serving.scaler import Scaler
from engine.serving.snapshot import Rehome, Snapshot, WorkerView
from engine.serving.transfer import Link, TransferModel
from engine.sim.workload import EventKind, TraceEvent

log = logging.getLogger(__name__)


class Ev(IntEnum):
    TRACE = 0
    STEP_DONE = 1
    READY = 2
    WAKE = 3
    TICK = 4


@dataclass(frozen=True)
class SimConfig:
    workers: int = 16
    nodes: int = 2
    state_slots: int = 4
    jitter_cv: float = 0.03
    tick_s: float = 3.0
    seed: int = 0
    max_lookahead_s: float | None = None
    camera: Camera | None = None  # streams wait for their camera's frames (engine/serving/ledger.py)
    transfer: TransferModel = field(default_factory=TransferModel)
    # Per-worker slowdown factors (worker i's steps take slowdown[i] times the profile; missing = 1),
    # the simulator's --worker-delay-ms: unequal workers.
    slowdown: tuple[float, ...] = ()
    # The autoscaler that acts (engine/serving/scaler.py): None = a fixed cluster (the paper's setup).
    autoscale: AutoscaleConfig | None = None
    scale_in_cooldown_s: float = 60.0

    def __post_init__(self) -> None:
        if self.workers < 1 or self.nodes < 1 or self.state_slots < 1:
            raise ValueError(f"need workers, nodes, state_slots >= 1, got {self.workers}, {self.nodes}, {self.state_slots}")
        if self.tick_s <= 0 or self.jitter_cv < 0:
            raise ValueError(f"need tick_s > 0 and jitter_cv >= 0, got {self.tick_s}, {self.jitter_cv}")


@dataclass
class SimWorker:
    wid: int
    node: int
    slots: int
    step_s: float = 0.0  # actual (jittered) duration of the job's current step
    gen: int = 0
    busy_s: float = 0.0
    draining: bool = False


@dataclass
class TimelineRow:
    t: float
    active_streams: int
    urgent_workers: int
    normal_workers: int
    relaxed_workers: int
    idle_workers: int
    desired_workers: int | None


@dataclass
class StreamRecord:
    sid: int
    arrival_t: float
    content_s: float
    ttfc_s: float | None
    chunks_on_time: int
    chunks_late: int
    stalls: list[Stall]
    mean_quality: float | None
    left: bool


@dataclass
class SimResult:
    policy: str
    streams: list[StreamRecord]
    rejected: dict[int, str]
    rehomes: int
    evictions: int
    restores: int
    preemptions: int
    timeline: list[TimelineRow]
    fidelity_counts: dict[str, int]
    end_t: float
    worker_busy_s: dict[int, float]


class Simulator:
    """The event queue and the simulated workers; every decision is the engine core's."""

    def __init__(self, policy: SlackPolicy, profile: FidelityProfile, events: list[TraceEvent],
                 config: SimConfig | None = None) -> None:
        self.profile = profile
        self.events = events
        self.cfg = config = config if config is not None else SimConfig()
        self.rng = np.random.default_rng(config.seed)
        self.now = 0.0
        self._q: list[tuple[float, int, int, object]] = []
        self._seq = 0
        # ``config.workers`` counts GPUs; a policy whose workers span several GPUs gets fewer workers.
        n_workers = max(1, config.workers // policy.config.gpus_per_worker)
        per_node = math.ceil(n_workers / config.nodes)
        slots = config.state_slots * policy.config.gpus_per_worker
        self.workers = {w: SimWorker(w, w // per_node, slots) for w in range(n_workers)}
        self._next_worker = n_workers
        ledger = StreamLedger(max_lookahead_s=config.max_lookahead_s, camera=config.camera)
        self.core = EngineCore(policy, self, lambda: self.now, ledger)
        if config.autoscale is not None:
            self.core.scaler = Scaler(config.autoscale, self, cooldown_s=config.scale_in_cooldown_s)
        self.rejected: dict[int, str] = {}
        self.removed_busy_s: dict[int, float] = {}  # busy time of workers the autoscaler removed
        self.timeline: list[TimelineRow] = []
        self._pending_trace = len(events)

    @property
    def policy(self) -> SlackPolicy:
        return self.core.policy

    @property
    def ledger(self) -> StreamLedger:
        return self.core.ledger

    @property
    def streams(self) -> dict[int, StreamEntry]:
        return self.core.ledger.entries

    # ---- event queue --------------------------------------------------------------------------
    def _push(self, t: float, kind: Ev, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._q, (t, int(kind), self._seq, payload))

    def run(self) -> SimResult:
        for e in self.events:
            self._push(e.t, Ev.TRACE, e)
        self._push(0.0, Ev.TICK, None)
        while self._q:
            t, kind, _, payload = heapq.heappop(self._q)
            self.now = t
            if kind == Ev.TRACE:
                assert isinstance(payload, TraceEvent)
                self._pending_trace -= 1
                self._on_trace(payload)
            elif kind == Ev.STEP_DONE:
                assert isinstance(payload, tuple)
                wid, gen = payload
                if wid in self.workers and gen == self.workers[wid].gen:
                    self.core.step_done(wid)
            elif kind in (Ev.READY, Ev.WAKE):
                assert isinstance(payload, int)
                self.core.kick(payload)
            elif kind == Ev.TICK:
                self._on_tick()
        return self._result()

    # ---- the Executor protocol ----------------------------------------------------------------
    def worker_views(self) -> list[WorkerView]:
        return [WorkerView(w.wid, w.node, w.slots, w.draining) for w in self.workers.values()]

    def input_ready(self, worker_id: int) -> set[int] | None:
        return None  # simulated content is always there (a lookahead cap, if set, is the ledger's)

    def execute(self, work: Work) -> float:
        w = self.workers[work.worker_id]
        delay = sum(self.cfg.transfer.residual_s(self.streams[sid].state_bytes, Link.HOST) for sid in work.restore)
        if not work.continues:
            slow = self.cfg.slowdown[w.wid] if w.wid < len(self.cfg.slowdown) else 1.0
            w.step_s = work.est_step_s * self._jitter() * slow
        w.gen += 1
        w.busy_s += w.step_s + delay
        self._push(self.now + delay + w.step_s, Ev.STEP_DONE, (w.wid, w.gen))
        return delay

    def rehome(self, move: Rehome) -> float:
        return move.residual_s

    def wake_at(self, worker_id: int, t: float) -> None:
        self._push(t, Ev.WAKE, worker_id)

    # ---- the scaler's WorkerPool ----------------------------------------------------------------
    def pending_workers(self) -> int:
        return 0  # a simulated worker is ready at once

    def add_worker(self) -> None:
        wid = self._next_worker
        self._next_worker += 1
        slots = self.cfg.state_slots * self.policy.config.gpus_per_worker
        self.workers[wid] = SimWorker(wid, 0, slots)

    def set_draining(self, worker_id: int, draining: bool) -> None:
        self.workers[worker_id].draining = draining

    def remove_worker(self, worker_id: int) -> None:
        if any(e.worker == worker_id and e.active for e in self.streams.values()):
            raise ValueError(f"worker {worker_id} still hosts streams")
        self.removed_busy_s[worker_id] = self.workers.pop(worker_id).busy_s

    def snapshot(self) -> Snapshot:
        return self.core.snapshot()

    # ---- trace events -------------------------------------------------------------------------
    def _on_trace(self, e: TraceEvent) -> None:
        core = self.core
        if e.kind is EventKind.ARRIVE:
            admission = core.arrive(e.stream, e.frames / e.fps)
            if not admission.accepted:
                self.rejected[e.stream] = admission.reason
        elif e.kind is EventKind.PAUSE:
            core.pause(e.stream)
        elif e.kind is EventKind.RESUME:
            core.resume(e.stream)
        elif e.kind is EventKind.PROMPT_SWITCH:
            core.prompt_switch(e.stream)
        elif e.kind is EventKind.LEAVE:
            core.leave(e.stream)

    def _jitter(self) -> float:
        if self.cfg.jitter_cv == 0:
            return 1.0
        return float(max(0.5, self.rng.normal(1.0, self.cfg.jitter_cv)))

    # ---- control tick -------------------------------------------------------------------------
    def _on_tick(self) -> None:
        plan = self.core.tick()
        counts = {t: 0 for t in Tier}
        idle = 0
        for wt in plan.worker_tiers.values():
            if wt is None:
                idle += 1
            else:
                counts[wt] += 1
        active = len(plan.stream_ids)
        self.timeline.append(TimelineRow(self.now, active, counts[Tier.URGENT], counts[Tier.NORMAL],
                                         counts[Tier.RELAXED], idle, plan.desired_workers))
        if self._pending_trace > 0 or active:
            self._push(self.now + self.cfg.tick_s, Ev.TICK, None)

    # ---- results ------------------------------------------------------------------------------
    def _result(self) -> SimResult:
        records = []
        for s in self.streams.values():
            tr = s.tracker
            records.append(StreamRecord(
                sid=s.sid,
                arrival_t=s.arrival_t,
                content_s=tr.content_s,
                ttfc_s=None if tr.first_chunk_t is None else tr.first_chunk_t - s.arrival_t,
                chunks_on_time=tr.chunks_on_time,
                chunks_late=tr.chunks_late,
                stalls=list(tr.stalls),
                mean_quality=s.quality_sum / s.quality_chunks if s.quality_chunks else None,
                left=s.left,
            ))
        counters = self.core.counters
        return SimResult(
            policy=self.policy.name,
            streams=records,
            rejected=dict(self.rejected),
            rehomes=counters.rehomes,
            evictions=counters.evictions,
            restores=counters.restores,
            preemptions=counters.preemptions,
            timeline=self.timeline,
            fidelity_counts=dict(self.core.fidelity_counts),
            end_t=self.now,
            worker_busy_s={**self.removed_busy_s, **{w.wid: w.busy_s for w in self.workers.values()}},
        )
