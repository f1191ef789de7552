"""The engine core's executor over Ray worker actors (`diffcast serve --ray --workers N`).

`RayExecutor` is the step-wise executor (app/server/serving/executors.py, ``StepExecutor``) whose engine step
is a call on worker ``w``'s actor: ``StreamWorker.run_step`` runs the same chunk stages the in-process
engine runs (engine/streaming/step_processor.py), so the policy's whole plan holds on every worker:
per-chunk fidelity, cross-user batches on a worker, eviction to the actor's host memory, preemption
between denoising steps. The workers step at once, each on an engine thread of its own.

What only a cluster has:

* re-homing: ``rehome`` moves the stream's live state to another actor (``ClusterController.migrate``)
  at the chunk boundary the core chose; the stream's next step waits for the move;
* placement: a new stream opens on whichever actor the factory picked; its first step moves it to the
  worker the policy admitted it on; after that the controller's placement is the truth, and a move
  made outside the policy (an operator's ``ClusterController.migrate``) is followed by the policy;
* worker death: the controller re-admits the dead worker's streams on survivors (from their parked
  copy where one exists); ``poll`` moves the policy's view of them there, and they keep playing;
* scaling: it is the autoscaler's worker pool (engine/serving/scaler.py): ``add_worker`` starts an actor
  in the background (it joins once its model is loaded), ``remove_worker`` stops a drained one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Executor as ThreadExecutor
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
from ray.exceptions import RayActorError, RayTaskError

from app.server.serving.engine_bridge import RayProcessor
from app.server.serving.executors import LiveStream, StepExecutor
from engine.cluster.controller import ClusterController, ClusterError, Recovery
from engine.cluster.worker import ChunkOrder, StepCall
from engine.serving.core import Clock, EngineCore, StepOrder, Work
from engine.serving.snapshot import Rehome, WorkerView

log = logging.getLogger(__name__)


class StreamMovedError(RuntimeError):
    """A stream of the step lives on another worker now (moved outside the policy): the step did not run."""


class RayExecutor(StepExecutor):
    """One denoising step per ``Work`` on the worker actor the work is for."""

    def __init__(self, controller: ClusterController, threads: ThreadExecutor, clock: Clock, state_slots: int,
                 fps: float, delay_s: float = 0.0, step_delay_s: float = 0.0,
                 worker_delays_s: Sequence[float] = ()) -> None:
        super().__init__(0, threads, clock, state_slots, fps, delay_s, step_delay_s)
        self.controller = controller
        self.state_slots = state_slots
        # Test knob (--worker-delay-ms): extra latency per chunk on the i-th worker started. The policy
        # is not told: it sees the slow worker through its streams' measured chunk times.
        ids = controller.worker_ids
        self.worker_delays_s = {wid: worker_delays_s[i] for i, wid in enumerate(ids) if i < len(worker_delays_s)}
        self.draining: set[int] = set()
        self.views = self._live_views(ids)
        self._moves: dict[int, Future[None]] = {}  # Ray stream id -> its migration in flight
        self._placed: set[int] = set()  # Ray streams placed where the policy admitted them
        self._move_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rehome")
        self._recoveries: list[Recovery] = []
        self._scale_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scale")
        self._starting = 0  # workers being started
        self._joined: list[Future[list[int]]] = []
        self._lock = threading.Lock()
        controller.recovery_listeners.append(self._on_recovery)

    def _live_views(self, ids: Sequence[int]) -> list[WorkerView]:
        return [WorkerView(wid, 0, self.state_slots, draining=wid in self.draining) for wid in ids]

    def check(self, processor: object) -> None:
        if not isinstance(processor, RayProcessor):
            raise TypeError(f"{type(processor).__name__} does not run on the Ray workers")

    # -- the engine step on an actor -------------------------------------------------------------------

    def _engine_step(self, worker_id: int, active: Sequence[tuple[LiveStream, StepOrder, np.ndarray | None]],
                     evict: Sequence[LiveStream], restore: Sequence[LiveStream],
                     drop: Sequence[LiveStream]) -> list[list[np.ndarray]]:
        for stream in (*(s for s, _, _ in active), *evict, *restore):
            self._place(_ray_id(stream), worker_id)
        orders = tuple(ChunkOrder(_ray_id(stream), order.point.config, inputs, _processor(stream).camera)
                       if inputs is not None else ChunkOrder(_ray_id(stream)) for stream, order, inputs in active)
        call = StepCall(orders, tuple(_ray_id(s) for s in evict), tuple(_ray_id(s) for s in restore),
                        self.delay_s + self.worker_delays_s.get(worker_id, 0.0), self.step_delay_s,
                        tuple(_ray_id(s) for s in drop))
        streams = [s for s, _, _ in active]
        if self._moved_away(worker_id, streams):
            raise StreamMovedError(f"streams moved away from worker {worker_id}")
        try:
            outcome = self.controller.run_step(worker_id, call)
        except RayTaskError:
            # Moved between the check and the call, or being moved: the source refuses a frozen state
            # while the move is still in flight, so wait for it to settle before asking where it went.
            if self._moved_away(worker_id, streams, settle=True):
                raise StreamMovedError(f"streams moved away from worker {worker_id}") from None
            raise
        self.forwards += outcome.forwards
        return [outcome.finished.get(order.stream_id, []) for order in orders]

    def _moved_away(self, worker_id: int, streams: Sequence[LiveStream], settle: bool = False) -> bool:
        home = self.controller.settled_home if settle else self.controller.home
        for stream in streams:
            try:
                if home(_ray_id(stream)) != worker_id:
                    return True
            except ClusterError:
                continue  # closed: its session is ending
        return False

    def _place(self, ray_id: int, worker_id: int) -> None:
        """Engine thread: the stream's state is on ``worker_id`` before its step (a move the policy
        ordered finishes first; a new stream moves from where the factory opened it)."""
        move = self._moves.get(ray_id)
        if move is not None:
            move.exception()  # waits; a failed move was logged, the stream stays where it is
        if ray_id not in self._placed and self.controller.home(ray_id) != worker_id:
            self.controller.migrate(ray_id, worker_id)
        self._placed.add(ray_id)

    def _complete(self, work: Work, seconds: float, exc: BaseException | None) -> None:
        if isinstance(exc, RayActorError | ClusterError) and work.worker_id not in self.controller.worker_ids:
            # The worker died under the step: the controller re-admitted its streams, ``poll`` moves them.
            self.wakeup.set()
            return
        if isinstance(exc, StreamMovedError) and self.core is not None:
            # An operator moved a stream away under the step: the policy follows it, the rest go again.
            self.core.step_lost(work.worker_id)
            self._follow(self.core)
            self.core.kick(work.worker_id)
            self.wakeup.set()
            return
        super()._complete(work, seconds, exc)

    # -- re-homing --------------------------------------------------------------------------------------

    def rehome(self, move: Rehome) -> float:
        """Move the stream's state to ``move.dst`` now (a chunk boundary); its next step waits for it."""
        stream = self.streams.get(move.stream_id)
        if stream is None:
            return 0.0
        ray_id = _ray_id(stream)
        previous = self._moves.get(ray_id)
        self._moves[ray_id] = self._move_pool.submit(self._migrate, ray_id, move, previous)
        return move.residual_s

    def _migrate(self, ray_id: int, move: Rehome, previous: Future[None] | None) -> None:
        if previous is not None:
            previous.exception()
        try:
            if self.controller.home(ray_id) != move.dst:
                stats = self.controller.migrate(ray_id, move.dst)
                with self._lock:
                    self.rehomes += 1
                self.note("rehome", move.stream_id, move.dst, src=move.src, hold_ms=round(1000 * stats.hold_s, 1))
                log.info("policy re-homed stream %d: worker %d -> %d (hold %.0f ms)", move.stream_id, move.src,
                         move.dst, 1000 * stats.hold_s)
        except Exception:
            log.exception("re-homing stream %d to worker %d failed; it stays where it is", move.stream_id, move.dst)

    # -- worker failures ------------------------------------------------------------------------------

    def _on_recovery(self, recovery: Recovery) -> None:
        """Any thread: the controller recovered from a dead worker; the loop applies it at its next pass."""
        with self._lock:
            self._recoveries.append(recovery)

    def poll(self) -> None:
        core = self.core
        if core is None:
            return
        self._recover(core)
        self._follow(core)
        self._join()

    # -- the autoscaler's worker pool -------------------------------------------------------------------

    def pending_workers(self) -> int:
        return self._starting

    def add_worker(self) -> None:
        self._starting += 1
        self.scale_events["up"] += 1
        self.note("scale-up", workers=len(self.views) + self._starting)
        future = self._scale_pool.submit(self.controller.add_workers, 1)
        future.add_done_callback(self._on_joined)

    def _on_joined(self, future: Future[list[int]]) -> None:
        with self._lock:
            self._joined.append(future)

    def _join(self) -> None:
        with self._lock:
            joined, self._joined = self._joined, []
        for future in joined:
            self._starting -= 1
            if future.exception() is not None:
                log.error("autoscaler: a new worker failed to start: %s", future.exception())
                continue
            known = [v.worker_id for v in self.views]
            self.views = self._live_views([*known, *(w for w in future.result() if w not in known)])
            self.wakeup.set()

    def set_draining(self, worker_id: int, draining: bool) -> None:
        (self.draining.add if draining else self.draining.discard)(worker_id)
        self.views = self._live_views([v.worker_id for v in self.views])
        if draining:
            self.note("drain", worker=worker_id)

    def remove_worker(self, worker_id: int) -> None:
        """The policy no longer places anything there; the actor stops once the moves off it are done."""
        self.views = [v for v in self.views if v.worker_id != worker_id]
        self.draining.discard(worker_id)
        self.scale_events["down"] += 1
        self.note("scale-down", worker=worker_id, workers=len(self.views))
        moves = list(self._moves.values())

        def stop() -> None:
            wait(moves)
            try:
                self.controller.remove_worker(worker_id)
            except ClusterError as exc:
                log.error("autoscaler: worker %d not removed: %s", worker_id, exc)

        self._scale_pool.submit(stop)

    def _follow(self, core: EngineCore) -> None:
        """Streams moved outside the policy: the policy's view follows the controller's placement."""
        placement = self.controller.placement()
        running = core.running()
        for stream in self.streams.values():
            ray_id = _ray_id(stream)
            move = self._moves.get(ray_id)
            if ray_id not in self._placed or stream.sid in running or (move is not None and not move.done()):
                continue
            home = placement.get(ray_id)
            entry = core.ledger.entries.get(stream.sid)
            if home is not None and entry is not None and entry.worker != home:
                stream.in_engine.clear()
                core.moved(stream.sid, home)

    def _recover(self, core: EngineCore) -> None:
        with self._lock:
            recoveries, self._recoveries = self._recoveries, []
        if not recoveries:
            return
        self.views = self._live_views(self.controller.worker_ids)
        by_ray = {_ray_id(s): s for s in self.streams.values()}
        for recovery in recoveries:
            homes: dict[int, int | None] = {}
            for ray_id, home in recovery.readmitted.items():
                stream = by_ray.get(ray_id)
                if stream is not None:
                    homes[stream.sid] = home
                    stream.in_engine.clear()
                    stream.ready, stream.taken = [], []
            lost = [by_ray[r] for r in recovery.lost if r in by_ray]
            for stream in lost:
                homes[stream.sid] = None
            core.worker_lost(recovery.worker_id, homes)
            for sid, new_home in homes.items():
                self.note("readmit" if new_home is not None else "lost", sid, new_home, src=recovery.worker_id)
            for stream in lost:
                self.streams.pop(stream.sid, None)
                stream.on_failure(ClusterError(f"worker {recovery.worker_id} died and no worker is left"))
            log.warning("policy moved streams %s of dead worker %d to their new homes", sorted(homes),
                        recovery.worker_id)
        self.wakeup.set()


def _processor(stream: LiveStream) -> RayProcessor:
    processor = stream.runner.processor
    assert isinstance(processor, RayProcessor)
    return processor


def _ray_id(stream: LiveStream) -> int:
    return _processor(stream).stream_id
