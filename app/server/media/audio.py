"""Audio passthrough in sync: the publisher's audio, delayed by the stream's current video latency.

    publisher audio ──push──▶ AudioPlayout (input ring, capture-time model) ──tick every 20 ms──▶
                                   ▲ video latency (Playout)                      DelayedAudioTrack(s),
                                   │                                              the recorder

Video frames take the engine's time (capture -> output shown: the playout's latency); the audio
must come out that much later for lips to stay in sync, and follow the latency as the serving
policy changes fidelity. The output has its own sample clock: 20 ms frames paced by the server's
monotonic clock, stamped ``tick * 960`` at 48 kHz, so its timestamps never drift however long the
stream runs. Each tick reads the input at "now minus the video's capture-to-output delay"; the read
cursor advances exactly one frame per tick and is moved only when it is off by more than
``RESYNC_S`` (a latency change, or the publisher's sample clock drifting against ours): forward
skips audio, backward plays silence (audio already heard is never played twice).

Capture times are estimated from arrival times, net of what aiortc's audio receiver adds: its
jitter buffer releases a packet only when ``AUDIO_PREFETCH`` newer ones have arrived; and Opus's own
delay (``CODEC_DELAY_S``) is taken off. (The video receiver hands a frame on at its last packet,
app/server/media/jitter.py, so video arrival needs no such correction.)
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from fractions import Fraction

import av
import numpy as np
from aiortc import MediaStreamTrack

SAMPLE_RATE = 48_000
CHANNELS = 2
FRAME_SAMPLES = 960  # 20 ms: WebRTC's Opus frame
FRAME_S = FRAME_SAMPLES / SAMPLE_RATE
TIME_BASE = Fraction(1, SAMPLE_RATE)
# aiortc's audio receiver (RTCRtpReceiver: JitterBuffer(capacity=16, prefetch=4)): a packet leaves
# its jitter buffer when 4 newer packets have arrived, 4 x 20 ms after it did.
AUDIO_PREFETCH = 4
AUDIO_RECEIVE_DELAY_S = AUDIO_PREFETCH * FRAME_S
# Opus delays what it decodes by its encoder's lookahead (libopus: 312 samples at 48 kHz, 6.5 ms),
# once on the way in (the publisher's encoder) and once on the way out (ours): the audio is read
# that much earlier, so the sound the viewer decodes lines up with the video.
OPUS_LOOKAHEAD_S = 312 / 48_000
CODEC_DELAY_S = 2 * OPUS_LOOKAHEAD_S
# Off by more than this, the read cursor jumps; below it, it runs on (no clicks from jitter).
RESYNC_S = 0.010
# Below the input frame rate the video's latency saws up within each chunk (its frames arrived
# faster than they are played) and drops at the next: the audio follows the saw's middle, and moves
# only when off by more than this share of the saw's height too (else it would skip or pause at
# every chunk). At a steady frame rate the saw is flat and RESYNC_S holds.
RESYNC_SPREAD = 0.25
KEEP_S = 12.0  # input audio kept: the longest video latency audio can follow
RING_SAMPLES = int(KEEP_S * SAMPLE_RATE)
ORIGIN_WINDOW_S = 5.0  # the capture-time model follows the publisher's clock over this window
STALL_S = 1.0  # the output clock restarts (skipping ticks) after a stall longer than this
HISTORY_TICKS = int(STALL_S / FRAME_S)  # ticks kept for consumers that fall behind: none is skipped
# The video latency followed: the mean over the frames played this recently (short: a real change,
# e.g. the policy moving the fidelity, is followed within it), and its saw's height over a longer
# window (long enough to hold a few chunks even at a few frames per second).
SYNC_WINDOW_S = 0.6
SPREAD_WINDOW_S = 2.0

Clock = Callable[[], float]


class AudioPlayout:
    """One stream's delayed audio: a ring of input samples and the clock that plays them out."""

    def __init__(
        self,
        video_delay_s: Callable[[], tuple[float, float] | None],
        clock: Clock = time.monotonic,
    ) -> None:
        self._video_delay_s = video_delay_s
        self._clock = clock
        self._resampler = av.AudioResampler(format="s16", layout="stereo", rate=SAMPLE_RATE)
        # Circular: input sample i lives at _ring[i % RING_SAMPLES] while i >= _ring_start.
        self._ring = np.zeros((RING_SAMPLES, CHANNELS), np.int16)
        self._written = 0  # input sample index one past the newest sample
        self._first_pts: int | None = None
        # Sliding minimum of (capture-time estimate of input sample 0) over ORIGIN_WINDOW_S.
        self._origins: deque[tuple[float, float]] = deque()
        self._cursor: int | None = None  # input sample index the next tick reads
        self._played = 0  # input samples before this index were played: never again
        self.delay_s: float | None = None  # the capture-to-output delay the audio follows
        self._slack = RESYNC_S  # how far off the cursor may be before it moves
        self.start = clock()  # monotonic time of tick 0
        self._tick = -1
        self._history: deque[tuple[int, np.ndarray]] = deque(maxlen=HISTORY_TICKS)
        self._tick_event = asyncio.Event()
        self.frames_in = 0
        self.resyncs = 0

    # -- input ---------------------------------------------------------------------------------

    def push(self, frame: av.AudioFrame) -> None:
        """An input frame as it arrives (any rate or layout; resampled to 48 kHz stereo)."""
        now = self._clock()
        self.frames_in += 1
        for out in self._resampler.resample(frame):
            samples = out.to_ndarray().reshape(-1, CHANNELS)
            start = self._written
            if out.pts is not None:  # place by timestamp: a lost packet leaves silence, not a shift
                if self._first_pts is None:
                    self._first_pts = out.pts
                start = out.pts - self._first_pts
                if abs(start - self._written) > KEEP_S * SAMPLE_RATE:  # the publisher's clock jumped
                    self._first_pts += start - self._written
                    start = self._written
                start = max(start, self._ring_start)
            self._write(start, samples)
            end = start + len(samples)
            origin = now - AUDIO_RECEIVE_DELAY_S - end / SAMPLE_RATE
            while self._origins and self._origins[-1][1] >= origin:
                self._origins.pop()
            self._origins.append((now, origin))
            while self._origins[0][0] < now - ORIGIN_WINDOW_S:
                self._origins.popleft()

    @property
    def _ring_start(self) -> int:
        """The oldest input sample still kept."""
        return max(0, self._written - RING_SAMPLES)

    @staticmethod
    def _span(lo: int, hi: int) -> tuple[slice, slice, int]:
        """Input samples [lo, hi) in the ring: up to its end, then from its start; and the split."""
        first = lo % RING_SAMPLES
        split = min(hi - lo, RING_SAMPLES - first)
        return slice(first, first + split), slice(0, hi - lo - split), split

    def _put(self, lo: int, samples: np.ndarray) -> None:
        head, tail, split = self._span(lo, lo + len(samples))
        self._ring[head] = samples[:split]
        self._ring[tail] = samples[split:]

    def _get(self, lo: int, hi: int) -> np.ndarray:
        head, tail, _ = self._span(lo, hi)
        return np.concatenate([self._ring[head], self._ring[tail]])

    def _write(self, start: int, samples: np.ndarray) -> None:
        samples = samples[-RING_SAMPLES:]
        end = start + len(samples)
        if start > self._written:  # a gap (lost packets): silence, not what the ring held before
            gap_lo = max(self._written, start - RING_SAMPLES)
            self._put(gap_lo, np.zeros((start - gap_lo, CHANNELS), np.int16))
        self._put(start, samples)
        self._written = max(self._written, end)

    @property
    def origin(self) -> float | None:
        """Estimated capture time (monotonic) of input sample 0."""
        return self._origins[0][1] if self._origins else None

    # -- output --------------------------------------------------------------------------------

    def _read(self, index: int) -> np.ndarray:
        out = np.zeros((FRAME_SAMPLES, CHANNELS), np.int16)
        # After the delay grew, the cursor is back over audio already heard: silence, not a replay.
        lo, hi = max(index, self._ring_start, self._played), min(index + FRAME_SAMPLES, self._written)
        if lo < hi:
            out[lo - index : hi - index] = self._get(lo, hi)
        return out

    def render(self, due: float) -> np.ndarray:
        """The output frame whose first sample plays at monotonic time ``due``."""
        video = self._video_delay_s()
        if video is not None:
            self.delay_s, spread = video
            self._slack = max(RESYNC_S, RESYNC_SPREAD * spread)
        origin = self.origin
        if self.delay_s is None or origin is None:
            return np.zeros((FRAME_SAMPLES, CHANNELS), np.int16)  # no video shown yet: nothing to match
        wanted = round((due + CODEC_DELAY_S - self.delay_s - origin) * SAMPLE_RATE)
        if self._cursor is None or abs(self._cursor - wanted) > self._slack * SAMPLE_RATE:
            if self._cursor is not None:
                self.resyncs += 1
            self._cursor = wanted
        out = self._read(self._cursor)
        self._cursor += FRAME_SAMPLES
        self._played = max(self._played, self._cursor)
        return out

    def tick(self, tick: int) -> None:
        self._history.append((tick, self.render(self.start + tick * FRAME_S)))
        self._tick = tick
        event, self._tick_event = self._tick_event, asyncio.Event()
        event.set()

    async def run(self) -> None:
        tick = 0
        while True:
            self.tick(tick)
            tick += 1
            now = self._clock()
            due = self.start + tick * FRAME_S
            if now - due > STALL_S:  # a long stall skips ticks: the timestamps stay on the clock
                tick = int((now - self.start) / FRAME_S)
                due = self.start + tick * FRAME_S
            # Behind after a short stall (a busy event loop): the missed ticks now, back to back.
            await asyncio.sleep(max(0.0, due - now))

    @property
    def tick_count(self) -> int:
        return self._tick

    async def next_frame(self, after: int) -> tuple[int, np.ndarray]:
        """The first tick after ``after`` still kept: (tick number, int16 samples [960, 2]). A
        consumer a little behind gets every tick in turn (audio must not have holes)."""
        while self._tick <= after:
            await self._tick_event.wait()
        return next(entry for entry in self._history if entry[0] > after)


def audio_frame(samples: np.ndarray, tick: int, pts: int | None = None) -> av.AudioFrame:
    """int16 [960, 2] samples of output tick ``tick`` (or at ``pts``) as a stamped PyAV frame."""
    frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="stereo")
    frame.sample_rate = SAMPLE_RATE
    frame.pts = tick * FRAME_SAMPLES if pts is None else pts
    frame.time_base = TIME_BASE
    return frame


class DelayedAudioTrack(MediaStreamTrack):
    """Outgoing audio of a stream: its AudioPlayout's ticks, 20 ms each."""

    kind = "audio"

    def __init__(self, audio: AudioPlayout) -> None:
        super().__init__()
        self._audio = audio
        self._tick = audio.tick_count  # from the next tick on: a new viewer gets no backlog

    async def recv(self) -> av.AudioFrame:
        self._tick, samples = await self._audio.next_frame(self._tick)
        return audio_frame(samples, self._tick)


def offers_audio(sdp: str) -> bool:
    """Whether an SDP offer sends audio: an ``m=audio`` section that is not recvonly or inactive."""
    sections = sdp.replace("\r\n", "\n").split("\nm=")
    for section in sections[1:]:
        if section.startswith("audio") and not any(
            f"a={d}" in section.split("\n") for d in ("recvonly", "inactive")
        ):
            return True
    return False


def wants_audio(sdp: str) -> bool:
    """Whether an SDP offer has an audio section at all (a viewer that can play audio)."""
    return "\nm=audio" in sdp.replace("\r\n", "\n")
