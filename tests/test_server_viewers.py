"""Viewers of one stream share its output frames: one RGB -> yuv420p conversion per output frame for the
publisher's return track, every WHEP viewer and the recording together."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import av
import numpy as np
import pytest

import app.server.media.frame_path as frame_path
from app.client import CodedCamera, http, open_session, open_whep_viewer, pattern_frame
from app.server.media.frame_path import FrameMeta, OutputFrame


def test_an_output_frame_converts_once_and_hands_each_consumer_its_own_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    convert = frame_path.yuv_frame
    monkeypatch.setattr(frame_path, "yuv_frame", lambda image: calls.append(id(image)) or convert(image))
    image = pattern_frame(3, (64, 48))
    out = OutputFrame(image, FrameMeta(0, 0.0))
    threads = [threading.Thread(target=out.video_frame) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first, second = out.video_frame(), out.video_frame()
    assert calls == [id(image)]
    assert first is not second and first.format.name == "yuv420p" and (first.width, first.height) == (64, 48)
    np.testing.assert_array_equal(first.to_ndarray(), convert(image).to_ndarray())
    first.pts = 1  # each consumer stamps its own frame
    assert second.pts is None
    back = first.to_ndarray(format="rgb24")
    assert np.abs(back.astype(int) - image.astype(int)).mean() < 4  # the picture, to 4:2:0's rounding


async def test_several_viewers_and_a_recording_share_one_conversion_per_output_frame(
        live_server: Callable[..., AbstractContextManager[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The publisher's return track, three WHEP viewers and a recording of one stream: every output frame
    is converted to yuv420p once, and every viewer gets the stream's frames (the IDs the camera drew)."""
    converted: Counter[int] = Counter()
    kept: list[np.ndarray] = []  # every image converted stays alive: no two share an id()
    lock = threading.Lock()
    convert = frame_path.yuv_frame

    def counting(image: np.ndarray) -> av.VideoFrame:
        with lock:
            converted[id(image)] += 1
            kept.append(image)
        return convert(image)

    monkeypatch.setattr(frame_path, "yuv_frame", counting)
    with live_server(max_streams=1, trace_stamp=True, record_dir=str(tmp_path / "rec")) as url:
        camera = CodedCamera((160, 120), fps=15)
        session = await open_session(url, camera, prompt="oil painting")
        viewers = []
        try:
            message = json.dumps({"type": "update", "record": True}).encode()
            status, _, raw = await asyncio.to_thread(
                http, "POST", f"{url}/api/streams/{session.stream_id}/control", message,
                {"Content-Type": "application/json", "Authorization": f"Bearer {session.owner_token}"})
            assert status == 200, raw
            # Viewers (no camera of their own: the IDs they read are the publisher's camera's).
            for _ in range(3):
                viewers.append(await open_whep_viewer(url, session.stream_id, token=session.viewer_token))
            for viewer in viewers:
                viewer.probe.camera = camera
            deadline = time.monotonic() + 90
            probes = [session.probe, *(v.probe for v in viewers)]
            while time.monotonic() < deadline and min(len(p.records) for p in probes) < 10:
                await asyncio.sleep(0.2)
            with lock:
                counts = dict(converted)
        finally:
            await asyncio.gather(*(v.close() for v in viewers), session.close())
    assert min(len(p.records) for p in probes) >= 10, [len(p.records) for p in probes]
    assert all(not p.foreign_ids for p in probes)  # the output of this stream's camera, in every viewer
    # Frames the stream played reached several consumers, yet no frame was converted twice.
    assert len(counts) >= 10 and max(counts.values()) == 1, Counter(counts.values())
    assert list((tmp_path / "rec").rglob("*.mp4")), "the recording ran beside the viewers"
