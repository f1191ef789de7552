"""Faults: clients that vanish, an engine that throws in one stream, a client that stops reading,
and server shutdown. Every other stream must keep running and every resource must be freed.

Worker crashes under Ray are covered by tests/test_cluster_server.py and test_cluster_controller.py;
a fidelity config the engine refuses under the policy loop by tests/test_server_scheduler.py.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import websockets
from _security_fixtures import served, tiny_factory  # noqa: F401

from app.client import CodedCamera, http, open_session, pattern_frame
from app.server.media.frame_path import encode_jpeg
from app.server.serving.engine_bridge import EngineKind, InProcessProcessor, StreamSettings
from app.server.serving.session import SessionManager

ROOT = Path(__file__).resolve().parents[1]


async def wait_until(condition: Callable[[], bool], timeout_s: float, poll_s: float = 0.01) -> float:
    """Seconds until ``condition()`` held; AssertionError after ``timeout_s``."""
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"not within {timeout_s} s")
        await asyncio.sleep(poll_s)
    return time.monotonic() - t0


async def send_frames(ws: Any, size: tuple[int, int], count: int, fps: float = 20) -> None:
    for i in range(count):
        await ws.send(encode_jpeg(pattern_frame(i, size), 80))
        await asyncio.sleep(1 / fps)


def freed(manager: SessionManager, processor: weakref.ref[Any]) -> bool:
    gc.collect()
    loop = manager.serving
    assert loop is not None
    return not manager.sessions and not loop.streams and not loop.core.ledger.entries and processor() is None


async def test_websocket_client_vanishing_mid_chunk_frees_everything(
    tiny_factory: Any, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    with served(tiny_factory, max_streams=1, engine_delay_ms=400) as (url, manager):
        ws = await websockets.connect(url.replace("http", "ws") + "/ws")
        hello = json.loads(await ws.recv())
        size = (hello["width"], hello["height"])
        feeder = asyncio.ensure_future(send_frames(ws, size, 1000))
        session = manager.sessions[hello["stream_id"]]
        processor = weakref.ref(session.runner.processor)
        tasks = weakref.WeakSet(session._tasks)
        runner, closed = weakref.ref(session.runner), session.closed
        del session  # only weak references from here: the test must not keep the stream alive
        await wait_until(lambda: getattr(runner(), "chunks", 0) >= 2, 60)
        loop = manager.serving
        assert loop is not None
        await wait_until(lambda: bool(loop.core.running()), 10, poll_s=0.001)  # a chunk is on the engine now
        feeder.cancel()
        t0 = time.monotonic()
        ws.transport.abort()  # TCP reset: no close frame, no goodbye
        await wait_until(closed.is_set, 5)
        closed_s = time.monotonic() - t0
        await wait_until(lambda: all(t.done() for t in tasks), 5, poll_s=0.02)
        await wait_until(lambda: not loop.core.running(), 15, poll_s=0.001)
        chunk_back_s = time.monotonic() - t0
        await wait_until(lambda: freed(manager, processor), 5, poll_s=0.02)
        freed_s = time.monotonic() - t0
    print(f"vanished WebSocket client mid-chunk: session closed in {closed_s:.3f} s, its chunk in flight came "
          f"back at {chunk_back_s:.3f} s, engine state freed at {freed_s:.3f} s")
    # Nothing of the stream outlives its chunk in flight (the margin covers a starved event loop and
    # the gc.collect() in every poll on this shared box; unloaded it is about 0.4 s).
    assert freed_s - chunk_back_s < 1.5
    # A client that vanishes is not an error of its stream (an output frame on its way when the
    # connection reset was once logged as a crash, whose traceback also kept the stream alive).
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def test_killed_webrtc_publisher_is_noticed_by_the_input_watchdog(tiny_factory: Any) -> None:  # noqa: F811
    with served(tiny_factory, max_streams=2, input_timeout_s=2.0) as (url, manager):
        client = subprocess.Popen([sys.executable, str(ROOT / "tests" / "_vanishing_client.py"), url],
                                  cwd=ROOT, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            assert client.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(client.stdout.readline), 60)
            stream_id = json.loads(line)["stream_id"]
            session = manager.sessions[stream_id]
            peers = list(session.peers.values())
            assembler, closed = session.assembler, session.closed
            processor = weakref.ref(session.runner.processor)
            del session
            await wait_until(lambda: assembler.received >= 10, 60)
            t0 = time.monotonic()
            client.send_signal(signal.SIGKILL)  # no DTLS close, no SCTP abort, no DELETE
            await wait_until(closed.is_set, 10)
            closed_s = time.monotonic() - t0
            await wait_until(lambda: freed(manager, processor), 5, poll_s=0.05)
        finally:
            client.kill()
            client.wait()
        assert all(pc.connectionState == "closed" for pc in peers)
    print(f"SIGKILLed WebRTC publisher: session closed and peer freed {closed_s:.2f} s after the kill")
    assert 2.0 <= closed_s < 2.0 + 2.0  # the watchdog's timeout, polled 4x per timeout


class FailingProcessor(InProcessProcessor):
    """The real engine, except that streams whose prompt is "explode" throw from their 3rd chunk on."""

    def __init__(self, inner: InProcessProcessor, explode: bool) -> None:
        super().__init__(inner._stream, inner.first_chunk_frames, inner.chunk_frames)
        self.explode = explode
        self.chunks = 0

    def _check(self) -> None:
        self.chunks += 1
        if self.explode and self.chunks >= 3:
            raise RuntimeError("engine failure injected by the test")

    def process(self, frames: np.ndarray) -> np.ndarray:
        self._check()
        return super().process(frames)

    def begin_chunk(self, frames: np.ndarray) -> None:
        self._check()
        super().begin_chunk(frames)


class FailingFactory:
    """The in-process engine whose processors fail on demand; everything else is the inner factory's."""

    kind = EngineKind.IN_PROCESS

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.parallel_chunks = inner.parallel_chunks
        self.pipeline = inner.pipeline
        self.loras = inner.loras
        self.device_memory = inner.device_memory

    @property
    def size(self) -> tuple[int, int]:
        return self._inner.size

    def open(self, settings: StreamSettings) -> FailingProcessor:
        return FailingProcessor(self._inner.open(settings), explode=settings.prompt == "explode")


@pytest.mark.parametrize("policy", ["slack", "fifo"])
async def test_engine_exception_ends_only_its_stream(tiny_factory: Any, policy: str) -> None:  # noqa: F811
    with served(FailingFactory(tiny_factory), max_streams=2, policy=policy, trace_stamp=True) as (url, manager):
        good = await open_session(url, CodedCamera((128, 128), fps=15, variant=0), prompt="oil painting")
        bad = await open_session(url, CodedCamera((128, 128), fps=15, variant=1), prompt="explode")
        await wait_until(lambda: bad.stream_id not in manager.sessions, 60, poll_s=0.1)
        shown = len(good.probe.records)
        await wait_until(lambda: len(good.probe.records) >= shown + 8, 30, poll_s=0.1)  # still playing
        status, _, body = await asyncio.to_thread(http, "GET", f"{url}/api/streams/{good.stream_id}")
        assert status == 200 and json.loads(body)["frames_out"] > 0
        assert list(manager.sessions) == [good.stream_id]
        await asyncio.gather(good.close(), bad.close())


async def test_slow_websocket_client_keeps_memory_bounded(tiny_factory: Any) -> None:  # noqa: F811
    """A client that never reads: the server's output path blocks on it (uvicorn's write flow
    control) instead of queueing, the playout buffer stays at its bound, and input keeps flowing."""
    process = psutil.Process()
    with served(tiny_factory, max_streams=1, jpeg_quality=95) as (url, manager):
        # max_queue=1 and no recv(): the client's socket buffer fills, then TCP pushes back.
        async with websockets.connect(url.replace("http", "ws") + "/ws", max_queue=1) as ws:
            hello = json.loads(await ws.recv())
            session = manager.sessions[hello["stream_id"]]
            size = (hello["width"], hello["height"])
            await send_frames(ws, size, 40)
            peak_buffer, rss = 0, []
            shown0 = session.playout.frames_shown
            for i in range(240):  # 12 s of a 20 fps camera, output never read
                await ws.send(encode_jpeg(pattern_frame(i, size), 80))
                peak_buffer = max(peak_buffer, session.playout.buffered)
                if i in (80, 239):  # after the socket buffers have filled (4 s), and at the end
                    rss.append(process.memory_info().rss)
                await asyncio.sleep(0.05)
            growth_mb = (rss[1] - rss[0]) / 2**20
            chunk = session.runner.processor.chunk_frames
            assert peak_buffer <= 3 * chunk
            assert session.assembler.received >= 280 and session.playout.frames_shown > shown0
    print(f"client not reading for 12 s: RSS growth over its last 8 s {growth_mb:.1f} MiB, playout buffer peak "
          f"{peak_buffer} frames")
    # A per-client queue of raw output frames (49 KB at up to 30 fps) would add ~11 MiB here; a queue of
    # JPEGs (~0.3 MiB/s) would hide in the noise, and loopback's kernel buffers absorb part of it anyway.
    assert growth_mb < 10


async def test_shutdown_drains_and_closes_peers(tiny_factory: Any) -> None:  # noqa: F811
    with served(tiny_factory, max_streams=2, trace_stamp=True) as (url, manager):
        rtc = await open_session(url, CodedCamera((128, 128), fps=15))
        ws = await websockets.connect(url.replace("http", "ws") + "/ws")
        json.loads(await ws.recv())
        await wait_until(lambda: len(rtc.probe.records) >= 3, 60, poll_s=0.1)
        peers = [pc for s in manager.sessions.values() for pc in s.peers.values()]
        sessions = list(manager.sessions.values())
        assert len(sessions) == 2 and len(peers) == 1
        t0 = time.monotonic()
    shutdown_s = time.monotonic() - t0  # the `with` exit stops uvicorn: lifespan shutdown closes all
    assert not manager.sessions and all(s.closed.is_set() for s in sessions)
    assert all(pc.connectionState == "closed" for pc in peers)
    assert manager.engine_threads._shutdown
    await asyncio.wait_for(ws.wait_closed(), 5)
    assert ws.close_code in (1001, 1012), ws.close_code  # going away / service restart
    client_s = await wait_until(lambda: rtc.pc.connectionState in ("closed", "failed"), 30, poll_s=0.1)
    print(f"shutdown with 2 streams: {shutdown_s:.2f} s; WebRTC client saw {rtc.pc.connectionState} after "
          f"{client_s:.2f} s more")
    assert shutdown_s < 10
    await rtc.close()
