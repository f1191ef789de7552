"""Stylized video to a virtual camera (pyvirtualcam): OBS Virtual Camera, v4l2loopback, or any
backend registered with ``pyvirtualcam.register_backend``.

Sources are plain iterators of uint8 RGB frames: a local camera, a video file, or the output of a
stream on a running diffcast server (pulled over WHEP). Camera and file frames go through a local
engine stream chunk by chunk; a server stream is already stylized. `VirtualCamSink` fits each
frame to the camera size and paces sends at the camera's frame rate.
"""

from __future__ import annotations

import asyncio
import logging
import platform
import queue
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from app.server.media.jitter import complete_video_frames_on_marker
from engine.aspect import fit_frame

log = logging.getLogger(__name__)

# What to do when no virtual camera exists, per `platform.system()`.
SETUP_STEPS: dict[str, str] = {
    "Linux": (
        "Linux needs the v4l2loopback kernel module:\n"
        "  sudo apt install v4l2loopback-dkms v4l2loopback-utils   # Fedora: dnf install v4l2loopback\n"
        '  sudo modprobe v4l2loopback devices=1 exclusive_caps=1 card_label="diffcast"\n'
        "  v4l2-ctl --list-devices        # shows the new /dev/videoN ('diffcast')\n"
        "then run this command again (add --device /dev/videoN to pick one). To load it at boot:\n"
        "  echo v4l2loopback | sudo tee /etc/modules-load.d/v4l2loopback.conf\n"
        '  echo \'options v4l2loopback devices=1 exclusive_caps=1 card_label="diffcast"\' | '
        "sudo tee /etc/modprobe.d/v4l2loopback.conf"
    ),
    "Darwin": (
        "macOS uses OBS Studio's virtual camera:\n"
        "  1. install OBS Studio >= 30 (https://obsproject.com) and open it once;\n"
        "  2. click 'Start Virtual Camera' once and allow the system extension\n"
        "     (System Settings -> Privacy & Security), then 'Stop Virtual Camera';\n"
        "  3. quit OBS (the camera can have only one producer) and run this command again."
    ),
    "Windows": (
        "Windows uses OBS Studio's virtual camera:\n"
        "  1. install OBS Studio >= 26 (https://obsproject.com);\n"
        "  2. in OBS click 'Start Virtual Camera' once (this registers the device), then 'Stop Virtual Camera';\n"
        "  3. close OBS (the camera can have only one producer) and run this command again.\n"
        "  (Unity Capture also works: --backend unitycapture.)"
    ),
}


class VirtualCameraError(RuntimeError):
    """No usable virtual camera; the message says how to set one up."""


def setup_message(system: str, reasons: str) -> str:
    steps = SETUP_STEPS.get(system, "\n\n".join(f"{name}:\n{text}" for name, text in SETUP_STEPS.items()))
    detail = reasons.strip() or "no virtual camera backend is available on this system"
    return f"cannot open a virtual camera ({detail}).\n\n{steps}"


def open_camera(
    width: int, height: int, fps: float, backend: str | None = None, device: str | None = None
) -> Any:
    """A `pyvirtualcam.Camera` taking RGB frames; VirtualCameraError with setup steps if none opens."""
    import pyvirtualcam
    from pyvirtualcam.camera import BACKENDS

    if backend is not None and backend not in BACKENDS:
        known = ", ".join(sorted(BACKENDS)) or "none"
        raise VirtualCameraError(
            setup_message(platform.system(), f"backend {backend!r} is not available here; available: {known}")
        )
    try:
        return pyvirtualcam.Camera(
            width, height, fps, fmt=pyvirtualcam.PixelFormat.RGB, backend=backend, device=device
        )
    except RuntimeError as exc:  # pyvirtualcam joins every backend's failure into one message
        raise VirtualCameraError(setup_message(platform.system(), str(exc))) from exc


class VirtualCamSink:
    """Sends RGB frames of any size to a virtual camera: centre-crop + resize, then paced sends.

    Frames go out at most at the camera's fps, one period apart. After a stall (a chunk that took
    longer than its frames' playing time) the clock restarts instead of catching up: pyvirtualcam's
    own ``sleep_until_next_frame`` adapts to a steady per-frame cost and sends bursts faster than
    the rate when frames arrive a chunk at a time.
    """

    def __init__(self, camera: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.camera = camera
        self.size = (int(camera.width), int(camera.height))
        self.frames = 0
        self._period = 1.0 / float(camera.fps)
        self._clock = clock
        self._due: float | None = None

    def send(self, frame: np.ndarray) -> None:
        image = np.ascontiguousarray(fit_frame(frame, self.size))
        now = self._clock()
        start = now if self._due is None else max(now, self._due)
        if start > now:
            time.sleep(start - now)
        self.camera.send(image)
        self.frames += 1
        self._due = start + self._period

    def play(self, frames: Iterable[np.ndarray], max_frames: int | None = None) -> int:
        for frame in frames:
            if max_frames is not None and self.frames >= max_frames:
                break
            self.send(frame)
        return self.frames

    def close(self) -> None:
        self.camera.close()


# -- sources ---------------------------------------------------------------------------------------


def camera_frames(index: int = 0) -> Iterator[np.ndarray]:
    """Frames from a local camera (OpenCV), RGB."""
    import cv2

    capture = cv2.VideoCapture(index)
    if not capture.isOpened():
        raise VirtualCameraError(
            f"cannot open camera {index}: no webcam found or it is in use by another program "
            "(close other apps using it, or use --source FILE / stream:<id>)"
        )
    try:
        while True:
            ok, bgr = capture.read()
            if not ok:
                raise VirtualCameraError(f"camera {index} stopped delivering frames")
            yield cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
    finally:
        capture.release()


def file_frames(path: Path, size: tuple[int, int] | None, loop: bool = False) -> Iterator[np.ndarray]:
    """Frames of a video file at ``size`` (centre-cropped to its aspect; None: the file's own), optionally
    looped forever."""
    from engine.video_io import read_frames

    while True:
        frames, _, _ = read_frames(path, size)
        yield from frames
        if not loop:
            return


def stylized_frames(frames: Iterable[np.ndarray], stream: Any) -> Iterator[np.ndarray]:
    """Run frames through an engine stream chunk by chunk (first chunk, then full chunks)."""
    pending: list[np.ndarray] = []
    for frame in frames:
        pending.append(frame)
        if len(pending) == stream.expected_frames:
            yield from stream.process(np.stack(pending))
            pending = []


def whep_frames(server: str, stream_id: str, token: str | None = None, timeout_s: float = 20.0) -> Iterator[np.ndarray]:
    """The stylized output of ``stream_id`` on a running server, pulled over WHEP.

    aiortc runs on its own event loop in a background thread; the newest decoded frame waits in a
    one-slot queue (latest frame wins), so a slow consumer never builds up delay.
    """
    frames: queue.Queue[np.ndarray | BaseException | None] = queue.Queue(maxsize=1)
    stop = threading.Event()

    def offer(item: np.ndarray | BaseException | None) -> None:
        while True:
            try:
                frames.put_nowait(item)
                return
            except queue.Full:
                try:
                    frames.get_nowait()
                except queue.Empty:
                    pass

    async def pull() -> None:
        from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
        from aiortc.mediastreams import MediaStreamError

        from app.client import http

        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        pc.addTransceiver("video", direction="recvonly")
        complete_video_frames_on_marker(pc)
        track_ready: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        @pc.on("track")
        def on_track(track: Any) -> None:
            if not track_ready.done():
                track_ready.set_result(track)

        try:
            await pc.setLocalDescription(await pc.createOffer())
            headers = {"Content-Type": "application/sdp"}
            if token:
                headers["Authorization"] = f"Bearer {token}"
            url = f"{server.rstrip('/')}/whep/{urllib.parse.quote(stream_id)}"
            status, head, body = await asyncio.to_thread(http, "POST", url, pc.localDescription.sdp.encode(), headers)
            if status != 201:
                raise VirtualCameraError(f"WHEP {url} answered {status}: {body.decode(errors='replace').strip()}")
            location = urllib.parse.urljoin(url, head.get("Location") or head.get("location") or "")
            await pc.setRemoteDescription(RTCSessionDescription(sdp=body.decode(), type="answer"))
            track = await asyncio.wait_for(track_ready, timeout_s)
            try:
                while not stop.is_set():
                    frame = await asyncio.wait_for(track.recv(), timeout_s)
                    offer(frame.to_ndarray(format="rgb24"))
            except (MediaStreamError, TimeoutError):
                log.info("stream %s ended", stream_id)
            finally:
                await asyncio.to_thread(http, "DELETE", location, None, headers)
        finally:
            await pc.close()

    def run() -> None:
        try:
            asyncio.run(pull())
            offer(None)
        except BaseException as exc:  # handed to the consumer thread, which raises it
            offer(exc)

    host = urllib.parse.urlparse(server).hostname or ""
    if host in ("127.0.0.1", "localhost"):
        # aioice drops loopback host candidates; a server on this machine needs them (docs/architecture.md, "Library facts").
        from app.server.media.ice import allow_loopback_candidates

        allow_loopback_candidates()
    thread = threading.Thread(target=run, name="whep-pull", daemon=True)
    thread.start()
    try:
        while True:
            item = frames.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=5)
