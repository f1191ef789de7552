"""NDI out and in, for real on loopback: cyndilib's own receivers and senders against a live server.

The NDI runtime is configured for this machine alone (``NDI_CONFIG_DIR``: discovery of 127.0.0.1
only, no multicast, loopback adapter only), before cyndilib loads. Frames are matched by the
frame IDs that ``trace_stamp`` copies from each input frame onto the output made from it.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from fractions import Fraction
from pathlib import Path
from types import ModuleType
from typing import Any

import cv2
import numpy as np
import pytest
from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription

from app.avsync import BeepMicrophone
from app.client import CodedCamera, http, pattern_frame, video_frames
from app.server.media.frame_path import ChunkAssembler
from app.server.media.framecode import band_height, draw_id, read_id
from app.server.media.ndi import BGRA, MISSING, NdiError, SourceNames, rgb_image, rgbx_bytes
from app.server.media.ndi_in import NdiInput, NdiInputConfig

Live = Callable[..., AbstractContextManager[str]]

# Discovery of this machine only: no multicast, the loopback adapter only (libndi 6 has no key that
# turns mDNS off; with only the loopback adapter allowed it stays on this machine).
LOOPBACK = {"ndi": {"networks": {"ips": "127.0.0.1", "discovery": ""}, "adapters": {"allowed": "127.0.0.1"},
                    "multicast": {"send": {"enable": False}, "recv": {"enable": False}}}}
DEADLINE_S = 60.0  # generous: waits end as soon as what they wait for happens


@pytest.fixture(scope="session")
def cy(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    """cyndilib, loaded with the loopback configuration (skipped without the ndi extra)."""
    directory = tmp_path_factory.mktemp("ndi-config")
    (directory / "ndi-config.v1.json").write_text(json.dumps(LOOPBACK))
    os.environ["NDI_CONFIG_DIR"] = str(directory)
    return pytest.importorskip("cyndilib", reason=MISSING)


def thumb(image: np.ndarray) -> np.ndarray:
    """Grey 32x32 of the picture below the frame-ID band."""
    body = image[band_height(image.shape[0]) :]
    return cv2.resize(cv2.cvtColor(body, cv2.COLOR_RGB2GRAY), (32, 32), interpolation=cv2.INTER_AREA).astype(np.float32)


async def wait_for(condition: Callable[[], bool], what: str | Callable[[], str], timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what if isinstance(what, str) else what()}"
        await asyncio.sleep(0.1)


async def call(method: str, url: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    status, _, raw = await asyncio.to_thread(http, method, url, data, headers)
    return status, json.loads(raw) if raw else None


def audio_stats(url: str, stream_id: str) -> dict[str, Any]:
    """The stream's audio fields, for a failure's message."""
    stats = json.loads(http("GET", f"{url}/api/streams/{stream_id}")[2])
    return {key: stats.get(key) for key in ("audio", "audio_delay_ms", "audio_resyncs", "ndi_out", "latency_ms")}


def main_frequency(chunks: list[np.ndarray], rate: int = 48_000) -> float | None:
    """The strongest frequency (Hz) of the last second of audio; None until that second is loud."""
    last = np.concatenate(chunks)[-rate:] if chunks else np.zeros(0)
    if len(last) < rate or np.abs(last[: rate // 10]).max() < 0.1 or np.abs(last[-rate // 10 :]).max() < 0.1:
        return None
    return float(np.argmax(np.abs(np.fft.rfft(last))[1:]) + 1)  # 1 Hz bins


class Frames:
    """A video track's new frames by frame ID (thumbnails)."""

    def __init__(self) -> None:
        self.by_id: dict[int, np.ndarray] = {}

    def add(self, image: np.ndarray) -> None:
        frame_id = read_id(image)
        if frame_id is not None and frame_id not in self.by_id:
            self.by_id[frame_id] = thumb(image)

    async def consume(self, track: MediaStreamTrack) -> None:
        async for frame in video_frames(track):
            self.add(frame.to_ndarray(format="rgb24"))


class NdiWatcher:
    """cyndilib's Finder and a FrameSync receiver, polled on a thread of their own."""

    def __init__(self, cy: ModuleType) -> None:
        self.cy = cy
        self.finder = cy.Finder()
        self.finder.open()
        self.frames = Frames()
        self.audio_peak = 0.0
        self.polls = 0
        self.audio: list[np.ndarray] = []  # the first channel, as captured
        self.error: Exception | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def names(self) -> list[str]:
        self.finder.update_sources()
        return list(self.finder.get_source_names())

    def named(self, label: str) -> str | None:
        return next((n for n in self.names() if n.endswith(f" ({label})")), None)

    def receive(self, name: str) -> None:
        self._thread = threading.Thread(target=self._receive, args=(name,), daemon=True)
        self._thread.start()

    def _receive(self, name: str) -> None:
        try:
            self._poll(name)
        except Exception as exc:  # said by the test's wait, which would otherwise only time out
            self.error = exc

    def _poll(self, name: str) -> None:
        cy = self.cy
        receiver = cy.Receiver(color_format=cy.RecvColorFormat.RGBX_RGBA, bandwidth=cy.RecvBandwidth.highest)
        video, sound = cy.VideoFrameSync(), cy.AudioFrameSync()
        receiver.frame_sync.set_video_frame(video)
        receiver.frame_sync.set_audio_frame(sound)
        receiver.connect_to(self.finder.get_source(name))
        last = None
        clock = time.monotonic()
        while not self._stop.is_set():
            self.polls += 1
            receiver.frame_sync.capture_video()
            width, height = video.get_resolution()
            if width and video.get_timestamp_posix() != last:
                last = video.get_timestamp_posix()
                self.frames.add(rgb_image(video.get_array(), int(video.get_fourcc()), width, height,
                                          video.get_line_stride()))
            wanted = int((time.monotonic() - clock) * 48_000)  # the samples due since the last capture
            if wanted >= 480:
                clock += wanted / 48_000
                if receiver.frame_sync.capture_audio(wanted):
                    samples = sound.get_array()[0]
                    self.audio_peak = max(self.audio_peak, float(np.abs(samples).max(initial=0.0)))
                    self.audio.append(samples)
                    del self.audio[:-200]  # the last few seconds
            time.sleep(0.005)
        receiver.disconnect()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.finder.close()


async def publish(url: str, camera: CodedCamera, label: str) -> tuple[RTCPeerConnection, dict[str, Any], Frames]:
    """The page's way in, with a beeping microphone; the stylized video that comes back, by frame ID."""
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver(camera, direction="sendrecv")
    pc.addTransceiver(BeepMicrophone(every_s=0.5, first_s=0.2), direction="sendrecv")
    pc.createDataChannel("control")
    back = Frames()

    @pc.on("track")
    def on_track(track: MediaStreamTrack) -> None:
        if track.kind == "video":
            asyncio.ensure_future(back.consume(track))

    await pc.setLocalDescription(await pc.createOffer())
    status, answer = await call("POST", f"{url}/api/offer",
                                {"sdp": pc.localDescription.sdp, "type": "offer", "label": label})
    assert status == 200, answer
    await pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type="answer"))
    return pc, answer, back


async def test_ndi_out_publishes_the_stylized_output_with_audio_under_distinct_names(cy: ModuleType, live_server: Live) -> None:
    stage = f"stage {os.getpid()}"  # NDI names are machine-wide: another test run's must not collide
    watcher = NdiWatcher(cy)
    with live_server(max_streams=2, ndi_out=True, trace_stamp=True) as url:
        camera = CodedCamera((128, 128), fps=15)
        pc, answer, back = await publish(url, camera, stage)
        sid, owner = answer["stream_id"], answer["owner_token"]
        await wait_for(lambda: len(back.by_id) > 3, "the stylized output over WebRTC")
        assert watcher.named(stage) is None  # nothing is published before the owner asks
        assert await call("POST", f"{url}/api/streams/{sid}/control", {"type": "update", "ndi_out": True}, owner) == (
            200, {"type": "ack", "applied": "update"})
        await wait_for(lambda: watcher.named(stage) is not None, "the NDI source")
        assert (await call("GET", f"{url}/api/streams/{sid}"))[1]["ndi_out"] == stage
        watcher.receive(str(watcher.named(stage)))

        # The same frames as the WebRTC output, frame ID by frame ID, with the microphone's beeps.
        def common() -> list[int]:
            return sorted(set(watcher.frames.by_id) & set(back.by_id))

        await wait_for(lambda: len(common()) >= 8 and watcher.audio_peak > 0.1, lambda: (
            f"NDI frames and audio: {len(watcher.frames.by_id)} NDI frames ({watcher.polls} polls), {len(back.by_id)} "
            f"WebRTC frames, {len(common())} in common, audio peak {watcher.audio_peak}, sources {watcher.names()}, "
            f"receiver error {watcher.error!r}, stream {audio_stats(url, sid)}"))
        assert set(watcher.frames.by_id) <= set(camera.sent), "NDI frames that no input frame made"
        for frame_id in common()[-8:]:
            ndi, webrtc = watcher.frames.by_id[frame_id], back.by_id[frame_id]
            source = thumb(pattern_frame(frame_id - camera.id_offset, camera.size))
            to_webrtc, to_input = float(np.abs(ndi - webrtc).mean()), float(np.abs(ndi - source).mean())
            assert to_webrtc < to_input / 2, (frame_id, to_webrtc, to_input)  # the stylized output, not the camera

        # A second stream with the same label gets a distinct name: not "<label> 2" either, which
        # another program on this machine publishes already; switched off, its source leaves.
        holder = NdiCamera(cy, f"{stage} 2", (64, 48))
        try:
            pc2, answer2, _ = await publish(url, CodedCamera((96, 96), fps=15, variant=1), stage)
            control2 = f"{url}/api/streams/{answer2['stream_id']}/control"
            assert (await call("POST", control2, {"type": "update", "ndi_out": True}, answer2["owner_token"]))[0] == 200
            await wait_for(lambda: watcher.named(f"{stage} 3") is not None, "the second stream's NDI source")
            assert watcher.named(stage) is not None
            assert (await call("GET", f"{url}/api/streams/{answer2['stream_id']}"))[1]["ndi_out"] == f"{stage} 3"
            assert (await call("POST", control2, {"type": "update", "ndi_out": False}, answer2["owner_token"]))[0] == 200
            await wait_for(lambda: watcher.named(f"{stage} 3") is None, "the switched-off source to leave")
            await pc2.close()
        finally:
            holder.close()

        # The stream ends: its source leaves the network.
        assert (await call("DELETE", f"{url}/api/streams/{sid}", token=owner))[0] == 204
        await pc.close()
        await wait_for(lambda: watcher.named(stage) is None, "the ended stream's source to leave", timeout_s=10)
    watcher.close()


async def test_ndi_out_is_refused_unless_the_operator_turned_it_on(live_server: Live) -> None:
    with live_server(max_streams=1) as url:
        pc, answer, back = await publish(url, CodedCamera((64, 64), fps=15), "stage")
        control = f"{url}/api/streams/{answer['stream_id']}/control"
        status, reply = await call("POST", control, {"type": "update", "ndi_out": True, "prompt": "charcoal drawing"},
                                   answer["owner_token"])
        assert status == 422 and "diffcast serve --ndi-out" in reply["message"], reply
        stats = (await call("GET", f"{url}/api/streams/{answer['stream_id']}"))[1]
        assert stats["ndi_out"] is None and stats["prompt"] != "charcoal drawing"  # nothing of it applied
        assert (await call("POST", control, {"type": "update", "noise_scale": 0.5}, answer["owner_token"]))[0] == 200
        await pc.close()


def streams(url: str) -> list[dict[str, Any]]:
    """GET /api/streams (open to a local client)."""
    result: list[dict[str, Any]] = json.loads(http("GET", f"{url}/api/streams")[2])
    return result


class NdiCamera:
    """A cyndilib sender with moving, frame-ID-coded pictures and a tone, on a thread of its own."""

    def __init__(self, cy: ModuleType, name: str, size: tuple[int, int], fps: float = 15.0) -> None:
        self.size, self.fps = size, fps
        self.sender = cy.Sender(name, clock_video=False, clock_audio=False)
        video = cy.VideoSendFrame()
        video.set_resolution(*size)
        video.set_fourcc(cy.FourCC.RGBX)
        video.set_frame_rate(Fraction(round(fps)))
        self.sender.set_video_frame(video)
        sound = cy.AudioSendFrame()
        sound.sample_rate, sound.num_channels = 48_000, 2
        sound.set_max_num_samples(round(48_000 / fps))
        self.sender.set_audio_frame(sound)
        self.sender.open()
        self.name = self.sender.name  # "MACHINE (name)"
        self.sent = 0  # frames sent so far: their IDs are 0 .. sent - 1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._send, daemon=True)
        self._thread.start()

    def _send(self) -> None:
        period, n = 1.0 / self.fps, 0
        samples = round(48_000 * period)  # a frame period of sound with each frame
        start = time.monotonic()
        while not self._stop.is_set():
            image = pattern_frame(n, self.size)
            draw_id(image, n)
            # A 440 Hz tone, its phase carried from frame to frame.
            tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(n * samples, (n + 1) * samples) / 48_000)).astype(np.float32)
            self.sender.write_video_and_audio(rgbx_bytes(image), np.stack([tone, tone]))
            n += 1
            self.sent = n
            time.sleep(max(0.0, start + n * period - time.monotonic()))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.sender.close()


async def test_ndi_in_is_a_stream_camera_and_the_api_opens_only_allowed_sources(cy: ModuleType, live_server: Live,
                                                                                 tmp_path: Path) -> None:
    camera = NdiCamera(cy, f"diffcast test cam {os.getpid()}", (160, 120))
    watcher = NdiWatcher(cy)
    try:
        with live_server(max_streams=3, ndi_in=camera.name, ndi_allow=("* (diffcast test *)",),
                         trace_stamp=True, ndi_out=True, record_dir=str(tmp_path)) as url:
            await wait_for(lambda: len(streams(url)) == 1, "the --ndi-in stream")
            stream = streams(url)[0]
            assert stream["kind"] == "ndi" and stream["label"] == camera.name and stream["audio"] is True
            sid = stream["stream_id"]

            # A WHEP viewer sees the camera's pictures, restyled: the frame IDs of the NDI frames come
            # back, and under the band each output keeps the input's layout but not its pixels.
            viewer = RTCPeerConnection(RTCConfiguration(iceServers=[]))
            viewer.addTransceiver("video", direction="recvonly")
            seen = Frames()
            viewer.on("track", lambda track: asyncio.ensure_future(seen.consume(track)))
            await viewer.setLocalDescription(await viewer.createOffer())
            status, _, raw = await asyncio.to_thread(http, "POST", f"{url}/whep/{sid}",
                                                     viewer.localDescription.sdp.encode(),
                                                     {"Content-Type": "application/sdp"})
            assert status == 201, raw
            await viewer.setRemoteDescription(RTCSessionDescription(sdp=raw.decode(), type="answer"))
            await wait_for(lambda: len(seen.by_id) >= 12, "the NDI camera's stylized frames")
            for frame_id in sorted(seen.by_id)[-6:]:
                out, source = seen.by_id[frame_id], thumb(pattern_frame(frame_id, camera.size))
                assert float(np.abs(out - source).mean()) > 4, "the output is the input itself, not restyled"
                structure = np.corrcoef(cv2.Sobel(out, cv2.CV_32F, 1, 0).ravel(),
                                        cv2.Sobel(source, cv2.CV_32F, 1, 0).ravel())[0, 1]
                assert structure > 0.3, (frame_id, structure)  # the input's edges, where the input has them
            stats = (await call("GET", f"{url}/api/streams/{sid}"))[1]
            assert (stats["input_width"], stats["input_height"]) == camera.size  # the source's resolution
            assert abs(stats["width"] / stats["height"] - 4 / 3) < 0.15  # and its aspect
            await viewer.close()

            # Through the API: only the sources the operator allows; an unknown one is said plainly.
            status, reply = await call("POST", f"{url}/api/ndi", {"source": "ELSEWHERE (camera 1)"})
            assert status == 403 and "--ndi-allow" in reply["detail"], reply
            status, reply = await call("POST", f"{url}/api/ndi", {"source": "NOWHERE (diffcast test ghost)"})
            assert status == 404 and "no NDI source 'NOWHERE (diffcast test ghost)'" in reply["detail"], reply
            status, reply = await call("POST", f"{url}/api/ndi", {"source": camera.name, "label": "second view",
                                                                  "noise_scale": 7})
            assert status == 422, reply
            status, reply = await call("POST", f"{url}/api/ndi", {"source": camera.name, "label": "second view"})
            assert status == 200 and reply["owner_token"], reply
            second = f"{url}/api/streams/{reply['stream_id']}"
            await wait_for(lambda: json.loads(http("GET", second)[2])["frames_out"] > 0, "the API stream's output")
            assert (await call("POST", f"{second}/control", {"type": "update", "prompt": "charcoal drawing"},
                               reply["owner_token"]))[0] == 200
            assert (await call("GET", f"{url}/api/streams/{sid}"))[0] == 200  # the first one undisturbed

            # NDI in to NDI out: the source's frames restyled, and its tone passed through (and recorded).
            assert (await call("POST", f"{second}/control", {"type": "update", "ndi_out": True, "record": True},
                               reply["owner_token"]))[0] == 200
            await wait_for(lambda: watcher.named("second view") is not None, "the API stream's NDI source")
            watcher.receive(str(watcher.named("second view")))
            await wait_for(lambda: len(watcher.frames.by_id) >= 3 and watcher.audio_peak > 0.1, lambda: (
                f"frames and the tone back over NDI: {len(watcher.frames.by_id)} frames, peak {watcher.audio_peak}, "
                f"receiver error {watcher.error!r}"))
            assert max(watcher.frames.by_id) < camera.sent, "frame IDs the NDI camera never sent"
            # The source's sound itself, not just sound: its 440 Hz tone is the strongest frequency.
            await wait_for(lambda: main_frequency(watcher.audio) is not None, "a loud second of the tone")
            assert 437 <= float(main_frequency(watcher.audio) or 0) <= 443, main_frequency(watcher.audio)

            # The source vanishes: both its streams end, and the recording tells the owner why.
            camera.close()
            await wait_for(lambda: not streams(url), "the streams to end")
            recordings = f"{second}/recordings"
            await wait_for(lambda: http("GET", recordings, None, {"Authorization": f"Bearer {reply['owner_token']}"})[0]
                           == 200, "the recordings")
            listing = (await call("GET", recordings, token=reply["owner_token"]))[1]
            assert [item["ended"] for item in listing] == [f"NDI source {camera.name!r} vanished"], listing
            # And the stream itself says so to its owner (410 with the reason), to no one else.
            status, gone = await call("GET", second, token=reply["owner_token"])
            assert status == 410 and f"NDI source {camera.name!r} vanished" in gone["detail"], (status, gone)
            assert (await call("GET", second))[0] == 401  # as for any id that is not a live stream
    finally:
        camera.close()
        watcher.close()


async def test_an_unknown_ndi_in_source_is_said_plainly(cy: ModuleType, caplog: pytest.LogCaptureFixture) -> None:
    assembler = ChunkAssembler(capacity=4)
    await NdiInput("NOWHERE (diffcast test ghost)", assembler, None, NdiInputConfig(find_s=1.0)).run()
    assert "no NDI source 'NOWHERE (diffcast test ghost)' on the network after 1 s" in caplog.text
    assert assembler.received == 0


def test_pixel_layouts_and_source_names() -> None:
    image = np.arange(3 * 5 * 3, dtype=np.uint8).reshape(3, 5, 3)
    padded = np.zeros((3, 6, 4), np.uint8)  # a line stride of 6 pixels for a 5-pixel-wide frame
    padded[:, :5, :3] = image[..., ::-1]  # BGRA: blue first
    np.testing.assert_array_equal(rgb_image(padded.reshape(-1), BGRA, 5, 3, 24), image)
    np.testing.assert_array_equal(rgbx_bytes(image).reshape(3, 5, 4)[..., :3], image)
    uyvy = int.from_bytes(b"UYVY", "little")
    with pytest.raises(NdiError, match="sends video as UYVY, which diffcast does not take"):
        rgb_image(padded.reshape(-1), uyvy, 5, 3, 24)
    with pytest.raises(NdiError, match="not a whole frame"):
        rgb_image(padded.reshape(-1)[:40], BGRA, 5, 3, 24)

    names = SourceNames()
    assert [names.claim("stage"), names.claim("stage"), names.claim("stage")] == ["stage", "stage 2", "stage 3"]
    names.release("stage 2")
    assert names.claim("stage") == "stage 2"


def test_ndi_flags(cy: ModuleType) -> None:
    from app.cli import build_parser
    from app.server.config import ServerConfig

    args = build_parser().parse_args(["serve", "--ndi-out", "--ndi-in", "STUDIO (cam 1)", "--ndi-allow", "STUDIO (*)",
                                      "--ndi-allow", "VJ (*)"])
    config = ServerConfig.from_args(args)
    assert (config.ndi_out, config.ndi_in, config.ndi_allow) == (True, "STUDIO (cam 1)", ("STUDIO (*)", "VJ (*)"))
    with pytest.raises(ValueError, match="--ndi-in names an NDI source"):
        ServerConfig(ndi_in=" ")
