"""Frame path units: latest-frames-win assembly, bounded playout, engine-thread runner."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import cv2
import numpy as np
import pytest
from _output_checks import assert_undistorted, circles_clip

from app.server.config import ServerConfig
from app.server.media.frame_path import (
    ChunkAssembler,
    FrameMeta,
    InputFrame,
    Playout,
    StreamRunner,
    _reformatter,
    fit_frame,
    frame_rgb,
    to_rgb,
    yuv420p_planes,
    yuv_frame,
)
from app.server.media.framecode import MAX_ID, draw_id, read_id
from app.server.serving.engine_bridge import EngineKind, StreamSettings
from app.server.serving.executors import RankExecutor, ServingLoop, StepExecutor
from app.server.serving.serving_loop import build_serving_loop
from engine.aspect import StreamSizes, fit_size


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_assembler_keeps_newest_frames_and_counts_drops() -> None:
    clock = FakeClock()
    assembler = ChunkAssembler(capacity=4, clock=clock)
    for i in range(10):
        clock.now = i / 30
        assembler.push(np.full((2, 2, 3), i, np.uint8))
    await assembler.wait(4)
    chunk = assembler.take(4)
    assert [f.meta.seq for f in chunk] == [6, 7, 8, 9]
    assert assembler.dropped == 6 and assembler.received == 10


def test_assembler_backlog_keeps_a_late_frame_for_the_next_chunk_and_bounds_the_delay() -> None:
    """With a backlog of one frame: a chunk taken a frame late is the oldest four (chunks follow one
    another frame by frame) and the fifth starts the next chunk, nothing dropped; further behind, the
    oldest frames go, so at most one frame waits after a take; a smaller take (the 1-frame first
    chunk) drops what lies beyond its own backlog."""
    clock = FakeClock()
    assembler = ChunkAssembler(capacity=4, clock=clock, backlog=1)
    for i in range(5):
        assembler.push(np.full((2, 2, 3), i, np.uint8))
    assert [f.meta.seq for f in assembler.take(4)] == [0, 1, 2, 3] and assembler.dropped == 0
    assert not assembler.ready(4) and assembler.ready(1)
    for i in range(5, 8):
        assembler.push(np.full((2, 2, 3), i, np.uint8))
    assert [f.meta.seq for f in assembler.take(4)] == [4, 5, 6, 7] and assembler.dropped == 0

    for i in range(8, 18):  # the engine falls 10 frames behind: only a chunk and the backlog stay
        assembler.push(np.full((2, 2, 3), i, np.uint8))
    assert assembler.dropped == 5
    assert [f.meta.seq for f in assembler.take(4)] == [13, 14, 15, 16] and assembler.ready(1)
    assert [f.meta.seq for f in assembler.take(1)] == [17] and assembler.received == 18 and assembler.dropped == 5

    first = ChunkAssembler(capacity=4, backlog=1)
    for i in range(5):
        first.push(np.full((2, 2, 3), i, np.uint8))
    assert [f.meta.seq for f in first.take(1)] == [3] and first.dropped == 3 and first.ready(1)
    with pytest.raises(ValueError, match="backlog >= 0"):
        ChunkAssembler(capacity=4, backlog=-1)


async def test_assembler_waits_for_new_frames() -> None:
    assembler = ChunkAssembler(capacity=5)
    assembler.push(np.zeros((2, 2, 3), np.uint8))
    waiter = asyncio.ensure_future(assembler.wait(2))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    with pytest.raises(RuntimeError, match="only 1 frames"):
        assembler.take(2)
    assembler.push(np.zeros((2, 2, 3), np.uint8))
    await asyncio.wait_for(waiter, 1)
    assert [f.meta.seq for f in assembler.take(2)] == [0, 1]
    assert not assembler.ready(1)
    with pytest.raises(ValueError, match="does not fit"):
        await assembler.wait(6)


def test_playout_is_bounded_and_repeats_when_starved() -> None:
    clock = FakeClock()
    assembler = ChunkAssembler(capacity=4, clock=clock)
    playout = Playout((4, 4), chunk_frames=4, max_fps=30, min_fps=2, clock=clock)
    metas = [assembler.push(np.zeros((4, 4, 3), np.uint8)) for _ in range(20)]
    images = np.arange(20, dtype=np.uint8)[:, None, None, None] * np.ones((1, 4, 4, 3), np.uint8)
    for start in range(0, 20, 4):  # five chunks arrive at once: only 3 chunks may stay buffered
        playout.push_chunk(images[start : start + 4], metas[start : start + 4])
    assert playout.dropped == 8
    shown = []
    for _ in range(14):
        clock.now += 0.05
        playout.tick()
        shown.append(int(playout._current.image[0, 0, 0]))
    assert shown[:12] == list(range(8, 20))  # oldest surviving first, in order
    assert shown[12:] == [19, 19] and playout.repeats == 2
    assert playout.slack_s == 0


def test_playout_clock_follows_production_rate() -> None:
    clock = FakeClock()
    playout = Playout((4, 4), chunk_frames=4, max_fps=30, min_fps=2, clock=clock)
    frame = np.zeros((4, 4, 4, 3), np.uint8)
    meta = [ChunkAssembler(4, clock).push(frame[0]) for _ in range(4)]
    for i in range(30):  # 4 frames every 0.4 s = 10 fps
        clock.now = 0.4 * i
        playout.push_chunk(frame, meta)
        for _ in range(4):
            playout.tick()
    assert playout.interval == pytest.approx(0.1, rel=0.05)


async def test_a_chunk_landing_in_an_empty_buffer_is_shown_without_waiting_for_the_clock() -> None:
    # The playout's own clock is fake: a tick "due" in 100 fake seconds is a real 100 s wait, so only
    # a chunk landing can end the wait in time, and the tick times returned are the fake clock's.
    clock = FakeClock()
    playout = Playout((4, 4), chunk_frames=4, max_fps=10, min_fps=10, clock=clock)  # interval 0.1 s
    chunk = np.zeros((4, 4, 4, 3), np.uint8)
    metas = [ChunkAssembler(4, clock).push(chunk[0]) for _ in range(4)]

    async def lands_at(when: float, due: float) -> float:
        waiting = asyncio.ensure_future(playout._next_tick(0.0, due))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # an empty buffer and nothing landed: the clock's tick is awaited
        clock.now = when
        playout.push_chunk(chunk, metas)
        tick_at = await asyncio.wait_for(waiting, 10.0)
        for _ in range(4):
            playout.tick()
        return tick_at

    assert await lands_at(0.07, due=100.0) == pytest.approx(0.07)  # at once: the last frame was up 0.07 s
    clock.now = 0.0
    assert await lands_at(0.02, due=100.0) == pytest.approx(0.05)  # the frame before stays up half an interval
    # A buffer that still holds frames keeps the clock's phase: the tick is the one that was due.
    playout.push_chunk(chunk, metas)
    clock.now = 0.0
    assert await asyncio.wait_for(playout._next_tick(0.0, 0.05), 10.0) == 0.05
    assert playout.early_tick(shown=1.0, due=1.1, landed=1.2) == 1.1  # never later than the clock


def test_reused_converters_match_a_frames_own_conversion_both_ways() -> None:
    import av

    rng = np.random.default_rng(0)
    converters = []
    for size in ((64, 48), (160, 96), (64, 48)):  # streams of two sizes on one thread
        image = cv2.GaussianBlur(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), (15, 15), 0)
        frame = yuv_frame(image)
        converters.append(_reformatter("yuv420p", "rgb24", *size))
        assert frame.format.name == "yuv420p" and (frame.width, frame.height) == size
        own = av.VideoFrame.from_ndarray(image, format="rgb24").reformat(format="yuv420p")
        # OpenCV's planes (BT.601, limited range, as swscale's): luma within one level of swscale's own,
        # chroma (a 2x2 average where swscale filters) within a few.
        diff = np.abs(frame.to_ndarray().astype(int) - own.to_ndarray())
        assert diff[: size[1]].max() <= 1 and diff[size[1] :].max() <= 4 and diff[size[1] :].mean() < 1
        rgb = frame_rgb(frame)
        np.testing.assert_array_equal(rgb, frame.to_ndarray(format="rgb24"))
        assert np.abs(rgb.astype(int) - image).mean() < 6  # the picture survives (4:2:0 chroma, rounding)
    # Each size keeps its own converter (one converter would rebuild its swscale context at every switch).
    assert converters[0] is converters[2] and converters[0] is not converters[1]
    odd = cv2.GaussianBlur(rng.integers(0, 256, (47, 63, 3), dtype=np.uint8), (15, 15), 0)
    frame = yuv_frame(odd)  # 4:2:0 cannot halve an odd side: swscale's frame, as av makes it
    own = av.VideoFrame.from_ndarray(odd, format="rgb24").reformat(format="yuv420p")
    assert (frame.width, frame.height) == (63, 47)
    np.testing.assert_array_equal(frame.to_ndarray(format="rgb24"), own.to_ndarray(format="rgb24"))
    with pytest.raises(ValueError, match="even sides"):
        yuv420p_planes(odd)


class Negate:
    """Independent, checkable stand-in for the model in this unit test: out = 255 - in."""

    first_chunk_frames = 1
    chunk_frames = 4

    def __init__(self, size: tuple[int, int] = (8, 8)) -> None:
        self.size = size  # the stream's, and the engine's at every fidelity
        self.updates: list[dict[str, Any]] = []

    def process(self, frames: np.ndarray) -> np.ndarray:
        return 255 - frames

    def sizes(self, camera: tuple[int, int], config: Any = None) -> StreamSizes:
        return StreamSizes(self.size, self.size)

    def update(self, **changes: Any) -> None:
        self.updates.append(changes)

    def reset(self) -> None:
        pass


class ChunkFactory:
    """An engine of whole chunks (`EngineKind.CHUNK_BATCHES`) around one test processor: each chunk of a
    batch through its ``process``."""

    kind = EngineKind.CHUNK_BATCHES
    parallel_chunks = 1
    pipeline = None
    loras: list[dict[str, Any]] = []

    def __init__(self, size: tuple[int, int], processor: Any) -> None:
        self.size = size
        self.processor = processor

    def device_memory(self) -> tuple[int | None, int]:
        return None, 0

    def open(self, settings: Any) -> Any:
        return self.processor

    def unsupported(self, config: Any) -> str | None:
        return None

    def run_chunks(self, chunks: Any) -> list[np.ndarray]:
        return [processor.process(frames) for processor, frames, _ in chunks]


def _serve(runner: StreamRunner, playout: Playout, size: tuple[int, int], executor: ThreadPoolExecutor) -> Any:
    """The engine core's loop with the whole-chunk executor (a processor behind ``process``), FIFO turns."""
    loop: ServingLoop = build_serving_loop(ServerConfig(policy="fifo"), ChunkFactory(size, runner.processor), executor)
    loop.attach(loop.admit(), runner, playout)
    return asyncio.ensure_future(loop.run())


async def test_runner_first_chunk_then_steady_chunks_with_trace_stamp() -> None:
    size = (64, 48)
    assembler = ChunkAssembler(capacity=4)
    playout = Playout(size, chunk_frames=4, max_fps=30, min_fps=2)
    processor = Negate(size)
    with ThreadPoolExecutor(1) as executor:
        runner = StreamRunner(processor, assembler, playout, executor, size, trace_stamp=True)
        task = _serve(runner, playout, size, executor)
        for i in range(5):
            image = np.full((96, 128, 3), 40, np.uint8)  # twice the engine size: resized on the way in
            draw_id(image, 100 + i)
            assembler.push(image)
            await asyncio.sleep(0.02)
        for _ in range(100):
            if runner.chunks == 2:
                break
            await asyncio.sleep(0.01)
        frames = list(playout._buffer)
        await runner.update(prompt="x")
        task.cancel()
    assert runner.chunks == 2 and processor.updates == [{"prompt": "x"}]
    assert playout.buffered == 0  # a prompt switch drops the old prompt's buffered output
    assert [f.meta.seq for f in frames if f.meta] == [0, 1, 2, 3, 4]
    for i, out in enumerate(frames):
        assert out.image.shape == (48, 64, 3)
        assert read_id(out.image) == 100 + i  # band copied from the input
        assert abs(int(out.image[-1, -1, 0]) - (255 - 40)) <= 1  # the rest is the model's output


def test_fit_frame_centre_crops() -> None:
    image = np.zeros((100, 200, 3), np.uint8)
    image[:, 50:150] = 255  # the centre square
    out = fit_frame(image, (10, 10))
    assert out.shape == (10, 10, 3) and out.min() == 255


def test_a_large_camera_frame_is_scaled_in_one_pass_like_rgb_then_area_resize() -> None:
    from engine.embedded.clips import heldout_specs, render_clip

    texture = render_clip(heldout_specs(frames=1)[0])[0]  # a photograph, 256x256
    for camera, size in (((640, 480), (288, 224)), ((1280, 720), (288, 224)), ((640, 480), (336, 192)),
                         ((480, 640), (224, 288)), ((576, 448), (288, 224))):
        frame = yuv_frame(cv2.resize(texture, camera, interpolation=cv2.INTER_CUBIC))
        out = to_rgb(frame, size)
        # The independent path: the whole frame in RGB, centre-cropped, OpenCV's area resize.
        reference = fit_frame(frame_rgb(frame), size)
        assert out.shape == reference.shape == (size[1], size[0], 3)
        mse = np.mean((out.astype(float) - reference.astype(float)) ** 2)
        psnr = 10 * np.log10(255.0**2 / mse)
        across = np.mean((out[:, 1:].astype(float) - reference[:, :-1].astype(float)) ** 2)
        down = np.mean((out[1:].astype(float) - reference[:-1].astype(float)) ** 2)
        assert psnr > 35 and mse * 2 < min(across, down), (camera, size, psnr)  # the same picture, not a pixel off
    # The same size and upscales keep the RGB-first path exactly.
    for camera in ((288, 224), (256, 256)):
        frame = yuv_frame(cv2.resize(texture, camera))
        np.testing.assert_array_equal(to_rgb(frame, (288, 224)), fit_frame(frame_rgb(frame), (288, 224)))


def test_framecode_roundtrip_and_guard() -> None:
    image = np.full((128, 128, 3), 128, np.uint8)
    assert read_id(image) is None
    for value in (0, 1, 5461, MAX_ID - 1):
        draw_id(image, value)
        assert read_id(image) == value


async def test_runner_pause_stops_feeding_the_engine() -> None:
    size = (8, 8)
    assembler = ChunkAssembler(capacity=4)
    playout = Playout(size, chunk_frames=4, max_fps=30, min_fps=2)
    with ThreadPoolExecutor(1) as executor:
        runner = StreamRunner(Negate(), assembler, playout, executor, size)
        task = _serve(runner, playout, size, executor)
        runner.pause()
        for _ in range(8):
            assembler.push(np.zeros((8, 8, 3), np.uint8))
        await asyncio.sleep(0.1)
        assert runner.chunks == 0 and runner.paused and assembler.dropped == 0
        runner.resume()
        assembler.push(np.zeros((8, 8, 3), np.uint8))  # first chunk: 1 frame
        for _ in range(100):
            if runner.chunks:
                break
            await asyncio.sleep(0.01)
        task.cancel()
    assert runner.chunks == 1 and assembler.received == 9


def test_the_executor_follows_the_engine_kind_a_factory_declares() -> None:
    """No probing: the kind a factory declares picks the executor, and a kind the factory cannot back
    (chunk batches without ``run_chunks``, Ray workers without a cluster) is refused at once."""

    class Steps(ChunkFactory):
        kind = EngineKind.IN_PROCESS
        parallel_chunks = 3

    class Claims(ChunkFactory):
        kind = EngineKind.RAY

    with ThreadPoolExecutor(1) as pool:
        assert isinstance(build_serving_loop(ServerConfig(), ChunkFactory((64, 48), Negate((64, 48))), pool).executor,
                          RankExecutor)
        steps = build_serving_loop(ServerConfig(), Steps((64, 48), Negate((64, 48))), pool).executor
        assert isinstance(steps, StepExecutor) and len(steps.views) == 3
        with pytest.raises(TypeError, match="Ray workers are a RayFactory's"):
            build_serving_loop(ServerConfig(), Claims((64, 48), Negate((64, 48))), pool)


async def test_no_chunk_is_taken_until_the_engine_has_reset_the_stream() -> None:
    """A reset's first chunk is one frame: taken before the engine thread reset the processor, it entered
    a stream that still expected four ("this chunk needs 4 frames, got 1") and ended it."""
    size = (8, 8)
    assembler = ChunkAssembler(capacity=8)
    playout = Playout(size, chunk_frames=4, max_fps=30, min_fps=2)
    entered = threading.Event()
    release = threading.Event()

    class SlowReset(Negate):
        def reset(self) -> None:
            entered.set()
            release.wait(10)

    with ThreadPoolExecutor(1) as executor:
        runner = StreamRunner(SlowReset(), assembler, playout, executor, size)
        assert runner.next_chunk() is None
        assembler.push(np.zeros((8, 8, 3), np.uint8))
        assert len(runner.next_chunk() or []) == 1  # the stream's first chunk
        for _ in range(5):
            assembler.push(np.zeros((8, 8, 3), np.uint8))
        reset = asyncio.ensure_future(runner.reset())
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
        assert not runner.has_chunk() and runner.next_chunk() is None  # the engine has not reset yet
        release.set()
        await reset
        assert len(runner.next_chunk() or []) == 1  # after it: a fresh stream's one-frame first chunk


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_a_frame_is_resized_once_each_way_at_any_resolution_scale(
        engine_factory: Any, scale: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4:3 camera's frames through the runner and the real engine at resolution scale 1 and 0.5: each
    frame is resized once on the way in (camera -> the chunk's engine size, cropped and resized in one
    go) and, below scale 1, once on the way out (engine size -> the stream's size); nothing in the
    engine resizes again. The output is the stream's size the engine picked from the camera's aspect,
    follows the camera's picture undistorted, and carries each input frame's ID."""
    from dataclasses import replace

    from engine.streaming.step_processor import StepRow, run_step

    resized: list[tuple[tuple[int, ...], tuple[int, int]]] = []  # (source shape, target size) of each frame
    resize = cv2.resize

    def counting(image: np.ndarray, size: tuple[int, int], *args: Any, **kwargs: Any) -> np.ndarray:
        if image.ndim == 3 and image.shape[2] == 3:  # a frame (the stabilizer's flow fields are not)
            resized.append((image.shape, tuple(size)))
        return resize(image, size, *args, **kwargs)

    camera = (320, 240)
    clip = circles_clip(camera, 9)
    for i, image in enumerate(clip):
        draw_id(image, 40 + i)
    processor = engine_factory.open(StreamSettings(prompt="oil painting", steps=1))
    config = replace(processor.fidelity(), resolution_scale=scale)
    playout = Playout(engine_factory.size, chunk_frames=4, max_fps=30, min_fps=2)
    runner = StreamRunner(processor, ChunkAssembler(capacity=4), playout, ThreadPoolExecutor(1), engine_factory.size,
                          trace_stamp=True)
    monkeypatch.setattr(cv2, "resize", counting)
    outputs, counts = [], []
    for frames in (clip[:1], clip[1:5], clip[5:9]):
        resized.clear()
        inputs = runner.chunk_inputs([InputFrame(f, FrameMeta(0, 0.0)) for f in frames], config)
        finished: list[np.ndarray] = []
        while not finished:
            done, _ = run_step([StepRow(processor, config, inputs)])
            finished = done[0]
            inputs_entered, inputs = inputs, None
        outputs.append(runner.chunk_outputs(inputs_entered, finished[0]))
        counts.append(len(resized) / len(frames))
    monkeypatch.undo()
    stream = runner.size
    engine = processor.sizes(camera, config).engine
    assert stream == fit_size(camera, engine_factory.size[0] * engine_factory.size[1], 16)
    assert (engine == stream) == (scale == 1.0)
    assert counts == [1.0 if scale == 1.0 else 2.0] * 3, counts  # in, and out below scale 1
    output = np.concatenate(outputs)
    assert output.shape == (9, stream[1], stream[0], 3)
    assert [read_id(frame) for frame in output] == [40 + i for i in range(9)]
    if engine_factory.size == (256, 256):  # the default model: a stylisation of the camera's picture
        assert_undistorted(output[1:], clip[1:], moving=False)
