"""One stream's output published as an NDI source: what viewers see, with its audio, in sync.

Like the recorder (app/server/control/recorder.py), the event loop only copies references into a bounded
queue, each playout tick's frame and each audio tick's samples, in the order they are played; a
thread of the output's own converts and hands them to libndi, so neither the event loop nor the
engine waits on NDI. Both playouts tick on the same monotonic clock and each item is sent as it
is played, so a receiver gets the audio as in sync as a WHEP viewer does. The source appears with
the stream's first stylized frame (its size is known then) and goes away when the output closes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from fractions import Fraction
from typing import Any

import numpy as np

from app.server.media.audio import CHANNELS, FRAME_SAMPLES, SAMPLE_RATE, AudioPlayout
from app.server.media.frame_path import Playout
from app.server.media.ndi import NdiError, SourceNames, rgbx_bytes, runtime
from engine.aspect import fit_frame

log = logging.getLogger(__name__)

OPEN_TRIES = 8  # names tried ("stage", "stage 2", ...) when other programs publish the first ones
QUEUE_ITEMS = 256  # about 3 s of video and audio: a sender further behind drops, never blocks the loop


class NdiOutput:
    """A stream's NDI source, named after its label (made distinct by ``names``)."""

    def __init__(self, names: SourceNames, label: str, playout: Playout, audio: AudioPlayout | None,
                 fps: float) -> None:
        self._cyndilib = runtime()  # NdiError at once when the extra is missing
        self._names = names
        self._label = label
        self.name = names.claim(label)
        self._playout = playout
        self._audio = audio
        self._fps = fps
        self.frames = 0
        self.dropped = 0  # items the sender thread was too far behind to take
        self._queue: queue.Queue[tuple[str, np.ndarray]] = queue.Queue(QUEUE_ITEMS)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._send, name="ndi-out", daemon=True)
        self._thread.start()

    def _put(self, kind: str, data: np.ndarray) -> None:
        try:
            self._queue.put_nowait((kind, data))
        except queue.Full:
            self.dropped += 1

    async def feed(self) -> None:
        """Event loop: every playout tick (and audio tick) from now on, until cancelled."""
        await asyncio.gather(self._feed_video(), self._feed_audio())

    async def _feed_video(self) -> None:
        tick = self._playout.tick_count
        while True:
            tick, frame, _ = await self._playout.next_frame(tick)
            if frame.meta is not None or self.frames:  # the black placeholder before the first chunk is not sent
                self.frames += 1
                self._put("video", frame.image)

    async def _feed_audio(self) -> None:
        audio = self._audio
        if audio is None:
            return
        tick = audio.tick_count
        while True:
            tick, samples = await audio.next_frame(tick)
            if self.frames:  # the source exists from the first video frame on
                self._put("audio", samples)

    async def close(self) -> None:
        """Stop sending and take the source off the network (the thread closes the sender)."""
        self._closing.set()  # what is still queued is not sent: the stream has ended or NDI was switched off
        await asyncio.to_thread(self._thread.join)
        self._names.release(self.name)

    # -- the output's thread -------------------------------------------------------------------

    def _send(self) -> None:
        sender: Any = None
        size: tuple[int, int] | None = None
        try:
            while not self._closing.is_set():
                try:
                    kind, data = self._queue.get(timeout=0.1)
                except queue.Empty:
                    continue
                if kind == "video":
                    if sender is None:
                        size = (data.shape[1], data.shape[0])
                        sender = self._open(size)
                    elif size is not None and data.shape[:2] != (size[1], size[0]):
                        data = fit_frame(data, size)  # the sender's size is fixed while it is open
                    sender.write_video_async(rgbx_bytes(data))
                elif sender is not None:
                    # int16 [960, 2] -> the float32 [channels, samples] NDI carries
                    sender.write_audio(np.ascontiguousarray(data.T, np.float32) / 32768.0)
        except Exception:
            log.exception("NDI output %r failed; the stream goes on without it", self.name)
        finally:
            if sender is not None:
                sender.close()
                log.info("NDI source %r closed (%d frames and audio ticks dropped)", self.name, self.dropped)

    def _open(self, size: tuple[int, int]) -> Any:
        """The sender, under the stream's name or, when another program on this machine publishes
        that name already (libndi refuses it: cyndilib raises MemoryError), the next free one."""
        refused: list[str] = []
        try:
            for _ in range(OPEN_TRIES):
                try:
                    sender = self._sender(size)
                    break
                except MemoryError:
                    log.warning("NDI source name %r is taken on this machine; trying the next", self.name)
                    refused.append(self.name)
                    self.name = self._names.claim(self._label)
            else:
                raise NdiError(f"no free NDI source name for {self._label!r} after {OPEN_TRIES} tries")
        finally:
            for name in refused:
                self._names.release(name)
        log.info("NDI source %r published (%dx%d%s)", sender.name, *size, ", with audio" if self._audio else "")
        return sender

    def _sender(self, size: tuple[int, int]) -> Any:
        cy = self._cyndilib
        # clock_video/clock_audio off: the playout clock paces the frames already; libndi's own
        # clock would block this thread a frame period per frame on top of that.
        sender = cy.Sender(self.name, clock_video=False, clock_audio=False)
        video = cy.VideoSendFrame()
        video.set_resolution(*size)
        video.set_fourcc(cy.FourCC.RGBX)
        video.set_frame_rate(Fraction(round(self._fps)))
        sender.set_video_frame(video)
        # An audio frame even for a stream without sound: cyndilib 0.1.3's clean-up after a refused
        # open destroys both frames unconditionally, and a missing one crashed the process (SIGSEGV).
        sound = cy.AudioSendFrame()
        sound.sample_rate = SAMPLE_RATE
        sound.num_channels = CHANNELS
        sound.set_max_num_samples(FRAME_SAMPLES)
        sender.set_audio_frame(sound)
        sender.open()
        return sender
