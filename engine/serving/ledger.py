"""Executor-side stream bookkeeping: observations in, ``StreamView``/``Snapshot`` out.

The policy is pure; something has to remember each stream's playout state, home worker, residency,
in-flight chunk and cooldowns between calls. ``StreamLedger`` is that something, shared by the simulator
and (later) the live server so both feed the policy identical views:

    ledger.admit(admission, now, content_s, state_bytes)        # after policy.admit(...) accepted
    ledger.chunk_started(sid, now, point, first)               # worker began a chunk with BMPR's point
    ledger.step_done(sid, now) / ledger.preempted(sid, now)    # step boundary progress / yielded mid-chunk
    ledger.is_stale(sid) -> ledger.abandon(sid, now)           # prompt switched mid-chunk: stop at a step
    ledger.chunk_done(sid, now, duration_s)                     # chunk playable -> PlayoutTracker
    ledger.cursor_report(sid, now, cursor_s)                   # live server: the client's playout position
    ledger.pause / resume / prompt_switch / leave(sid, now)
    ledger.snapshot(now, workers) -> Snapshot                  # for policy.tick / policy.admit
    ledger.views_on(worker_id, now, running) -> [StreamView]   # for policy.dispatch
    ledger.evict / restore / move(...)                         # apply Dispatch / Rehome decisions

R (remaining time of a started chunk) is estimated from the profiled latency of its point, as the policy
would see it on a real GPU; the simulator's jittered actual durations never leak into the views.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.fidelity import FidelityConfig
from engine.serving.playout import ChunkOutcome, PlayoutTracker
from engine.serving.profile import ProfilePoint
from engine.serving.snapshot import Admission, Snapshot, StreamView, WorkerView


@dataclass(frozen=True)
class Camera:
    """A live stream's input: the camera delivers content at the content rate from the stream's arrival
    (stopping while it is paused), and a chunk can start once its last input frame was captured. A frame
    is captured at its start time, so a chunk of ``d`` seconds is ready ``d - frame_s`` after the
    content before it. The engine's first chunk is shorter (one frame for the causal VAE's first latent)."""

    first_chunk_s: float
    chunk_s: float
    frame_s: float


@dataclass
class InFlight:
    point: ProfilePoint
    est_step_s: float
    steps_left: int
    epoch: int
    step_started_t: float
    # The calibration ratio of the profile ``est_step_s`` came from (live: the policy is rebuilt on a
    # rescaled profile as the engine's speed is measured; a step is measured against that one).
    scale: float = 1.0


@dataclass
class StreamEntry:
    sid: int
    arrival_t: float
    tracker: PlayoutTracker
    worker: int
    state_bytes: float
    resident: bool = False  # a new stream's state (prompt embedding, empty KV) needs a slot first
    available_t: float = 0.0  # a transfer in progress makes the stream unrunnable until then
    inflight: InFlight | None = None
    last_rehomed_at: float = -math.inf
    last_run_at: float = -math.inf
    finished: bool = False
    left: bool = False
    quality_sum: float = 0.0
    quality_chunks: int = 0
    max_steps: int | None = None  # the user's step count caps the stream's fidelity (None: no cap)
    input_s: float = 0.0  # camera content its started chunks consumed (``StreamLedger.camera``)
    camera_paused_s: float = 0.0  # how long the camera stood still (pauses) before ``paused_at``
    paused_at: float | None = None
    # The step batch the stream's chunks run in and the content of those of its chunks the engine still
    # holds, oldest first (see ``StreamLedger.step_batch_content``).
    step_batch: FidelityConfig | None = None
    step_batch_held: tuple[float, ...] = ()

    def captured_s(self, now: float) -> float:
        """Camera content captured by ``now``."""
        return (now if self.paused_at is None else self.paused_at) - self.arrival_t - self.camera_paused_s

    @property
    def active(self) -> bool:
        return not (self.finished or self.left)

    @property
    def first_chunk(self) -> bool:
        return self.tracker.generated_s == 0.0 and self.tracker.epoch == 0 and not self.step_batch_held


@dataclass
class StreamLedger:
    max_lookahead_s: float | None = None  # live V2V cannot run ahead of the camera; None = unbounded
    # A finer model of the same: each chunk waits for its input frames (the simulator of a live trace).
    camera: Camera | None = None
    max_log: int | None = None  # per-stream tracker log/stall rows kept (live servers); None = all
    entries: dict[int, StreamEntry] = field(default_factory=dict)
    _by_worker: dict[int, set[int]] = field(default_factory=dict)

    # ---- membership ---------------------------------------------------------------------------
    def admit(self, adm: Admission, now: float, content_s: float, state_bytes: float) -> StreamEntry:
        if not adm.accepted or adm.worker_id is None:
            raise ValueError(f"stream {adm.stream_id} was not admitted: {adm.reason}")
        if adm.stream_id in self.entries:
            raise ValueError(f"stream {adm.stream_id} is already in the ledger")
        tracker = PlayoutTracker(now, adm.initial_slack_s, content_s, max_log=self.max_log)
        e = StreamEntry(adm.stream_id, now, tracker, adm.worker_id, state_bytes)
        self.entries[e.sid] = e
        self._by_worker.setdefault(e.worker, set()).add(e.sid)
        return e

    def on_worker(self, worker_id: int) -> list[StreamEntry]:
        return [self.entries[s] for s in sorted(self._by_worker.get(worker_id, ()))]

    def _detach(self, e: StreamEntry) -> None:
        self._by_worker.get(e.worker, set()).discard(e.sid)

    def forget(self, sid: int) -> None:
        """Drop a stream that has left and has no chunk in flight: a live server that runs for days
        must not keep every stream it ever served (the simulator keeps them for its report)."""
        e = self.entries.get(sid)
        if e is None:
            return
        if not e.left or e.inflight is not None:
            raise ValueError(f"stream {sid} cannot be forgotten: left={e.left}, chunk in flight={e.inflight is not None}")
        self._detach(e)
        del self.entries[sid]

    def move(self, sid: int, dst: int, now: float, residual_s: float) -> None:
        """Re-home at a chunk boundary: the state follows, usable after the critical-path residual."""
        e = self.entries[sid]
        if e.inflight is not None:
            raise ValueError(f"stream {sid} has a chunk in flight; re-home it at its next chunk boundary")
        self._detach(e)
        e.worker = dst
        self._by_worker.setdefault(dst, set()).add(sid)
        e.last_rehomed_at = now
        e.available_t = now + residual_s
        e.step_batch, e.step_batch_held = None, ()  # a moved state leaves its step batch's chunks behind

    def evict(self, sid: int) -> None:
        self.entries[sid].resident = False

    def restore(self, sid: int) -> bool:
        """Mark resident; True when a host->GPU copy is needed (not for a brand-new stream)."""
        e = self.entries[sid]
        e.resident = True
        return e.last_run_at > -math.inf or e.tracker.epoch > 0

    # ---- observations -------------------------------------------------------------------------
    def chunk_started(self, sid: int, now: float, point: ProfilePoint, scale: float = 1.0) -> None:
        e = self.entries[sid]
        if e.inflight is not None:
            e.inflight.step_started_t = now  # resuming a preempted chunk
            return
        total = point.first_chunk_latency_s if e.first_chunk else point.latency_s
        if self.camera is not None:
            e.input_s += self.camera.first_chunk_s if e.first_chunk else self.camera.chunk_s
        steps = point.config.sequential_steps
        e.inflight = InFlight(point, total / steps, steps, e.tracker.epoch, now, scale)

    def step_done(self, sid: int, now: float) -> None:
        inflight = self.entries[sid].inflight
        if inflight is None:
            raise ValueError(f"stream {sid} has no chunk in flight")
        inflight.steps_left -= 1
        inflight.step_started_t = now

    def is_stale(self, sid: int) -> bool:
        """The chunk in flight was started under a prompt that has since been switched."""
        inflight = self.entries[sid].inflight
        return inflight is not None and inflight.epoch != self.entries[sid].tracker.epoch

    def abandon(self, sid: int, now: float) -> None:
        """Drop the chunk in flight (stale prompt, or a batch partner left); the next one starts fresh."""
        e = self.entries[sid]
        e.inflight = None
        e.last_run_at = now

    def preempted(self, sid: int, now: float) -> None:
        self.entries[sid].last_run_at = now

    def step_batch_content(self, sid: int, duration_s: float) -> float:
        """Seconds of content the stream's finishing chunk (of ``duration_s``) brings out, where the
        engine does not say (the simulator; live executors count the frames). A step batch
        (``FidelityConfig.step_batch``, StreamDiffusionV2's) holds a stream's chunks in the engine until
        their last step: its first ``steps - 1`` chunks bring out nothing, each later one the chunk
        ``steps - 1`` before it. Leaving it (another point) brings out the chunks still held with the
        chunk itself, as the live engine drains them (engine/streaming/step_processor.py)."""
        e = self.entries[sid]
        assert e.inflight is not None
        config = e.inflight.point.config
        held = e.step_batch_held
        if not config.step_batch:
            e.step_batch, e.step_batch_held = None, ()
            return sum(held) + duration_s
        if e.step_batch != config:  # a new step batch: the old one's chunks come out, this one starts filling
            e.step_batch, e.step_batch_held = config, (duration_s,)
            return sum(held)
        held += (duration_s,)
        out, e.step_batch_held = held[: max(0, len(held) - (config.steps - 1))], held[-(config.steps - 1):]
        return sum(out)

    def chunk_done(self, sid: int, now: float, duration_s: float) -> ChunkOutcome | None:
        """The chunk became playable. Returns None when it was started under an older prompt (discarded)."""
        e = self.entries[sid]
        inflight, e.inflight = e.inflight, None
        e.last_run_at = now
        if e.left or inflight is None:
            self._detach(e)
            return None
        out = None
        if inflight.epoch == e.tracker.epoch:
            out = e.tracker.on_chunk_ready(now, duration_s)
            e.quality_sum += inflight.point.quality
            e.quality_chunks += 1
        if e.tracker.done_generating:
            e.finished = True
            self._detach(e)
        return out

    def cursor_report(self, sid: int, now: float, cursor_s: float) -> None:
        self.entries[sid].tracker.report_cursor(now, cursor_s)

    def pause(self, sid: int, now: float) -> None:
        e = self.entries[sid]
        e.tracker.pause(now)
        if e.paused_at is None:
            e.paused_at = now

    def resume(self, sid: int, now: float) -> None:
        e = self.entries[sid]
        e.tracker.resume(now)
        if e.paused_at is not None:
            e.camera_paused_s += now - e.paused_at
            e.paused_at = None

    def prompt_switch(self, sid: int, now: float, running: bool) -> bool:
        """Reset slack; drop a preempted partial chunk of the old prompt; revive a stream that had
        finished generating but not finished playing. Returns False if it had already played out."""
        e = self.entries[sid]
        tr = e.tracker
        if tr.done_generating and tr.cursor(now) >= tr.content_s - 1e-9:
            return False
        tr.reset_slack(now)
        if e.inflight is not None and not running:
            e.inflight = None
        if e.finished:
            e.finished = False
            e.resident = False  # its state went to host when it finished; restore on next run
            self._by_worker.setdefault(e.worker, set()).add(sid)
        return True

    def leave(self, sid: int, running: bool) -> None:
        e = self.entries[sid]
        e.left = True
        if not running:
            self._detach(e)

    def input_wait_s(self, sid: int, now: float) -> float:
        """Seconds until the camera has captured the stream's next chunk (0: there; inf: paused)."""
        camera = self.camera
        e = self.entries[sid]
        if camera is None:
            return 0.0
        need = e.input_s + (camera.first_chunk_s if e.first_chunk else camera.chunk_s) - camera.frame_s
        wait = need - e.captured_s(now)
        if wait <= 1e-9:
            return 0.0
        return math.inf if e.paused_at is not None else wait

    # ---- views --------------------------------------------------------------------------------
    def view(self, sid: int, now: float, running: bool) -> StreamView:
        e = self.entries[sid]
        tr = e.tracker
        inflight = e.inflight
        rem = 0.0
        if inflight is not None:
            rem = inflight.steps_left * inflight.est_step_s
            if running:
                rem -= min(inflight.est_step_s, now - inflight.step_started_t)
        slack = tr.slack(now)
        cap = self.max_lookahead_s
        runnable = e.active and e.available_t <= now and (
            inflight is not None or ((cap is None or slack < cap) and self.input_wait_s(sid, now) <= 0))
        return StreamView(
            stream_id=sid,
            worker_id=e.worker,
            slack_s=slack,
            arrival_t=e.arrival_t,
            remaining_content_s=tr.remaining_content_s,
            inflight_remaining_s=max(0.0, rem),
            inflight_point=inflight.point if inflight is not None else None,
            running=running,
            resident=e.resident,
            runnable=runnable,
            first_chunk=e.first_chunk,
            paused=tr.paused,
            last_rehomed_at=e.last_rehomed_at,
            last_run_at=e.last_run_at,
            state_bytes=e.state_bytes,
            max_steps=e.max_steps,
        )

    def views_on(self, worker_id: int, now: float, running: Iterable[int] = ()) -> list[StreamView]:
        run = set(running)
        return [self.view(e.sid, now, e.sid in run) for e in self.on_worker(worker_id)]

    def snapshot(self, now: float, workers: Sequence[WorkerView], running: Iterable[int] = ()) -> Snapshot:
        run = set(running)
        views = [self.view(sid, now, sid in run) for w in workers for sid in sorted(self._by_worker.get(w.worker_id, ()))]
        return Snapshot(now, views, list(workers))
