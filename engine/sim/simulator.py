"""Discrete-event simulator (Vidur-style heapq loop, injected clock) around the serving policy.

The simulator is an *executor*: per-stream state lives in the same ``StreamLedger`` the live server uses
(playout trackers, residency, in-flight chunks, cooldowns); the simulator adds simulated workers and a
clock, asks the policy for decisions, and applies them. Workers
execute chunks step by step with profiled latencies times seeded jitter, so step-level preemption,
offload/restore and re-homing costs all land on the simulated clock.
"""

from __future__ import annotations

import heapq
import logging
import math
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from engine.serving.credit import Tier
from engine.serving.fidelity import FidelityProfile
from engine.serving.ledger import StreamEntry, StreamLedger
from engine.serving.playout import Stall
from engine.serving.policy import SlackPolicy
from engine.serving.snapshot import AdmissionRequest, Dispatch, Rehome, Snapshot, StreamView, WorkerView
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
    transfer: TransferModel = field(default_factory=TransferModel)

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
    streams: set[int] = field(default_factory=set)
    job: tuple[int, ...] = ()
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
    def __init__(self, policy: SlackPolicy, profile: FidelityProfile, events: list[TraceEvent],
                 config: SimConfig | None = None) -> None:
        self.policy = policy
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
        self.ledger = StreamLedger(max_lookahead_s=config.max_lookahead_s)
        self.rejected: dict[int, str] = {}
        self.pending_rehome: dict[int, Rehome] = {}
        self.rehomes = self.evictions = self.restores = self.preemptions = 0
        self.timeline: list[TimelineRow] = []
        self.fidelity_counts: dict[str, int] = {}
        self._pending_trace = len(events)

    @property
    def streams(self) -> dict[int, StreamEntry]:
        return self.ledger.entries

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
                self._on_step_done(*payload)
            elif kind in (Ev.READY, Ev.WAKE):
                assert isinstance(payload, int)
                self._kick(payload)
            elif kind == Ev.TICK:
                self._on_tick()
        return self._result()

    # ---- views for the policy -----------------------------------------------------------------
    def _worker_view(self, w: SimWorker) -> WorkerView:
        return WorkerView(w.wid, w.node, w.slots, w.draining)

    def _running(self) -> set[int]:
        return {sid for w in self.workers.values() for sid in w.job}

    def snapshot(self) -> Snapshot:
        return self.ledger.snapshot(self.now, [self._worker_view(w) for w in self.workers.values()], self._running())

    # ---- trace events -------------------------------------------------------------------------
    def _on_trace(self, e: TraceEvent) -> None:
        if e.kind is EventKind.ARRIVE:
            self._arrive(e)
            return
        s = self.streams.get(e.stream)
        if s is None or s.left:
            return
        running = s.sid in self.workers[s.worker].job
        if e.kind is EventKind.PAUSE:
            self.ledger.pause(s.sid, self.now)
        elif e.kind is EventKind.RESUME:
            self.ledger.resume(s.sid, self.now)
            self._kick(s.worker)
        elif e.kind is EventKind.PROMPT_SWITCH:
            if self.ledger.prompt_switch(s.sid, self.now, running):
                self._kick(s.worker)
        elif e.kind is EventKind.LEAVE:
            self.ledger.leave(s.sid, running)

    def _arrive(self, e: TraceEvent) -> None:
        content_s = e.frames / e.fps
        adm = self.policy.admit(AdmissionRequest(e.stream, self.now, content_s), self.snapshot())
        if not adm.accepted or adm.worker_id is None:
            self.rejected[e.stream] = adm.reason
            return
        self.ledger.admit(adm, self.now, content_s, self.policy.reference.state_bytes)
        self._kick(adm.worker_id)

    # ---- worker execution ---------------------------------------------------------------------
    def _kick(self, wid: int) -> None:
        w = self.workers.get(wid)
        if w is None or w.job:
            return
        self._dispatch(w, step_boundary=False)

    def _dispatch(self, w: SimWorker, step_boundary: bool) -> None:
        views = self.ledger.views_on(w.wid, self.now, w.job)
        d = self.policy.dispatch(self.now, self._worker_view(w), views, step_boundary=step_boundary)
        if step_boundary and d.stream_ids == w.job:
            self._run_step(w, 0.0)
            return
        if step_boundary:
            self.preemptions += 1
            for sid in w.job:
                self.ledger.preempted(sid, self.now)
            w.job = ()
        if not d.stream_ids:
            self._schedule_wake(w, views)
            return
        self._start(w, d)

    def _schedule_wake(self, w: SimWorker, views: list[StreamView]) -> None:
        """Idle worker: wake when a blocked stream becomes runnable (transfer done or lookahead cap)."""
        wake = math.inf
        for v in views:
            s = self.streams[v.stream_id]
            if not s.active:
                continue
            if s.available_t > self.now:
                wake = min(wake, s.available_t)
            elif self.cfg.max_lookahead_s is not None and not v.paused:
                wake = min(wake, self.now + max(1e-3, v.slack_s - self.cfg.max_lookahead_s))
        if wake < math.inf:
            self._push(wake, Ev.WAKE, w.wid)

    def _start(self, w: SimWorker, d: Dispatch) -> None:
        assert d.point is not None
        for sid in d.evict:
            self.ledger.evict(sid)
            self.evictions += 1
        delay = 0.0
        for sid in d.restore:
            if self.ledger.restore(sid):
                self.restores += 1
                delay += self.cfg.transfer.residual_s(self.streams[sid].state_bytes, Link.HOST)
        w.job = d.stream_ids
        for sid in d.stream_ids:
            if self.streams[sid].inflight is None:
                label = d.point.config.label()
                self.fidelity_counts[label] = self.fidelity_counts.get(label, 0) + 1
            self.ledger.chunk_started(sid, self.now + delay, d.point)
        lead = self.streams[w.job[0]].inflight
        assert lead is not None
        w.step_s = lead.est_step_s * self._jitter()
        self._run_step(w, delay)

    def _jitter(self) -> float:
        if self.cfg.jitter_cv == 0:
            return 1.0
        return float(max(0.5, self.rng.normal(1.0, self.cfg.jitter_cv)))

    def _run_step(self, w: SimWorker, delay: float) -> None:
        w.gen += 1
        w.busy_s += w.step_s + delay
        self._push(self.now + delay + w.step_s, Ev.STEP_DONE, (w.wid, w.gen))

    def _on_step_done(self, wid: int, gen: int) -> None:
        w = self.workers.get(wid)
        if w is None or gen != w.gen or not w.job:
            return
        for sid in w.job:
            self.ledger.step_done(sid, self.now)
        lead = self.streams[w.job[0]].inflight
        assert lead is not None
        if lead.steps_left > 0 and len(w.job) == 1 and self.ledger.is_stale(w.job[0]):
            # The prompt changed mid-chunk: abandon the stale chunk at this step boundary (a batch
            # keeps going for its other streams and the stale output is discarded at the end).
            self.ledger.abandon(w.job[0], self.now)
            w.job = ()
            self._kick(wid)
            return
        if lead.steps_left > 0 and all(self.streams[sid].active for sid in w.job):
            self._dispatch(w, step_boundary=True)
            return
        job, w.job = w.job, ()
        if lead.steps_left > 0:
            # A stream in the batch left mid-chunk: nobody's chunk completes; the others restart it.
            for sid in job:
                self.ledger.abandon(sid, self.now)
                if self.streams[sid].left:
                    self.ledger.leave(sid, running=False)
            self._kick(wid)
            return
        for sid in job:
            self.ledger.chunk_done(sid, self.now, self._chunk_duration(sid))
            r = self.pending_rehome.pop(sid, None)
            if r is not None:
                self._apply_rehome(r)
        self._kick(wid)

    def _chunk_duration(self, sid: int) -> float:
        first = self.streams[sid].first_chunk
        return self.profile.first_chunk_duration_s if first else self.profile.chunk_duration_s

    def _apply_rehome(self, r: Rehome) -> None:
        s = self.streams[r.stream_id]
        if r.dst not in self.workers or s.worker != r.src or not s.active:
            return
        self.ledger.move(s.sid, r.dst, self.now, r.residual_s)
        self.rehomes += 1
        self._push(s.available_t, Ev.READY, r.dst)
        self._kick(r.src)

    # ---- control tick -------------------------------------------------------------------------
    def _on_tick(self) -> None:
        snap = self.snapshot()
        plan = self.policy.tick(snap)
        for r in plan.rehomes:
            if self.streams[r.stream_id].inflight is not None:
                self.pending_rehome[r.stream_id] = r  # applied at its next chunk boundary
            else:
                self._apply_rehome(r)
        counts = {t: 0 for t in Tier}
        idle = 0
        for wt in plan.worker_tiers.values():
            if wt is None:
                idle += 1
            else:
                counts[wt] += 1
        self.timeline.append(TimelineRow(self.now, len(snap.streams), counts[Tier.URGENT], counts[Tier.NORMAL],
                                         counts[Tier.RELAXED], idle, plan.desired_workers))
        if self._pending_trace > 0 or snap.streams:
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
        return SimResult(
            policy=self.policy.name,
            streams=records,
            rejected=dict(self.rejected),
            rehomes=self.rehomes,
            evictions=self.evictions,
            restores=self.restores,
            preemptions=self.preemptions,
            timeline=self.timeline,
            fidelity_counts=dict(self.fidelity_counts),
            end_t=self.now,
            worker_busy_s={w.wid: w.busy_s for w in self.workers.values()},
        )
