"""Measuring audio/video sync from a client: a beeping microphone and the sender's media clock.

`BeepMicrophone` sends 20 ms Opus-sized frames with a short tone every ``every_s`` seconds and
remembers when each beep was captured; `CodedCamera` (app/client.py) does the same for video
frames. On the receiving side, `SenderClock` reads the RTCP sender reports of a received track,
which map its RTP timestamps to the sender's wall clock: the media time a browser aligns audio and
video by (lip sync). `sync_errors` then compares, beep by beep, the capture-to-media-time delay of
the audio with that of the video frames captured at the same moment.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import av
import numpy as np
from aiortc import MediaStreamTrack, RTCRtpReceiver
from aiortc.mediastreams import MediaStreamError
from aiortc.rtp import RtcpSrPacket

from app.client import CodedCamera, video_frames
from app.server.media.framecode import read_id

RATE = 48_000
FRAME = 960  # 20 ms
BEEP_S = 0.1
BEEP_HZ = 1000.0
NTP_UNIT = 2**32


class BeepMicrophone(MediaStreamTrack):
    """A paced synthetic microphone: silence with a tone burst every ``every_s`` seconds."""

    kind = "audio"

    def __init__(self, every_s: float = 2.0, first_s: float = 1.0) -> None:
        super().__init__()
        self.every_s = every_s
        self.first_s = first_s
        self.start: float | None = None  # time.monotonic() of sample 0
        self.count = 0

    def beep_times(self, until: float) -> list[float]:
        """Capture times (monotonic) of the beeps that started before ``until``."""
        if self.start is None:
            return []
        times = self.start + self.first_s + self.every_s * np.arange(0, 1 + max(0.0, until - self.start) / self.every_s)
        return [float(t) for t in times if t < until]

    def _samples(self, first: int) -> np.ndarray:
        n = first + np.arange(FRAME)
        t = n / RATE - self.first_s
        phase = np.mod(t, self.every_s)
        tone = np.where((t >= 0) & (phase < BEEP_S), 0.5 * np.sin(2 * np.pi * BEEP_HZ * t), 0.0)
        mono = (tone * 32767).astype(np.int16)
        return np.stack([mono, mono], axis=1).reshape(1, -1)

    async def recv(self) -> av.AudioFrame:
        if self.start is None:
            self.start = time.monotonic()
        index = self.count
        self.count += 1
        # A frame leaves the microphone once its last sample is captured.
        await asyncio.sleep(max(0.0, self.start + (index + 1) * FRAME / RATE - time.monotonic()))
        frame = av.AudioFrame.from_ndarray(self._samples(index * FRAME), format="s16", layout="stereo")
        frame.sample_rate = RATE
        frame.pts = index * FRAME
        frame.time_base = Fraction(1, RATE)
        return frame


class SenderClock:
    """The sender's media clock for one received track, from its RTCP sender reports.

    aiortc's receiver stamps decoded frames ``RTP timestamp - the first one``; each sender report
    pairs an RTP timestamp with the sender's NTP time. The smallest NTP-minus-RTP offset over the
    reports is kept: a report sent late after its packet only overstates it."""

    def __init__(self, receiver: RTCRtpReceiver, rate: int) -> None:
        self.rate = rate
        self.offset: float | None = None
        self._receiver = receiver
        handle: Callable[[Any], Awaitable[None]] = receiver._handle_rtcp_packet

        async def on_rtcp(packet: Any) -> None:
            if isinstance(packet, RtcpSrPacket):
                self._report(packet.sender_info.ntp_timestamp / NTP_UNIT, packet.sender_info.rtp_timestamp)
            await handle(packet)

        receiver._handle_rtcp_packet = on_rtcp  # type: ignore[method-assign]

    def _origin(self) -> int | None:
        # The receiver's TimestampMapper: the RTP timestamp its decoded frames count from.
        mapper = self._receiver._RTCRtpReceiver__timestamp_mapper  # type: ignore[attr-defined]
        return getattr(mapper, "_origin", None)

    def _report(self, ntp_s: float, rtp: int) -> None:
        origin = self._origin()
        if origin is None:
            return
        relative = (rtp - origin) % 2**32
        if relative >= 2**31:
            relative -= 2**32
        offset = ntp_s - relative / self.rate
        self.offset = offset if self.offset is None else min(self.offset, offset)

    def media_time(self, pts: int) -> float | None:
        """The sender's wall-clock time (seconds, NTP epoch) of a received frame's ``pts``."""
        return None if self.offset is None else self.offset + pts / self.rate


class VideoStamps:
    """Consumes a received video track with frame IDs (app/client.py's CodedCamera, served with
    --trace-stamp): per new ID, its capture time -> (the frame's pts, when it came out of the receiver)."""

    def __init__(self, camera: CodedCamera) -> None:
        self.camera = camera
        self.stamps: dict[float, tuple[int, float]] = {}

    async def consume(self, track: MediaStreamTrack) -> None:
        async for frame in video_frames(track):
            frame_id = read_id(frame.to_ndarray(format="rgb24"))
            captured = None if frame_id is None else self.camera.sent.get(frame_id)
            if captured is not None and captured not in self.stamps and frame.pts is not None:
                self.stamps[captured] = (int(frame.pts), time.monotonic())


@dataclass
class AudioProbe:
    """Consumes a received audio track: keeps (pts, mono samples) to find the beeps in, and when
    each frame came out of the receiver (time.monotonic(), by pts)."""

    chunks: list[tuple[int, np.ndarray]] = field(default_factory=list)
    arrivals: dict[int, float] = field(default_factory=dict)

    async def consume(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            if isinstance(frame, av.AudioFrame) and frame.pts is not None:
                data = frame.to_ndarray().reshape(-1, len(frame.layout.channels)).astype(np.float32)
                self.chunks.append((int(frame.pts), data.mean(axis=1) / 32768))
                self.arrivals[int(frame.pts)] = time.monotonic()

    def arrival(self, pts: int) -> float | None:
        """When the sample at ``pts`` came out of the receiver (its frame's arrival, plus its offset)."""
        start = max((p for p in self.arrivals if p <= pts), default=None)
        return None if start is None else self.arrivals[start] + (pts - start) / RATE

    @property
    def peak(self) -> float:
        return max((float(np.abs(c).max()) for _, c in self.chunks), default=0.0)

    def onsets(self, threshold: float = 0.1, quiet_s: float = 0.5) -> list[int]:
        """pts (samples) where the level first passes ``threshold`` after ``quiet_s`` of quiet."""
        found: list[int] = []
        last_loud: int | None = None
        for pts, samples in sorted(self.chunks, key=lambda c: c[0]):
            for i in np.flatnonzero(np.abs(samples) >= threshold):
                at = pts + int(i)
                if last_loud is None or at - last_loud > quiet_s * RATE:
                    found.append(at)
                last_loud = at
        return found


def sync_errors(
    beeps: list[float], onsets: list[float | None], frames: list[tuple[float, float | None]], window_s: float = 0.5,
) -> list[float]:
    """Audio minus video delay (seconds) per beep: each beep's capture -> its onset (``onsets``: the
    times the beeps' onsets were found at, on some clock), less the same for the video frames
    captured within ``window_s`` of it (``frames``: (capture time, time on that clock))."""
    errors: list[float] = []
    heard = [t for t in onsets if t is not None]
    for beep in beeps:
        near = [t - c for c, t in frames if t is not None and abs(c - beep) <= window_s]
        if not near or not heard:
            continue
        video_delay = float(np.median(near))
        # This beep's onset: the one whose delay is closest to the video's (beeps are seconds apart).
        delay = min((t - beep for t in heard), key=lambda d: abs(d - video_delay))
        errors.append(delay - video_delay)
    return errors
