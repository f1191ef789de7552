"""The stage timer (engine/streaming/stage_timer.py): stage boundaries marked in order, times resolved
lazily from the marks (no wait while a chunk runs), and the runtime's stages timed through it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from _runtime_fixtures import clip, fidelity, tiny_runtime

import engine.streaming.runtime as runtime_module
from engine.streaming.deblock import DeblockConfig
from engine.streaming.runtime import StreamRuntime
from engine.streaming.stage_timer import Mark, StageTimer, StageTimings, WallMark

CPU = torch.device("cpu")


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class FakeDevice:
    """A device queue: events complete only once the host waited on them or on a later one, and their
    elapsed time is only defined then (as with CUDA: ``elapsed_time`` on a pending event fails)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.recorded: list[FakeEvent] = []
        self.done_upto = -1
        self.waits = 0


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.index = -1
        self.t = 0.0

    def record(self) -> None:
        self.index = len(self.device.recorded)
        self.t = self.device.clock()
        self.device.recorded.append(self)

    def synchronize(self) -> None:
        self.device.waits += 1
        self.device.done_upto = max(self.device.done_upto, self.index)

    def elapsed_time(self, end: Mark) -> float:
        assert isinstance(end, FakeEvent)
        if max(self.index, end.index) > self.device.done_upto:
            raise RuntimeError("event not completed")
        return (end.t - self.t) * 1000.0


def test_boundaries_give_each_stage_its_span_and_sum_to_the_whole_chunk() -> None:
    clock = FakeClock()
    timer = StageTimer(CPU, lambda: WallMark(clock))
    assert timer.last() == StageTimings()  # nothing finished yet
    timer.start()
    for name, seconds in (("entered", 0.25), ("denoised", 1.5)):
        clock.t += seconds
        timer.boundary(name)
    clock.t += 0.5
    with timer.span():  # deblocking inside decoding
        clock.t += 0.125
    clock.t += 0.375
    timer.boundary("decoded")
    clock.t += 2.0
    timer.boundary("end")
    got = timer.last()
    assert got == StageTimings(encode_s=0.25, dit_s=1.5, decode_s=0.875, deblock_s=0.125, stabilize_s=2.0)
    assert got.total_s == pytest.approx(clock.t - 100.0)


def test_a_boundary_out_of_order_or_outside_a_chunk_is_refused() -> None:
    timer = StageTimer(CPU)
    with pytest.raises(RuntimeError, match="no chunk is open"):
        timer.boundary("entered")
    timer.start()
    with pytest.raises(ValueError, match="'entered' comes next"):
        timer.boundary("decoded")


def test_times_are_resolved_on_read_with_one_wait_on_the_last_mark() -> None:
    clock = FakeClock()
    device = FakeDevice(clock)
    timer = StageTimer(CPU, lambda: FakeEvent(device))
    for chunk in range(2):
        timer.start()
        for name in ("entered", "denoised", "decoded", "end"):
            clock.t += 1.0
            timer.boundary(name)
        assert device.waits == 0, "a chunk's marks made the host wait while it ran"
        if chunk == 0:
            continue  # the first chunk's times are never read: they are dropped, never waited for
        assert timer.last() == StageTimings(encode_s=1.0, dit_s=1.0, decode_s=1.0, stabilize_s=1.0)
        assert device.waits == 1 and device.done_upto == len(device.recorded) - 1  # on the end mark only
        timer.last()
        assert device.waits == 1  # resolved once


def test_a_span_outside_a_chunk_records_nothing() -> None:
    clock = FakeClock()
    device = FakeDevice(clock)
    timer = StageTimer(CPU, lambda: FakeEvent(device))
    with timer.span():  # the serving path decodes stage by stage, with no chunk open
        pass
    assert device.recorded == []


def _slowed(clock: FakeClock, seconds: float, call: Callable[..., object]) -> Callable[..., object]:
    def slow(*args: object, **kwargs: object) -> object:
        out = call(*args, **kwargs)
        clock.t += seconds
        return out
    return slow


def test_the_runtime_times_each_stage_of_its_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stage of run_chunks made to take a known time on a hand-moved clock (after its real work):
    the timings name exactly those times, deblocking apart from decoding, and sum to the chunk."""
    rt = tiny_runtime(deblock=DeblockConfig())
    clock = FakeClock()
    rt.timer = StageTimer(CPU, lambda: WallMark(clock))
    state = rt.open("s", "oil painting", (32, 32), fidelity(steps=2))
    for name, seconds in (("enter_chunks", 1.0), ("run_to_end", 2.0), ("decode_chunks", 4.0),
                          ("finish_frames", 8.0)):
        monkeypatch.setattr(rt, name, _slowed(clock, seconds, getattr(rt, name)))
    monkeypatch.setattr(runtime_module, "deblock", _slowed(clock, 0.5, runtime_module.deblock))
    for frames in clip(2):
        start = clock.t
        rt.run_chunk(state, frames)
        assert rt.last_timings == StageTimings(encode_s=1.0, dit_s=2.0, decode_s=4.0, deblock_s=0.5, stabilize_s=8.0)
        assert rt.last_timings.total_s == clock.t - start


def test_the_runtime_marks_nothing_when_a_chunk_runs_stage_by_stage() -> None:
    """The serving path (enter, denoise, finish as separate calls) records no marks at all: no event per
    chunk to keep, nothing to wait on."""
    rt = tiny_runtime(deblock=DeblockConfig())
    device = FakeDevice(FakeClock())
    rt.timer = StageTimer(CPU, lambda: FakeEvent(device))
    state = rt.open("s", "oil painting", (32, 32), fidelity(steps=1))
    for frames in clip(2):
        chunk = rt.enter_chunk(state, frames)
        rt.run_to_end([chunk])
        rt.finish_chunk(chunk)
    assert device.recorded == []


def _runtime_on_cuda() -> StreamRuntime:
    rt = tiny_runtime()
    rt.dit.cuda()
    rt.vae.cuda()  # type: ignore[attr-defined]
    return StreamRuntime(rt.dit, rt.vae, rt.prompts, rt.preset, rt.config)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_chunk_makes_no_device_wide_sync_and_its_stages_fit_its_wall_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rt = _runtime_on_cuda()
    state = rt.open("s", "oil painting", (32, 32), fidelity(steps=2))
    syncs = []
    real = torch.cuda.synchronize
    for frames in clip(3):
        t0 = rt.clock()
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(a))
        rt.run_chunk(state, frames)
        monkeypatch.setattr(torch.cuda, "synchronize", real)
        wall = rt.clock() - t0
        timings = rt.last_timings
        assert syncs == []
        assert min(timings.encode_s, timings.dit_s, timings.decode_s) > 0
        assert timings.total_s <= wall
