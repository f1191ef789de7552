"""Viewers of one stream share its output frames: one RGB -> yuv420p conversion per output frame for the
publisher's return track, every WHEP viewer and the recording together, and one VP8 encode for all its
WebRTC viewers."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from aiortc import MediaStreamTrack

import app.server.media.frame_path as frame_path
from app.client import (
    CodedCamera,
    OutputProbe,
    WhepViewer,
    http,
    open_session,
    open_whep_viewer,
    pattern_frame,
)
from app.server.media.frame_path import FrameMeta, OutputFrame, frame_rgb, video_frames
from app.server.media.framecode import read_id


def test_an_output_frame_converts_once_and_hands_each_consumer_its_own_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    convert = frame_path.yuv420p_planes
    monkeypatch.setattr(frame_path, "yuv420p_planes", lambda image: calls.append(id(image)) or convert(image))
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
    np.testing.assert_array_equal(first.to_ndarray(), convert(image))
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
    convert = frame_path.yuv420p_planes

    def counting(image: np.ndarray) -> np.ndarray:
        with lock:
            converted[id(image)] += 1
            kept.append(image)
        return convert(image)

    monkeypatch.setattr(frame_path, "yuv420p_planes", counting)
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


@dataclass
class PictureProbe(OutputProbe):
    """Keeps every decoded picture that carries a frame ID, by ID (the probe's own count goes on)."""

    pictures: dict[int, list[np.ndarray]] = field(default_factory=dict)

    async def consume(self, track: MediaStreamTrack) -> None:
        async for frame in video_frames(track):
            image = frame_rgb(frame)
            self.frames += 1
            frame_id = read_id(image)
            if frame_id is not None:
                self.pictures.setdefault(frame_id, []).append(image)

    @property
    def coded(self) -> int:
        return sum(len(p) for p in self.pictures.values())


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(255.0**2 / max(1e-9, np.mean((a.astype(float) - b.astype(float)) ** 2))))


async def wait_for(condition: Callable[[], bool], seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert condition()


async def test_a_streams_webrtc_viewers_share_one_vp8_encode_per_frame_and_decode_the_same_pictures(
        live_server: Callable[..., AbstractContextManager[str]], monkeypatch: pytest.MonkeyPatch,
        libvpx_calls: list[int]) -> None:
    """The publisher's return track and three WHEP viewers: libvpx runs once per frame sent, every viewer
    decodes the same pictures (bit for bit) of the stream's output; a viewer joining late starts at a
    keyframe and decodes; a viewer leaving stops no one."""
    outputs: dict[int, np.ndarray] = {}  # what the stream played, by the frame ID its trace stamp drew
    push_chunk = frame_path.Playout.push_chunk

    def keeping(self: frame_path.Playout, images: np.ndarray, metas: list[FrameMeta]) -> None:
        for image in images:
            frame_id = read_id(image)
            if frame_id is not None:
                outputs[frame_id] = image
        push_chunk(self, images, metas)

    monkeypatch.setattr(frame_path.Playout, "push_chunk", keeping)
    with live_server(max_streams=1, trace_stamp=True) as url:
        camera = CodedCamera((160, 120), fps=15)
        session = await open_session(url, camera, prompt="oil painting")
        viewers: list[WhepViewer] = []

        async def stats() -> dict[str, int]:
            status, _, raw = await asyncio.to_thread(
                http, "GET", f"{url}/api/streams/{session.stream_id}", None,
                {"Authorization": f"Bearer {session.owner_token}"})
            assert status == 200, raw
            return dict(json.loads(raw))

        try:
            for _ in range(3):
                viewers.append(await open_whep_viewer(url, session.stream_id, PictureProbe(),
                                                      token=session.viewer_token))
            probes = [v.probe for v in viewers]
            assert all(isinstance(p, PictureProbe) for p in probes)
            pictured = [p for p in probes if isinstance(p, PictureProbe)]
            await wait_for(lambda: min(p.coded for p in pictured) >= 20)
            sent = [session.probe.frames, *(p.frames for p in probes)]
            libvpx = len(libvpx_calls)  # read after the frames: some of these are still on their way
            before = await stats()

            # A viewer joining late: its first frame is a keyframe encoded for everyone, and it decodes.
            late = await open_whep_viewer(url, session.stream_id, PictureProbe(), token=session.viewer_token)
            viewers.append(late)
            assert isinstance(late.probe, PictureProbe)
            late_probe = late.probe
            await wait_for(lambda: late_probe.coded >= 10)
            assert (await stats())["keyframes"] > before["keyframes"]

            # One viewer leaving: the others go on.
            await viewers[0].close()
            counts = [p.coded for p in pictured[1:]]
            await wait_for(lambda: all(p.coded >= n + 10 for p, n in zip(pictured[1:], counts, strict=True)))
        finally:
            await asyncio.gather(*(v.close() for v in viewers), session.close())

    # Four senders, one libvpx encode per frame: as many as the first viewer received (less those in
    # flight), not four times as many.
    assert libvpx <= before["encoded_frames"]  # the stream's own count, read after ours
    assert libvpx <= max(sent) + 10 and 2 * libvpx < sum(sent), (libvpx, sent)
    # The viewers decode the same bitstream: the same pictures, bit for bit, for every frame ID they share.
    everyone = [*pictured, late_probe]
    for one, other in ((everyone[0], p) for p in everyone[1:]):
        shared_ids = set(one.pictures) & set(other.pictures)
        assert len(shared_ids) >= 5
        same = sum(1 for i in shared_ids
                   if {p.tobytes() for p in one.pictures[i]} & {p.tobytes() for p in other.pictures[i]})
        assert same >= 0.9 * len(shared_ids), (same, len(shared_ids))
    # ... and they are the stream's output frames: nearer the frame of their own ID than its neighbours.
    scores = [(psnr(pictures[-1], outputs[i]), psnr(pictures[-1], outputs[i - 2]))
              for i, pictures in late_probe.pictures.items() if i in outputs and i - 2 in outputs]
    assert len(scores) >= 5
    assert np.mean([own for own, _ in scores]) > 28 and all(own > other for own, other in scores), scores
