"""A synthetic WebRTC client of the service, for tests and `demos/bench_live.py`.

`CodedCamera` sends moving frames with their frame ID drawn into the pixels (framecode) and
remembers when it sent each ID; `OutputProbe` reads the stylized track that comes back, reads the
ID off each new frame (the server copies the band across when started with ``trace_stamp``) and
records glass-to-glass latency: capture on the client -> decoded on the client, through the
whole real path (encode, network, server decode, engine, playout, encode, network, decode).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache
from typing import Any

import av
import numpy as np
from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription

from app.server.media.encoder import CameraVp8Encoder, install_vp8_encoders
from app.server.media.frame_path import frame_rgb, video_frames, yuv_frame
from app.server.media.framecode import MAX_ID, draw_id, read_id
from app.server.media.jitter import complete_video_frames_on_marker

TIME_BASE = Fraction(1, 90_000)


def pattern_frame(index: int, size: tuple[int, int], variant: int = 0) -> np.ndarray:
    """Moving test content: a colour gradient with a bright bar sweeping across; ``variant`` changes
    the colours and the direction so that two clients send clearly different video."""
    width = size[0]
    image = _gradient(size, variant % 2).copy()
    bar = width // 8
    pos = (index * 4) % (width + bar) - bar
    if variant % 2 == 1:
        pos = width - pos - bar
    image[:, max(pos, 0) : max(pos + bar, 0)] = 255 if variant % 2 == 0 else 0
    return image


@lru_cache(maxsize=8)
def _gradient(size: tuple[int, int], variant: int) -> np.ndarray:
    """The still part of `pattern_frame`, made once per size (made per frame it cost a camera 1 ms)."""
    width, height = size
    x = np.linspace(0, 1, width, dtype=np.float32)[None, :]
    y = np.linspace(0, 1, height, dtype=np.float32)[:, None]
    if variant == 0:
        rgb = [x * np.ones_like(y), y * np.ones_like(x), 0.2 * np.ones((height, width), np.float32)]
    else:
        rgb = [0.15 * np.ones((height, width), np.float32), 1 - y * np.ones_like(x), 1 - x * np.ones_like(y)]
    image = (np.stack(rgb, axis=-1) * 255).astype(np.uint8)
    image.flags.writeable = False
    return image


class CodedCamera(MediaStreamTrack):
    """A paced synthetic camera whose frames carry their ID in a framecode band."""

    kind = "video"

    def __init__(self, size: tuple[int, int], fps: float = 30.0, variant: int = 0, id_offset: int = 0) -> None:
        super().__init__()
        self.size = size
        self.fps = fps
        self.variant = variant
        self.id_offset = id_offset
        self.sent: dict[int, float] = {}  # frame ID -> time.monotonic() at capture
        self.count = 0
        self._start: float | None = None

    def frame_id(self, index: int) -> int:
        return (self.id_offset + index) % MAX_ID

    async def recv(self) -> av.VideoFrame:
        if self._start is None:
            self._start = time.monotonic()
        due = self._start + self.count / self.fps
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        index = self.count
        self.count += 1
        image = pattern_frame(index, self.size, self.variant)
        draw_id(image, self.frame_id(index))
        self.sent[self.frame_id(index)] = time.monotonic()
        frame = yuv_frame(image)
        frame.pts = int((due - self._start) * 90_000)
        frame.time_base = TIME_BASE
        return frame


@dataclass
class OutputProbe:
    """Consumes a received video track; records each new frame ID and its glass-to-glass latency."""

    camera: CodedCamera | None = None
    frames: int = 0
    first_frame_at: float | None = None
    records: list[tuple[float, int, float]] = field(default_factory=list)  # (time, id, latency s)
    foreign_ids: list[int] = field(default_factory=list)  # IDs this client never sent
    last_image: np.ndarray | None = None
    _last_id: int | None = None

    async def consume(self, track: MediaStreamTrack) -> None:
        async for frame in video_frames(track):
            now = time.monotonic()
            image = frame_rgb(frame)
            self.frames += 1
            self.last_image = image
            frame_id = read_id(image)
            if frame_id is None or frame_id == self._last_id:
                continue  # not coded yet, or the playout clock repeating a frame
            self._last_id = frame_id
            if self.first_frame_at is None:
                self.first_frame_at = now
            if self.camera is None:
                continue
            sent = self.camera.sent.get(frame_id)
            if sent is None:
                self.foreign_ids.append(frame_id)
            else:
                self.records.append((now, frame_id, now - sent))

    def latencies(self, since: float = 0.0, until: float = float("inf")) -> np.ndarray:
        return np.array([lat for t, _, lat in self.records if since <= t < until])


def http(
    method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """A blocking HTTP request that returns error statuses instead of raising."""
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


@dataclass
class ProbeSession:
    pc: RTCPeerConnection
    camera: CodedCamera
    probe: OutputProbe
    stream_id: str
    started: float
    channel: Any
    replies: list[dict[str, Any]]
    # The stream's capabilities (docs/security.md): the owner token controls and stops it.
    owner_token: str = ""
    viewer_token: str = ""

    async def close(self) -> None:
        await self.pc.close()


async def open_session(base_url: str, camera: CodedCamera, **options: Any) -> ProbeSession:
    """Publish ``camera`` through POST /api/offer and start probing the stylized track that comes back."""
    started = time.monotonic()
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    probe = OutputProbe(camera)
    replies: list[dict[str, Any]] = []
    tasks: list[asyncio.Task[None]] = []
    pc.addTrack(camera)
    complete_video_frames_on_marker(pc)  # the stylized track comes back on this transceiver
    channel = pc.createDataChannel("control")

    @channel.on("message")
    def on_message(message: str) -> None:
        replies.append(json.loads(message))

    @pc.on("track")
    def on_track(track: MediaStreamTrack) -> None:
        tasks.append(asyncio.ensure_future(probe.consume(track)))

    await pc.setLocalDescription(await pc.createOffer())
    body = json.dumps({"sdp": pc.localDescription.sdp, "type": "offer", **options}).encode()
    status, _, raw = await asyncio.to_thread(
        http, "POST", f"{base_url}/api/offer", body, {"Content-Type": "application/json"}
    )
    if status != 200:
        await pc.close()
        raise RuntimeError(f"offer refused: {status} {raw.decode(errors='replace')}")
    answer = json.loads(raw)
    await pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type="answer"))
    install_vp8_encoders(pc, lambda _: CameraVp8Encoder())  # the camera sends as a browser's would
    return ProbeSession(pc, camera, probe, answer["stream_id"], started, channel, replies,
                        answer.get("owner_token", ""), answer.get("viewer_token", ""))


@dataclass
class WhipSession:
    """A WHIP publisher (RFC 9725), as OBS publishes: its session URL (the 201's Location, a
    capability of its own) is what ends it; the stream id is what viewers need."""

    pc: RTCPeerConnection
    camera: CodedCamera
    stream_id: str
    location: str  # absolute URL of the publisher's session
    owner_token: str
    viewer_token: str

    async def end(self) -> int:
        """DELETE on the Location with no other credential, then close the peer; the DELETE's status."""
        status = (await asyncio.to_thread(http, "DELETE", self.location))[0]
        await self.pc.close()
        return status

    async def close(self) -> None:
        await self.pc.close()


async def open_whip_session(base_url: str, camera: CodedCamera, token: str | None = None, **options: Any) -> WhipSession:
    """Publish ``camera`` through POST /whip (``options`` as the query: prompt, steps, ...)."""
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver(camera, direction="sendonly")
    await pc.setLocalDescription(await pc.createOffer())
    headers = {"Content-Type": "application/sdp", **({"Authorization": f"Bearer {token}"} if token else {})}
    query = f"?{urllib.parse.urlencode(options)}" if options else ""
    status, head, raw = await asyncio.to_thread(
        http, "POST", f"{base_url}/whip{query}", pc.localDescription.sdp.encode(), headers
    )
    if status != 201:
        await pc.close()
        raise RuntimeError(f"WHIP publish refused: {status} {raw.decode(errors='replace')}")
    head = {k.lower(): v for k, v in head.items()}
    await pc.setRemoteDescription(RTCSessionDescription(sdp=raw.decode(), type="answer"))
    install_vp8_encoders(pc, lambda _: CameraVp8Encoder())
    return WhipSession(pc, camera, head["x-diffcast-stream-id"], urllib.parse.urljoin(f"{base_url}/", head["location"]),
                       head.get("x-diffcast-owner-token", ""), head.get("x-diffcast-viewer-token", ""))


@dataclass
class WhepViewer:
    """A WHEP viewer (`/whep/<stream id>`) reading the stream's output with an `OutputProbe`."""

    pc: RTCPeerConnection
    probe: OutputProbe
    location: str  # absolute URL of the viewer's session

    async def close(self) -> None:
        await self.pc.close()


async def open_whep_viewer(base_url: str, stream_id: str, probe: OutputProbe | None = None,
                           token: str | None = None) -> WhepViewer:
    """Watch a stream through POST /whep/<stream id> (``token``: a viewer or owner token, where viewing
    is not public); ``probe`` reads what arrives (a new one, without a camera, by default)."""
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    probe = probe if probe is not None else OutputProbe()
    pc.on("track", lambda track: asyncio.ensure_future(probe.consume(track)))
    pc.addTransceiver("video", direction="recvonly")
    complete_video_frames_on_marker(pc)
    await pc.setLocalDescription(await pc.createOffer())
    headers = {"Content-Type": "application/sdp", **({"Authorization": f"Bearer {token}"} if token else {})}
    status, head, raw = await asyncio.to_thread(
        http, "POST", f"{base_url}/whep/{stream_id}", pc.localDescription.sdp.encode(), headers)
    if status != 201:
        await pc.close()
        raise RuntimeError(f"WHEP viewer refused: {status} {raw.decode(errors='replace')}")
    head = {k.lower(): v for k, v in head.items()}
    await pc.setRemoteDescription(RTCSessionDescription(sdp=raw.decode(), type="answer"))
    return WhepViewer(pc, probe, urllib.parse.urljoin(f"{base_url}/", head["location"]))
