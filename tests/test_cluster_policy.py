"""The serving policy drives 2 real Ray worker actors live (`diffcast serve --ray --workers 2 --policy slack`).

One local Ray cluster on loopback (tiny-random, CPU, one torch thread per actor); worker 0 is slowed by
``--worker-delay-ms``. Three streams fed from in-process camera sources at a fixed frame rate: streams
1 and 3 land on worker 0 and share its single state slot (so it parks one in host memory and brings it
back every turn), stream 2 on worker 1 leaves early. The policy then finds worker 0's streams urgent
(their measured chunks are late) and worker 1 free, and re-homes one; finally worker 1 is SIGKILLed and
its stream is re-admitted on worker 0 and keeps playing.

Every chunk the actors ran (its input frames, the fidelity the policy gave it, the frames that came
back) is recorded at the controller's seam and replayed through an independent stream in this process
(`engine.pipeline`, never the cluster code): moved, parked and restored states must give bit-identical
frames to a stream that never moved or parked.

Last, three workers, the third slowed, six streams (two per worker): the live re-homing rule, by
measured per-worker speed, moves the slow worker's streams to the others.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import torch

from app.server.config import ServerConfig
from app.server.media.frame_path import ChunkAssembler, Playout, StreamRunner
from app.server.serving.engine_bridge import InProcessFactory, RayFactory, StreamSettings
from app.server.serving.executors import ServingLoop
from app.server.serving.serving_loop import build_serving_loop
from engine.aspect import fit_frame, fit_size, scaled_size
from engine.cluster.controller import ClusterConfig, ClusterController
from engine.cluster.worker import ChunkOrder, StepCall, StepOutcome
from engine.fidelity import FidelityConfig
from engine.pipeline import StreamParams
from engine.serving.live import bundled_live_profile
from engine.serving.snapshot import Rehome, TickPlan

FPS = 8.0
SLOW_MS = 400.0  # worker 0's extra latency per chunk: two streams there cannot keep up
# Every wait ends at its event; the deadline only bounds a failure, generous for a loaded 2-core box.
WAIT_S = 120.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterController]:
    # A killed worker's ping fails at once; the long timeout only keeps a loaded box's slow ping from
    # being taken for a hung worker (which is then killed, its streams lost).
    config = ClusterConfig(model="tiny-random", workers=2, threads_per_worker=1, health_interval_s=0.5,
                           health_timeout_s=30.0, object_store_mb=200)
    controller = ClusterController.start(config)
    controller.start_monitor()
    yield controller
    controller.shutdown()


class Recorder:
    """Wraps ``ClusterController.run_step``: every chunk each Ray stream ran, in order."""

    def __init__(self, controller: ClusterController) -> None:
        # (fidelity, frames, the camera's size) of every chunk that entered, by stream.
        self.chunks: dict[int, list[tuple[FidelityConfig, np.ndarray, tuple[int, int] | None]]] = {}
        self.outputs: dict[int, list[np.ndarray]] = {}
        self.workers: dict[int, list[int]] = {}  # the worker of each chunk that entered
        run_step = controller.run_step

        def recorded(worker_id: int, call: StepCall) -> StepOutcome:
            outcome = run_step(worker_id, call)
            for order in call.orders:
                if order.frames is not None:
                    assert order.config is not None
                    self.chunks.setdefault(order.stream_id, []).append((order.config, order.frames, order.camera))
                    self.workers.setdefault(order.stream_id, []).append(worker_id)
            for sid, finished in outcome.finished.items():
                self.outputs.setdefault(sid, []).extend(finished)
            return outcome

        controller.run_step = recorded  # type: ignore[method-assign]


class Camera:
    """One stream on the loop, fed random frames at ``FPS`` by an in-process source."""

    def __init__(self, loop: ServingLoop, factory: RayFactory, pool: ThreadPoolExecutor, seed: int,
                 camera: tuple[int, int] | None = None) -> None:
        self.settings = StreamSettings(steps=2, seed=seed)
        self.sid = loop.admit(self.settings.steps)
        self.processor = factory.open(self.settings)
        self.ray_id = self.processor.stream_id  # type: ignore[attr-defined]
        self.assembler = ChunkAssembler(capacity=4 * self.processor.chunk_frames)
        self.playout = Playout(factory.size, self.processor.chunk_frames, max_fps=FPS, min_fps=FPS)
        self.runner = StreamRunner(self.processor, self.assembler, self.playout, pool, factory.size)
        self.failures: list[BaseException] = []
        self.rng = np.random.default_rng(seed)
        self.size = camera or factory.size  # of its frames
        loop.attach(self.sid, self.runner, self.playout, on_failure=self.failures.append)
        self.tasks = [asyncio.create_task(self._feed()), asyncio.create_task(self.playout.run())]

    async def _feed(self) -> None:
        while True:
            self.assembler.push(self.rng.integers(0, 256, (self.size[1], self.size[0], 3), dtype=np.uint8))
            await asyncio.sleep(1 / FPS)

    def stop(self) -> None:
        for task in self.tasks:
            task.cancel()


async def wait_for(condition: Any, what: str, timeout_s: float = WAIT_S, streams: Sequence[Camera] = ()) -> None:
    """Until ``condition()``; a failure of one of ``streams`` ends the wait with its error."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        failed = [f for s in streams for f in s.failures]
        assert not failed, f"a stream failed while waiting for {what}: {failed!r}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def twin_outputs(local: InProcessFactory, settings: StreamSettings,
                 chunks: list[tuple[FidelityConfig, np.ndarray, tuple[int, int] | None]]) -> list[np.ndarray]:
    """The same chunks at the same fidelity through a fresh local stream that never moved or parked, sized
    from the same camera."""
    twin = local.open(settings)
    outs = []
    for config, frames, camera in chunks:
        twin.set_fidelity(config)  # type: ignore[attr-defined]
        if camera is not None:
            twin.sizes(camera, config)
        outs.append(twin.process(frames))
    return outs


async def test_a_ray_stream_is_resized_once_each_way_at_a_lower_rung(cluster: ClusterController,
                                                                    tmp_path: Path) -> None:
    """Every rung at x0.5: the server resizes each camera frame straight to the rung's engine size, the
    worker's stream takes its size from the camera's (which goes with the chunk), and the frames come
    back at that size after one resize there, stylized: the frames of an in-process stream fed the
    same chunks, neither black nor the input."""
    torch.set_num_threads(1)  # the actors run one thread each: same reduction order for the twin here
    recorder = Recorder(cluster)
    factory = RayFactory(cluster)
    profile = bundled_live_profile("tiny-random", factory.size)
    half = replace(profile, points=tuple(p for p in profile.points if p.config.resolution_scale == 0.5))
    half.save(tmp_path / "half.json")
    config = ServerConfig(model="tiny-random", max_fps=FPS, policy="slack", profile=str(tmp_path / "half.json"))
    pool = ThreadPoolExecutor(max_workers=2)
    loop = build_serving_loop(config, factory, pool)
    runner = asyncio.create_task(loop.run())
    camera = (300, 200)  # 3:2 -> a 144x96 stream, whose x0.5 rung is 64x48 (4:3: a stream of 144x112)
    granularity = int(cluster.info.size_granularity)
    stream = fit_size(camera, factory.size[0] * factory.size[1], granularity)
    engine = scaled_size(stream, 0.5, granularity)
    a = Camera(loop, factory, pool, seed=4, camera=camera)
    try:
        await wait_for(lambda: len(recorder.outputs.get(a.ray_id, [])) >= 3 and a.playout.frames_shown > 4,
                       "three chunks", streams=(a,))
    finally:
        a.stop()
        cluster.close(a.ray_id)
        runner.cancel()
        pool.shutdown(wait=False)
    chunks, outs = recorder.chunks[a.ray_id], recorder.outputs[a.ray_id]
    assert stream == (144, 96) and engine == (64, 48) and a.runner.size == stream
    assert all(c.resolution_scale == 0.5 and f.shape[1:] == (engine[1], engine[0], 3) and cam == camera
               for c, f, cam in chunks)
    assert all(out.shape[1:] == (stream[1], stream[0], 3) for out in outs)
    local = InProcessFactory.load("tiny-random")
    for (_, frames, _), got, want in zip(chunks, outs, twin_outputs(local, a.settings, chunks[: len(outs)]),
                                         strict=False):
        np.testing.assert_array_equal(got, want)
        assert got.std() > 10 and np.abs(got[-1].astype(float) - fit_frame(frames[-1], stream)).mean() > 10


async def test_policy_rehomes_off_a_slow_worker_parks_states_and_survives_a_killed_worker(
    cluster: ClusterController,
) -> None:
    torch.set_num_threads(1)  # the actors run one thread each: same reduction order for the twin here
    local = InProcessFactory.load("tiny-random")
    recorder = Recorder(cluster)
    factory = RayFactory(cluster)
    config = ServerConfig(model="tiny-random", max_fps=FPS, policy="slack", max_batch=1, state_slots=1,
                          worker_delay_ms=(SLOW_MS, 0.0))
    pool = ThreadPoolExecutor(max_workers=2)
    loop = build_serving_loop(config, factory, pool)
    assert loop.policy.config.rehoming  # two workers: the slack preset re-homes
    runner = asyncio.create_task(loop.run())
    a, b, c = (Camera(loop, factory, pool, seed) for seed in (1, 2, 3))
    placement = {s.sid: loop.core.ledger.entries[s.sid].worker for s in (a, b, c)}
    assert placement == {a.sid: 0, b.sid: 1, c.sid: 0}  # the policy's admission: fewest streams first
    try:
        # Worker 0: two streams, one state slot: it parks one and restores it every turn. Worker 1 has no
        # free slot while stream 2 is there, so nothing can move before this.
        await wait_for(lambda: b.playout.frames_shown > 4, "stream 2 to play", streams=(a, b, c))
        await wait_for(lambda: loop.counters()["evictions"] >= 1 and loop.counters()["restores"] >= 1,
                       "worker 0 to park and restore a state", streams=(a, b, c))
        b.stop()
        loop.remove(b.sid)  # worker 1 is free now (the session's end closes its Ray stream too)
        cluster.close(b.ray_id)
        # The slow worker's streams fall behind and the policy moves one to worker 1.
        await wait_for(lambda: loop.executor.rehomes >= 1, "a policy re-home", streams=(a, c))
        moved = next(s for s in (a, c) if cluster.placement()[s.ray_id] == 1)
        stayed = a if moved is c else c
        assert loop.core.ledger.entries[moved.sid].worker == 1
        assert recorder.workers[moved.ray_id][0] == 0
        shown = moved.playout.frames_shown
        await wait_for(lambda: 1 in recorder.workers[moved.ray_id] and moved.playout.frames_shown > shown + 8,
                       "the moved stream to play on worker 1", streams=(a, c))

        # SIGKILL the worker the moved stream now lives on: it is re-admitted on worker 0 and plays on.
        # Its chunks that finished before the kill continue its first state; a chunk in flight at the
        # kill is lost, and the next output is from the fresh re-admitted state.
        finished_before_kill = len(recorder.outputs[moved.ray_id])
        pid = ray.get(cluster.actor(1).info.remote()).pid
        os.kill(pid, signal.SIGKILL)
        await wait_for(lambda: len(cluster.recoveries) == 1, "the worker's death to be detected", streams=(a, c))
        [recovery] = cluster.recoveries
        assert recovery.readmitted == {moved.ray_id: 0}
        await wait_for(lambda: loop.core.ledger.entries[moved.sid].worker == 0, "the policy to follow",
                       streams=(a, c))
        shown = moved.playout.frames_shown
        await wait_for(lambda: moved.playout.frames_shown > shown + 8, "the re-admitted stream to play",
                       streams=(a, c))
        assert not moved.failures and not stayed.failures
    finally:
        for s in (a, b, c):
            s.stop()
            cluster.close(s.ray_id)
        runner.cancel()
        pool.shutdown(wait=False)

    # Moved and parked states gave the frames of a stream that never moved or parked (the comparison can
    # fail: a restarted or foreign state gives other frames). The re-admitted stream restarted fresh, so
    # only its chunks finished before the kill are compared (chunks finish in order, one output each).
    for stream in (moved, stayed):
        chunks = recorder.chunks[stream.ray_id]
        outs = recorder.outputs[stream.ray_id]
        if stream is moved:
            outs = outs[:finished_before_kill]
            assert 1 in recorder.workers[stream.ray_id][: len(outs)]  # chunks that ran after the move count
        assert len(outs) >= 3
        for got, want in zip(outs, twin_outputs(local, stream.settings, chunks[: len(outs)]), strict=True):
            np.testing.assert_array_equal(got, want)
    assert not np.array_equal(recorder.outputs[a.ray_id][1], recorder.outputs[c.ray_id][1])


def test_a_parked_stream_survives_its_workers_death_bit_identically(cluster: ClusterController) -> None:
    """Re-admission keeps the state where a copy exists: the policy parked the stream (evicted to host
    memory), its worker is SIGKILLed, and it goes on from the controller's copy on another worker with
    the frames of a stream that never parked or moved (a fresh restart would give other frames)."""
    torch.set_num_threads(1)
    local = InProcessFactory.load("tiny-random")
    if len(cluster.worker_ids) < 2:
        cluster.add_workers(2 - len(cluster.worker_ids))
    src, dst = cluster.worker_ids[:2]
    settings = StreamSettings(steps=2, seed=7)
    twin = local.open(settings)
    config = twin.fidelity()  # type: ignore[attr-defined]
    params = StreamParams(prompt=settings.prompt, noise_scale=settings.noise_scale, steps=settings.steps, seed=7)
    cluster.open(901, params, worker_id=src)
    rng = np.random.default_rng(7)
    size = local.size

    def chunk(n: int) -> np.ndarray:
        return rng.integers(0, 256, (n, size[1], size[0], 3), dtype=np.uint8)

    def run(frames: np.ndarray, worker: int, restore: tuple[int, ...] = ()) -> np.ndarray:
        outcome = cluster.run_step(worker, StepCall((ChunkOrder(901, config, frames),), restore=restore))
        while not outcome.finished[901]:
            outcome = cluster.run_step(worker, StepCall((ChunkOrder(901),)))
        [out] = outcome.finished[901]
        return out

    for n in (1, 4, 4):
        frames = chunk(n)
        np.testing.assert_array_equal(run(frames, src), twin.process(frames))
    cluster.run_step(src, StepCall((), evict=(901,)))  # parked; the controller keeps the copy
    pid = ray.get(cluster.actor(src).info.remote()).pid
    deaths = len(cluster.recoveries)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + WAIT_S
    while len(cluster.recoveries) == deaths:
        assert time.monotonic() < deadline, "the worker's death was not detected"
        time.sleep(0.1)
    assert cluster.recoveries[-1].readmitted[901] == dst
    for _ in range(2):
        frames = chunk(4)
        np.testing.assert_array_equal(run(frames, dst, restore=(901,)), twin.process(frames))
    cluster.close(901)


async def test_live_streams_move_off_a_worker_slower_than_its_peers(cluster: ClusterController) -> None:
    """`serve --ray --workers 3 --worker-delay-ms 0,0,400` with six streams: every live stream is URGENT
    (it cannot get ahead of its camera), so SlackServe's receivers (workers without URGENT streams)
    never exist and nothing moved. The live rule compares the workers' measured speeds: the slow
    worker's streams move to the others within a few ticks of its speed being known, and none ever
    moves onto it."""
    if len(cluster.worker_ids) < 3:
        cluster.add_workers(3 - len(cluster.worker_ids))
    fast_a, fast_b, slow = cluster.worker_ids[:3]
    factory = RayFactory(cluster)
    config = ServerConfig(model="tiny-random", max_fps=FPS, policy="slack", worker_delay_ms=(0.0, 0.0, SLOW_MS))
    pool = ThreadPoolExecutor(max_workers=3)
    loop = build_serving_loop(config, factory, pool)
    ticks: list[tuple[float | None, tuple[Rehome, ...]]] = []  # the slow worker's speed as planned with, moves
    tick = loop.core.tick

    def recorded() -> TickPlan:
        plan = tick()
        ticks.append((loop.core.worker_speed(slow), plan.rehomes))
        return plan

    loop.core.tick = recorded  # type: ignore[method-assign]
    runner = asyncio.create_task(loop.run())
    cams = [Camera(loop, factory, pool, seed) for seed in range(11, 17)]
    try:
        homes = [loop.core.ledger.entries[s.sid].worker for s in cams]
        assert sorted(homes) == sorted([fast_a, fast_b, slow] * 2)  # admission: fewest streams first
        on_slow = [s for s, home in zip(cams, homes, strict=True) if home == slow]
        await wait_for(lambda: loop.counters()["rehomes"] >= 1, "a re-home off the slow worker", streams=cams)
        moved = [s for s in on_slow if cluster.placement()[s.ray_id] != slow]
        assert moved, "the re-home was not off the slow worker"
        shown = {s.sid: s.playout.frames_shown for s in moved}
        await wait_for(lambda: all(s.playout.frames_shown > shown[s.sid] + 8 for s in moved),
                       "the moved streams to play on their new workers", streams=cams)
        assert not any(s.failures for s in cams)
    finally:
        for s in cams:
            s.stop()
            cluster.close(s.ray_id)
        runner.cancel()
        pool.shutdown(wait=False)
    moves = [m for _, plan in ticks for m in plan]
    assert all(m.src == slow and m.dst != slow for m in moves), moves
    # Bounded: the first tick that knew the slow worker's speed, or the few after it while its streams
    # turned URGENT, planned the move (ticks, not seconds: a loaded box slows the steps, not the rule).
    known = next(i for i, (speed, _) in enumerate(ticks) if speed is not None)
    first_move = next(i for i, (_, plan) in enumerate(ticks) if plan)
    assert first_move - known <= 4, ticks[known : first_move + 1]
    assert loop.counters()["rehomes"] == loop.executor.rehomes <= 2  # the slow worker had two streams
