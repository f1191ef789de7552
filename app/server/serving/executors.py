"""The live server's executors of the engine core (engine/serving/core.py) and the loop that drives it.

The core decides; an executor carries the decision out on a real engine and tells the core when the
step is over. Here:

* ``StepExecutor`` — the in-process engine (`InProcessFactory`): one worker per engine lane
  (engine/streaming/lanes.py), every ``Work`` ONE denoising step of one or more streams' chunks on
  that lane's engine thread; a re-home between lanes moves nothing (one process, one model). A new chunk takes its input
  from the stream's assembler and enters (encode, noise) first; the last step decodes and
  stabilises. Streams whose steps the policy groups share one forward (split by cache fill level);
  a stream the policy preempts keeps its half-done chunk parked in its processor; evicted streams'
  states go to host memory and come back bit-identically before their next step.
* ``RayExecutor`` (app/server/serving/cluster_executor.py) — the ``StepExecutor`` over Ray worker actors:
  each ``Work`` is one step on worker ``w``'s actor; re-homing, worker failures, autoscaling.
* ``RankExecutor`` — whole chunks (`ChunkBatchFactory`: the pipeline ranks): a ``Work``'s new chunks,
  each at the policy's point, go through the ring together (their micro-steps overlap across ranks);
  whole chunks, so no step preemption and no eviction (docs/parallel.md).

Which one serves a factory follows from its declared `EngineKind` (app/server/serving/serving_loop.py).
``ServingLoop`` is the asyncio side: it admits streams through the core, feeds it cursor reports,
pauses and prompt switches, runs the control tick, and kicks idle workers when input arrives.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor as ThreadExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.server.media.frame_path import InputFrame, Playout, StreamRunner
from app.server.serving.engine_bridge import (
    ChunkBatchFactory,
    InProcessProcessor,
    StepProcessor,
)
from app.server.serving.session import CapacityError
from engine.fidelity import FidelityConfig
from engine.serving.core import Clock, EngineCore, StepOrder, StepResult, Work
from engine.serving.live import (
    LIVE_CONTENT_S,
)
from engine.serving.policy import SlackPolicy
from engine.serving.snapshot import Rehome, WorkerView
from engine.streaming.lanes import EngineLanes
from engine.streaming.step_processor import StepRow, run_step

log = logging.getLogger(__name__)

POLL_S = 0.005  # idle wait for input when no stream has a chunk ready
TICK_S = 0.5  # control tick: credits and tiers for the stats, re-homes
LEDGER_LOG_ROWS = 1000  # per-stream tracker log kept: a live stream may run for days
UNLIMITED_SLOTS = 1 << 20
LOAD_WINDOW_S = 5.0  # a worker's load: the share of the last seconds its engine was busy
ACTIONS_KEPT = 50  # the policy's recent actions, for the dashboard


class AdmissionError(CapacityError):
    """The serving policy refused a new stream (its first chunk would miss the initial slack)."""


@dataclass
class LiveStream:
    """What the executors need of one admitted stream."""

    sid: int
    runner: StreamRunner
    playout: Playout
    on_failure: Callable[[BaseException], None]  # its chunk raised on the engine: the session ends
    taken: list[InputFrame] = field(default_factory=list)  # input of a chunk about to enter
    # Chunks in the engine, oldest first: their input frames and those decoded at the engine size (a
    # step batch holds several; their outputs come out in this order).
    in_engine: deque[tuple[list[InputFrame], np.ndarray]] = field(default_factory=deque)
    ready: list[tuple[list[InputFrame], np.ndarray]] = field(default_factory=list)  # finished, not yet shown
    shown_at_switch: int = -1  # no cursor reports until a frame newer than this was played
    # Its chunks that came out non-finite (black: StreamRuntime.take_fault) and the latest one's reason,
    # for its owner's stats; and the faults it was reset for (_LiveExecutor._reset_after_fault).
    chunk_faults: int = 0
    chunk_fault: str | None = None
    faults_reset: int = 0


class _LiveExecutor:
    """What the live executors share: the streams, the engine threads, completions into the core."""

    lanes: EngineLanes | None = None  # the in-process engine's lanes (StepExecutor), for their threads

    def __init__(self, workers: int, threads: ThreadExecutor, clock: Clock, state_slots: int, fps: float,
                 delay_s: float = 0.0, step_delay_s: float = 0.0) -> None:
        self.views = [WorkerView(w, 0, state_slots) for w in range(workers)]
        self.fps = fps  # content rate: a finished chunk of n frames is n / fps seconds of playout
        self.last_step_s: dict[int, float] = {}
        self.threads = threads
        self.clock = clock
        self.delay_s = delay_s  # test knobs: emulate a slower engine (--engine-delay-ms, --engine-step-delay-ms)
        self.step_delay_s = step_delay_s
        self.streams: dict[int, LiveStream] = {}
        self.core: EngineCore | None = None  # set by the loop
        self.wakeup = asyncio.Event()
        self.forwards = 0  # batched DiT forwards run (StepExecutor), for tests and benchmarks
        self.rehomes = 0  # streams whose state really moved to another worker
        # Benchmark knob (demos/bench_cluster.py): each step lasts at least the profile's estimate; the
        # engine thread sleeps only the difference, so a scaled profile is what the workers really cost.
        self.pad_to_profile = False
        self.scale_events = {"up": 0, "down": 0}  # workers added and removed by the autoscaler
        self.device = "cpu"  # what each worker runs on, for the operator's view
        # Per worker, (end, seconds) of its recent engine jobs: its load over LOAD_WINDOW_S.
        self._busy: dict[int, deque[tuple[float, float]]] = {}
        # The policy's recent actions as they happened (re-homes, evictions, preemptions, scaling,
        # recoveries): {"t", "action", "stream", "worker", ...}, newest last.
        self.actions: deque[dict[str, Any]] = deque(maxlen=ACTIONS_KEPT)
        self._resets: set[asyncio.Task[None]] = set()  # streams' resets after a non-finite chunk, running

    def note(self, action: str, stream: int | None = None, worker: int | None = None, **more: Any) -> None:
        self.actions.append({"t": time.time(), "action": action, "stream": stream, "worker": worker, **more})

    def load(self, worker_id: int) -> float:
        """Share of the last LOAD_WINDOW_S seconds the worker's engine was busy."""
        now = time.monotonic()
        busy = self._busy.get(worker_id, ())
        start = now - LOAD_WINDOW_S
        return min(1.0, sum(max(0.0, end - max(end - wall, start)) for end, wall in busy) / LOAD_WINDOW_S)

    def check(self, processor: object) -> None:
        """TypeError for a processor this executor cannot drive."""

    def poll(self) -> None:
        """Event-loop side housekeeping before each pass (worker failures, scaling); nothing here."""

    # -- Executor protocol --
    def worker_views(self) -> list[WorkerView]:
        return self.views

    def input_ready(self, worker_id: int) -> set[int] | None:
        return {sid for sid, s in self.streams.items() if s.runner.has_chunk()}

    def rehome(self, move: Rehome) -> float:
        raise NotImplementedError("one in-process engine has no other worker to move a stream to")

    def wake_at(self, worker_id: int, t: float) -> None:
        delay = max(0.0, t - self.clock())
        asyncio.get_running_loop().call_later(delay, self.wakeup.set)

    # -- shared --
    def _take_inputs(self, work: Work) -> None:
        for order in work.orders:
            stream = self.streams.get(order.stream_id)
            if stream is not None and order.new_chunk:
                stream.taken = stream.runner.next_chunk() or []

    def _run(self, work: Work, job: Callable[[], None], steps: int = 1) -> None:
        """Run ``job`` on an engine thread; its wall time, per denoising step it covers, goes to the core."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        if self.pad_to_profile:
            inner, until = job, t0 + work.est_step_s * steps

            def job() -> None:
                inner()
                time.sleep(max(0.0, until - time.perf_counter()))

        future = loop.run_in_executor(self.threads, job)

        def done(f: asyncio.Future[None]) -> None:
            wall = time.perf_counter() - t0
            busy = self._busy.setdefault(work.worker_id, deque())
            busy.append((time.monotonic(), wall))
            while busy and busy[0][0] < time.monotonic() - LOAD_WINDOW_S:
                busy.popleft()
            seconds = wall / steps
            exc = f.exception() if not f.cancelled() else asyncio.CancelledError()
            self._complete(work, seconds, exc)

        future.add_done_callback(done)

    def _complete(self, work: Work, seconds: float, exc: BaseException | None) -> None:
        core = self.core
        assert core is not None
        if exc is not None:
            for sid in core.failed(work.worker_id):
                stream = self.streams.pop(sid, None)
                if stream is not None:
                    stream.on_failure(exc)
            self.wakeup.set()
            return
        self.last_step_s[work.worker_id] = seconds
        content: dict[int, float] = {}
        for order in work.orders:
            stream = self.streams.get(order.stream_id)
            if stream is not None and order.last_step:
                stream.runner.chunk_seconds = seconds
                content[order.stream_id] = sum(len(frames) for frames, _ in stream.ready) / self.fps
        result: StepResult = core.step_done(work.worker_id, seconds, content)
        for sid in result.delivered:
            stream = self.streams.get(sid)
            if stream is not None:
                for frames, out in stream.ready:
                    stream.runner.deliver(frames, out)
        for sid in (*result.delivered, *result.discarded, *result.abandoned):
            stream = self.streams.get(sid)
            if stream is not None:
                stream.ready = []
        for sid in (*result.delivered, *result.discarded, *result.abandoned):
            entry = core.ledger.entries.get(sid)
            if entry is not None and entry.left:
                core.forget(sid)
        for order in work.orders:
            stream = self.streams.get(order.stream_id)
            if stream is not None and stream.chunk_faults > stream.faults_reset:
                self._reset_after_fault(stream)
        self.wakeup.set()

    def _reset_after_fault(self, stream: LiveStream) -> None:
        """A chunk of the stream came out non-finite (black): its caches may hold the cause, so it is
        reset as its owner's reset message would (fresh state, same controls) and goes on; the other
        streams are untouched. A failing reset ends the stream."""
        stream.faults_reset = stream.chunk_faults
        self.note("reset", stream.sid, reason=stream.chunk_fault)
        task = asyncio.get_running_loop().create_task(stream.runner.reset())
        self._resets.add(task)

        def done(task: asyncio.Task[None]) -> None:
            self._resets.discard(task)
            exc = None if task.cancelled() else task.exception()
            if exc is not None and stream.sid in self.streams:
                stream.on_failure(exc)

        task.add_done_callback(done)


class StepExecutor(_LiveExecutor):
    """One denoising step per ``Work`` on a worker's engine: here the in-process engine's lanes, each
    worker a lane. `RayExecutor` (app/server/serving/cluster_executor.py) runs the step on worker ``w``'s actor
    (``_engine_step``), moves states between actors (``rehome``), follows streams whose worker died
    (``_complete``), checks a stream is one of its cluster's (``check``) and adds and removes workers
    for the autoscaler."""

    def rehome(self, move: Rehome) -> float:
        """Lanes share one process and one model: the stream's state stays where it is in memory."""
        if move.stream_id in self.streams:
            self.rehomes += 1
            self.note("rehome", move.stream_id, move.dst, src=move.src)
        return 0.0

    def execute(self, work: Work) -> float:
        self._take_inputs(work)
        for sid in work.evict:
            self.note("evict", sid, work.worker_id)
        for sid in work.restore:
            self.note("restore", sid, work.worker_id)
        for sid in work.preempted:
            self.note("preempt", sid, work.worker_id)
        rows = [(order, self.streams[order.stream_id]) for order in work.orders if order.stream_id in self.streams]
        evict = [self.streams[sid] for sid in work.evict if sid in self.streams]
        restore = [self.streams[sid] for sid in work.restore if sid in self.streams]
        drop = [self.streams[sid] for sid in work.drop if sid in self.streams]
        self._run(work, lambda: self._step(work.worker_id, rows, evict, restore, drop))
        return 0.0

    def check(self, processor: object) -> None:
        if not isinstance(processor, StepProcessor):
            raise TypeError(f"{type(processor).__name__} cannot run a chunk step by step")

    def _step(self, worker_id: int, rows: Sequence[tuple[StepOrder, LiveStream]], evict: Sequence[LiveStream],
              restore: Sequence[LiveStream], drop: Sequence[LiveStream] = ()) -> None:
        """Engine thread: abandoned chunks are forgotten, new chunks take their input, the engine runs the
        step, finished chunks come out."""
        for stream in drop:
            stream.in_engine.clear()
        active: list[tuple[LiveStream, StepOrder, np.ndarray | None]] = []
        for order, stream in rows:
            inputs = None
            if order.new_chunk:
                if not stream.taken:
                    continue  # paused or reset between the readiness check and now
                inputs = stream.runner.chunk_inputs(stream.taken, order.point.config)
                stream.in_engine.append((stream.taken, inputs))
                stream.taken = []
            active.append((stream, order, inputs))
        finished = self._engine_step(worker_id, active, evict, restore, drop)
        for (stream, _, _), outs in zip(active, finished, strict=True):
            for out in outs:
                try:
                    frames, inputs = stream.in_engine.popleft()
                except IndexError:
                    continue  # a chunk whose input was forgotten (a reset): nobody waits for it
                stream.ready.append((frames, stream.runner.chunk_outputs(inputs, out)))

    def _engine_step(self, worker_id: int, active: Sequence[tuple[LiveStream, StepOrder, np.ndarray | None]],
                     evict: Sequence[LiveStream], restore: Sequence[LiveStream],
                     drop: Sequence[LiveStream]) -> list[list[np.ndarray]]:
        """The step on the engine: every active row's finished chunks (engine-size frames)."""
        for stream in drop:
            _step_processor(stream).drop_chunks()
        rows = [StepRow(_step_processor(stream), order.point.config if inputs is not None else None, inputs)
                for stream, order, inputs in active]
        with self.lanes.step(worker_id) if self.lanes is not None else nullcontext():
            finished, forwards = run_step(rows, [_step_processor(s) for s in evict],
                                          [_step_processor(s) for s in restore], self.delay_s, self.step_delay_s)
        self.forwards += forwards
        for stream, _, _ in active:
            processor = stream.runner.processor
            if isinstance(processor, InProcessProcessor):  # resident: it just ran
                fault = processor.stream.runtime.take_fault(processor.stream.state.stream_id)
                if fault is not None:  # reset when the step completes (_reset_after_fault)
                    stream.chunk_faults += fault[0]
                    stream.chunk_fault = f"{fault[1]}; the stream was reset"
        return finished


class RankExecutor(_LiveExecutor):
    """Whole chunks (`ChunkBatchFactory`: the pipeline ranks): every new chunk at the policy's point, a
    cross-user batch as one `run_chunks` call (all its chunks enter the ring together and overlap
    across ranks). One ``Work`` runs the chunks whole; the core's later steps of them are done already."""

    def __init__(self, factory: ChunkBatchFactory, threads: ThreadExecutor, clock: Clock, fps: float,
                 delay_s: float = 0.0, step_delay_s: float = 0.0) -> None:
        super().__init__(1, threads, clock, UNLIMITED_SLOTS, fps, delay_s, step_delay_s)
        self.factory = factory

    def execute(self, work: Work) -> float:
        if not any(order.new_chunk for order in work.orders):
            # The chunks already ran whole when they started: their later steps took what they did then.
            step_s = self.last_step_s.get(work.worker_id, 0.0)
            asyncio.get_running_loop().call_soon(self._complete, work, step_s, None)
            return 0.0
        self._take_inputs(work)
        rows = [(o.point.config, self.streams[o.stream_id]) for o in work.orders
                if o.new_chunk and o.stream_id in self.streams]
        steps = max(o.point.config.steps for o in work.orders)
        self._run(work, lambda: self._batch(rows, steps), steps)
        return 0.0

    def _batch(self, rows: Sequence[tuple[FidelityConfig, LiveStream]], steps: int) -> None:
        """Engine thread: set each chunk's fidelity, run the chunks together, keep their frames."""
        batch = []
        for config, stream in rows:
            if not stream.taken:
                continue  # paused or reset between the readiness check and now
            batch.append((stream, stream.taken, stream.runner.chunk_inputs(stream.taken, config), config))
            stream.taken = []
        if not batch:
            return
        if self.delay_s or self.step_delay_s:
            time.sleep(self.delay_s * len(batch) + self.step_delay_s * steps)
        outs = self.factory.run_chunks([(stream.runner.processor, inputs, config)
                                        for stream, _, inputs, config in batch])
        for (stream, frames, inputs, _), out in zip(batch, outs, strict=True):
            stream.ready.append((frames, stream.runner.chunk_outputs(inputs, out)))


def _step_processor(stream: LiveStream) -> StepProcessor:
    processor = stream.runner.processor
    if not isinstance(processor, StepProcessor):
        raise TypeError(f"{type(processor).__name__} cannot run a chunk step by step")
    return processor


class ServingLoop:
    """The engine core on the live server: admission, events, cursor reports, ticks, kicks."""

    def __init__(self, core: EngineCore, executor: _LiveExecutor, fps: float) -> None:
        self.core = core
        self.executor = executor
        executor.core = core
        self.fps = fps
        self._ids = itertools.count(1)
        self._last_tick = -float("inf")

    @property
    def policy(self) -> SlackPolicy:
        return self.core.policy

    @property
    def streams(self) -> dict[int, LiveStream]:
        return self.executor.streams

    # ---- membership -----------------------------------------------------------------------------
    def admit(self, max_steps: int | None = None) -> int:
        """A new stream's id, or AdmissionError with the policy's reason."""
        sid = next(self._ids)
        admission = self.core.arrive(sid, LIVE_CONTENT_S, max_steps)
        if not admission.accepted:
            raise AdmissionError(f"the serving policy refused the stream: {admission.reason}")
        return sid

    def attach(self, sid: int, runner: StreamRunner, playout: Playout,
               on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.executor.check(runner.processor)
        self.executor.streams[sid] = LiveStream(sid, runner, playout, on_failure or _reraise)
        runner.on_event = lambda event: self.on_event(sid, event)
        self.executor.wakeup.set()

    def remove(self, sid: int) -> None:
        """The stream closed (or failed to open): it leaves the ledger."""
        self.executor.streams.pop(sid, None)
        self.core.leave(sid)
        self.core.forget(sid)  # else when its step in flight comes back

    def on_event(self, sid: int, event: str) -> None:
        stream = self.streams.get(sid)
        if stream is None:
            return
        if event == "pause":
            self.core.pause(sid)
        elif event == "resume":
            self.core.resume(sid)
        elif event in ("prompt", "reset"):
            if event == "reset":  # the engine forgets its chunks in flight: so do we
                stream.in_engine.clear()
                stream.ready = []
            # Buffered output of the old prompt is useless: the slack resets (SlackServe's prompt switch).
            stream.playout.discard_buffered()
            stream.shown_at_switch = stream.playout.frames_shown
            self.core.prompt_switch(sid)
        self.executor.wakeup.set()

    # ---- the loop -------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            try:
                self.run_once()
            except Exception:  # a bug here must not freeze every stream: log it and keep serving
                log.exception("engine core loop failed at a chunk boundary")
            try:
                await asyncio.wait_for(self.executor.wakeup.wait(), POLL_S)
            except TimeoutError:
                pass
            self.executor.wakeup.clear()

    def run_once(self) -> None:
        """Cursor reports, the control tick when due, then every idle worker's next work."""
        self.executor.poll()
        now = self.core.clock()
        self.report_cursors()
        if now - self._last_tick >= TICK_S:
            self._last_tick = now
            self.core.tick()
        self.core.kick_all()

    def report_cursors(self) -> None:
        """Playout cursor = output frames that left the buffer. Only while the buffer holds frames:
        an empty buffer means the viewer is frozen, which the ledger detects itself at the next chunk."""
        for s in self.streams.values():
            p = s.playout
            if p.first_frame_at is None or p.buffered == 0 or p.frames_shown <= s.shown_at_switch:
                continue
            self.core.report_cursor(s.sid, p.frames_consumed / self.fps)

    # ---- stats ----------------------------------------------------------------------------------
    def stats(self, sid: int) -> dict[str, Any]:
        """The policy's fields of one stream's stats message."""
        entry = self.core.ledger.entries.get(sid)
        stats = self.core.stats.get(sid)
        if entry is None or stats is None:
            return {}
        stream = self.streams.get(sid)
        tracker = entry.tracker
        point = stats.point
        config = point.config if point is not None else None
        return {
            "policy": self.policy.name,
            "tier": stats.tier,
            "credit_s": round(stats.credit_s, 3),
            "policy_slack_s": round(tracker.slack(self.core.clock()), 3),
            "fidelity": config.label() if config is not None else None,
            "fidelity_steps": config.steps if config is not None else None,
            "chunk_steps": config.steps if config is not None else None,
            "kv_window": config.kv_window_frames if config is not None else None,
            "precision": config.precision if config is not None else None,
            "resolution_scale": config.resolution_scale if config is not None else None,
            "attention_sparsity": config.attention_sparsity if config is not None else None,
            "step_batch": config.step_batch if config is not None else None,
            "fidelity_quality": round(point.quality, 2) if point is not None else 0.0,
            "downshifts": stats.downshifts,
            "degraded_chunks": stats.degraded_chunks,
            "reduced_resolution_chunks": stats.reduced_resolution_chunks,
            "step_batch_chunks": stats.step_batch_chunks,
            "policy_chunks": stats.chunks,
            "batch": stats.batch,
            "resident": entry.resident,
            "stalls": tracker.stall_count,
            "cpr": round(tracker.cpr, 3),
            "chunk_faults": stream.chunk_faults if stream is not None else 0,
            "chunk_fault": stream.chunk_fault if stream is not None else None,
            # The intra-op threads of the last step on the stream's lane (in-process engine only).
            "engine_threads": self.lane_threads(entry.worker),
        }

    def lane_threads(self, worker_id: int) -> int | None:
        """The threads worker ``worker_id``'s last step ran on, where the worker is an engine lane."""
        lanes = self.executor.lanes
        return None if lanes is None else lanes.last_threads.get(worker_id)

    def workers(self) -> list[dict[str, Any]]:
        """Every worker as the policy sees it: its streams (policy ids), their tiers, its load."""
        placement: dict[int, list[int]] = {}
        for sid, entry in self.core.ledger.entries.items():
            if not entry.left:
                placement.setdefault(entry.worker, []).append(sid)
        rows = []
        for view in self.executor.worker_views():
            sids = sorted(placement.get(view.worker_id, []))
            tiers = dict.fromkeys(("urgent", "normal", "relaxed"), 0)
            for sid in sids:
                stats = self.core.stats.get(sid)
                if stats is not None and stats.tier in tiers:
                    tiers[stats.tier] += 1
            rows.append({"id": view.worker_id, "device": self.executor.device, "streams": sids, "tiers": tiers,
                         "load": round(self.executor.load(view.worker_id), 3), "draining": view.draining,
                         "threads": self.lane_threads(view.worker_id)})
        return rows

    def counters(self) -> dict[str, int]:
        c = self.core.counters
        return {"evictions": c.evictions, "restores": c.restores, "preemptions": c.preemptions,
                "admissions_refused": c.admissions_refused, "rehomes": self.executor.rehomes}


def _reraise(exc: BaseException) -> None:
    raise exc
