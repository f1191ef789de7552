"""The playout-slack serving policy (SlackServe, docs/references.md) and its baselines, behind one pure interface.

``SlackPolicy`` has three entry points, all pure functions of their arguments:

* ``admit(request, snapshot)`` on stream arrival: initial slack, home worker, or a rejection reason;
* ``dispatch(now, worker, streams)`` at a worker's step or chunk boundary: which stream(s) run next with
  which fidelity point, whether the running stream is preempted, which states to evict/restore;
* ``tick(snapshot)`` every control interval: fidelity, credits, tiers, per-worker queues, re-homes,
  and (when configured) the autoscaler's desired worker count.

The baselines are the same class with mechanisms switched off (``PolicyConfig``), so the simulator
runs every policy through identical executor code and only the decisions differ.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

import numpy as np

from engine.serving.autoscale import AutoscaleConfig, desired_worker_count
from engine.serving.bmpr import BMPR
from engine.serving.credit import Tier, TierThresholds, classify, classify_many
from engine.serving.profile import FidelityProfile, ProfilePoint
from engine.serving.rehoming import ClusterArrays, RehomingConfig, plan_rehomes
from engine.serving.snapshot import (
    Admission,
    AdmissionRequest,
    Dispatch,
    Snapshot,
    StreamView,
    TickPlan,
    WorkerView,
)
from engine.serving.transfer import TransferModel


class Ordering(Enum):
    TIER_CREDIT = "tier-credit"  # ours: three-tier queue, lowest credit first within a tier
    LEAST_SLACK = "least-slack"  # TridentServe-chunk: per-chunk slack (credit), no tiers
    STREAM_DEADLINE = "stream-deadline"  # TridentServe: per-stream completion deadline first
    FIFO = "fifo"  # StreamDiffusionV2: arrival order, stream batching
    ROUND_ROBIN = "round-robin"  # streams take turns: the one that ran least recently goes next


@dataclass(frozen=True)
class PolicyConfig:
    name: str = "slackserve"
    ordering: Ordering = Ordering.TIER_CREDIT
    bmpr: bool = True
    step_preemption: bool = True
    rehoming: bool = True
    credit_eviction: bool = True
    admission_control: bool = True
    max_batch: int = 1
    gpus_per_worker: int = 1
    initial_slack_mult: float = 4.0
    # Live camera streams (the server; None in the simulator's traces): a camera delivers one chunk
    # per chunk duration and the playout buffer is kept short for latency (its clock follows the
    # production rate), so the slack never builds up and its budget would hold every stream at the
    # fastest point. Instead each stream's chunk gets its share of its worker's time, ``live_load`` x
    # chunk duration / the live streams on the worker, and BMPR's best point within it (its fastest
    # floor point when none fits); the live calibration keeps the latencies honest. The slack still
    # orders, preempts and evicts through the tiers.
    live_load: float | None = None
    thresholds: TierThresholds = field(default_factory=TierThresholds)
    rehome: RehomingConfig = field(default_factory=RehomingConfig)

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.gpus_per_worker < 1:
            raise ValueError(f"gpus_per_worker must be >= 1, got {self.gpus_per_worker}")
        if self.live_load is not None and not 0.0 < self.live_load <= 1.0:
            raise ValueError(f"live_load must be in (0, 1], got {self.live_load}")


def policy_presets() -> dict[str, PolicyConfig]:
    """Baselines, our policy, and the ablation ladder (mechanisms added in control-plane order)."""
    base = PolicyConfig(bmpr=False, rehoming=False, credit_eviction=False, admission_control=False)
    credit_only = replace(base, name="credit-only")
    return {
        "fifo-batch": replace(base, name="fifo-batch", ordering=Ordering.FIFO, step_preemption=False, max_batch=4,
                              gpus_per_worker=4),
        "ts-deadline": replace(base, name="ts-deadline", ordering=Ordering.STREAM_DEADLINE, step_preemption=False),
        "ts-chunk-lsf": replace(base, name="ts-chunk-lsf", ordering=Ordering.LEAST_SLACK, step_preemption=False),
        "credit-only": credit_only,
        "+bmpr": replace(credit_only, name="+bmpr", bmpr=True),
        "+rehoming": replace(credit_only, name="+rehoming", bmpr=True, rehoming=True),
        "slackserve": PolicyConfig(name="slackserve"),
        # The live server's turn-taking: each stream at its own fixed fidelity, least recently run first.
        "fifo": replace(base, name="fifo", ordering=Ordering.ROUND_ROBIN, step_preemption=False),
    }


PRESET_ALIASES = {"slack": "slackserve"}


def resolve_preset(name: str) -> PolicyConfig:
    """A preset by name (``policy_presets`` keys, or an alias such as ``slack``)."""
    presets = policy_presets()
    key = PRESET_ALIASES.get(name, name)
    if key not in presets:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join([*presets, *PRESET_ALIASES])}")
    return presets[key]


BASELINES = ("fifo-batch", "ts-deadline", "ts-chunk-lsf")
# The source of a batch point the profile lacks: an upper bound on the batch's time (see batch_point).
ASSUMED_BATCH = "assumed: batch x single"
ABLATION_LADDER = ("credit-only", "+bmpr", "+rehoming", "slackserve")


@dataclass(frozen=True, slots=True)
class _Scored:
    view: StreamView
    point: ProfilePoint  # config of the next (or in-flight) chunk
    credit: float
    tier: Tier
    key: tuple[float, ...]


def live_streams(streams: Sequence[StreamView]) -> int:
    """Streams of a worker that take engine time (a paused camera sends nothing)."""
    return sum(1 for v in streams if not v.paused)


class SlackPolicy:
    def __init__(
        self,
        profile: FidelityProfile,
        config: PolicyConfig | None = None,
        transfer: TransferModel | None = None,
        autoscale: AutoscaleConfig | None = None,
    ) -> None:
        self.profile = profile
        self.config = config = config if config is not None else PolicyConfig()
        self.transfer = transfer if transfer is not None else TransferModel()
        self.autoscale = autoscale
        self.router = BMPR(profile.per_stream(), profile.quality_floor)
        self.reference = profile.reference()
        self._routers: dict[int, BMPR] = {}
        self._batch_points = {b: self.batch_point(self.reference, b) for b in range(1, config.max_batch + 1)}
        self.static_point = self._batch_points[1]
        # Policy-independent playout contract: every policy promises the same first-chunk deadline.
        self.initial_slack_s = config.initial_slack_mult * self.reference.first_chunk_latency_s

    @property
    def name(self) -> str:
        return self.config.name

    def rescaled(self, ratio: float) -> SlackPolicy:
        """The same policy on a profile whose every latency is ``ratio`` times this one's (an engine
        measured that much slower or faster than profiled)."""
        def scaled(p: ProfilePoint) -> ProfilePoint:
            return replace(p, latency_s=p.latency_s * ratio, first_chunk_latency_s=p.first_chunk_latency_s * ratio)

        profile = replace(self.profile, points=tuple(scaled(p) for p in self.profile.points))
        return SlackPolicy(profile, self.config, self.transfer, self.autoscale)

    def chunk_duration_s(self, first: bool) -> float:
        """Seconds of content one chunk adds to its stream's playout (a stream's first chunk is shorter)."""
        return self.profile.first_chunk_duration_s if first else self.profile.chunk_duration_s

    def batch_point(self, point: ProfilePoint, batch: int) -> ProfilePoint:
        """``batch`` streams in one forward at ``point``'s config: the profiled batch point, or where the
        profile has none, ``batch`` times the single-stream latency (batching is never slower than
        running the chunks one after another; the live calibration corrects the estimate)."""
        config = replace(point.config, stream_batch=batch, gpus=self.config.gpus_per_worker)
        try:
            return self.profile.find(config)
        except KeyError:
            if batch == 1 and config.gpus == point.config.gpus:
                return point
            return replace(point, config=config, latency_s=point.latency_s * batch,
                           first_chunk_latency_s=point.first_chunk_latency_s * batch, source=ASSUMED_BATCH)

    # ---- per-stream scoring -------------------------------------------------------------------
    def _router(self, max_steps: int | None) -> BMPR:
        """BMPR over the points with at most ``max_steps`` steps (the user's choice caps fidelity)."""
        points = self.profile.per_stream()
        steps = sorted({p.config.steps for p in points})
        if max_steps is None or max_steps >= steps[-1]:
            return self.router
        k = max((s for s in steps if s <= max_steps), default=steps[0])
        if k not in self._routers:
            self._routers[k] = BMPR([p for p in points if p.config.steps <= k], self.profile.quality_floor)
        return self._routers[k]

    def top_point(self, max_steps: int | None = None) -> ProfilePoint:
        """The highest-quality point a stream with this ceiling may run (ties: fastest)."""
        return max(self._router(max_steps).candidates, key=lambda p: (p.quality, -p.latency_s))

    def next_point(self, slack_s: float, inflight_remaining_s: float, max_steps: int | None = None,
                   sharing: int = 0) -> ProfilePoint:
        """BMPR's point for a stream's next chunk; ``sharing``: the live streams on its worker (0: none
        counted, the slack budget alone)."""
        if not self.config.bmpr:
            return self.static_point if max_steps is None else self.top_point(max_steps)
        router = self._router(max_steps)
        if self.config.live_load is not None and sharing > 0:
            return router.route(self.live_share_s(sharing)).point
        budget = router.budget(slack_s, inflight_remaining_s, self.config.thresholds.urgent_mult)
        return router.route(budget).point

    def live_share_s(self, sharing: int) -> float:
        """A live stream's share of its worker's time per chunk, with ``sharing`` streams on the worker."""
        assert self.config.live_load is not None
        return self.config.live_load * self.profile.chunk_duration_s / max(1, sharing)

    def _score(self, v: StreamView, sharing: int = 0) -> _Scored:
        point = (v.inflight_point if v.inflight_point is not None
                 else self.next_point(v.slack_s, 0.0, v.max_steps, sharing))
        if v.inflight_point is not None:
            # Credit looks one chunk past the one in flight: that next chunk gets BMPR's choice.
            t_next = self.next_point(v.slack_s, v.inflight_remaining_s, v.max_steps, sharing).latency_s
            credit = v.slack_s - (v.inflight_remaining_s + t_next)
        else:
            t_next = point.first_chunk_latency_s if v.first_chunk else point.latency_s
            credit = v.slack_s - t_next
        tier = classify(credit, t_next, self.config.thresholds)
        order = self.config.ordering
        if order is Ordering.TIER_CREDIT:
            key: tuple[float, ...] = (float(tier), credit, v.arrival_t)
        elif order is Ordering.LEAST_SLACK:
            key = (credit, v.arrival_t)
        elif order is Ordering.STREAM_DEADLINE:
            key = (v.slack_s + v.remaining_content_s, v.arrival_t)
        elif order is Ordering.ROUND_ROBIN:
            key = (v.last_run_at, v.arrival_t)
        else:
            key = (v.arrival_t,)
        return _Scored(v, point, credit, tier, key)

    # ---- admission ----------------------------------------------------------------------------
    def admit(self, req: AdmissionRequest, snap: Snapshot) -> Admission:
        s0 = self.initial_slack_s
        live = [w for w in snap.workers if not w.draining]
        if not live:
            return Admission(req.stream_id, False, None, s0, "no live workers to host the stream")
        by_worker: dict[int, list[StreamView]] = {w.worker_id: [] for w in live}
        for v in snap.streams:
            if v.worker_id in by_worker:
                by_worker[v.worker_id].append(v)
        newcomer = StreamView(req.stream_id, -1, s0, arrival_t=req.now, remaining_content_s=req.content_s,
                              first_chunk=True, max_steps=req.max_steps)
        new_scored = self._score(newcomer)
        router = self._router(req.max_steps)
        fastest_first = router.frontier[router.fastest_ok].first_chunk_latency_s
        first_time = fastest_first if self.config.bmpr else new_scored.view.slack_s - new_scored.credit

        def wait(w: WorkerView) -> float:
            ahead = 0.0
            for v in by_worker[w.worker_id]:
                sc = self._score(v)  # BMPR's slack point: the admission's wait stays SlackServe's estimate
                if v.running or (v.runnable and sc.key < new_scored.key):
                    ahead += v.inflight_remaining_s if v.inflight_point is not None else sc.point.latency_s
            return ahead

        roomy = [w for w in live if w.state_slots > 0
                 and (w.max_streams is None or len(by_worker[w.worker_id]) < w.max_streams)]
        if not roomy:
            return Admission(req.stream_id, False, None, s0,
                             "device memory is full: every worker holds as many stream states as fit "
                             f"({max(w.max_streams or w.state_slots for w in live)} each)")
        home = min(roomy, key=lambda w: (len(by_worker[w.worker_id]), wait(w), w.worker_id))
        if self.config.admission_control:
            est = wait(home) + first_time
            if est > s0:
                return Admission(
                    req.stream_id, False, None, s0,
                    f"first chunk would be ready in ~{est:.2f}s on the least-loaded worker {home.worker_id} "
                    f"({len(by_worker[home.worker_id])} streams) but the initial slack is {s0:.2f}s",
                )
        return Admission(req.stream_id, True, home.worker_id, s0)

    # ---- boundary dispatch --------------------------------------------------------------------
    def dispatch(
        self, now: float, worker: WorkerView, streams: Sequence[StreamView], step_boundary: bool = False
    ) -> Dispatch:
        """``streams``: every stream homed on ``worker``. ``step_boundary``: a chunk is mid-flight
        (the stream with ``running=True``) and has steps left; otherwise this is a chunk boundary."""
        sharing = live_streams(streams)
        scored = [self._score(v, sharing) for v in streams if v.runnable]
        if not scored:
            return Dispatch(worker.worker_id, (), None)
        scored.sort(key=lambda s: s.key)
        best = scored[0]
        in_flight = tuple(s for s in scored if s.view.running)
        if in_flight:
            running = in_flight[0]
            may_preempt = (
                self.config.step_preemption
                and step_boundary
                and len(in_flight) == 1
                and self.config.ordering is Ordering.TIER_CREDIT
                and best.tier < running.tier
            )
            if not may_preempt:
                return Dispatch(worker.worker_id, tuple(s.view.stream_id for s in in_flight), running.point)
        if self.config.max_batch > 1 and self.config.ordering is Ordering.FIFO:
            # StreamDiffusionV2's stream batching: the first streams in arrival order that run at the
            # same (fixed) fidelity, one forward.
            fresh = [s for s in scored if s.view.inflight_point is None]
            chosen = [s for s in fresh if s.point == fresh[0].point][: self.config.max_batch] if fresh else [best]
            point = self.batch_point(chosen[0].point, len(chosen)) if fresh else best.point
        elif self.config.max_batch > 1 and best.view.inflight_point is None:
            # Cross-user batching: streams whose next chunk BMPR sends to the lead's point join its
            # forward, in queue order (the executor splits rows whose caches are not at one fill level).
            chosen = [best] + [s for s in scored[1:] if s.view.inflight_point is None and s.point == best.point
                               and s.view.first_chunk == best.view.first_chunk][: self.config.max_batch - 1]
            point = self.batch_point(best.point, len(chosen)) if len(chosen) > 1 else best.point
        else:
            chosen = [best]
            point = best.point
        chosen_ids = {s.view.stream_id for s in chosen}
        restore = tuple(s.view.stream_id for s in chosen if not s.view.resident)
        evict = self._evictions(worker, scored, streams, chosen_ids, len(restore))
        return Dispatch(
            worker.worker_id,
            tuple(s.view.stream_id for s in chosen),
            point,
            preempt=bool(in_flight),
            evict=evict,
            restore=restore,
        )

    def _evictions(
        self,
        worker: WorkerView,
        scored: Sequence[_Scored],
        streams: Sequence[StreamView],
        chosen: set[int],
        incoming: int,
    ) -> tuple[int, ...]:
        resident = [v for v in streams if v.resident]
        overflow = len(resident) + incoming - worker.state_slots
        if overflow <= 0:
            return ()
        credit = {s.view.stream_id: s.credit for s in scored}
        victims = [v for v in resident if v.stream_id not in chosen and not v.running]
        if self.config.credit_eviction:
            # Highest credit first: the stream least likely to stall while it is away. Streams that
            # cannot run now (paused at a cap, transferring) have unbounded credit for this purpose.
            victims.sort(key=lambda v: -credit.get(v.stream_id, math.inf))
        else:
            victims.sort(key=lambda v: v.last_run_at)  # LRU
        return tuple(v.stream_id for v in victims[:overflow])

    # ---- control tick -------------------------------------------------------------------------
    def tick(self, snap: Snapshot) -> TickPlan:
        streams = snap.streams
        n = len(streams)
        ids = np.fromiter((v.stream_id for v in streams), np.int64, n)
        slack = np.fromiter((v.slack_s for v in streams), np.float64, n)
        rem = np.fromiter((v.inflight_remaining_s for v in streams), np.float64, n)
        first = np.fromiter((v.first_chunk for v in streams), np.bool_, n)
        wids = np.fromiter((v.worker_id for v in streams), np.int64, n)
        active = np.fromiter((not v.paused for v in streams), np.bool_, n)
        sharing = np.zeros(n, dtype=np.int64)  # live streams on each stream's worker
        if n:
            _, inverse = np.unique(wids, return_inverse=True)
            sharing = np.bincount(inverse, weights=active)[inverse].astype(np.int64)
        lat = np.zeros(n, dtype=np.float64)
        fidelity: list[ProfilePoint] = [self.static_point] * n
        ceilings = [v.max_steps for v in streams]
        for ceiling in set(ceilings):  # one vectorised routing per user step cap (usually one group)
            rows = np.array([i for i, c in enumerate(ceilings) if c == ceiling], dtype=np.int64)
            if self.config.bmpr:
                router = self._router(ceiling)
                if self.config.live_load is not None:  # as next_point: the stream's share of its worker
                    budgets = self.live_share_s(1) / np.maximum(1, sharing[rows])
                else:
                    budgets = (slack[rows] - rem[rows]) / (1.0 + self.config.thresholds.urgent_mult)
                idx = router.route_many(budgets)
                lat[rows] = np.where(first[rows], router.first_latencies[idx], router.latencies[idx])
                for row, i in zip(rows.tolist(), idx.tolist(), strict=True):
                    fidelity[row] = router.frontier[i]
            else:
                ref = self.next_point(0.0, 0.0, ceiling)
                lat[rows] = np.where(first[rows], ref.first_chunk_latency_s, ref.latency_s)
                for row in rows.tolist():
                    fidelity[row] = ref
        credits = slack - (rem + lat)
        tiers = classify_many(credits, lat, self.config.thresholds)

        worker_ids = np.array([w.worker_id for w in snap.workers], dtype=np.int64)
        pos = {w: i for i, w in enumerate(worker_ids.tolist())}
        widx = np.fromiter((pos[w] for w in wids.tolist()), np.int64, n)
        nw = len(worker_ids)
        order = np.lexsort((credits, tiers, widx))
        bounds = np.searchsorted(widx[order], np.arange(nw + 1))
        sorted_ids = ids[order].tolist()
        queues = {int(worker_ids[i]): tuple(sorted_ids[bounds[i] : bounds[i + 1]]) for i in range(nw)}
        total = np.bincount(widx, minlength=nw)
        most_urgent = np.full(nw, 3, dtype=np.int64)
        np.minimum.at(most_urgent, widx, tiers.astype(np.int64))
        worker_tiers = {int(worker_ids[i]): (Tier(int(most_urgent[i])) if total[i] else None) for i in range(nw)}

        rehomes: tuple = ()
        if self.config.rehoming and n:
            arrays = ClusterArrays(
                stream_ids=ids,
                stream_worker=widx,
                tiers=tiers,
                credits=credits,
                last_rehomed_at=np.fromiter((v.last_rehomed_at for v in streams), np.float64, n),
                state_bytes=np.fromiter((v.state_bytes for v in streams), np.float64, n),
                worker_ids=worker_ids,
                worker_node=np.array([w.node_id for w in snap.workers], dtype=np.int64),
                worker_slots=np.array([w.state_slots for w in snap.workers], dtype=np.int64),
                worker_draining=np.array([w.draining for w in snap.workers], dtype=np.bool_),
                worker_speed=np.array([np.nan if w.speed is None else w.speed for w in snap.workers],
                                      dtype=np.float64),
            )
            rehomes = plan_rehomes(arrays, snap.now, self.config.rehome, self.transfer)
        desired = None
        if self.autoscale is not None:
            live = sum(1 for w in snap.workers if not w.draining)
            desired, _ = desired_worker_count(n, live, self.autoscale)
        return TickPlan(
            now=snap.now,
            stream_ids=ids,
            fidelity=fidelity,
            credits=credits,
            tiers=tiers,
            queues=queues,
            worker_tiers=worker_tiers,
            rehomes=rehomes,
            desired_workers=desired,
        )
