"""Discrete-event simulator (Vidur-style heapq loop, injected clock) around the serving policy.

The simulator is an *executor*: it owns all mutable state (playout trackers, residency, worker jobs),
builds ``Snapshot``/``StreamView`` objects for the policy, and applies what the policy returns. Workers
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
from engine.serving.fidelity import FidelityProfile, ProfilePoint
from engine.serving.playout import PlayoutTracker, Stall
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
class InFlight:
    point: ProfilePoint
    step_s: float
    steps_left: int
    epoch: int
    step_started_t: float = 0.0


@dataclass
class SimStream:
    sid: int
    arrival_t: float
    tracker: PlayoutTracker
    worker: int
    state_bytes: float
    resident: bool = True
    available_t: float = 0.0  # transfers in progress make the stream unrunnable until then
    inflight: InFlight | None = None
    pending_rehome: Rehome | None = None
    last_rehomed_at: float = -math.inf
    last_run_at: float = -math.inf
    finished: bool = False
    left: bool = False
    quality_sum: float = 0.0
    quality_chunks: int = 0


@dataclass
class SimWorker:
    wid: int
    node: int
    slots: int
    streams: set[int] = field(default_factory=set)
    job: tuple[int, ...] = ()
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
                 config: SimConfig = SimConfig()) -> None:
        self.policy = policy
        self.profile = profile
        self.events = events
        self.cfg = config
        self.rng = np.random.default_rng(config.seed)
        self.now = 0.0
        self._q: list[tuple[float, int, int, object]] = []
        self._seq = 0
        # ``config.workers`` counts GPUs; a policy whose workers span several GPUs gets fewer workers.
        n_workers = max(1, config.workers // policy.config.gpus_per_worker)
        per_node = math.ceil(n_workers / config.nodes)
        slots = config.state_slots * policy.config.gpus_per_worker
        self.workers = {w: SimWorker(w, w // per_node, slots) for w in range(n_workers)}
        self.streams: dict[int, SimStream] = {}
        self.rejected: dict[int, str] = {}
        self.rehomes = self.evictions = self.restores = self.preemptions = 0
        self.timeline: list[TimelineRow] = []
        self.fidelity_counts: dict[str, int] = {}
        self._pending_trace = len(events)

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
    def _view(self, s: SimStream, running: bool) -> StreamView:
        tr = s.tracker
        inflight = s.inflight
        rem = 0.0
        if inflight is not None:
            rem = inflight.steps_left * inflight.step_s
            if running:
                rem -= min(inflight.step_s, self.now - inflight.step_started_t)
        slack = tr.slack(self.now)
        cap = self.cfg.max_lookahead_s
        runnable = (not s.finished and not s.left and s.available_t <= self.now
                    and (cap is None or slack < cap or inflight is not None))
        return StreamView(
            stream_id=s.sid,
            worker_id=s.worker,
            slack_s=slack,
            arrival_t=s.arrival_t,
            remaining_content_s=tr.remaining_content_s,
            inflight_remaining_s=max(0.0, rem),
            inflight_point=inflight.point if inflight is not None else None,
            running=running,
            resident=s.resident,
            runnable=runnable,
            first_chunk=tr.generated_s == 0.0 and tr.epoch == 0,
            paused=tr.paused,
            last_rehomed_at=s.last_rehomed_at,
            last_run_at=s.last_run_at,
            state_bytes=s.state_bytes,
        )

    def _worker_view(self, w: SimWorker) -> WorkerView:
        return WorkerView(w.wid, w.node, w.slots, w.draining)

    def snapshot(self) -> Snapshot:
        views = []
        for w in self.workers.values():
            for sid in w.streams:
                views.append(self._view(self.streams[sid], sid in w.job))
        return Snapshot(self.now, views, [self._worker_view(w) for w in self.workers.values()])

    # ---- trace events -------------------------------------------------------------------------
    def _on_trace(self, e: TraceEvent) -> None:
        if e.kind is EventKind.ARRIVE:
            self._arrive(e)
            return
        s = self.streams.get(e.stream)
        if s is None or s.left:
            return
        tr = s.tracker
        if e.kind is EventKind.PAUSE:
            tr.pause(self.now)
        elif e.kind is EventKind.RESUME:
            tr.resume(self.now)
            self._kick(s.worker)
        elif e.kind is EventKind.PROMPT_SWITCH:
            if tr.done_generating and tr.cursor(self.now) >= tr.content_s - 1e-9:
                return  # already fully played: nothing left to switch
            tr.reset_slack(self.now)
            if s.inflight is not None and s.sid not in self.workers[s.worker].job:
                s.inflight = None  # a preempted partial chunk belongs to the old prompt
            if s.finished:
                s.finished = False
                s.resident = False  # its state went to host when it finished; restore on next run
                self.workers[s.worker].streams.add(s.sid)
            self._kick(s.worker)
        elif e.kind is EventKind.LEAVE:
            s.left = True
            w = self.workers[s.worker]
            if s.sid not in w.job:
                w.streams.discard(s.sid)

    def _arrive(self, e: TraceEvent) -> None:
        content_s = e.frames / e.fps
        adm = self.policy.admit(AdmissionRequest(e.stream, self.now, content_s), self.snapshot())
        if not adm.accepted or adm.worker_id is None:
            self.rejected[e.stream] = adm.reason
            return
        tracker = PlayoutTracker(self.now, adm.initial_slack_s, content_s)
        s = SimStream(e.stream, self.now, tracker, adm.worker_id, self.policy.reference.state_bytes)
        self.streams[e.stream] = s
        w = self.workers[adm.worker_id]
        w.streams.add(e.stream)
        # A new stream's state (prompt embedding, empty KV) starts on-GPU; it may need an eviction.
        s.resident = False
        self._kick(w.wid)

    # ---- worker execution ---------------------------------------------------------------------
    def _kick(self, wid: int) -> None:
        w = self.workers.get(wid)
        if w is None or w.job:
            return
        self._dispatch(w, step_boundary=False)

    def _dispatch(self, w: SimWorker, step_boundary: bool) -> None:
        views = [self._view(self.streams[sid], sid in w.job) for sid in w.streams]
        d = self.policy.dispatch(self.now, self._worker_view(w), views, step_boundary=step_boundary)
        if step_boundary and d.stream_ids == w.job:
            self._run_step(w, 0.0)
            return
        if step_boundary:
            self.preemptions += 1
            for sid in w.job:
                self.streams[sid].last_run_at = self.now
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
            if s.finished or s.left:
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
            s = self.streams[sid]
            s.resident = False
            self.evictions += 1
        delay = 0.0
        for sid in d.restore:
            s = self.streams[sid]
            s.resident = True
            if s.tracker.generated_s > 0 or s.tracker.epoch > 0 or s.last_run_at > -math.inf:
                self.restores += 1
                delay += self.cfg.transfer.residual_s(s.state_bytes, Link.HOST)
        w.job = d.stream_ids
        for sid in d.stream_ids:
            s = self.streams[sid]
            if s.inflight is None:
                point = d.point
                first = s.tracker.generated_s == 0.0 and s.tracker.epoch == 0
                total = (point.first_chunk_latency_s if first else point.latency_s) * self._jitter()
                steps = point.config.steps
                s.inflight = InFlight(point, total / steps, steps, s.tracker.epoch)
                label = point.config.label()
                self.fidelity_counts[label] = self.fidelity_counts.get(label, 0) + 1
        self._run_step(w, delay)

    def _jitter(self) -> float:
        if self.cfg.jitter_cv == 0:
            return 1.0
        return float(max(0.5, self.rng.normal(1.0, self.cfg.jitter_cv)))

    def _run_step(self, w: SimWorker, delay: float) -> None:
        lead = self.streams[w.job[0]].inflight
        assert lead is not None
        start = self.now + delay
        for sid in w.job:
            inflight = self.streams[sid].inflight
            assert inflight is not None
            inflight.step_started_t = start
        w.gen += 1
        w.busy_s += lead.step_s + delay
        self._push(start + lead.step_s, Ev.STEP_DONE, (w.wid, w.gen))

    def _on_step_done(self, wid: int, gen: int) -> None:
        w = self.workers.get(wid)
        if w is None or gen != w.gen or not w.job:
            return
        for sid in w.job:
            inflight = self.streams[sid].inflight
            assert inflight is not None
            inflight.steps_left -= 1
        lead = self.streams[w.job[0]].inflight
        assert lead is not None
        live_job = tuple(sid for sid in w.job if not self.streams[sid].left)
        if lead.steps_left > 0 and live_job == w.job:
            self._dispatch(w, step_boundary=True)
            return
        if lead.steps_left > 0:
            for sid in w.job:  # drop streams that left mid-chunk; finish nobody's chunk
                self.streams[sid].inflight = None
                if self.streams[sid].left:
                    w.streams.discard(sid)
            w.job = ()
            self._kick(wid)
            return
        job, w.job = w.job, ()
        for sid in job:
            self._chunk_done(self.streams[sid], w)
        self._kick(wid)

    def _chunk_done(self, s: SimStream, w: SimWorker) -> None:
        inflight = s.inflight
        assert inflight is not None
        s.inflight = None
        s.last_run_at = self.now
        if s.left:
            w.streams.discard(s.sid)
            return
        tr = s.tracker
        if inflight.epoch == tr.epoch:
            first = tr.generated_s == 0.0 and tr.epoch == 0
            dur = self.profile.first_chunk_duration_s if first else self.profile.chunk_duration_s
            tr.on_chunk_ready(self.now, dur)
            s.quality_sum += inflight.point.quality
            s.quality_chunks += 1
        if tr.done_generating:
            s.finished = True
            s.pending_rehome = None
            w.streams.discard(s.sid)
            return
        if s.pending_rehome is not None:
            self._apply_rehome(s, s.pending_rehome)

    def _apply_rehome(self, s: SimStream, r: Rehome) -> None:
        s.pending_rehome = None
        src, dst = self.workers[r.src], self.workers.get(r.dst)
        if dst is None or s.worker != r.src or s.finished or s.left:
            return
        src.streams.discard(s.sid)
        dst.streams.add(s.sid)
        s.worker = r.dst
        s.last_rehomed_at = self.now
        s.available_t = self.now + r.residual_s
        self.rehomes += 1
        self._push(s.available_t, Ev.READY, r.dst)
        self._kick(r.src)

    # ---- control tick -------------------------------------------------------------------------
    def _on_tick(self) -> None:
        snap = self.snapshot()
        plan = self.policy.tick(snap)
        for r in plan.rehomes:
            s = self.streams[r.stream_id]
            if s.sid in self.workers[s.worker].job or s.inflight is not None:
                s.pending_rehome = r  # applied at its next chunk boundary
            else:
                self._apply_rehome(s, r)
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
