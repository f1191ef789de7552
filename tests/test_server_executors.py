"""The engine core on the live server's in-process executor (hand-driven clock, real tiny engine).

Every observation the ledger receives (chunk ready times, playout cursor, pauses, prompt switches)
is computed here independently from the frames pushed and played; every engine result that the
policy's actions could disturb (eviction to host memory, preemption between denoising steps) is
compared with a twin stream that ran the same chunks undisturbed.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from app.server.config import ServerConfig
from app.server.media.frame_path import ChunkAssembler, Playout, StreamRunner
from app.server.serving.engine_bridge import StreamSettings
from app.server.serving.executors import AdmissionError, ServingLoop
from app.server.serving.serving_loop import build_serving_loop
from engine.fidelity import FidelityConfig


@pytest.fixture(scope="module")
def engine_factory() -> Any:
    """The tiny random-weight model whatever conftest picks: these tests need a model whose preset
    has 4 steps and the bundled tiny-random profile, and they are about scheduling, not pictures."""
    import torch

    from app.server.serving.engine_bridge import InProcessFactory

    torch.set_num_threads(1)
    return InProcessFactory.load("tiny-random")


FPS = 8.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Stream:
    """One stream on the loop, with what it was fed, the fidelity of each chunk and what came out."""

    def __init__(self, loop: ServingLoop, factory: Any, clock: FakeClock, executor: ThreadPoolExecutor,
                 steps: int = 2, seed: int = 0) -> None:
        self.settings = StreamSettings(steps=steps, seed=seed)
        self.sid = loop.admit(steps)
        self.processor = factory.open(self.settings)
        self.assembler = ChunkAssembler(capacity=self.processor.chunk_frames, clock=clock)
        self.playout = Playout(factory.size, self.processor.chunk_frames, max_fps=FPS, min_fps=FPS, clock=clock)
        self.runner = StreamRunner(self.processor, self.assembler, self.playout, executor, factory.size)
        self.size = factory.size
        self.chunks: list[np.ndarray] = []  # inputs, chunk by chunk, as the engine took them (at its size)
        self.configs: list[FidelityConfig] = []
        self.outputs: list[np.ndarray] = []
        self.rng = np.random.default_rng(1000 + seed)
        set_fidelity, chunk_inputs = self.processor.set_fidelity, self.runner.chunk_inputs

        def record_fidelity(config: FidelityConfig) -> None:
            self.configs.append(config)
            set_fidelity(config)

        def record_inputs(frames: Any, config: FidelityConfig | None = None) -> np.ndarray:
            inputs = chunk_inputs(frames, config)
            self.chunks.append(inputs)
            return inputs

        self.processor.set_fidelity = record_fidelity
        self.runner.chunk_inputs = record_inputs
        deliver = self.runner.deliver

        def record_output(frames: Any, out: np.ndarray) -> None:
            self.outputs.append(out)
            deliver(frames, out)

        self.runner.deliver = record_output
        loop.attach(self.sid, self.runner, self.playout)

    def push(self, n: int) -> None:
        for _ in range(n):
            self.assembler.push(self.rng.integers(0, 255, (self.size[1], self.size[0], 3), dtype=np.uint8))

    def twin_outputs(self, factory: Any) -> list[np.ndarray]:
        """The same chunks at the same fidelity through a fresh stream that nothing disturbed."""
        twin = factory.open(self.settings)
        outs = []
        for config, chunk in zip(self.configs, self.chunks, strict=False):
            twin.set_fidelity(config)
            twin.sizes(self.size, config)  # as the server asks: the stream's size from its camera's
            outs.append(twin.process(chunk))
        return outs


async def settle(loop: ServingLoop) -> None:
    """One pass of the loop, then wait until the engine has no step in flight, nor a reset after a faulty
    chunk (no chunk of that stream is taken until the engine has reset it: app/server/media/frame_path.py)."""
    loop.run_once()
    for _ in range(5000):
        if not loop.core.jobs and not loop.executor._resets:
            return
        await asyncio.sleep(0.002)
    raise AssertionError("the engine did not finish its work")


@pytest.fixture
def executor() -> Any:
    pool = ThreadPoolExecutor(max_workers=1)
    yield pool
    pool.shutdown(wait=True)


def make_loop(factory: Any, executor: ThreadPoolExecutor, clock: FakeClock, **config: Any) -> ServingLoop:
    return build_serving_loop(ServerConfig(model="tiny-random", max_fps=FPS, **config), factory, executor, clock)


async def test_executor_feeds_ledger_chunk_times_and_cursor(engine_factory: Any, executor: ThreadPoolExecutor) -> None:
    clock = FakeClock()
    loop = make_loop(engine_factory, executor, clock)
    # A profile whose first chunks take 0.2 s, so the slack arithmetic below has room (hand clock), and
    # no step batch, so every chunk's frames come out in the chunk's own step.
    loop.core.calibrate = False
    policy = loop.policy
    policy = type(policy)(policy.profile.filtered(lambda c: not c.step_batch), policy.config)
    loop.core.policy = policy.rescaled(0.2 / policy.reference.first_chunk_latency_s)
    s0 = loop.policy.initial_slack_s
    assert s0 == pytest.approx(0.8)
    a = Stream(loop, engine_factory, clock, executor)
    tracker = loop.core.ledger.entries[a.sid].tracker

    await settle(loop)
    assert not a.outputs  # no input yet: nothing ran
    a.push(1)  # the first chunk is one frame
    clock.now = 0.5
    await settle(loop)
    assert tracker.log == [("chunk", 0.5, 1 / FPS)]
    assert tracker.slack(0.5) == pytest.approx(1 / FPS + s0 - 0.5)
    assert a.playout.buffered == 1 and len(a.outputs) == 1
    assert a.configs[0].steps <= 2  # the user's step count is the ceiling

    clock.now = 0.6
    a.playout.tick()  # the one frame is played: cursor 1/8 s
    a.push(4)
    clock.now = 0.9
    await settle(loop)
    assert tracker.log[-1] == ("chunk", 0.9, 4 / FPS)
    clock.now = 1.0
    a.playout.tick()
    a.playout.tick()  # 3 frames have left the buffer, 2 wait
    a.push(4)
    clock.now = 1.2
    await settle(loop)  # reports the cursor (3 frames = 0.375 s), then the chunk is ready
    assert tracker.log[-1] == ("chunk", 1.2, 4 / FPS)
    assert tracker.cursor(1.2) == pytest.approx(3 / FPS)
    assert tracker.slack(1.2) == pytest.approx(9 / FPS - 3 / FPS)
    assert tracker.stalls == []

    a.runner.pause()
    assert tracker.paused
    a.runner.resume()
    assert not tracker.paused
    await a.runner.update(prompt="pencil sketch")  # prompt switch: slack reset, old output not played
    assert tracker.epoch == 1 and a.playout.buffered == 0
    assert tracker.slack(1.2) == pytest.approx(s0)

    stats = loop.stats(a.sid)
    assert stats["policy_chunks"] == 3 and stats["chunk_steps"] == a.configs[-1].steps == stats["fidelity_steps"]
    # Whatever the policy picked, the engine ran it and the chunk came back at the stream's size.
    assert all(out.shape == (4, a.size[1], a.size[0], 3) for out in a.outputs[1:])
    loop.remove(a.sid)
    assert a.sid not in loop.core.ledger.entries  # forgotten: a server running for days keeps no closed streams


async def test_more_streams_than_state_slots_evicts_and_restores_bit_identically(
    engine_factory: Any, executor: ThreadPoolExecutor
) -> None:
    clock = FakeClock()
    loop = make_loop(engine_factory, executor, clock, state_slots=1, policy="fifo")
    a = Stream(loop, engine_factory, clock, executor, steps=1, seed=1)
    b = Stream(loop, engine_factory, clock, executor, steps=1, seed=2)
    for k in range(5):
        for s in (a, b):
            s.push(1 if k == 0 else 4)
        clock.now += 1.0
        await settle(loop)
        await settle(loop)  # turns: both streams ran one chunk
        assert len(a.outputs) == len(b.outputs) == k + 1
    counters = loop.counters()
    # One slot: every turn parks the other stream's state in host memory and brings its own back.
    assert counters["evictions"] >= 8 and counters["restores"] >= 7, counters
    assert a.processor.offloaded != b.processor.offloaded
    for s in (a, b):
        for got, want in zip(s.outputs, s.twin_outputs(engine_factory), strict=True):
            np.testing.assert_array_equal(got, want)
    # The two streams are different stylisations, not one copied to both.
    assert not np.array_equal(a.outputs[-1], b.outputs[-1])


async def test_an_urgent_stream_preempts_a_relaxed_one_between_denoising_steps(
    engine_factory: Any, executor: ThreadPoolExecutor
) -> None:
    clock = FakeClock()
    # Reference fidelity for every chunk (no BMPR), so a newcomer's credit is 3 chunk times (NORMAL).
    loop = build_serving_loop(ServerConfig(model="tiny-random", max_fps=2.0, policy="credit-only"), engine_factory,
                              executor, clock)
    # The hand-driven clock measures no real time: calibrating to a loaded machine's wall time would
    # change the tiers this test sets up (it failed that way beside other jobs).
    loop.core.calibrate = False
    a = Stream(loop, engine_factory, clock, executor, steps=4, seed=3)
    a.push(1)
    await settle(loop)
    a.push(4)
    await settle(loop)  # a's slack is now far ahead of its playout (2 s of content, clock not moving)
    loop.core.tick()
    assert loop.stats(a.sid)["tier"] == "relaxed"
    a.push(4)
    loop.run_once()  # a's third chunk starts: its first step is on the engine now
    assert a.configs[-1].steps > 1 and loop.core.jobs
    b = Stream(loop, engine_factory, clock, executor, steps=4, seed=4)  # a newcomer, tighter on slack
    b.push(1)
    for _ in range(20):
        await settle(loop)
    assert loop.counters()["preemptions"] >= 1
    assert len(a.outputs) == 3 and len(b.outputs) == 1
    # The parked half-done chunk resumed exactly where it stopped.
    for got, want in zip(a.outputs, a.twin_outputs(engine_factory), strict=True):
        np.testing.assert_array_equal(got, want)


async def test_streams_with_one_point_share_a_batched_forward(engine_factory: Any, executor: ThreadPoolExecutor) -> None:
    clock = FakeClock()
    loop = make_loop(engine_factory, executor, clock, max_batch=2)
    a = Stream(loop, engine_factory, clock, executor, steps=1, seed=5)
    b = Stream(loop, engine_factory, clock, executor, steps=1, seed=6)
    for k in range(3):
        for s in (a, b):
            s.push(1 if k == 0 else 4)
        clock.now += 0.1
        await settle(loop)
        await settle(loop)
    batches = [loop.core.stats[s.sid].batch for s in (a, b)]
    assert batches == [2, 2], batches
    assert loop.executor.forwards < 2 * 3  # fewer forwards than chunks: rows shared forwards
    for s in (a, b):
        for got, want in zip(s.outputs, s.twin_outputs(engine_factory), strict=True):
            # Batching never mixes streams; a batched matmul may round one grey level differently.
            assert np.abs(got.astype(int) - want.astype(int)).max() <= 1


async def test_admission_refuses_a_stream_whose_first_chunk_would_be_late(
    engine_factory: Any, executor: ThreadPoolExecutor
) -> None:
    clock = FakeClock()
    loop = make_loop(engine_factory, executor, clock, engine_step_delay_ms=200)
    admitted = 0
    with pytest.raises(AdmissionError, match="first chunk would be ready in"):
        for _ in range(50):
            clock.now += 0.01  # streams arriving one after another, none has input yet
            Stream(loop, engine_factory, clock, executor)
            admitted += 1
    # Every admitted stream's next chunk is queued ahead of a newcomer; the initial slack covers a few.
    assert 1 <= admitted < 50
    assert loop.counters()["admissions_refused"] == 1


async def test_a_config_the_engine_cannot_run_ends_only_that_stream(
    engine_factory: Any, executor: ThreadPoolExecutor
) -> None:
    clock = FakeClock()
    loop = make_loop(engine_factory, executor, clock)
    # A profile from some other engine: a 2-frame KV window cannot hold this engine's 3 sink frames.
    alien = FidelityConfig(steps=1, kv_window_frames=2, precision="fp32")
    policy = loop.core.policy
    loop.core.policy = type(policy)(replace(policy.profile, points=tuple(replace(p, config=alien) for p in policy.profile.points[:1])),
                                    policy.config)
    a = Stream(loop, engine_factory, clock, executor)
    failures: list[BaseException] = []
    loop.streams[a.sid].on_failure = failures.append
    a.push(1)
    await settle(loop)
    await asyncio.sleep(0.05)
    assert len(failures) == 1 and "kv_window_frames=2" in str(failures[0])
    assert a.sid not in loop.streams and a.sid not in loop.core.ledger.entries


async def test_policy_recalibrates_toward_the_measured_engine_speed(
    engine_factory: Any, executor: ThreadPoolExecutor
) -> None:
    """The mechanism, not a number: a profile claiming a 100x faster engine is corrected upward, and a
    profile claiming a 100x slower one downward (measured times on a loaded box move, the direction doesn't)."""
    for factor, direction in ((0.01, 1), (100.0, -1)):
        clock = FakeClock()
        loop = make_loop(engine_factory, executor, clock, max_batch=1)
        policy = loop.core.policy
        loop.core.policy = policy.rescaled(factor)
        claimed = loop.core.policy.reference.latency_s
        a = Stream(loop, engine_factory, clock, executor, steps=1)
        for i in range(8):
            a.push(1 if i == 0 else 4)
            clock.now += 1.0
            await settle(loop)
        assert (loop.core.applied_ratio - 1.0) * direction > 0, loop.core.applied_ratio
        assert (loop.core.policy.reference.latency_s - claimed) * direction > 0
        loop.remove(a.sid)


async def test_batched_steps_raise_the_calibration_and_never_lower_it(
    engine_factory: Any, executor: ThreadPoolExecutor
) -> None:
    """A batch the profile did not measure is estimated at its streams' times added up, an upper
    bound, so its measured ratio is a lower bound on the engine's speed ratio. Streams that only ever
    run in batches must still correct a profile that claims a 100x faster engine (before, the core
    observed single-stream steps only and stayed at the claim), and must not lower the estimate of
    a profile that claims a 100x slower one (the bound says nothing there)."""
    for factor, expect_raised in ((0.01, True), (100.0, False)):
        clock = FakeClock()
        loop = make_loop(engine_factory, executor, clock, max_batch=2)
        loop.core.policy = loop.core.policy.rescaled(factor)
        claimed = loop.core.policy.reference.latency_s
        a = Stream(loop, engine_factory, clock, executor, steps=1)
        b = Stream(loop, engine_factory, clock, executor, steps=1, seed=1)
        for i in range(8):
            a.push(1 if i == 0 else 4)
            b.push(1 if i == 0 else 4)
            clock.now += 1.0
            await settle(loop)
        labels = list(loop.core.fidelity_counts)
        assert labels and all(label.endswith("/b2") for label in labels), loop.core.fidelity_counts
        if expect_raised:
            assert loop.core.applied_ratio > 1.0 and loop.core.policy.reference.latency_s > claimed
        else:
            assert loop.core.applied_ratio == 1.0 and loop.core.policy.reference.latency_s == claimed
        loop.remove(a.sid)
        loop.remove(b.sid)


async def test_simulator_and_live_server_run_the_same_engine_core(
    engine_factory: Any, executor: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One loop: the core's own dispatch and update run under both executors (no second runner)."""
    from engine.serving.core import EngineCore
    from engine.serving.policy import SlackPolicy, resolve_preset
    from engine.serving.profile import bundled_profile
    from engine.sim.simulator import SimConfig, Simulator
    from engine.sim.workload import EventKind, TraceEvent

    seen: dict[str, set[str]] = {}
    for name in ("_dispatch", "step_done", "arrive", "tick"):
        original = getattr(EngineCore, name)

        def spy(self: EngineCore, *args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            seen.setdefault(type(self.executor).__name__, set()).add(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(EngineCore, name, spy)
    profile = bundled_profile("tiny-random_cpu_128")
    events = [TraceEvent(0.0, EventKind.ARRIVE, 0, frames=33, fps=profile.fps)]
    Simulator(SlackPolicy(profile, resolve_preset("slackserve")), profile, events, SimConfig(workers=1, nodes=1)).run()
    clock = FakeClock()
    loop = make_loop(engine_factory, executor, clock)
    a = Stream(loop, engine_factory, clock, executor)
    a.push(1)
    await settle(loop)
    assert a.outputs
    assert seen["Simulator"] == seen["StepExecutor"] == {"_dispatch", "step_done", "arrive", "tick"}


async def test_step_batch_point_runs_one_forward_per_chunk_with_sequential_results(
    engine_factory: Any, executor: ThreadPoolExecutor
) -> None:
    """StreamDiffusionV2's stream batch as a fidelity point: a chunk's 2 steps share forwards with the
    next chunk's, one forward per chunk, the frames come out one chunk later, equal to sequential."""
    clock = FakeClock()
    loop = make_loop(engine_factory, executor, clock, policy="fifo")
    loop.core.calibrate = False  # this test sets the policy's profile by hand
    policy = loop.core.policy
    base = next(p for p in policy.profile.points if p.config.steps == 2 and p.config.resolution_scale == 1.0
                and p.config.precision == "fp32")
    batched = replace(base, config=replace(base.config, step_batch=True))
    loop.core.policy = type(policy)(replace(policy.profile, points=(batched,)), policy.config)
    a = Stream(loop, engine_factory, clock, executor, steps=2, seed=7)
    chunks, forwards = 12, []
    for k in range(chunks):
        a.push(1 if k == 0 else 4)
        clock.now += 0.5
        await settle(loop)
        forwards.append(loop.executor.forwards)
    assert all(c.step_batch and c.steps == 2 for c in a.configs)
    assert len(a.outputs) == chunks - 1  # the newest chunk is still half-way through the step batch
    # Once both step caches hold a full window (same fill level), one forward per chunk carries both
    # chunks' steps; before that the two rows run as two forwards, as in StreamBatch.
    assert np.diff(forwards)[-4:].tolist() == [1, 1, 1, 1], forwards
    sequential = [replace(c, step_batch=False) for c in a.configs]
    twin = engine_factory.open(a.settings)
    for config, chunk, got in zip(sequential, a.chunks, a.outputs, strict=False):
        twin.set_fidelity(config)
        want = twin.process(chunk)
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
    # Leaving the step batch: the chunk in flight finishes first, then chunks run step by step again.
    loop.core.policy = type(policy)(replace(policy.profile, points=(base,)), policy.config)
    a.push(4)
    clock.now += 0.5
    await settle(loop)
    assert len(a.outputs) == chunks + 1


async def test_a_live_stream_downshifts_resolution_when_its_worker_fills_up(
    engine_factory: Any, executor: ThreadPoolExecutor
) -> None:
    """A live stream's chunk gets its share of the worker (live_load x chunk duration / live streams on
    it): alone it runs the best point; with three more streams on the worker that point no longer fits
    and the engine really runs the stream at a lower resolution."""
    clock = FakeClock()
    loop = make_loop(engine_factory, executor, clock)
    loop.core.calibrate = False  # the hand-driven clock measures no real time
    policy = loop.policy
    top = policy.top_point(4)
    share_alone = policy.live_share_s(1)
    # The best point takes 0.4 of a lone stream's share: it fits alone, not in a quarter of it.
    loop.core.policy = policy.rescaled(0.4 * share_alone / top.latency_s)
    top = loop.policy.top_point(4)
    a = Stream(loop, engine_factory, clock, executor, steps=4, seed=8)
    a.push(1)
    await settle(loop)
    assert a.configs[-1].resolution_scale == 1.0 and loop.core.stats[a.sid].point.quality == top.quality
    others = [Stream(loop, engine_factory, clock, executor, steps=4, seed=20 + i) for i in range(3)]
    assert top.latency_s > loop.policy.live_share_s(4)
    a.push(4)
    clock.now += 1.0
    await settle(loop)
    chosen = a.configs[-1]
    assert chosen.resolution_scale < 1.0 and loop.core.stats[a.sid].point.quality < top.quality
    assert loop.core.stats[a.sid].point.latency_s <= max(loop.policy.live_share_s(4),
                                                          min(p.latency_s for p in loop.policy.profile.per_stream()))
    state = a.processor._stream.state
    assert state.engine_size == loop.executor.streams[a.sid].runner.processor._stream.runtime.engine_size(
        state.size, chosen)  # the engine really ran the smaller size
    assert loop.stats(a.sid)["reduced_resolution_chunks"] == 1
    for other in others:
        other.runner.pause()  # paused cameras take no share: the stream goes back to the best point
    a.push(4)
    clock.now += 1.0
    await settle(loop)
    assert a.configs[-1].resolution_scale == 1.0


async def test_two_lanes_run_two_streams_side_by_side_with_undisturbed_results() -> None:
    """Each lane is a worker of the core: the two streams are homed on different lanes, both lanes'
    steps are dispatched at once, and every chunk equals a fresh stream's run of the same chunks (to
    float rounding: a lane's step runs on its share of the threads, which orders the sums differently)."""
    from app.server.serving.engine_bridge import InProcessFactory
    from engine.streaming.lanes import EngineLanes

    single = InProcessFactory.load("tiny-random")
    factory = InProcessFactory(single.pipeline, EngineLanes(2, 2))
    clock = FakeClock()
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        loop = make_loop(factory, pool, clock, policy="fifo")
        assert [w.worker_id for w in loop.executor.worker_views()] == [0, 1]
        a = Stream(loop, factory, clock, pool, steps=1, seed=5)
        b = Stream(loop, factory, clock, pool, steps=1, seed=6)
        homes = {loop.core.ledger.entries[s.sid].worker for s in (a, b)}
        assert homes == {0, 1}
        for k in range(4):
            for s in (a, b):
                s.push(1 if k == 0 else 4)
            clock.now += 1.0
            loop.run_once()
            assert sorted(loop.core.jobs) == [0, 1]  # one step on each lane, at once
            await settle(loop)
        assert len(a.outputs) == len(b.outputs) == 4
        for s in (a, b):
            for got, want in zip(s.outputs, s.twin_outputs(single), strict=True):
                diff = np.abs(got.astype(int) - want.astype(int))
                assert diff.max() <= 1 and (diff > 0).mean() < 1e-3
        assert np.abs(a.outputs[-1].astype(int) - b.outputs[-1].astype(int)).mean() > 5
    finally:
        pool.shutdown(wait=True)


async def test_device_memory_bounds_resident_states_and_refuses_when_none_fit(
    engine_factory: Any, executor: ThreadPoolExecutor
) -> None:
    """A device memory budget (``--device-memory-gib``, on a CPU here; the GPU's free memory on CUDA)
    becomes state slots: room for one state parks the other stream between its chunks (bit-identical
    after), and room for none refuses at admission with a reason, never a failure mid-stream."""
    from engine.serving.device_memory import GIB, USABLE_SHARE

    free, weights = engine_factory.device_memory()
    assert free is None, "a CPU engine has no device budget of its own"
    state = max(p.state_bytes for p in make_loop(engine_factory, executor, FakeClock()).policy.profile.per_stream())
    assert state > 0
    one = (weights + 1.5 * state / USABLE_SHARE) / GIB  # room for one state and a half
    clock = FakeClock()
    loop = make_loop(engine_factory, executor, clock, device_memory_gib=one, policy="fifo")
    assert [v.state_slots for v in loop.executor.worker_views()] == [1]
    a = Stream(loop, engine_factory, clock, executor, steps=1, seed=1)
    b = Stream(loop, engine_factory, clock, executor, steps=1, seed=2)
    for k in range(3):
        for s in (a, b):
            s.push(1 if k == 0 else 4)
        clock.now += 1.0
        await settle(loop)
        await settle(loop)
    assert loop.counters()["evictions"] >= 4
    assert a.processor.offloaded != b.processor.offloaded, "two states resident with room for one"
    for s in (a, b):
        for got, want in zip(s.outputs, s.twin_outputs(engine_factory), strict=True):
            np.testing.assert_array_equal(got, want)

    none = (weights + 0.5 * state / USABLE_SHARE) / GIB
    full = make_loop(engine_factory, executor, FakeClock(), device_memory_gib=none)
    with pytest.raises(AdmissionError, match="device memory is full"):
        full.admit()
    with pytest.raises(ValueError, match="device-memory-gib"):
        ServerConfig(device_memory_gib=float("nan"))
