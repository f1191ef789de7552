"""The per-stream frame path: bounded input, chunk assembly, engine thread, playout clock.

    camera frames ──push──▶ ChunkAssembler (holds at most a chunk and a small backlog of frames)
                               │ take(n) when the engine core dispatches the stream's next chunk
                               ▼
                           StreamRunner ──engine thread (app/server/serving/executors.py)──▶ the engine
                               │ deliver
                               ▼
                           Playout (bounded buffer) ──tick at the production rate──▶ output tracks

Delay cannot accumulate anywhere: the assembler drops the oldest frames once it holds a chunk and
its backlog while the engine is busy (counted as dropped), and the playout buffer holds at most a
few chunks (overflow is dropped too).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import av
import cv2
import numpy as np
from aiortc import MediaStreamTrack
from aiortc.mediastreams import MediaStreamError
from av.video.reformatter import VideoReformatter

from app.server.media.framecode import copy_band
from app.server.serving.engine_bridge import StreamProcessor
from engine.aspect import crop_box, fit_frame
from engine.fidelity import FidelityConfig

log = logging.getLogger(__name__)

Clock = Callable[[], float]
FPS_WINDOW_S = 2.0
LATENCY_WINDOW_S = 5.0

_local = threading.local()


MAX_CONVERTERS = 16  # per thread: a lane's streams at their camera sizes, odd-sized frames' yuv420p


def _reformatter(*conversion: object) -> VideoReformatter:
    """This thread's swscale converter for one ``conversion`` (target format, source format and size,
    target size), reused frame after frame. A frame's own ``reformat`` / ``to_ndarray(format=...)``
    builds a converter (with its slice threads) and frees it with the frame: 0.5 ms CPU per 256x256
    frame, and the freeing ran on the event loop. A converter rebuilds itself whenever its conversion
    changes, so a thread serving streams of different sizes keeps one per conversion. One slice
    thread: a camera frame is too small to split, and the split waits on threads the engine competes for."""
    converters: dict[tuple[object, ...], VideoReformatter] = _local.__dict__.setdefault("reformatters", {})
    converter = converters.get(conversion)
    if converter is None:
        if len(converters) >= MAX_CONVERTERS:  # sizes come and go with streams: start over
            converters.clear()
        converter = converters[conversion] = VideoReformatter()
    return converter


def frame_rgb(frame: av.VideoFrame) -> np.ndarray:
    """A decoded video frame as uint8 [H, W, 3] RGB."""
    converter = _reformatter("rgb24", frame.format.name, frame.width, frame.height)
    return converter.reformat(frame, format="rgb24", threads=1).to_ndarray()


def yuv_frame(image: np.ndarray) -> av.VideoFrame:
    """uint8 [H, W, 3] RGB as a yuv420p frame, the format aiortc's VP8 and H264 encoders take as it
    is (given RGB they convert it themselves, with a new converter per frame)."""
    if image.shape[0] % 2 or image.shape[1] % 2:
        converter = _reformatter("yuv420p", "rgb24", image.shape[1], image.shape[0])
        return converter.reformat(av.VideoFrame.from_ndarray(image, format="rgb24"), format="yuv420p", threads=1)
    return av.VideoFrame.from_ndarray(yuv420p_planes(image), format="yuv420p")


def yuv420p_planes(image: np.ndarray) -> np.ndarray:
    """uint8 [H, W, 3] RGB -> its yuv420p planes, uint8 [H * 3 / 2, W]: Y, then U, then V, as
    ``av.VideoFrame.to_ndarray`` lays out a yuv420p frame. OpenCV's BT.601 limited-range conversion,
    swscale's standard: luma within one level of swscale's, chroma within a few (a 2x2 average where
    swscale filters), and a decoder's RGB comes back as near to the image. 4x faster than swscale and its
    frame objects (0.05 against 0.22 ms at 256x256): the server converts every output frame on its
    event loop, and the benchmark's cameras every frame they send. ValueError for an odd side, which
    4:2:0 cannot halve (`yuv_frame` takes one: swscale rounds it)."""
    if image.shape[0] % 2 or image.shape[1] % 2:
        raise ValueError(f"yuv420p planes need even sides, got {image.shape[1]}x{image.shape[0]}")
    return cv2.cvtColor(np.ascontiguousarray(image), cv2.COLOR_RGB2YUV_I420)


async def video_frames(track: MediaStreamTrack) -> AsyncIterator[av.VideoFrame]:
    """The video frames a received track yields until it ends (audio frames skipped)."""
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            return
        if isinstance(frame, av.VideoFrame):
            yield frame


@dataclass(frozen=True)
class FrameMeta:
    seq: int  # per-stream input sequence number
    arrival: float  # time.monotonic() when the server received the frame


@dataclass(frozen=True)
class InputFrame:
    source: av.VideoFrame | np.ndarray  # decoded lazily on the engine thread
    meta: FrameMeta


class OutputFrame:
    """A frame the playout shows, shared by every consumer of the stream's output (the publisher's
    return track, each WHEP viewer, the recording, the WebSocket sender, any other output that reads
    ``Playout.next_frame``): the RGB image, and the yuv420p planes every video encoder takes, converted
    once for all of them by whichever asks first (on the event loop or a recording's thread), so V
    viewers cost one conversion per frame, not V + 1."""

    __slots__ = ("_lock", "_yuv", "image", "meta")

    def __init__(self, image: np.ndarray, meta: FrameMeta | None) -> None:
        self.image = image  # uint8 [H, W, 3] RGB
        self.meta = meta  # None for the placeholder shown before the first chunk
        self._yuv: np.ndarray | None = None
        self._lock = threading.Lock()

    def yuv420p(self) -> np.ndarray:
        """The frame's yuv420p planes, uint8 [H * 3 / 2, W] (Y, then U, then V; what
        ``av.VideoFrame.to_ndarray`` gives): converted at the first call, the same array after."""
        with self._lock:
            if self._yuv is None:
                self._yuv = yuv420p_planes(self.image)
            return self._yuv

    def video_frame(self) -> av.VideoFrame:
        """A new yuv420p frame of this one, for an encoder: a copy of the shared planes (no conversion),
        so each consumer stamps its own ``pts`` on its own frame."""
        return av.VideoFrame.from_ndarray(self.yuv420p(), format="yuv420p")


def to_rgb(source: av.VideoFrame | np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """A camera frame as uint8 [H, W, 3] RGB at ``size``: centre-cropped to its aspect, never stretched
    (engine/aspect.py). A decoded frame larger than that is converted and scaled down in one swscale
    pass (area filter) and only then cropped: at 640x480 -> 288x224 0.49 ms instead of 0.95 (RGB at
    the camera's size, then OpenCV's area resize), at 1280x720 0.71 instead of 1.85 (demos/bench_media.py)."""
    if isinstance(source, av.VideoFrame):
        x, y, crop_w, crop_h = crop_box((source.width, source.height), size)
        width, height = size
        if crop_w <= width or crop_h <= height:  # the same size, or up: RGB first, then OpenCV
            return fit_frame(frame_rgb(source), size)
        # The whole frame scaled so that its centred crop is exactly ``size``.
        scaled_w, scaled_h = round(source.width * width / crop_w), round(source.height * height / crop_h)
        converter = _reformatter("rgb24", source.format.name, source.width, source.height, scaled_w, scaled_h)
        scaled = converter.reformat(source, width=scaled_w, height=scaled_h, format="rgb24", interpolation="AREA",
                                    threads=1).to_ndarray()
        left, top = round(x * width / crop_w), round(y * height / crop_h)
        return scaled[top : top + height, left : left + width]  # a view: the chunk stacks (copies) it
    return fit_frame(source, size)


def decode_jpeg(data: bytes) -> np.ndarray:
    """JPEG bytes -> uint8 RGB; ValueError saying so when the bytes are not an image."""
    image = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), cv2.IMREAD_COLOR)
    if image is None:
        raise ValueError(f"binary message of {len(data)} bytes is not a JPEG/PNG image")
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


def encode_jpeg(image: np.ndarray, quality: int) -> bytes:
    ok, data = cv2.imencode(".jpg", cv2.cvtColor(image, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise RuntimeError("JPEG encoding failed")
    return data.tobytes()


class ChunkAssembler:
    """Input buffer: the frames received since the last take, at most ``capacity`` (the largest chunk)
    plus ``backlog``.

    A take gets the oldest frames, so chunks follow one another frame by frame, and leaves up to
    ``backlog`` newer ones to start the next chunk: an engine that comes for a chunk a frame or two
    late (its lane was running another stream's step) loses nothing, and catches up since the next
    chunk is that much nearer complete. Beyond that the newest frames win: the oldest are dropped, so
    delay stays bounded by ``backlog`` frames however far behind the engine falls."""

    def __init__(self, capacity: int, clock: Clock = time.monotonic, backlog: int = 0) -> None:
        if capacity < 1 or backlog < 0:
            raise ValueError(f"an assembler needs capacity >= 1 and backlog >= 0, got {capacity} and {backlog}")
        self._capacity = capacity
        self._backlog = backlog
        self._clock = clock
        self._frames: deque[InputFrame] = deque()
        self._changed = asyncio.Event()
        self._seq = 0
        self.accepting = True
        self.received = 0
        self.dropped = 0
        self.camera_size: tuple[int, int] | None = None  # (width, height) of the last frame received

    def push(self, source: av.VideoFrame | np.ndarray, arrived_size: tuple[int, int] | None = None) -> FrameMeta:
        """A camera frame; ``arrived_size`` is its (width, height) as the client sent it when ``source``
        is already resized (the WebSocket path decodes JPEGs straight to the stream's size)."""
        meta = FrameMeta(self._seq, self._clock())
        self._seq += 1
        self.received += 1
        if arrived_size is not None:
            self.camera_size = arrived_size
        else:
            self.camera_size = (source.shape[1], source.shape[0]) if isinstance(source, np.ndarray) \
                else (source.width, source.height)
        if not self.accepting:  # paused: nothing will be generated from this frame
            return meta
        if len(self._frames) == self._capacity + self._backlog:
            self._frames.popleft()
            self.dropped += 1
        self._frames.append(InputFrame(source, meta))
        self._changed.set()
        return meta

    def ready(self, n: int) -> bool:
        return len(self._frames) >= n

    async def wait(self, n: int) -> None:
        """Until ``n`` frames newer than the last take are here."""
        if not 0 < n <= self._capacity:
            raise ValueError(f"chunk of {n} frames does not fit an assembler of capacity {self._capacity}")
        while len(self._frames) < n:
            self._changed.clear()
            await self._changed.wait()

    def take(self, n: int) -> list[InputFrame]:
        """The oldest ``n`` of the newest ``n + backlog`` frames (call when `ready`); frames older than
        those count as dropped, newer ones stay for the next chunk."""
        if not self.ready(n):
            raise RuntimeError(f"take({n}) with only {len(self._frames)} frames buffered")
        while len(self._frames) > n + self._backlog:
            self._frames.popleft()
            self.dropped += 1
        return [self._frames.popleft() for _ in range(n)]

    def clear(self) -> None:
        self._frames.clear()


class Playout:
    """Per-stream bounded output buffer and the clock that plays it out.

    The clock ticks at the rate the model produces frames (measured between chunks, clamped to
    [min_fps, max_fps]) and a little faster while more than one chunk is buffered, so slack stays
    small. A tick with nothing new repeats the last frame. A chunk that lands in an empty buffer
    does not wait for the next tick of a clock that runs on its own phase: it is shown as soon as the
    frame before it has been up for ``MIN_SHOW`` of an interval, and the clock follows from there
    (just-in-time playout: a stream whose engine keeps up saves up to a frame period of latency).
    Every consumer (WebRTC tracks, WHEP viewers, the WebSocket sender) sees every tick; none of them
    holds a queue of its own.
    """

    MIN_SHOW = 0.5  # of a frame interval: the shortest a frame stays up when a chunk lands early

    def __init__(
        self,
        size: tuple[int, int],
        chunk_frames: int,
        max_fps: float,
        min_fps: float,
        clock: Clock = time.monotonic,
    ) -> None:
        width, height = size
        self._clock = clock
        self._chunk_frames = chunk_frames
        self._max_buffer = 3 * chunk_frames
        self._min_interval = 1.0 / max_fps
        self._max_interval = 1.0 / min_fps
        self._frame_period = self._min_interval
        self._last_push: float | None = None
        self._buffer: deque[OutputFrame] = deque()
        self._current = OutputFrame(np.zeros((height, width, 3), np.uint8), None)
        self._tick = 0
        self._tick_event = asyncio.Event()
        self._landed = asyncio.Event()
        self._start = clock()
        self._shown: deque[float] = deque()
        self._latencies: deque[tuple[float, float]] = deque()
        self.trace: deque[tuple[int, float, float]] = deque(maxlen=2000)  # (seq, arrival, shown)
        self.frames_shown = 0
        self.repeats = 0
        self.dropped = 0
        self.first_frame_at: float | None = None

    @property
    def interval(self) -> float:
        interval = min(max(self._frame_period, self._min_interval), self._max_interval)
        if len(self._buffer) > self._chunk_frames:
            interval *= 0.75  # drain a backlog instead of carrying it as latency
        return interval

    @property
    def chunk_duration_s(self) -> float:
        """Seconds of output one chunk plays for at the stream's current frame period (what a cue's
        transition seconds are counted in)."""
        return self._chunk_frames * min(max(self._frame_period, self._min_interval), self._max_interval)

    @property
    def slack_s(self) -> float:
        """Seconds of generated output not yet played."""
        return len(self._buffer) * self.interval

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self._start

    def push_chunk(self, images: np.ndarray, metas: list[FrameMeta]) -> None:
        now = self._clock()
        if self._last_push is not None:
            period = (now - self._last_push) / len(images)
            self._frame_period = 0.7 * self._frame_period + 0.3 * period
        self._last_push = now
        for image, meta in zip(images, metas, strict=True):
            self._buffer.append(OutputFrame(image, meta))
        while len(self._buffer) > self._max_buffer:
            self._buffer.popleft()
            self.dropped += 1
        self._landed.set()

    def fit_placeholder(self, size: tuple[int, int]) -> None:
        """The stream's size is known (its camera's aspect): the black frame shown until its first chunk
        takes it, so viewers and recordings see one size from the start. Called before the first chunk
        is delivered, when no tick can change the frame shown."""
        width, height = size
        if self._current.meta is None and self._current.image.shape[:2] != (height, width):
            self._current = OutputFrame(np.zeros((height, width, 3), np.uint8), None)

    def mark_gap(self) -> None:
        """Production stopped on purpose (pause, reset): do not count the gap as model speed."""
        self._last_push = None

    def discard_buffered(self) -> None:
        """A prompt switch under the serving policy: buffered output of the old prompt is not played
        (SlackServe's slack reset); the viewer holds the last frame until the new prompt's chunk."""
        self.dropped += len(self._buffer)
        self._buffer.clear()

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    @property
    def frames_consumed(self) -> int:
        """Output frames that have left the buffer (played, dropped or discarded): the playout cursor."""
        return self.frames_shown + self.dropped

    def tick(self) -> None:
        now = self._clock()
        if self._buffer:
            self._current = self._buffer.popleft()
            meta = self._current.meta
            self.frames_shown += 1
            self._shown.append(now)
            if meta is not None:
                if self.first_frame_at is None:
                    self.first_frame_at = now
                self._latencies.append((now, now - meta.arrival))
                self.trace.append((meta.seq, meta.arrival, now))
        elif self.frames_shown:
            self.repeats += 1
        self._forget_before(now)
        self._tick += 1
        event, self._tick_event = self._tick_event, asyncio.Event()
        event.set()

    async def run(self) -> None:
        due = self._clock()
        while True:
            self.tick()
            now = self._clock()
            due = max(due + self.interval, now)  # after a stall, restart the clock instead of bursting
            due = await self._next_tick(now, due)

    async def _next_tick(self, shown: float, due: float) -> float:
        """Wait for the tick after the one at ``shown``: at ``due``, or earlier when a chunk lands in the
        empty buffer (not before ``MIN_SHOW`` of an interval after ``shown``). Returns the tick's time."""
        self._landed.clear()
        if not self._buffer:
            try:
                await asyncio.wait_for(self._landed.wait(), max(0.0, due - self._clock()))
            except TimeoutError:
                return due
            due = self.early_tick(shown, due, self._clock())
        await asyncio.sleep(max(0.0, due - self._clock()))
        return due

    def early_tick(self, shown: float, due: float, landed: float) -> float:
        """When to show a chunk that landed at ``landed`` in the buffer the tick at ``shown`` emptied,
        the clock's own next tick being ``due``: at once, but not before the frame shown at ``shown``
        has been up for ``MIN_SHOW`` of an interval, and never later than the clock would have."""
        return min(due, max(landed, shown + self.MIN_SHOW * self.interval))

    async def next_frame(self, after: int) -> tuple[int, OutputFrame, float]:
        """The frame of the first tick after tick number ``after``: (tick, frame, seconds since start)."""
        while self._tick <= after:
            await self._tick_event.wait()
        return self._tick, self._current, self._clock() - self._start

    def _forget_before(self, now: float) -> None:
        """Keep only the windows the stats look at, so a stream can run for hours."""
        while self._shown and self._shown[0] < now - FPS_WINDOW_S:
            self._shown.popleft()
        while self._latencies and self._latencies[0][0] < now - LATENCY_WINDOW_S:
            self._latencies.popleft()

    def output_fps(self) -> float:
        """New (not repeated) frames played per second over the last FPS_WINDOW_S."""
        now = self._clock()
        self._forget_before(now)
        span = min(FPS_WINDOW_S, now - self._start)
        return len(self._shown) / span if span > 0 else 0.0

    @property
    def tick_count(self) -> int:
        """The number of the last tick: ``next_frame(tick_count)`` waits for the next one."""
        return self._tick

    @property
    def started_at(self) -> float:
        """The clock's time at the playout's start: ``next_frame``'s seconds count from it."""
        return self._start

    def recent_latency_s(self, window_s: float) -> tuple[float, float] | None:
        """(mean, max - min) of the latency (input arrival -> played) of the output frames played
        in the last ``window_s`` (or of the last one played); None before the first. What the
        stream's audio is delayed by (app/server/media/audio.py): below the input rate, latency saws up
        within each chunk (its frames arrived faster than they are played); the mean is the
        middle of that saw, the spread its height."""
        if not self._latencies:
            return None
        since = self._clock() - window_s
        recent = [lat for shown, lat in self._latencies if shown >= since] or [self._latencies[-1][1]]
        return float(np.mean(recent)), float(np.max(recent) - np.min(recent))

    def latency_s(self) -> dict[str, float]:
        """Server-side latency (input frame arrival -> its output frame played) over the last
        LATENCY_WINDOW_S: last, p50, p95."""
        self._forget_before(self._clock())
        if not self._latencies:
            return {}
        values = np.array([lat for _, lat in self._latencies])
        return {
            "last": float(values[-1]),
            "p50": float(np.percentile(values, 50)),
            "p95": float(np.percentile(values, 95)),
        }


class StreamRunner:
    """Feeds chunks from the assembler through the engine thread into the playout buffer."""

    def __init__(
        self,
        processor: StreamProcessor,
        assembler: ChunkAssembler,
        playout: Playout,
        executor: Executor,
        size: tuple[int, int],
        trace_stamp: bool = False,
    ) -> None:
        self._processor = processor
        self._assembler = assembler
        self._playout = playout
        self._executor = executor
        self._size = size  # the model's default until the engine sizes the stream at its first chunk
        self._trace_stamp = trace_stamp
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._restart = True
        self._resetting = False  # between a reset's start and the engine's reset of the stream
        self.chunks = 0
        self.chunk_seconds = 0.0  # engine time of the last chunk
        # Told "pause", "resume", "reset" and "prompt" as they happen (the serving policy's ledger).
        self.on_event: Callable[[str], None] | None = None

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) the stream runs and plays out at: the model's default until the first chunk
        picks it from the camera's aspect."""
        return self._size

    def _notify(self, event: str) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def pause(self) -> None:
        self._resumed.clear()
        self._assembler.accepting = False
        self._assembler.clear()
        self._playout.mark_gap()
        self._notify("pause")

    def resume(self) -> None:
        self._assembler.accepting = True
        self._playout.mark_gap()
        self._resumed.set()
        self._notify("resume")

    async def call(self, fn: Callable[..., Any], **kwargs: Any) -> Any:
        """Run a processor method on the engine thread (the engine is not thread-safe)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(**kwargs))

    async def update(self, **changes: Any) -> None:
        await self.call(self._processor.update, **changes)
        if "prompt" in changes:
            self._notify("prompt")

    async def reset(self) -> None:
        # No chunk is taken until the engine has started the stream over: a first chunk (one frame)
        # taken before the processor's reset ran would enter a stream that still expects four.
        self._resetting = True
        # The core hears of it first, so that it stops continuing the chunk the reset is about to drop.
        self._notify("reset")
        try:
            await self.call(self._processor.reset)
        finally:
            self._restart = True  # the engine sizes the stream again from its next chunk's camera
            self._resetting = False
        self._playout.mark_gap()

    def _chunk_size(self) -> int:
        return self._processor.first_chunk_frames if self._restart else self._processor.chunk_frames

    # -- hooks for the engine core's executors (app/server/serving/executors.py) ---------------------------

    @property
    def processor(self) -> StreamProcessor:
        return self._processor

    def has_chunk(self) -> bool:
        """Event loop: a chunk of input is waiting and the stream is neither paused nor being reset."""
        return not (self.paused or self._resetting) and self._assembler.ready(self._chunk_size())

    def next_chunk(self) -> list[InputFrame] | None:
        """Event loop: this stream's next chunk of input frames if it is ready now (not paused)."""
        if not self.has_chunk():
            return None
        n = self._chunk_size()
        self._restart = False
        return self._assembler.take(n)

    def chunk_inputs(self, frames: list[InputFrame], config: FidelityConfig | None = None) -> np.ndarray:
        """Engine thread: decode a chunk's frames, each resized once, straight from the camera's size to
        the engine size the chunk runs at (``config``: its fidelity; None: the stream's own), as the
        engine sizes the stream (its camera's aspect, engine/aspect.py)."""
        source = frames[0].source
        camera = (source.shape[1], source.shape[0]) if isinstance(source, np.ndarray) else (source.width, source.height)
        sizes = self._processor.sizes(camera, config)
        if sizes.stream != self._size:  # the stream's first chunk: the placeholder takes its size
            self._size = sizes.stream
            self._playout.fit_placeholder(self._size)
        return np.stack([to_rgb(frame.source, sizes.engine) for frame in frames])

    def deliver(self, frames: list[InputFrame], out: np.ndarray) -> None:
        """Event loop: a finished chunk goes to the playout buffer."""
        self.chunks += 1
        self._playout.push_chunk(out, [frame.meta for frame in frames])

    def chunk_outputs(self, inputs: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Engine thread: check the engine's output (at the stream's size), stamp the frame-ID band."""
        if out.ndim != 4 or out.shape[0] != len(inputs) or out.shape[3] != 3:
            raise RuntimeError(f"engine returned {out.shape} for an input chunk of {inputs.shape}")
        width, height = self._size
        if out.shape[1:3] != (height, width):  # an engine that sized the stream otherwise: play out at ours
            out = np.stack([fit_frame(image, self._size) for image in out])
        if self._trace_stamp:
            out = np.array(out, copy=True)
            for source, target in zip(inputs, out, strict=True):
                copy_band(source, target)
        return out
