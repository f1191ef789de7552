"""The live server's engine loop under the playout-slack serving policy (`diffcast serve --policy slack`).

One machine is one policy worker. The same `SlackPolicy` and `StreamLedger` the simulator runs
(engine/serving, docs/simulation.md) decide here, from observations of the real service:

* admission: `SlackPolicy.admit` on every new stream; a stream whose first chunk cannot be ready
  within the initial slack is refused (503 + Retry-After, with the policy's reason);
* order: at every chunk boundary `SlackPolicy.dispatch` picks the next stream among those whose
  input chunk has arrived (live V2V cannot run ahead of its camera);
* fidelity: BMPR routes each chunk to a (steps, KV window, precision) point of the profile from the
  stream's slack; the user's `steps` is its ceiling. Resolution scale is fixed per stream (the
  engine cannot change a stream's size mid-stream), so the live profile keeps scale-1 points only;
* batching: ready streams that BMPR sends to the same config and whose caches are at the same fill
  level run as ONE batched forward (`StreamRuntime.step_batch`); `SloBatcher` sizes the batch from
  the measured latency of batched forwards;
* observations: chunk start/ready times from the injected clock, the playout cursor from the
  server's playout clock (output frames that have left the buffer), pauses, resets and prompt
  switches (`StreamRunner.on_event`).

The engine thread stays the single executor: every engine call goes through ``executor``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from app.server.config import ServerConfig
from app.server.engine_bridge import BatchProcessor, ProcessorFactory, parallel_chunks, per_chunk_fidelity
from app.server.frame_path import InputFrame, Playout, StreamRunner
from app.server.session import CapacityError
from engine.serving.credit import Tier
from engine.serving.fidelity import (
    BUNDLED_PROFILES,
    FidelityConfig,
    FidelityProfile,
    ProfilePoint,
    bundled_profile,
    load_profile,
)
from engine.serving.ledger import StreamLedger
from engine.serving.policy import PolicyConfig, SlackPolicy
from engine.serving.snapshot import AdmissionRequest, StreamView, WorkerView
from engine.streaming.slo import SloBatcher

log = logging.getLogger(__name__)

Clock = Callable[[], float]
LIVE_CONTENT_S = 365 * 86400.0  # a live stream has no known end
WORKER = WorkerView(worker_id=0, node_id=0, state_slots=1 << 20)  # states never leave this host
LIVE_PROFILE = "tiny-random_cpu_128"  # measured on this repository's CPU box (docs/service.md, "Live policy")
CALIBRATION_MIN_SAMPLES = 5
CALIBRATION_DRIFT = 0.2  # rebuild the policy when the box's speed moved this much from the last fit
POLL_S = 0.005  # idle wait for input when no stream has a chunk ready
STATS_TICK_S = 0.5  # how often tiers/credits for the stats are recomputed (policy.tick)
LEDGER_LOG_ROWS = 1000  # per-stream tracker log kept: a live stream may run for days


class AdmissionError(CapacityError):
    """The serving policy refused a new stream (its first chunk would miss the initial slack)."""


def live_profile(profile: FidelityProfile) -> FidelityProfile:
    """The configs the live engine can switch between per chunk: full resolution, dense attention,
    no fp8, single stream."""
    return profile.filtered(lambda c: c.resolution_scale == 1.0 and c.attention_sparsity == 0.0
                            and c.precision != "fp8" and c.stream_batch == 1 and c.gpus == 1)


def with_emulated_delay(profile: FidelityProfile, delay_s: float, step_delay_s: float) -> FidelityProfile:
    """The profile of an engine slowed by the server's test knobs (``--engine-delay-ms`` per chunk,
    ``--engine-step-delay-ms`` per denoising step): the policy must know what the engine costs."""
    if delay_s == 0.0 and step_delay_s == 0.0:
        return profile

    def slow(p: ProfilePoint) -> ProfilePoint:
        extra = delay_s + step_delay_s * p.config.steps
        return replace(p, latency_s=p.latency_s + extra, first_chunk_latency_s=p.first_chunk_latency_s + extra)

    return replace(profile, points=tuple(slow(p) for p in profile.points),
                   notes=(*profile.notes, f"emulated delay {delay_s:g} s + {step_delay_s:g} s/step added"))


@dataclass
class LiveStream:
    sid: int
    runner: StreamRunner
    playout: Playout
    ceiling: Callable[[], int]  # the user's steps: BMPR never goes above it
    on_failure: Callable[[BaseException], None]  # its chunk raised on the engine: the session ends
    config: FidelityConfig | None = None  # of the last chunk started
    quality: float = 0.0
    top_quality: float = 0.0  # best quality the stream's ceiling allows
    chunks: int = 0
    downshifts: int = 0  # chunks whose config has lower quality than the previous chunk's
    degraded_chunks: int = 0  # chunks below the stream's best allowed config
    batch: int = 1
    tier: str = "-"
    credit_s: float = 0.0
    shown_at_switch: int = -1  # no cursor reports until a frame newer than this was played


@dataclass(frozen=True)
class Job:
    sid: int
    runner: StreamRunner
    processor: BatchProcessor
    frames: list[InputFrame]


class PolicyScheduler:
    """Admits, orders and routes every stream's chunks on this machine's one engine thread."""

    def __init__(
        self,
        profile: FidelityProfile,
        executor: Executor,
        fps: float,
        clock: Clock = time.monotonic,
        max_batch: int = 4,
        policy: PolicyConfig | None = None,
    ) -> None:
        if fps <= 0:
            raise ValueError(f"fps must be positive, got {fps}")
        self.measured_profile = live_profile(profile)
        self.profile = self.measured_profile
        self.policy = SlackPolicy(self.profile, policy or PolicyConfig(rehoming=False))
        # Online calibration: this box's current speed relative to the profile (load from other
        # processes, another machine, thermal state). Single-stream chunks are compared with their
        # profiled latency; when the ratio drifts, the policy is rebuilt on the rescaled profile.
        self.speed_ratio = 1.0  # EWMA of measured / profiled chunk time
        self.applied_ratio = 1.0
        self._ratio_samples = 0
        self.ledger = StreamLedger(max_lookahead_s=None, max_log=LEDGER_LOG_ROWS)
        self.fps = fps
        self.clock = clock
        self.executor = executor
        self.batcher = SloBatcher(self.profile.chunk_pixel_frames, target_fps=fps, max_batch=max_batch)
        self.streams: dict[int, LiveStream] = {}
        self._routers: dict[int, SlackPolicy] = {}
        self._ids = itertools.count(1)
        self._last_stats_tick = -float("inf")
        self._running: set[int] = set()  # streams whose chunk is on the engine thread now
        self.batches_run = 0
        self.batched_chunks = 0

    # ---- membership -----------------------------------------------------------------------------
    def admit(self) -> int:
        """A new stream's ledger id, or AdmissionError with the policy's reason."""
        now = self.clock()
        sid = next(self._ids)
        snapshot = self.ledger.snapshot(now, [WORKER], self._running)
        admission = self.policy.admit(AdmissionRequest(sid, now, LIVE_CONTENT_S), snapshot)
        if not admission.accepted:
            raise AdmissionError(f"the serving policy refused the stream: {admission.reason}")
        self.ledger.admit(admission, now, LIVE_CONTENT_S, state_bytes=self.policy.reference.state_bytes)
        self.ledger.restore(sid)  # its state lives on this host from the start
        return sid

    def attach(self, sid: int, runner: StreamRunner, playout: Playout, ceiling: Callable[[], int],
               on_failure: Callable[[BaseException], None] | None = None) -> None:
        if not isinstance(runner.processor, BatchProcessor):
            raise TypeError(f"{type(runner.processor).__name__} cannot take per-chunk fidelity from the policy")
        stream = LiveStream(sid, runner, playout, ceiling, on_failure or _reraise)
        self.streams[sid] = stream
        runner.on_event = lambda event: self.on_event(sid, event)

    def remove(self, sid: int) -> None:
        """The stream closed (or failed to open): it leaves the ledger."""
        self.streams.pop(sid, None)
        if sid in self.ledger.entries and not self.ledger.entries[sid].left:
            self.ledger.leave(sid, running=sid in self._running)
        if sid in self.ledger.entries and sid not in self._running:
            self.ledger.forget(sid)  # else when its chunk in flight comes back

    def on_event(self, sid: int, event: str) -> None:
        stream = self.streams.get(sid)
        if stream is None:
            return
        now = self.clock()
        if event == "pause":
            self.ledger.pause(sid, now)
        elif event == "resume":
            self.ledger.resume(sid, now)
        elif event in ("prompt", "reset"):
            # Buffered output of the old prompt is useless: the slack resets (SlackServe's prompt switch).
            stream.playout.discard_buffered()
            stream.shown_at_switch = stream.playout.frames_shown
            self.ledger.prompt_switch(sid, now, running=sid in self._running)

    # ---- routing --------------------------------------------------------------------------------
    def router(self, ceiling: int) -> SlackPolicy:
        """BMPR over the configs with at most ``ceiling`` steps (the user's choice caps fidelity)."""
        steps = sorted({p.config.steps for p in self.profile.per_stream()})
        k = max((s for s in steps if s <= ceiling), default=steps[0])
        if k not in self._routers:
            sub = self.profile.filtered(lambda c: c.steps <= k)
            self._routers[k] = SlackPolicy(sub, replace(self.policy.config, rehoming=False))
        return self._routers[k]

    def route(self, stream: LiveStream, view: StreamView) -> ProfilePoint:
        router = self.router(stream.ceiling())
        return router.next_point(view.slack_s, view.inflight_remaining_s)

    # ---- the loop -------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            try:
                ran = await self.run_once()
            except Exception:  # a bug here must not freeze every stream: log it and keep serving
                log.exception("policy engine loop failed at a chunk boundary")
                ran = False
            if not ran:
                await asyncio.sleep(POLL_S)

    def report_cursors(self, now: float) -> None:
        """Playout cursor = output frames that left the buffer. Only while the buffer holds frames:
        an empty buffer means the viewer is frozen, which the ledger detects itself at the next chunk."""
        for s in self.streams.values():
            p = s.playout
            if p.first_frame_at is None or p.buffered == 0 or p.frames_shown <= s.shown_at_switch:
                continue
            if s.sid in self._running or s.sid not in self.ledger.entries:
                continue
            self.ledger.cursor_report(s.sid, now, p.frames_consumed / self.fps)

    async def run_once(self) -> bool:
        """One chunk boundary: dispatch, run one (batched) chunk, feed the ledger. False if idle."""
        ready = {sid for sid, s in self.streams.items() if s.runner.has_chunk() and sid in self.ledger.entries}
        if not ready:
            return False
        now = self.clock()
        self.report_cursors(now)
        views = {v.stream_id: replace(v, runnable=v.runnable and v.stream_id in ready)
                 for v in self.ledger.views_on(WORKER.worker_id, now)}
        self._update_stats(now)
        decision = self.policy.dispatch(now, WORKER, list(views.values()))
        if not decision.stream_ids:
            return False
        lead = self.streams[decision.stream_ids[0]]
        point = self.route(lead, views[lead.sid])
        others = sorted((sid for sid in ready if sid != lead.sid and sid in views), key=lambda sid: views[sid].slack_s)
        candidates = [lead] + [self.streams[sid] for sid in others
                               if self.route(self.streams[sid], views[sid]).config == point.config]
        limit = self.batcher.batch_size()
        loop = asyncio.get_running_loop()
        try:
            keys = await loop.run_in_executor(self.executor, _set_fidelity, [s.runner for s in candidates], point.config)
        except ValueError as exc:  # a profile config this engine cannot run: the profile is not for it
            self.remove(lead.sid)
            lead.on_failure(exc)
            return True
        group = [s for s, key in zip(candidates, keys, strict=True) if key == keys[0]][:limit]
        jobs = []
        for s in group:
            frames = s.runner.next_chunk()
            if frames is None:  # paused or reset since the readiness check
                continue
            jobs.append(Job(s.sid, s.runner, _batch_processor(s.runner), frames))
        if not jobs:
            return False
        start = self.clock()
        for job in jobs:
            self.ledger.chunk_started(job.sid, start, point)
            self._record_start(self.streams[job.sid], point, len(jobs))
        self._running = {job.sid for job in jobs}
        t0 = time.perf_counter()
        try:
            outputs = await loop.run_in_executor(self.executor, _run_jobs, jobs)
        except Exception as exc:  # the engine refused or crashed: those streams end, the others go on
            self._running = set()
            for job in jobs:
                self.ledger.abandon(job.sid, self.clock())
                failed = self.streams.get(job.sid)
                self.remove(job.sid)
                if failed is not None:
                    failed.on_failure(exc)
            return True
        finally:
            self._running = set()
        seconds = time.perf_counter() - t0
        if len(jobs) == 1:
            first = len(jobs[0].frames) < self.profile.chunk_pixel_frames  # a (re)start's short chunk
            self.observe_latency(point.first_chunk_latency_s if first else point.latency_s, seconds)
        self.batcher.observe(len(jobs), seconds)
        self.batches_run += 1
        self.batched_chunks += len(jobs)
        done = self.clock()
        for job, out in zip(jobs, outputs, strict=True):
            job.runner.chunk_seconds = seconds
            if self.ledger.entries[job.sid].left:
                self.ledger.chunk_done(job.sid, done, len(job.frames) / self.fps)  # detaches it
                self.ledger.forget(job.sid)
                continue
            if self.ledger.is_stale(job.sid):  # the prompt switched while it ran: never shown
                self.ledger.abandon(job.sid, done)
                continue
            self.ledger.chunk_done(job.sid, done, len(job.frames) / self.fps)
            job.runner.deliver(job.frames, out)
        return True

    def observe_latency(self, profiled_s: float, measured_s: float) -> None:
        """One single-stream chunk's measured time against its profiled (currently scaled) time."""
        ratio = self.applied_ratio * measured_s / profiled_s
        self.speed_ratio = ratio if self._ratio_samples == 0 else 0.8 * self.speed_ratio + 0.2 * ratio
        self._ratio_samples += 1
        if self._ratio_samples >= CALIBRATION_MIN_SAMPLES and abs(self.speed_ratio / self.applied_ratio - 1) > CALIBRATION_DRIFT:
            self.recalibrate(self.speed_ratio)

    def recalibrate(self, ratio: float) -> None:
        """Rebuild the policy and routers on the measured profile with every latency times ``ratio``."""
        def scaled(p: ProfilePoint) -> ProfilePoint:
            return replace(p, latency_s=p.latency_s * ratio, first_chunk_latency_s=p.first_chunk_latency_s * ratio)

        base = self.measured_profile
        self.profile = replace(base, points=tuple(scaled(p) for p in base.points))
        self.policy = SlackPolicy(self.profile, self.policy.config)
        self._routers.clear()
        log.info("serving policy recalibrated: chunks take %.2fx the profiled time (was %.2fx)", ratio,
                 self.applied_ratio)
        self.applied_ratio = ratio

    def _record_start(self, stream: LiveStream, point: ProfilePoint, batch: int) -> None:
        top = self.router(stream.ceiling()).reference.quality
        if stream.config is not None and point.quality < stream.quality:
            stream.downshifts += 1
        if point.quality < top:
            stream.degraded_chunks += 1
        stream.config, stream.quality, stream.top_quality = point.config, point.quality, top
        stream.chunks += 1
        stream.batch = batch

    def _update_stats(self, now: float) -> None:
        if now - self._last_stats_tick < STATS_TICK_S:
            return
        self._last_stats_tick = now
        plan = self.policy.tick(self.ledger.snapshot(now, [WORKER], self._running))
        for i, sid in enumerate(plan.stream_ids.tolist()):
            stream = self.streams.get(int(sid))
            if stream is not None:
                stream.tier = Tier(int(plan.tiers[i])).name.lower()
                stream.credit_s = float(plan.credits[i])

    # ---- stats ----------------------------------------------------------------------------------
    def stats(self, sid: int) -> dict[str, Any]:
        """The policy's fields of one stream's stats message."""
        stream = self.streams.get(sid)
        entry = self.ledger.entries.get(sid)
        if stream is None or entry is None:
            return {}
        now = self.clock()
        tracker = entry.tracker
        config = stream.config
        return {
            "policy": self.policy.name,
            "tier": stream.tier,
            "credit_s": round(stream.credit_s, 3),
            "policy_slack_s": round(tracker.slack(now), 3),
            "fidelity": config.label() if config is not None else None,
            "fidelity_steps": config.steps if config is not None else None,
            "kv_window": config.kv_window_frames if config is not None else None,
            "precision": config.precision if config is not None else None,
            "resolution_scale": config.resolution_scale if config is not None else None,
            "fidelity_quality": round(stream.quality, 2),
            "downshifts": stream.downshifts,
            "degraded_chunks": stream.degraded_chunks,
            "policy_chunks": stream.chunks,
            "batch": stream.batch,
            "stalls": tracker.stall_count,
            "cpr": round(tracker.cpr, 3),
        }


def _batch_processor(runner: StreamRunner) -> BatchProcessor:
    processor = runner.processor
    if not isinstance(processor, BatchProcessor):
        raise TypeError(f"{type(processor).__name__} is not batch-capable")
    return processor


def _set_fidelity(runners: Sequence[StreamRunner], config: FidelityConfig) -> list[Hashable]:
    """Engine thread: the chunk's config for every candidate, then their batch keys."""
    keys = []
    for runner in runners:
        processor = _batch_processor(runner)
        processor.set_fidelity(config)
        keys.append(processor.batch_key())
    return keys


def _run_jobs(jobs: Sequence[Job]) -> list[np.ndarray]:
    """Engine thread: decode inputs, one (batched) forward, fit and stamp the outputs."""
    inputs = [job.runner.chunk_inputs(job.frames) for job in jobs]
    if len(jobs) == 1:
        outs = [jobs[0].processor.process(inputs[0])]
    else:
        outs = jobs[0].processor.process_batch([(job.processor, x) for job, x in zip(jobs, inputs, strict=True)])
    return [job.runner.chunk_outputs(x, out) for job, x, out in zip(jobs, inputs, outs, strict=True)]


def bundled_live_profile(model: str | None, size: tuple[int, int]) -> FidelityProfile:
    """The bundled measured profile of ``model`` (None = the embedded default) at ``size``, else the
    tiny-random one (the policy then plans with the wrong latencies; the caller warns)."""
    name = model or "default"
    for path in sorted(BUNDLED_PROFILES.glob("*.json")):
        profile = load_profile(path)
        if profile.model == name and tuple(profile.resolution) == tuple(size) and profile.source.startswith("measured"):
            return profile
    return bundled_profile(LIVE_PROFILE)


def build_scheduler(config: ServerConfig, factory: ProcessorFactory, executor: Executor) -> PolicyScheduler | None:
    """The slack policy's engine loop for ``factory``, or None (FIFO turns) where it cannot apply:
    engines without per-chunk fidelity (Ray workers, pipeline ranks) or running chunks in parallel."""
    if not per_chunk_fidelity(factory) or parallel_chunks(factory) != 1:
        log.warning("--policy slack needs one in-process engine with per-chunk fidelity; %s takes FIFO turns",
                    type(factory).__name__)
        return None
    profile = load_profile(config.profile) if config.profile else bundled_live_profile(config.model, factory.size)
    if tuple(profile.resolution) != tuple(factory.size):
        log.warning("fidelity profile %s was measured at %s but the engine runs at %s: latencies are off; "
                    "measure one with `diffcast profile --out FILE` and pass --profile FILE",
                    profile.model, profile.resolution, factory.size)
    profile = with_emulated_delay(live_profile(profile), config.engine_delay_ms / 1000.0,
                                  config.engine_step_delay_ms / 1000.0)
    scheduler = PolicyScheduler(profile, executor, fps=config.max_fps, max_batch=config.max_batch)
    log.info("serving policy %s: %d live configs, initial slack %.2f s, content rate %g fps",
             scheduler.policy.name, len(scheduler.profile.points), scheduler.policy.initial_slack_s, config.max_fps)
    return scheduler


def _reraise(exc: BaseException) -> None:
    raise exc
