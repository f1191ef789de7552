"""The control-process side of scale-out: Ray worker actors, where each stream lives, and applying the
serving policy's plans (admission, re-homing, evict/restore) to them.

    controller = ClusterController.start(ClusterConfig(model="tiny-random", workers=2))
    controller.open(7, StreamParams(prompt="oil painting"))
    out = controller.process(7, frames)                 # routed to the stream's home actor
    controller.migrate(7, dst=1)                        # real state moves at the next chunk boundary
    controller.apply_tick(policy.tick(snapshot))        # the policy's re-homes, applied

Consistency (TurboServe §6.1): a stream has one lock, held by each chunk and by each move, so a move
happens only at a chunk boundary and holds the stream only for the transfer. The source freezes and
serialises the state into the object store, the destination pulls it straight from there, and the
stream's home changes only after the destination has installed it; the source copy is dropped last.

Failure: a call that fails with ``RayActorError``, or a health ping that fails or times out, marks the
worker dead; its streams are re-admitted on the survivors with their prompt and controls kept, from the
state the policy last parked in host memory where the stream is parked (the controller holds a copy),
else with fresh caches. The next chunk of such a stream runs as a first chunk (from the newest frame) and its
output is held for the chunk's duration (``StreamWorker.process``): the bounded gap a viewer sees.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
from ray._private import ray_constants
from ray.exceptions import GetTimeoutError, RayActorError

from engine.cluster.worker import MoveReport, StepCall, StepOutcome, StreamWorker, WorkerInfo
from engine.pipeline import StreamParams
from engine.serving.snapshot import Admission, Dispatch, TickPlan, WorkerView
from engine.streaming.parcel import Parcel

log = logging.getLogger(__name__)

HISTORY = 1000  # migrations and recoveries kept for inspection
HEALTH_GROUP = "health"  # the actors' concurrency group for pings


class ClusterError(RuntimeError):
    """The cluster cannot serve a request (unknown stream or worker, no live workers)."""


@dataclass(frozen=True)
class ClusterConfig:
    model: str | None = None  # as Pipeline.load: None = embedded default, "tiny-random", or a path
    workers: int = 2
    max_workers: int = 0  # the most the autoscaler may run (a local cluster gets CPUs for them); 0 = workers
    device: str = "cpu"
    threads_per_worker: int = 1  # torch threads in each actor
    dtype: str = "auto"  # weight dtype of each actor's model (engine.devices.resolve_dtype)
    vae: str | None = None  # a Wan model's stream VAE (engine/vae_choice.py); None: the model's own
    loras: tuple[tuple[str, str, float], ...] = ()  # (name, path, default strength) every actor loads
    cpus_per_worker: float = 1.0  # Ray scheduling resources of one actor
    gpus_per_worker: float = 0.0
    state_slots: int = 4  # resident streams per worker, as the policy's WorkerView sees it
    object_store_mb: int | None = None  # a local cluster's object store (moving states); None = Ray's default
    health_interval_s: float = 1.0
    health_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if self.health_interval_s <= 0 or self.health_timeout_s <= 0:
            raise ValueError("health_interval_s and health_timeout_s must be positive")


@dataclass(frozen=True)
class MigrationStats:
    stream_id: int
    src: int
    dst: int
    nbytes: int
    export_s: float  # source: serialise the state
    import_s: float  # destination: deserialise and install
    hold_s: float  # the stream could not run: chunk boundary -> new home installed

    @property
    def transfer_s(self) -> float:
        """Object-store put/get and the two actor calls: the hold minus both ends' work."""
        return max(0.0, self.hold_s - self.export_s - self.import_s)


@dataclass(frozen=True)
class Recovery:
    """One worker failure and what the controller did about it."""

    worker_id: int
    detected_by: str  # "call" (an actor call failed) or "ping" (health check)
    readmitted: dict[int, int]  # stream -> new home
    lost: tuple[int, ...]  # streams with nowhere to go (no live worker)
    detected_at: float  # time.monotonic()
    done_at: float


@dataclass
class _Stream:
    home: int
    params: StreamParams
    lock: threading.Lock = field(default_factory=threading.Lock)
    suspended: bool = False
    # The state as the policy last parked it in its worker's host memory, while it stays parked: a
    # copy that outlives the worker, so a re-admission keeps the stream's state.
    parked: Parcel | None = None


def connect(address: str | None = None, num_cpus: int | None = None, object_store_mb: int | None = None) -> None:
    """Join the Ray cluster at ``address``, or start a local one on 127.0.0.1 (no dashboard; object store
    of ``object_store_mb``, None = Ray's default share of memory)."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=False)
        return
    # Ray replaces 127.0.0.1 with the machine's routable address (even when passed as the node address)
    # unless it runs in its single-machine mode; a local cluster has no other node, so that mode keeps
    # the GCS, raylet and object-manager addresses on loopback. Read at call time, hence settable here.
    ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        object_store_memory=None if object_store_mb is None else object_store_mb * 1024 * 1024,
        log_to_driver=False,
    )


class ClusterController:
    """Owns the worker actors and the stream table; thread-safe (the server calls it from its engine
    threads, the health monitor from its own)."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        # Stream calls run one at a time (the default group); health pings have a thread of their own so a
        # worker with a queue of long chunks still answers them and is not taken for dead.
        self._actor_cls: Any = ray.remote(concurrency_groups={HEALTH_GROUP: 1})(  # type: ignore[call-overload]
            StreamWorker
        ).options(
            num_cpus=config.cpus_per_worker, num_gpus=config.gpus_per_worker, max_restarts=0
        )
        self._workers: dict[int, Any] = {}
        self._next_worker = 0
        self._streams: dict[int, _Stream] = {}
        self._table = threading.RLock()
        self.info: WorkerInfo | None = None
        # Recent history for stats and tests; bounded, since a server runs for days.
        self.recoveries: deque[Recovery] = deque(maxlen=HISTORY)
        self.migrations: deque[MigrationStats] = deque(maxlen=HISTORY)
        self._monitor: threading.Thread | None = None
        self._stop = threading.Event()
        # Called after each recovery, on the thread that found the worker dead (the live server's
        # executor moves the policy's view of the streams to their new homes).
        self.recovery_listeners: list[Callable[[Recovery], None]] = []

    @classmethod
    def start(cls, config: ClusterConfig, address: str | None = None) -> ClusterController:
        """Connect to (or start) Ray and bring up ``config.workers`` actors, each with a model replica."""
        num_cpus = max(2, int(max(config.workers, config.max_workers) * config.cpus_per_worker) + 1)
        connect(address, num_cpus=None if address else num_cpus, object_store_mb=config.object_store_mb)
        controller = cls(config)
        controller.add_workers(config.workers)
        return controller

    # -- workers --------------------------------------------------------------------------------------

    def add_workers(self, count: int) -> list[int]:
        """Start ``count`` actors and wait until each has loaded its replica (scale-out)."""
        cfg = self.config
        with self._table:
            ids = list(range(self._next_worker, self._next_worker + count))
            self._next_worker += count
        actors = {wid: self._actor_cls.remote(cfg.model, cfg.device, cfg.threads_per_worker, cfg.loras, cfg.dtype,
                                              cfg.vae) for wid in ids}
        infos = ray.get([a.info.remote() for a in actors.values()])
        with self._table:
            self._workers.update(actors)
            self.info = self.info or infos[0]
        log.info("workers %s ready (%s, pids %s)", ids, infos[0].model, [i.pid for i in infos])
        return ids

    @property
    def worker_ids(self) -> list[int]:
        with self._table:
            return sorted(self._workers)

    def actor(self, worker_id: int) -> Any:
        """The Ray actor handle of a live worker (tests use it to kill one)."""
        with self._table:
            if worker_id not in self._workers:
                raise ClusterError(f"no live worker {worker_id}; live workers are {sorted(self._workers)}")
            return self._workers[worker_id]

    def worker_views(self) -> list[WorkerView]:
        """The workers as the serving policy's snapshot sees them."""
        return [WorkerView(wid, node_id=0, state_slots=self.config.state_slots) for wid in self.worker_ids]

    def placement(self) -> dict[int, int]:
        with self._table:
            return {sid: s.home for sid, s in self._streams.items()}

    def _least_loaded(self) -> int | None:
        counts: dict[int, int] = defaultdict(int)
        for s in self._streams.values():
            counts[s.home] += 1
        return min(self._workers, key=lambda w: (counts[w], w)) if self._workers else None

    # -- stream lifetime ------------------------------------------------------------------------------

    def open(self, stream_id: int, params: StreamParams, worker_id: int | None = None) -> int:
        """Open a stream on ``worker_id`` (default: the live worker with fewest streams); returns its home."""
        with self._table:
            if stream_id in self._streams:
                raise ClusterError(f"stream {stream_id} is already open (on worker {self._streams[stream_id].home})")
            home = worker_id if worker_id is not None else self._least_loaded()
            if home is None:
                raise ClusterError("no live workers to open a stream on")
            actor = self.actor(home)
            self._streams[stream_id] = entry = _Stream(home, params)
        try:
            self._call(home, actor.open.remote(stream_id, params))
        except BaseException:
            with self._table:
                if self._streams.get(stream_id) is entry:
                    del self._streams[stream_id]
            raise
        return home

    def close(self, stream_id: int) -> None:
        with self._table:
            entry = self._streams.pop(stream_id, None)
            actor = self._workers.get(entry.home) if entry is not None else None
        if actor is not None:
            actor.close.remote(stream_id)  # fire and forget: nothing waits on a goodbye

    def _entry(self, stream_id: int) -> _Stream:
        with self._table:
            entry = self._streams.get(stream_id)
        if entry is None:
            raise ClusterError(f"no stream {stream_id} in the cluster")
        return entry

    @contextmanager
    def _held(self, stream_id: int) -> Iterator[_Stream]:
        """The stream at a chunk boundary: no chunk or move of it runs meanwhile."""
        entry = self._entry(stream_id)
        with entry.lock:
            yield entry

    def _call(self, worker_id: int, ref: Any) -> Any:
        """``ray.get`` that turns a dead actor into a recovery, then re-raises."""
        try:
            return ray.get(ref)
        except RayActorError:
            self._fail(worker_id, "call")
            raise

    def _on_home(self, stream_id: int, method: str, *args: Any) -> Any:
        """Call a worker method for a stream under its lock; if the home dies, once more on the new home."""
        with self._held(stream_id) as entry:
            try:
                return self._call(entry.home, getattr(self.actor(entry.home), method).remote(stream_id, *args))
            except RayActorError:
                pass  # _call re-admitted the stream elsewhere
            return self._call(entry.home, getattr(self.actor(entry.home), method).remote(stream_id, *args))

    def process(self, stream_id: int, frames: np.ndarray, camera: tuple[int, int] | None = None) -> np.ndarray:
        """One chunk on the stream's home worker (uint8 [T, H, W, 3] in and out; ``camera``: as in
        `ChunkOrder`)."""
        return np.asarray(self._on_home(stream_id, "process", frames, camera))

    def update(self, stream_id: int, **changes: Any) -> StreamParams:
        params: StreamParams = self._on_home(stream_id, "update", changes)
        self._entry(stream_id).params = params  # kept for re-admission after a failure
        return params

    def reset(self, stream_id: int) -> None:
        self._on_home(stream_id, "reset")

    # -- the engine core's steps ----------------------------------------------------------------------

    def run_step(self, worker_id: int, call: StepCall) -> StepOutcome:
        """One engine-core ``Work`` on ``worker_id`` (its streams must live there: the caller places
        them first). Parked copies of evicted states are kept here until the stream is restored. A
        dead worker raises ``RayActorError`` after its streams were re-admitted elsewhere."""
        outcome: StepOutcome = self._call(worker_id, self.actor(worker_id).run_step.remote(call))
        with self._table:
            for sid in call.restore:
                if (entry := self._streams.get(sid)) is not None:
                    entry.parked = None
            for sid, blob in outcome.parked.items():
                if (entry := self._streams.get(sid)) is not None:
                    entry.parked = blob
        return outcome

    def home(self, stream_id: int) -> int:
        return self._entry(stream_id).home

    def settled_home(self, stream_id: int) -> int:
        """The stream's home once a move of it in flight has finished (or failed): its step that met the
        move half-way (the source had frozen the state) learns where the stream lives now."""
        with self._held(stream_id) as entry:
            return entry.home

    def remove_worker(self, worker_id: int) -> None:
        """Stop a worker that hosts no stream (scale-in, after the policy moved its streams away)."""
        with self._table:
            if any(e.home == worker_id for e in self._streams.values()):
                raise ClusterError(f"worker {worker_id} still hosts streams; move them away first")
            actor = self._workers.pop(worker_id, None)
        if actor is None:
            raise ClusterError(f"no live worker {worker_id}")
        ray.kill(actor, no_restart=True)
        log.info("worker %d removed", worker_id)

    def loads(self) -> dict[int, dict[str, int]]:
        """Each live worker's stream counts (its health ping's answer; absent when it does not answer)."""
        with self._table:
            workers = dict(self._workers)
        refs = {wid: actor.ping.options(concurrency_group=HEALTH_GROUP).remote() for wid, actor in workers.items()}
        out: dict[int, dict[str, int]] = {}
        for wid, ref in refs.items():
            try:
                out[wid] = ray.get(ref, timeout=self.config.health_timeout_s)
            except (RayActorError, GetTimeoutError):
                continue
        return out

    # -- offload --------------------------------------------------------------------------------------

    def suspend(self, stream_id: int) -> int:
        """Offload the stream's state to host memory on its worker; returns the bytes moved."""
        nbytes: int = self._on_home(stream_id, "suspend")
        self._entry(stream_id).suspended = True
        return nbytes

    def resume(self, stream_id: int) -> None:
        self._on_home(stream_id, "resume")
        self._entry(stream_id).suspended = False

    # -- migration ------------------------------------------------------------------------------------

    def migrate(self, stream_id: int, dst: int) -> MigrationStats:
        """Move a stream's live state to worker ``dst`` at its next chunk boundary.

        Transport: the Ray object store (the source's return value, pulled by the destination). A
        GPU-to-GPU transport (NCCL / NIXL one-sided reads) would replace the ``StreamHandoff.state``
        bytes with device buffers registered on both workers; the protocol around it stays as is.
        """
        entry = self._entry(stream_id)
        dst_actor = self.actor(dst)
        if entry.home == dst:
            raise ClusterError(f"stream {stream_id} already lives on worker {dst}")
        # Outside the hold: the destination warms up for this stream while its current chunk runs.
        self._call(dst, dst_actor.prepare.remote(entry.params))
        with self._held(stream_id) as entry:
            src = entry.home
            if entry.suspended:
                raise ClusterError(f"stream {stream_id} is suspended; resume it before moving it")
            t0 = time.perf_counter()
            src_actor = self.actor(src)
            exported, handoff = src_actor.export_stream.options(num_returns=2).remote(stream_id)
            # Submitted at once: Ray starts the import as soon as the export's object exists. The report
            # is read first, so a dead source is blamed on the source, not on the destination.
            imported = dst_actor.import_stream.remote(handoff)
            sent: MoveReport = self._call(src, exported)  # the state itself stays in the object store
            try:
                received: MoveReport = self._call(dst, imported)
            except Exception:
                # The source never let go: un-freeze it there and keep serving from it.
                src_actor.thaw.remote(stream_id)
                raise
            with self._table:
                entry.home = dst
            hold = time.perf_counter() - t0
        src_actor.close.remote(stream_id)
        stats = MigrationStats(stream_id, src, dst, sent.nbytes, sent.seconds, received.seconds, hold)
        self.migrations.append(stats)
        log.info("stream %d moved %d -> %d: %.2f MB, hold %.1f ms", stream_id, src, dst, stats.nbytes / 1e6,
                 1000 * hold)
        return stats

    # -- applying the serving policy's plans ----------------------------------------------------------

    def apply_admission(self, admission: Admission, params: StreamParams) -> int | None:
        """Open an admitted stream on the home the policy chose; None for a rejection."""
        if not admission.accepted:
            log.info("stream %d rejected: %s", admission.stream_id, admission.reason)
            return None
        return self.open(admission.stream_id, params, admission.worker_id)

    def apply_tick(self, plan: TickPlan) -> list[MigrationStats]:
        """Carry out the tick's re-homes. A move whose source no longer matches (the stream moved, closed
        or was re-admitted since the snapshot) is stale and skipped."""
        done = []
        for move in plan.rehomes:
            with self._table:
                entry = self._streams.get(move.stream_id)
                current = entry.home if entry is not None else None
            if current != move.src or move.dst not in self.worker_ids:
                log.info("skipping stale re-home of stream %d (%s -> %s; now on %s)", move.stream_id, move.src,
                         move.dst, current)
                continue
            done.append(self.migrate(move.stream_id, move.dst))
        return done

    def apply_dispatch(self, dispatch: Dispatch) -> None:
        """Offload the dispatch's evictions to host memory and bring back the streams it restores."""
        for sid in dispatch.evict:
            self.suspend(sid)
        for sid in dispatch.restore:
            self.resume(sid)

    # -- failure --------------------------------------------------------------------------------------

    def check_health(self) -> list[Recovery]:
        """Ping every worker; a failed or late answer is a dead worker, and is recovered from. The ping
        checks that the process lives and answers, not that its chunks make progress."""
        with self._table:
            workers = dict(self._workers)
        refs = {wid: actor.ping.options(concurrency_group=HEALTH_GROUP).remote() for wid, actor in workers.items()}
        deadline = time.monotonic() + self.config.health_timeout_s
        recovered = []
        for wid, ref in refs.items():
            try:
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except (RayActorError, GetTimeoutError):
                recovery = self._fail(wid, "ping")
                if recovery is not None:
                    recovered.append(recovery)
        return recovered

    def start_monitor(self, on_recovery: Callable[[Recovery], None] | None = None) -> None:
        """Health-check every ``health_interval_s`` on a daemon thread until ``shutdown``."""

        def loop() -> None:
            while not self._stop.wait(self.config.health_interval_s):
                for recovery in self.check_health():
                    if on_recovery is not None:
                        on_recovery(recovery)

        self._monitor = threading.Thread(target=loop, name="cluster-health", daemon=True)
        self._monitor.start()

    def _fail(self, worker_id: int, detected_by: str) -> Recovery | None:
        """Forget a dead worker and re-admit its streams elsewhere (idempotent)."""
        detected = time.monotonic()
        with self._table:
            actor = self._workers.pop(worker_id, None)
            if actor is None:
                return None  # already handled (by the monitor or another call)
            ray.kill(actor, no_restart=True)  # a hung actor must not come back and serve stale streams
            orphans = {sid: e for sid, e in self._streams.items() if e.home == worker_id}
            readmitted: dict[int, int] = {}
            lost: list[int] = []
            for sid, entry in orphans.items():
                home = self._readmit(sid, entry)
                if home is None:
                    lost.append(sid)
                else:
                    readmitted[sid] = home
            for sid in lost:
                del self._streams[sid]
        recovery = Recovery(worker_id, detected_by, readmitted, tuple(lost), detected, time.monotonic())
        self.recoveries.append(recovery)
        log.warning("worker %d died (%s): streams %s re-admitted, %s lost", worker_id, detected_by, readmitted, lost)
        for listener in list(self.recovery_listeners):
            listener(recovery)
        return recovery

    def _readmit(self, stream_id: int, entry: _Stream) -> int | None:
        """Re-open the stream (same controls) on the least-loaded survivor, from its parked copy where
        one exists (its state as the policy last parked it), else fresh; None if no worker is left.
        Called with the table lock held, never the stream's lock: that may belong to the very call that
        found the worker dead."""
        while (home := self._least_loaded()) is not None:
            actor = self._workers[home]
            try:
                if entry.parked is not None:
                    ray.get(actor.adopt.remote(stream_id, entry.params, entry.parked))
                    entry.parked = None  # resident again on its new home
                else:
                    ray.get(actor.open.remote(stream_id, entry.params))
            except RayActorError:
                self._fail(home, "call")  # the survivor died too: re-admit its streams, try the next
                continue
            entry.home, entry.suspended = home, False
            return home
        return None

    def shutdown(self) -> None:
        """Stop the monitor and the actors (the Ray cluster itself is left running)."""
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=self.config.health_interval_s + self.config.health_timeout_s)
        with self._table:
            actors = list(self._workers.values())
            self._workers.clear()
            self._streams.clear()
        for actor in actors:
            ray.kill(actor, no_restart=True)
