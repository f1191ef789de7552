"""Server-side recording: the control field, the MP4 and its sidecar, the owner's API, the quota."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import av
import cv2
import numpy as np
import pytest
from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription

from app.avsync import BeepMicrophone
from app.client import CodedCamera, http, pattern_frame, video_frames
from app.server.control.recordings import RecordingError, RecordingStore

Live = Callable[..., AbstractContextManager[str]]


def thumb(image: np.ndarray) -> np.ndarray:
    gray = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)
    return cv2.resize(gray, (32, 32), interpolation=cv2.INTER_AREA).astype(np.float32)


class Received:
    """The output frames the client got (time, thumbnail)."""

    def __init__(self) -> None:
        self.frames: list[tuple[float, np.ndarray]] = []

    async def consume(self, track: MediaStreamTrack) -> None:
        async for frame in video_frames(track):
            self.frames.append((time.monotonic(), thumb(frame.to_ndarray(format="rgb24"))))

    def between(self, start: float, end: float) -> list[np.ndarray]:
        return [image for t, image in self.frames if start <= t <= end]


async def publish(url: str, camera: CodedCamera, mic: BeepMicrophone | None) -> tuple[RTCPeerConnection, dict[str, Any], Received]:
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver(camera, direction="sendrecv")
    if mic is not None:
        pc.addTransceiver(mic, direction="sendrecv")
    pc.createDataChannel("control")
    received = Received()

    @pc.on("track")
    def on_track(track: MediaStreamTrack) -> None:
        if track.kind == "video":
            asyncio.ensure_future(received.consume(track))

    await pc.setLocalDescription(await pc.createOffer())
    body = json.dumps({"sdp": pc.localDescription.sdp, "type": "offer", "prompt": "ink wash"}).encode()
    status, _, raw = await asyncio.to_thread(http, "POST", f"{url}/api/offer", body, {"Content-Type": "application/json"})
    assert status == 200, raw
    answer = json.loads(raw)
    await pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type="answer"))
    return pc, answer, received


async def call(method: str, url: str, body: bytes | None = None, token: str | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    status, _, raw = await asyncio.to_thread(http, method, url, body, headers)
    return status, raw


async def control(url: str, stream_id: str, token: str, message: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, raw = await call("POST", f"{url}/api/streams/{stream_id}/control", json.dumps(message).encode(), token)
    return status, json.loads(raw)


async def wait_for(condition: Callable[[], bool], timeout_s: float = 40.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.2)


def decode(data: bytes) -> tuple[list[np.ndarray], float, str]:
    """(video thumbnails, audio peak level (AAC decodes to floats in [-1, 1]), video codec) of an MP4."""
    with av.open(io.BytesIO(data)) as container:
        codec = container.streams.video[0].codec_context.name
        frames = [thumb(f.to_ndarray(format="rgb24")) for f in container.decode(video=0)]
    peak = 0.0
    with av.open(io.BytesIO(data)) as container:
        if container.streams.audio:
            for frame in container.decode(audio=0):
                peak = max(peak, float(np.abs(frame.to_ndarray()).max()))
    return frames, peak, codec


async def test_recording_writes_the_output_with_its_audio_for_its_owner(live_server: Live, tmp_path: Path) -> None:
    with live_server(max_streams=2, record_dir=str(tmp_path / "rec")) as url:
        camera = CodedCamera((128, 128), fps=15)
        pc, answer, received = await publish(url, camera, BeepMicrophone(every_s=1.0, first_s=0.3))
        sid, owner, viewer = answer["stream_id"], answer["owner_token"], answer["viewer_token"]
        recordings = f"{url}/api/streams/{sid}/recordings"
        await wait_for(lambda: len(received.frames) > 10)

        assert await control(url, sid, owner, {"type": "update", "record": True}) == (200, {"type": "ack", "applied": "update"})
        started = time.monotonic()
        stats = json.loads((await call("GET", f"{url}/api/streams/{sid}"))[1])
        assert stats["recording"] is True and stats["audio"] is True
        status, raw = await call("GET", recordings, token=owner)
        running = json.loads(raw)
        assert status == 200 and len(running) == 1 and running[0]["recording"] is True
        assert (await call("GET", f"{recordings}/{running[0]['name']}", token=owner))[0] == 409
        await asyncio.sleep(2.0)
        assert (await control(url, sid, owner, {"type": "update", "prompt": "charcoal drawing"}))[0] == 200
        await asyncio.sleep(2.0)
        assert (await control(url, sid, owner, {"type": "update", "record": False}))[0] == 200
        stopped = time.monotonic()

        # Owner only: no token 401; a viewer token, a stranger's, another stream's owner token: 404 alike.
        assert (await call("GET", recordings))[0] == 401
        assert (await call("GET", recordings, token=viewer))[0] == 404
        assert (await call("GET", recordings, token="x" * 32))[0] == 404
        assert (await call("GET", f"{url}/api/streams/{'a' * 22}/recordings", token=owner))[0] == 404
        pc2, answer2, _ = await publish(url, CodedCamera((64, 64), fps=15), None)
        assert (await call("GET", recordings, token=answer2["owner_token"]))[0] == 404
        await pc2.close()

        status, raw = await call("GET", recordings, token=owner)
        listing = json.loads(raw)
        assert status == 200 and len(listing) == 1 and listing[0]["recording"] is False, listing
        name, sidecar_name = listing[0]["name"], listing[0]["prompts"]
        for bad in ("..%2F..%2Fowner", "owner", f"{name[:-4]}.part", "%2Fetc%2Fpasswd"):
            assert (await call("GET", f"{recordings}/{bad}", token=owner))[0] == 404, bad
        status, mp4 = await call("GET", f"{recordings}/{name}", token=owner)
        assert status == 200
        status, raw = await call("GET", f"{recordings}/{sidecar_name}?access_token={owner}")
        sidecar = json.loads(raw)
        assert status == 200 and [m["prompt"] for m in sidecar["prompts"]] == ["ink wash", "charcoal drawing"]
        assert 1.0 < sidecar["prompts"][1]["t"] < sidecar["duration_s"]

        frames, peak, codec = decode(mp4)
        shown = received.between(started, stopped)
        # Every playout tick while recording: about as many frames as the client received meanwhile.
        assert 0.6 * len(shown) - 5 <= len(frames) <= 1.4 * len(shown) + 5, (len(frames), len(shown))
        assert codec in ("h264", "mpeg4") and sidecar["frames"] == len(frames)
        assert peak > 0.1, "the beeps of the input are not in the recording"
        # The recorded frames are what the client saw: not black, not the camera's input. The last ones
        # were still on their way to the client when the stop was acknowledged, so frames it got just
        # after count as seen. A frame the recorder took may never reach the client (its encoder or
        # jitter buffer skips one on a loaded machine, and consecutive frames of this moving pattern
        # differ by ~9 levels), so each frame must be far nearer the output than the input, and most
        # must match a frame the client got.
        inputs = [thumb(pattern_frame(i, (128, 128))) for i in range(0, 160, 4)]
        seen_by_client = received.between(started, stopped + 1.0)
        matched = []
        for image in frames[len(frames) // 4 :: max(1, len(frames) // 8)]:
            assert image.std() > 2, "a flat (black) frame"
            to_output = min(float(np.abs(image - seen).mean()) for seen in seen_by_client)
            to_input = min(float(np.abs(image - source).mean()) for source in inputs)
            assert to_output < to_input / 2, (to_output, to_input)
            matched.append(to_output < 8)
        assert sum(matched) >= 0.75 * len(matched), matched

        # A recording running when the stream ends is finished, not cut.
        assert (await control(url, sid, owner, {"type": "update", "record": True}))[0] == 200
        await asyncio.sleep(1.5)
        assert (await call("DELETE", f"{url}/api/streams/{sid}", token=owner))[0] == 204
        await pc.close()
        # The owner keeps access to the recordings after the stream has ended.
        await wait_for(lambda: len(json.loads(http("GET", recordings, None, {"Authorization": f"Bearer {owner}"})[2])) == 2)
        listing = json.loads((await call("GET", recordings, token=owner))[1])
        last = next(item for item in listing if item["name"] != name)
        assert last["ended"] == "stopped by its owner" and last["frames"] > 0
        frames, _, _ = decode((await call("GET", f"{recordings}/{last['name']}", token=owner))[1])
        assert len(frames) == last["frames"]

        assert (await call("DELETE", f"{recordings}/{name}", token=owner))[0] == 204
        assert (await call("DELETE", f"{recordings}/{name}", token=owner))[0] == 404
        assert [item["name"] for item in json.loads((await call("GET", recordings, token=owner))[1])] == [last["name"]]


async def test_recording_off_and_full_storage_are_clear_errors(live_server: Live, tmp_path: Path) -> None:
    with live_server(max_streams=1) as url:
        pc, answer, received = await publish(url, CodedCamera((64, 64), fps=15), None)
        sid, owner = answer["stream_id"], answer["owner_token"]
        status, reply = await control(url, sid, owner, {"type": "update", "record": True})
        assert status == 422 and "recording is not enabled on this server" in reply["message"]
        status, raw = await call("GET", f"{url}/api/streams/{sid}/recordings", token=owner)
        assert status == 404 and b"recording is not enabled on this server" in raw
        await pc.close()

    # 20 kB of room: the recording stops by itself when it fills it, and the next one is refused.
    with live_server(max_streams=1, record_dir=str(tmp_path / "rec"), record_max_gb=20e3 / 1024**3) as url:
        pc, answer, received = await publish(url, CodedCamera((128, 128), fps=15), None)
        sid, owner = answer["stream_id"], answer["owner_token"]
        await wait_for(lambda: len(received.frames) > 5)
        assert (await control(url, sid, owner, {"type": "update", "record": True}))[0] == 200

        def stats() -> dict[str, Any]:
            return json.loads(http("GET", f"{url}/api/streams/{sid}")[2])

        await wait_for(lambda: stats()["recording"] is False)
        assert stats()["record_error"] == "recording storage is full"
        status, reply = await control(url, sid, owner, {"type": "update", "record": True})
        assert status == 422 and "recording storage is full" in reply["message"]
        listing = json.loads((await call("GET", f"{url}/api/streams/{sid}/recordings", token=owner))[1])
        assert len(listing) == 1 and listing[0]["ended"] == "storage full"
        frames, _, _ = decode((await call("GET", f"{url}/api/streams/{sid}/recordings/{listing[0]['name']}",
                                          token=owner))[1])
        assert len(frames) == listing[0]["frames"] > 0  # a complete, playable file
        assert listing[0]["duration_s"] > 0
        await pc.close()


def test_store_refuses_when_full_and_keeps_names_inside(tmp_path: Path) -> None:
    store = RecordingStore(tmp_path, max_bytes=1000, owner_of=lambda _: "owner-token")
    directory, name = store.new_recording("s" * 22)
    assert directory == tmp_path / ("s" * 22) and store.is_owner("owner-token", "s" * 22)
    assert not store.is_owner("other", "s" * 22)
    (directory / f"{name}.mp4").write_bytes(b"\0" * 1000)
    store.finished("s" * 22, name)
    with pytest.raises(RecordingError, match="recording storage is full"):
        store.new_recording("s" * 22)
    for bad in ("../owner", "owner", f"{name}.mp4/..", f"../{'s' * 22}/{name}.mp4"):
        assert store.file("s" * 22, bad) is None and not store.delete("s" * 22, bad)
    assert store.delete("s" * 22, f"{name}.mp4") and store.fits()
