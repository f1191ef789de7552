"""The engine core: one loop that turns the policy's plans into work on executors, written once.

vLLM v1's ``EngineCore.step`` shape, for chunked video streams:

    schedule  at a worker's step or chunk boundary, ``SlackPolicy.dispatch`` on the ledger's views
              (only streams whose input is there) -> a ``Work`` order: which streams take one
              denoising step together, at which fidelity point, which states to evict / restore first,
              whether the stream that was running is preempted;
    execute   ``Executor.execute(work)``: the only place that touches an engine;
    update    ``EngineCore.step_done(worker)`` when the executor finishes the step: the ledger learns
              step and chunk completions (playout slack, CPR, stalls), stale chunks are abandoned, a
              pending re-home is applied at the chunk boundary, and the worker is scheduled again.

Every ``tick_s`` the control tick runs ``SlackPolicy.tick`` (credits, tiers, re-homes, the
autoscaler's advice). Admission, pauses, prompt switches and departures come in as events.

The core is pure Python with an injected clock. Its executors: the simulator's simulated workers
(engine/sim/simulator.py, a virtual clock and profiled step times) and the live server's in-process
engine (app/server/serving/executors.py, real chunks on the engine thread). Both run this code; only the
executor differs. FIFO and the other baselines are policy presets (``policy_presets``), not loops.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from engine.serving.credit import Tier
from engine.serving.ledger import InFlight, StreamEntry, StreamLedger
from engine.serving.policy import ASSUMED_BATCH, SlackPolicy
from engine.serving.profile import ProfilePoint
from engine.serving.snapshot import (
    Admission,
    AdmissionRequest,
    Rehome,
    Snapshot,
    StreamView,
    TickPlan,
    WorkerView,
)

if TYPE_CHECKING:
    from engine.serving.scaler import Scaler

log = logging.getLogger(__name__)

Clock = Callable[[], float]
CALIBRATION_MIN_SAMPLES = 5
CALIBRATION_DRIFT = 0.2  # rebuild the policy when the measured speed moved this much from the last fit
# Per-worker speed: each step's seconds decay by this per newer step of the worker (about its last 10
# steps count), so a step batch's long first step and short later ones average out.
WORKER_SPEED_DECAY = 0.9


@dataclass(frozen=True, slots=True)
class StepOrder:
    """One stream's part of a ``Work``: its chunk's fidelity, and where the step sits in the chunk."""

    stream_id: int
    point: ProfilePoint
    new_chunk: bool  # the step starts a chunk (the executor takes its input and encodes it first)
    last_step: bool  # the step finishes the chunk (the executor decodes it and has output to show)


@dataclass(frozen=True)
class Work:
    """What a worker does next: evict, restore, then ONE batched denoising step of ``orders``."""

    worker_id: int
    orders: tuple[StepOrder, ...]
    evict: tuple[int, ...] = ()
    restore: tuple[int, ...] = ()
    preempted: tuple[int, ...] = ()  # their partial chunks stay parked until they are dispatched again
    # Streams whose chunks the core abandoned since their last step: the engine forgets them first
    # (part of the work, so that it happens in order with the steps on that engine).
    drop: tuple[int, ...] = ()
    continues: bool = False  # the next step of the worker's previous work (a step boundary, no preemption)
    est_step_s: float = 0.0  # the profile's estimate of this step's time

    @property
    def stream_ids(self) -> tuple[int, ...]:
        return tuple(o.stream_id for o in self.orders)


class Executor(Protocol):
    """Carries out the core's work on some engine: real (in-process) or simulated."""

    def worker_views(self) -> Sequence[WorkerView]: ...

    def input_ready(self, worker_id: int) -> set[int] | None:
        """Streams on the worker whose next chunk's input has arrived (live V2V cannot run ahead of its
        camera); None when every stream's input is always there (simulated content)."""
        ...

    def execute(self, work: Work) -> float:
        """Start the work; the executor calls ``EngineCore.step_done`` when the step is over. Returns
        the seconds before the step itself starts (restores from host memory go first)."""
        ...

    def rehome(self, move: Rehome) -> float:
        """Move a stream's state to another worker at a chunk boundary; seconds until it is usable."""
        ...

    def wake_at(self, worker_id: int, t: float) -> None:
        """Schedule the worker again at ``t`` (an idle worker waiting for a stream to become runnable)."""
        ...


@dataclass
class CoreCounters:
    admissions: int = 0
    admissions_refused: int = 0
    evictions: int = 0
    restores: int = 0
    preemptions: int = 0
    rehomes: int = 0
    abandoned: int = 0  # chunks dropped at a step boundary (prompt switched, batch partner left)


@dataclass
class StepResult:
    """What became of a finished step, for the executor: outputs to show, outputs to throw away."""

    delivered: tuple[int, ...] = ()  # chunks that finished under the stream's current prompt
    discarded: tuple[int, ...] = ()  # finished chunks nobody will see (the prompt switched, the stream left)
    abandoned: tuple[int, ...] = ()  # chunks dropped mid-way: the engine must drop their partial state


@dataclass
class StreamStats:
    """The policy's view of one stream, refreshed at every tick (for stats and the dashboard)."""

    tier: str = "-"
    credit_s: float = 0.0
    point: ProfilePoint | None = None  # of the last chunk started
    top_quality: float = 0.0  # best quality its ceiling allows
    chunks: int = 0
    downshifts: int = 0  # chunks whose point has lower quality than the previous chunk's
    degraded_chunks: int = 0  # chunks below the stream's best allowed point
    reduced_resolution_chunks: int = 0  # chunks the engine ran below the stream's full resolution
    step_batch_chunks: int = 0  # chunks whose steps shared forwards with the next chunks' (step batch)
    batch: int = 1


@dataclass
class EngineCore:
    """Schedule -> execute -> update over the policy, the ledger and one executor."""

    policy: SlackPolicy
    executor: Executor
    clock: Clock
    ledger: StreamLedger = field(default_factory=StreamLedger)
    counters: CoreCounters = field(default_factory=CoreCounters)
    # Online calibration (live executors report measured step times): the engine's speed relative to
    # the profile. When it drifts, the policy is rebuilt on the rescaled profile.
    calibrate: bool = False
    jobs: dict[int, tuple[int, ...]] = field(default_factory=dict)  # worker -> streams of its step in flight
    pending_rehomes: dict[int, Rehome] = field(default_factory=dict)
    abandoned: set[int] = field(default_factory=set)  # streams whose engine must drop chunks (next Work)
    fidelity_counts: dict[str, int] = field(default_factory=dict)
    stats: dict[int, StreamStats] = field(default_factory=dict)
    # The autoscaler that acts (engine/serving/scaler.py): adds and removes the executor's workers.
    scaler: Scaler | None = None
    speed_ratio: float = 1.0
    applied_ratio: float = 1.0
    _ratio_samples: int = 0
    _base_policy: SlackPolicy | None = None
    # Per worker, decayed sums of its steps' measured seconds and their base-profile estimates, and its
    # steps measured: the sums' ratio is its speed (``WorkerView.speed``), what live re-homing compares.
    _worker_time: dict[int, tuple[float, float, int]] = field(default_factory=dict)

    # ---- admission and stream events ------------------------------------------------------------
    def arrive(self, stream_id: int, content_s: float, max_steps: int | None = None) -> Admission:
        now = self.clock()
        admission = self.policy.admit(AdmissionRequest(stream_id, now, content_s, max_steps), self.snapshot())
        if not admission.accepted or admission.worker_id is None:
            self.counters.admissions_refused += 1
            return admission
        entry = self.ledger.admit(admission, now, content_s, self.policy.reference.state_bytes)
        entry.max_steps = max_steps
        self.counters.admissions += 1
        self.stats[stream_id] = StreamStats()
        self.kick(admission.worker_id)
        return admission

    def set_max_steps(self, stream_id: int, max_steps: int | None) -> None:
        """The user's step count: the policy never routes the stream's chunks above it."""
        entry = self.ledger.entries.get(stream_id)
        if entry is not None:
            entry.max_steps = max_steps

    def pause(self, stream_id: int) -> None:
        if self._active(stream_id) is not None:
            self.ledger.pause(stream_id, self.clock())

    def resume(self, stream_id: int) -> None:
        entry = self._active(stream_id)
        if entry is not None:
            self.ledger.resume(stream_id, self.clock())
            self.kick(entry.worker)

    def prompt_switch(self, stream_id: int) -> None:
        """Buffered output of the old prompt is useless: the slack resets (SlackServe's prompt switch)."""
        entry = self._active(stream_id)
        if entry is not None and self.ledger.prompt_switch(stream_id, self.clock(), self._running(stream_id)):
            self.kick(entry.worker)

    def leave(self, stream_id: int) -> None:
        entry = self.ledger.entries.get(stream_id)
        if entry is None or entry.left:
            return
        self.ledger.leave(stream_id, self._running(stream_id))
        self.pending_rehomes.pop(stream_id, None)

    def forget(self, stream_id: int) -> None:
        """Drop a stream that left and has nothing in flight (live servers run for days)."""
        entry = self.ledger.entries.get(stream_id)
        if entry is not None and entry.left and not self._running(stream_id):
            entry.inflight = None
            self.abandoned.discard(stream_id)
            self.ledger.forget(stream_id)
            self.stats.pop(stream_id, None)

    def report_cursor(self, stream_id: int, cursor_s: float) -> None:
        """The live client's playout position (content seconds played since the stream began)."""
        entry = self._active(stream_id)
        if entry is not None and not self._running(stream_id):
            self.ledger.cursor_report(stream_id, self.clock(), cursor_s)

    def _active(self, stream_id: int) -> StreamEntry | None:
        entry = self.ledger.entries.get(stream_id)
        return entry if entry is not None and not entry.left else None

    def _running(self, stream_id: int) -> bool:
        return any(stream_id in job for job in self.jobs.values())

    # ---- views ----------------------------------------------------------------------------------
    def running(self) -> set[int]:
        return {sid for job in self.jobs.values() for sid in job}

    def snapshot(self) -> Snapshot:
        workers = list(self.executor.worker_views())
        if self._worker_time:
            workers = [replace(w, speed=self.worker_speed(w.worker_id)) for w in workers]
        return self.ledger.snapshot(self.clock(), workers, self.running())

    def worker_speed(self, worker_id: int) -> float | None:
        """How many times the base profile's time the worker's recent steps took; None: fewer than
        CALIBRATION_MIN_SAMPLES steps measured (a worker's first steps, its first chunks', mislead)."""
        measured, profiled, steps = self._worker_time.get(worker_id, (0.0, 0.0, 0))
        return measured / profiled if steps >= CALIBRATION_MIN_SAMPLES and profiled > 0 else None

    def _views(self, worker: WorkerView) -> list[StreamView]:
        now = self.clock()
        job = self.jobs.get(worker.worker_id, ())
        views = self.ledger.views_on(worker.worker_id, now, job)
        ready = self.executor.input_ready(worker.worker_id)
        if ready is None:
            return views
        # A chunk already started (running or preempted) needs no new input.
        return [v if v.runnable and (v.stream_id in ready or v.inflight_point is not None)
                else replace(v, runnable=False) for v in views]

    # ---- schedule + execute -----------------------------------------------------------------------
    def kick(self, worker_id: int) -> None:
        """A chunk boundary on an idle worker: dispatch its next work, if any."""
        if self.jobs.get(worker_id):
            return
        worker = self._worker(worker_id)
        if worker is not None:
            self._dispatch(worker, step_boundary=False)

    def kick_all(self) -> None:
        for worker in self.executor.worker_views():
            self.kick(worker.worker_id)

    def _worker(self, worker_id: int) -> WorkerView | None:
        return next((w for w in self.executor.worker_views() if w.worker_id == worker_id), None)

    def _dispatch(self, worker: WorkerView, step_boundary: bool) -> None:
        wid = worker.worker_id
        job = self.jobs.get(wid, ())
        views = self._views(worker)
        decision = self.policy.dispatch(self.clock(), worker, views, step_boundary=step_boundary)
        preempted: tuple[int, ...] = ()
        if step_boundary and decision.stream_ids != job:
            self.counters.preemptions += 1
            now = self.clock()
            for sid in job:
                self.ledger.preempted(sid, now)
            preempted = job
        self.jobs.pop(wid, None)
        if not decision.stream_ids or decision.point is None:
            self._schedule_wake(wid, views)
            return
        for sid in decision.evict:
            self.ledger.evict(sid)
            self.counters.evictions += 1
        restored = tuple(sid for sid in decision.restore if self.ledger.restore(sid))
        self.counters.restores += len(restored)
        orders = []
        for sid in decision.stream_ids:
            inflight = self.ledger.entries[sid].inflight
            if inflight is None:
                self._count_start(sid, decision.point, len(decision.stream_ids))
                orders.append(StepOrder(sid, decision.point, True, decision.point.config.sequential_steps == 1))
            else:
                orders.append(StepOrder(sid, inflight.point, False, inflight.steps_left == 1))
        now = self.clock()
        for sid in decision.stream_ids:
            self.ledger.chunk_started(sid, now, decision.point, self.applied_ratio)
        lead = self.ledger.entries[decision.stream_ids[0]].inflight
        assert lead is not None
        self.jobs[wid] = decision.stream_ids
        drop = tuple(sid for sid in decision.stream_ids if sid in self.abandoned)
        self.abandoned.difference_update(drop)
        work = Work(wid, tuple(orders), decision.evict, restored, preempted,
                    continues=step_boundary and not preempted, est_step_s=lead.est_step_s, drop=drop)
        delay = self.executor.execute(work)
        if delay > 0:  # the step starts once the restored states are back
            for sid in decision.stream_ids:
                started = self.ledger.entries[sid].inflight
                assert started is not None
                started.step_started_t = now + delay

    def _count_start(self, sid: int, point: ProfilePoint, batch: int) -> None:
        label = point.config.label()
        self.fidelity_counts[label] = self.fidelity_counts.get(label, 0) + 1
        stats = self.stats.setdefault(sid, StreamStats())
        entry = self.ledger.entries[sid]
        top = self.policy.top_point(entry.max_steps).quality
        if stats.point is not None and point.quality < stats.point.quality:
            stats.downshifts += 1
        if point.quality < top:
            stats.degraded_chunks += 1
        stats.reduced_resolution_chunks += int(point.config.resolution_scale < 1.0)
        stats.step_batch_chunks += int(point.config.step_batch)
        stats.point, stats.top_quality, stats.batch = point, top, batch
        stats.chunks += 1

    def _schedule_wake(self, wid: int, views: Sequence[StreamView]) -> None:
        """Idle worker: wake when a blocked stream becomes runnable (transfer done, lookahead cap, camera
        input captured)."""
        now = self.clock()
        wake = math.inf
        cap = self.ledger.max_lookahead_s
        for v in views:
            entry = self.ledger.entries[v.stream_id]
            if not entry.active:
                continue
            if entry.available_t > now:
                wake = min(wake, entry.available_t)
            elif not v.paused:
                if cap is not None:
                    wake = min(wake, now + max(1e-3, v.slack_s - cap))
                wait = self.ledger.input_wait_s(v.stream_id, now)
                if 0 < wait < math.inf:
                    wake = min(wake, now + wait)
        if wake < math.inf:
            self.executor.wake_at(wid, wake)

    # ---- update -----------------------------------------------------------------------------------
    def step_done(self, worker_id: int, measured_s: float | None = None,
                  content_s: Mapping[int, float] | None = None) -> StepResult:
        """The executor finished the worker's step. ``measured_s``: its wall time (live executors),
        which calibrates the profile; None for simulated steps. ``content_s``: seconds of content each
        finished chunk really holds, where the executor knows (else the profile's chunk duration)."""
        job = self.jobs.get(worker_id, ())
        if not job:
            return StepResult()
        now = self.clock()
        for sid in job:
            self.ledger.step_done(sid, now)
        lead = self.ledger.entries[job[0]].inflight
        assert lead is not None
        if measured_s is not None:
            self._observe_latency(worker_id, lead, measured_s)
        if lead.steps_left > 0 and len(job) == 1 and self.ledger.is_stale(job[0]):
            # The prompt changed mid-chunk: drop the stale chunk at this step boundary (a batch keeps
            # going for its other streams and the stale output is discarded at the end).
            self.ledger.abandon(job[0], now)
            self.counters.abandoned += 1
            self.abandoned.add(job[0])
            self.jobs.pop(worker_id)
            self.kick(worker_id)
            return StepResult(abandoned=job)
        if lead.steps_left > 0 and all(self.ledger.entries[sid].active for sid in job):
            worker = self._worker(worker_id)
            if worker is None:
                self.jobs.pop(worker_id)
                return StepResult()
            self._dispatch(worker, step_boundary=True)
            return StepResult()
        self.jobs.pop(worker_id)
        if lead.steps_left > 0:
            # A stream in the batch left mid-chunk: nobody's chunk completes; the others restart theirs.
            for sid in job:
                self.ledger.abandon(sid, now)
                if self.ledger.entries[sid].left:
                    self.ledger.leave(sid, running=False)
            self.counters.abandoned += len(job)
            self.abandoned.update(job)
            self.kick(worker_id)
            return StepResult(abandoned=job)
        delivered: list[int] = []
        discarded: list[int] = []
        moves: list[Rehome] = []
        for sid in job:
            entry = self.ledger.entries[sid]
            duration = self.policy.chunk_duration_s(first=entry.first_chunk)
            if content_s is not None and sid in content_s:
                duration = content_s[sid]
            elif not entry.left:
                duration = self.ledger.step_batch_content(sid, duration)
            fresh = not entry.left and not self.ledger.is_stale(sid)
            if duration <= 0 and not entry.left:
                # A step batch filling up: the chunk is in the engine, its frames come out with a later one.
                self.ledger.abandon(sid, now)
                continue
            self.ledger.chunk_done(sid, now, duration)
            (delivered if fresh else discarded).append(sid)
            move = self.pending_rehomes.pop(sid, None)
            if move is not None:
                moves.append(move)
        # The source worker (this one) is kicked only after every chunk of the batch is done and every
        # move applied: its next dispatch must not see a batch partner's finished chunk as one still in
        # flight, nor start the next chunk of a partner that moves too (its move then found a chunk in
        # flight and raised: two streams of one batch re-homed at the same boundary).
        for move in moves:
            self._apply_rehome(move)
        self.kick(worker_id)
        return StepResult(tuple(delivered), tuple(discarded))

    def failed(self, worker_id: int) -> tuple[int, ...]:
        """The worker's step raised: its streams leave (their sessions end); the others go on."""
        job = self.jobs.pop(worker_id, ())
        now = self.clock()
        for sid in job:
            self.ledger.abandon(sid, now)
            self.leave(sid)
            self.forget(sid)
        self.kick(worker_id)
        return job

    def worker_lost(self, worker_id: int, homes: Mapping[int, int | None]) -> tuple[int, ...]:
        """A worker died. Its step in flight is dropped and its streams' started chunks abandoned; each
        stream in ``homes`` goes on from the home the executor re-admitted it on (resident there), or
        leaves (None: no worker left). Returns the streams of the dropped step."""
        job = self.jobs.pop(worker_id, ())
        now = self.clock()
        for sid, home in homes.items():
            entry = self._active(sid)
            if entry is None:
                continue
            if entry.inflight is not None:
                self.ledger.abandon(sid, now)
                self.counters.abandoned += 1
            self.pending_rehomes.pop(sid, None)
            if home is None:
                self.leave(sid)
                self.forget(sid)
                continue
            self.ledger.move(sid, home, now, 0.0)
            self.ledger.restore(sid)
            self.kick(home)
        return job

    def step_lost(self, worker_id: int) -> tuple[int, ...]:
        """The worker's step did not run (a stream's state was moved away under it): the chunks its
        streams had started are abandoned (their engine drops them at their next step). The caller
        schedules the worker again. Returns the streams of the lost step."""
        job = self.jobs.pop(worker_id, ())
        now = self.clock()
        for sid in job:
            entry = self._active(sid)
            if entry is not None and entry.inflight is not None:
                self.ledger.abandon(sid, now)
                self.counters.abandoned += 1
                self.abandoned.add(sid)
        return job

    def moved(self, stream_id: int, worker_id: int) -> None:
        """The stream's state was moved to ``worker_id`` outside the policy (an operator's migration):
        the ledger follows; a partial chunk it had parked did not travel and starts again."""
        entry = self._active(stream_id)
        if entry is None or self._running(stream_id) or entry.worker == worker_id:
            return
        if entry.inflight is not None:
            self.ledger.abandon(stream_id, self.clock())
            self.counters.abandoned += 1
        self.pending_rehomes.pop(stream_id, None)
        self.ledger.move(stream_id, worker_id, self.clock(), 0.0)
        self.kick(worker_id)

    # ---- re-homing and the control tick -----------------------------------------------------------
    def _apply_rehome(self, move: Rehome) -> None:
        entry = self.ledger.entries[move.stream_id]
        if self._worker(move.dst) is None or entry.worker != move.src or not entry.active:
            return
        residual = self.executor.rehome(move)
        self.ledger.move(entry.sid, move.dst, self.clock(), residual)
        self.counters.rehomes += 1
        self.executor.wake_at(move.dst, entry.available_t)

    def request_rehome(self, move: Rehome) -> None:
        """Move a stream at its next chunk boundary (now, if it has no chunk started)."""
        entry = self._active(move.stream_id)
        if entry is None:
            return
        if entry.inflight is not None:
            self.pending_rehomes[move.stream_id] = move
        else:
            self._apply_rehome(move)
            self.kick(move.src)

    def tick(self) -> TickPlan:
        """The control tick: credits and tiers for every stream, re-homes (each at its stream's next
        chunk boundary), the autoscaler's advice."""
        plan = self.policy.tick(self.snapshot())
        for move in plan.rehomes:
            self.request_rehome(move)
        if self.scaler is not None:
            self.scaler.step(self, plan)
        for i, sid in enumerate(plan.stream_ids.tolist()):
            stats = self.stats.get(int(sid))
            if stats is not None:
                stats.tier = Tier(int(plan.tiers[i])).name.lower()
                stats.credit_s = float(plan.credits[i])
        return plan

    # ---- calibration ----------------------------------------------------------------------------
    def _observe_latency(self, worker_id: int, inflight: InFlight, measured_s: float) -> None:
        """One step's measured time against its base-profile time, for the whole engine's speed ratio
        and for the worker's (``worker_speed``). A batch the profile
        did not measure is estimated at its streams' single-stream times added up, an upper bound
        (batching is never slower), so its ratio is a lower bound on the engine's: it may raise the
        estimate, never lower it. Ignoring such batches left a server whose lanes all ran batches
        at a point chosen before any measurement (four streams, two per lane, at x0.875 where x0.5
        fits: half the frames dropped for the whole run)."""
        est = inflight.est_step_s
        if not self.calibrate or est <= 0:
            return
        # Against the base profile: the policy may have been rescaled since the chunk started, and
        # measuring it against the current scale compounded the two (ratios of 700 on a 10x engine).
        base_s = est / inflight.scale
        measured, profiled, steps = self._worker_time.get(worker_id, (0.0, 0.0, 0))
        self._worker_time[worker_id] = (WORKER_SPEED_DECAY * measured + measured_s,
                                        WORKER_SPEED_DECAY * profiled + base_s, steps + 1)
        ratio = measured_s / base_s
        if inflight.point.source == ASSUMED_BATCH:
            ratio = max(ratio, self.speed_ratio)
        self.speed_ratio = ratio if self._ratio_samples == 0 else 0.8 * self.speed_ratio + 0.2 * ratio
        self._ratio_samples += 1
        drift = abs(self.speed_ratio / self.applied_ratio - 1)
        if self._ratio_samples >= CALIBRATION_MIN_SAMPLES and drift > CALIBRATION_DRIFT:
            self.recalibrate(self.speed_ratio)

    def recalibrate(self, ratio: float) -> None:
        """Rebuild the policy on its base profile with every latency times ``ratio``."""
        if self._base_policy is None:
            self._base_policy = self.policy
        self.policy = self._base_policy.rescaled(ratio)
        log.info("serving policy recalibrated: chunks take %.2fx the profiled time (was %.2fx)", ratio,
                 self.applied_ratio)
        self.applied_ratio = ratio

