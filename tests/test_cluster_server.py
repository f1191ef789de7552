"""The live server on 2 Ray workers: a WebRTC stream keeps playing across a re-homing of its state to the
other worker, and across the death of the worker it then lives on (same session, bounded gap).

Two clients: the page in headless Chromium (the product path), and the aiortc probe the other service
tests use (app.client), whose frame IDs drawn into the camera frames are carried onto the output
frames (trace_stamp), so every frame it decodes is traced back to a frame it sent and the time between
new output frames shows any gap. The browser test only re-homes; the probe test also kills a worker.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from conftest import running_server
from test_browser_page import CHROMIUM_FLAGS

from app.client import CodedCamera, ProbeSession, http, open_session
from app.server.app import create_app
from app.server.config import ServerConfig
from app.server.serving.engine_bridge import RayFactory
from engine.cluster.controller import ClusterConfig, ClusterController

FRAMES_AFTER = 8  # new output frames the client must see after each event
WAIT_S = 60.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterController]:
    config = ClusterConfig(model="tiny-random", workers=2, health_interval_s=0.5, object_store_mb=200)
    controller = ClusterController.start(config)
    controller.start_monitor()
    yield controller
    controller.shutdown()


@pytest.fixture
def page(chromium_path: Path, camera_clip: Path) -> Iterator[Any]:
    """Headless Chromium with the generated clip as its camera (flags: tests/test_browser_page.py)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(chromium_path), args=[*CHROMIUM_FLAGS, f"--use-file-for-fake-video-capture={camera_clip}"]
        )
        try:
            yield browser.new_page()
        finally:
            browser.close()


def new_stream(cluster: ClusterController, before: set[int], timeout_s: float = WAIT_S) -> tuple[int, int]:
    """The stream opened since ``before`` (a placement snapshot), and its home."""
    deadline = time.monotonic() + timeout_s
    while not (opened := set(cluster.placement()) - before):
        assert time.monotonic() < deadline, "no stream was opened on the cluster"
        time.sleep(0.1)
    [sid] = opened
    return sid, cluster.placement()[sid]


@pytest.mark.browser
def test_page_keeps_playing_across_rehoming(cluster: ClusterController, page: Any) -> None:
    config = ServerConfig(allow_loopback_candidates=True, max_streams=2)
    before = set(cluster.placement())
    with running_server(create_app(config, factory=RayFactory(cluster))) as url:
        page.goto(f"{url}/?autostart=1")
        page.wait_for_function("window.diffcast && window.diffcast.outputFrames > 10", timeout=WAIT_S * 1000)
        sid, src = new_stream(cluster, before)
        cluster.migrate(sid, 1 - src)
        shown = page.evaluate("window.diffcast.outputFrames")
        page.wait_for_function(f"window.diffcast.outputFrames > {shown + 10}", timeout=WAIT_S * 1000)
        assert cluster.placement()[sid] == 1 - src
        assert page.evaluate("window.diffcast.status") == "live"
        assert page.evaluate("window.diffcast.errors") == []


async def frames_after(session: ProbeSession, t: float, count: int = FRAMES_AFTER) -> float:
    """Wait until the client has decoded ``count`` new frames made after ``t``; the largest gap between
    consecutive new frames around ``t`` (from the last frame before it, if any)."""
    deadline = time.monotonic() + WAIT_S
    while sum(1 for r in session.probe.records if r[0] > t) < count:
        assert time.monotonic() < deadline, f"fewer than {count} new frames within {WAIT_S} s of the event"
        await asyncio.sleep(0.1)
    times = [r[0] for r in session.probe.records]
    before = max((x for x in times if x <= t), default=t)
    around = [before] + [x for x in times if x > t][:count]
    return max(b - a for a, b in zip(around, around[1:], strict=False))


async def test_stream_keeps_playing_across_rehoming_and_worker_death(cluster: ClusterController) -> None:
    config = ServerConfig(allow_loopback_candidates=True, trace_stamp=True, max_streams=2)
    before = set(cluster.placement())
    with running_server(create_app(config, factory=RayFactory(cluster))) as url:
        session = await open_session(url, CodedCamera((128, 128), fps=20), prompt="oil painting")
        await frames_after(session, session.started)
        sid, src = await asyncio.to_thread(new_stream, cluster, before)

        move = await asyncio.to_thread(cluster.migrate, sid, 1 - src)
        moved_at = time.monotonic()
        move_gap = await frames_after(session, moved_at)
        assert cluster.placement()[sid] == 1 - src

        ray.kill(cluster.actor(1 - src))
        killed_at = time.monotonic()
        kill_gap = await frames_after(session, killed_at)
        assert cluster.placement()[sid] == src
        [recovery] = cluster.recoveries
        assert recovery.readmitted[sid] == src

        status, _, body = await asyncio.to_thread(http, "GET", f"{url}/api/streams/{session.stream_id}")
        assert status == 200 and json.loads(body)["stream_id"] == session.stream_id  # the same session
        await session.close()

    assert not session.probe.foreign_ids
    print(f"\nre-home: hold {1000 * move.hold_s:.0f} ms, largest output gap {1000 * move_gap:.0f} ms; "
          f"worker death: detected by {recovery.detected_by} after {1000 * (recovery.done_at - killed_at):.0f} ms, "
          f"largest output gap {1000 * kill_gap:.0f} ms")
    # Bounded gaps: a move holds the stream for one transfer; a death costs detection plus one chunk.
    assert move_gap < 2.0
    assert kill_gap < 5.0
