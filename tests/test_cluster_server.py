"""The live server on 2 Ray workers: a WebRTC stream keeps playing across a re-homing of its state to the
other worker, and across the death of the worker it then lives on (same session, bounded gap).

The client is the aiortc probe the other service tests use (app.server.probe): frame IDs drawn into the
camera frames are carried onto the output frames (trace_stamp), so every frame the client decodes is
traced back to a frame it sent, and the time between new output frames shows any gap.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest
import ray
from conftest import running_server

from app.server.app import create_app
from app.server.config import ServerConfig
from app.server.engine_bridge import RayFactory
from app.server.probe import CodedCamera, ProbeSession, http, open_session
from engine.cluster.controller import ClusterConfig, ClusterController

FRAMES_AFTER = 8  # new output frames the client must see after each event
WAIT_S = 60.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[ClusterController]:
    controller = ClusterController.start(ClusterConfig(model="tiny-random", workers=2, health_interval_s=0.5))
    controller.start_monitor()
    yield controller
    controller.shutdown()


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
    with running_server(create_app(config, factory=RayFactory(cluster))) as url:
        session = await open_session(url, CodedCamera((128, 128), fps=20), prompt="oil painting")
        await frames_after(session, session.started)
        [(sid, src)] = cluster.placement().items()

        move = await asyncio.to_thread(cluster.migrate, sid, 1 - src)
        moved_at = time.monotonic()
        move_gap = await frames_after(session, moved_at)
        assert cluster.placement() == {sid: 1 - src}

        ray.kill(cluster.actor(1 - src))
        killed_at = time.monotonic()
        kill_gap = await frames_after(session, killed_at)
        assert cluster.placement() == {sid: src}
        [recovery] = cluster.recoveries
        assert recovery.readmitted == {sid: src}

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
