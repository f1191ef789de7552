"""An NDI source as a stream's camera: its frames go into the stream's ChunkAssembler, as a WebRTC
camera's do, and its audio into the stream's AudioPlayout; the stream's size follows the source's
aspect and its frame rate follows the source (every new frame is pushed as it arrives).

A thread of the input's own finds the source, connects, and polls libndi's frame synchroniser
(docs/ndi.md: cyndilib's blocking receive holds the GIL), handing each new frame to the event loop.
The source vanishing ends the stream, with the reason logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import av
import numpy as np

from app.server.media.audio import SAMPLE_RATE, AudioPlayout
from app.server.media.frame_path import ChunkAssembler
from app.server.media.ndi import NdiError, rgb_image, runtime
from app.server.serving.engine_bridge import StreamSettings
from app.server.serving.session import Session, SessionManager

log = logging.getLogger(__name__)

AUDIO_CHUNK_S = 0.01  # audio is taken from the source 10 ms or more at a time


@dataclass(frozen=True)
class NdiInputConfig:
    find_s: float = 10.0  # how long a source is looked for before it counts as unknown
    lost_s: float = 2.0  # a source gone from discovery this long has vanished
    poll_s: float = 0.004  # how often the frame synchroniser is read: finer than a 120 fps source's frames


def find_source(finder: Any, name: str, within_s: float) -> Any:
    """The source ``name`` as an open cyndilib Finder sees it; NdiError naming what it does see."""
    deadline = time.monotonic() + within_s
    while True:
        finder.update_sources()
        names = finder.get_source_names()
        if name in names:
            return finder.get_source(name)
        if time.monotonic() >= deadline:
            seen = ", ".join(repr(n) for n in sorted(names)) or "none"
            raise NdiError(f"no NDI source {name!r} on the network after {within_s:g} s (sources seen: {seen})")
        time.sleep(0.1)  # not Finder.wait_for_sources: it holds the GIL while it waits


def source_exists(name: str, within_s: float) -> None:
    """NdiError unless the source ``name`` is on the network within ``within_s`` (blocking). The
    error names no other source: the API's callers may see only the sources the operator allows."""
    finder = runtime().Finder()
    finder.open()
    try:
        find_source(finder, name, within_s)
    except NdiError:
        raise NdiError(f"no NDI source {name!r} on the network (looked for {within_s:g} s)") from None
    finally:
        finder.close()


class NdiInput:
    """One NDI source feeding one stream."""

    def __init__(self, source: str, assembler: ChunkAssembler, audio: AudioPlayout | None,
                 config: NdiInputConfig = NdiInputConfig()) -> None:
        self._cy = runtime()
        self.source = source
        self._assembler = assembler
        self._audio = audio
        self._config = config
        self._stop = threading.Event()
        self.size: tuple[int, int] | None = None
        self.ended: str | None = None  # why the input ended: the source vanished, was never found, ...

    async def run(self) -> None:
        """Until the source vanishes, is never found, or sends what cannot be taken (each logged);
        cancelled with the stream."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        # A thread of its own, not asyncio.to_thread: the loop's default pool is aiortc's codec pool
        # (app/server/app.py), and an input holds its thread for the stream's whole life.
        thread = threading.Thread(target=self._thread, args=(loop, done), name="ndi-in", daemon=True)
        thread.start()
        try:
            await done
        except NdiError as exc:  # said in plain words; the stream ends as for a vanished source
            self.ended = str(exc)
            log.error("NDI input: %s; its stream ends", exc)
        finally:
            self._stop.set()  # cancelled with the stream: the thread stops at its next poll

    def _thread(self, loop: asyncio.AbstractEventLoop, done: asyncio.Future[None]) -> None:
        error: BaseException | None = None
        try:
            self._receive(loop)
        except Exception as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop already closed (the server stopped)
            loop.call_soon_threadsafe(self._settle, done, error)

    @staticmethod
    def _settle(done: asyncio.Future[None], error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    def _receive(self, loop: asyncio.AbstractEventLoop) -> None:
        cy, cfg = self._cy, self._config
        finder = cy.Finder()
        finder.open()
        receiver: Any = None
        try:
            source = find_source(finder, self.source, cfg.find_s)
            receiver = cy.Receiver(color_format=cy.RecvColorFormat.RGBX_RGBA, bandwidth=cy.RecvBandwidth.highest)
            video = cy.VideoFrameSync()
            sound = cy.AudioFrameSync()
            receiver.frame_sync.set_video_frame(video)
            receiver.frame_sync.set_audio_frame(sound)
            receiver.connect_to(source)
            log.info("NDI source %r connected", self.source)
            last_stamp: float | None = None
            audio_pts = 0
            seen_at = time.monotonic()
            next_check = audio_clock = seen_at
            while not self._stop.is_set():
                receiver.frame_sync.capture_video()
                width, height = video.get_resolution()
                stamp = video.get_timestamp_posix()
                if width and stamp != last_stamp:
                    last_stamp = stamp
                    image = rgb_image(video.get_array(), int(video.get_fourcc()), width, height,
                                      video.get_line_stride())
                    if self.size != (width, height):
                        log.info("NDI source %r: %dx%d at %s fps", self.source, width, height,
                                 video.get_frame_rate())
                        self.size = (width, height)
                    loop.call_soon_threadsafe(self._assembler.push, image)
                now = time.monotonic()
                # Audio on this thread's clock: as many samples as the time since the last capture
                # (the frame synchroniser resamples the source to it). Its queue depth, which
                # capture_available_audio takes, read tens of thousands of samples per 4 ms poll
                # here, and capturing that much stretched the sound to silence.
                rate = sound.sample_rate or SAMPLE_RATE
                wanted = int((now - audio_clock) * rate)
                if self._audio is not None and wanted >= rate * AUDIO_CHUNK_S:
                    audio_clock += wanted / rate
                    if receiver.frame_sync.capture_audio(wanted):
                        samples = sound.get_array()
                        loop.call_soon_threadsafe(self._audio.push, self._audio_frame(samples, rate, audio_pts))
                        audio_pts += samples.shape[1]
                if now >= next_check:
                    next_check = now + 0.5
                    finder.update_sources()
                    if self.source in finder.get_source_names():
                        seen_at = now
                    elif now - seen_at > cfg.lost_s:
                        self.ended = f"NDI source {self.source!r} vanished"
                        log.warning("%s; its stream ends", self.ended)
                        return
                time.sleep(cfg.poll_s)
        finally:
            if receiver is not None:
                receiver.disconnect()
            finder.close()

    @staticmethod
    def _audio_frame(samples: np.ndarray, rate: int, pts: int) -> av.AudioFrame:
        """float32 [channels, samples] as a planar PyAV frame (the playout resamples it to 48 kHz stereo)."""
        channels = samples.shape[0]
        layout = "mono" if channels == 1 else "stereo"
        planes = np.ascontiguousarray(samples[:2] if channels > 2 else samples, np.float32)
        frame = av.AudioFrame.from_ndarray(planes, format="fltp", layout=layout)
        frame.sample_rate = rate
        frame.pts = pts
        frame.time_base = Fraction(1, rate)
        return frame


async def open_ndi_stream(manager: SessionManager, source: str, settings: StreamSettings,
                          label: str | None) -> Session:
    """A stream whose camera is the NDI source ``source``, with audio passthrough; it ends when the
    source vanishes. The source is assumed to exist (``source_exists``): one that never appears
    ends the stream with the reason logged (and in a running recording's ``ended``)."""
    session = await manager.open("ndi", settings)
    session.label = label or source
    audio = session.enable_audio()
    ndi = NdiInput(source, session.assembler, audio)

    async def receive() -> None:
        await ndi.run()
        if ndi.ended is not None:  # the owner reads it in the recording's sidecar after the end
            session.end_reason = ndi.ended

    session.spawn(receive(), "ndi-in", ends_session=True)
    return session
