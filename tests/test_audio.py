"""Audio passthrough: the delayed playout on a simulated clock, and media-time sync with real aiortc peers."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from fractions import Fraction

import av
import numpy as np
from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from app.avsync import AudioProbe, BeepMicrophone, SenderClock, sync_errors
from app.client import CodedCamera, http
from app.server.audio import (
    AUDIO_RECEIVE_DELAY_S,
    FRAME_S,
    FRAME_SAMPLES,
    RESYNC_S,
    SAMPLE_RATE,
    AudioPlayout,
    offers_audio,
)
from app.server.framecode import read_id


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ramp_frame(first: int, samples: int, pts: int) -> av.AudioFrame:
    """Input whose every sample holds its own index (mod 2**15): where the output read from is visible."""
    values = ((first + np.arange(samples)) % 32768).astype(np.int16)
    frame = av.AudioFrame.from_ndarray(np.stack([values, values], axis=1).reshape(1, -1), format="s16", layout="stereo")
    frame.sample_rate = SAMPLE_RATE
    frame.pts = pts
    frame.time_base = Fraction(1, SAMPLE_RATE)
    return frame


def run_playout(minutes: float, drift_ppm: float, delays: Callable[[float], float]) -> tuple[AudioPlayout, list[int]]:
    """Feed a publisher whose sample clock runs ``drift_ppm`` fast and read the playout every tick;
    returns the playout and, per tick, how far (samples) the sample played is from the one captured
    exactly ``delays(t)`` before it (the truth, computed here from the simulated capture times)."""
    clock = FakeClock()
    t0 = clock.now
    net = 0.005
    delay = {"now": delays(0.0)}
    audio = AudioPlayout(lambda: delay["now"], clock=clock)
    rate = SAMPLE_RATE * (1 + drift_ppm * 1e-6)  # publisher samples per second of our clock
    errors: list[int] = []
    written = 0
    ticks = int(minutes * 60 / FRAME_S)
    for tick in range(ticks):
        due = audio.start + tick * FRAME_S
        # Input frames whose last sample was captured before now, as aiortc hands them over.
        while t0 + (written + FRAME_SAMPLES) / rate + net + AUDIO_RECEIVE_DELAY_S <= due:
            clock.now = t0 + (written + FRAME_SAMPLES) / rate + net + AUDIO_RECEIVE_DELAY_S
            audio.push(ramp_frame(written, FRAME_SAMPLES, written))
            written += FRAME_SAMPLES
        clock.now = due
        delay["now"] = delays(due - audio.start)
        out = audio.render(due)
        if due - delay["now"] - t0 - net < 0.5:
            continue  # the played sample was captured before the publisher started
        truth = round((due - delay["now"] - t0 - net) * rate) % 32768
        errors.append((int(out[0, 0]) - truth + 16384) % 32768 - 16384)
        assert np.array_equal(out[:, 0], (int(out[0, 0]) + np.arange(FRAME_SAMPLES)) % 32768 - 0), "not contiguous"
    return audio, errors


def test_audio_follows_the_video_delay_through_drift_and_latency_changes() -> None:
    # The video's capture-to-output delay: 0.6 s, then the policy lowers fidelity (0.35 s), then raises it.
    def delays(t: float) -> float:
        return 0.6 if t < 60 else 0.35 if t < 120 else 0.9

    audio, errors = run_playout(minutes=3, drift_ppm=80, delays=delays)
    tolerance = RESYNC_S * SAMPLE_RATE + 2
    assert np.abs(errors).max() <= tolerance, np.abs(errors).max()
    # Three minutes at 80 ppm is 14 ms of drift: one cursor move for it, plus one per latency change.
    assert 2 <= audio.resyncs <= 6, audio.resyncs


def test_audio_is_silent_until_the_video_latency_is_known() -> None:
    clock = FakeClock()
    audio = AudioPlayout(lambda: None, clock=clock)
    audio.push(ramp_frame(1, FRAME_SAMPLES, 0))
    assert not audio.render(clock.now).any()


def test_offers_audio_reads_the_direction() -> None:
    video = "v=0\r\nm=video 9 UDP/TLS/RTP/SAVPF 96\r\na=sendrecv\r\n"
    assert not offers_audio(video)
    assert offers_audio(video + "m=audio 9 UDP/TLS/RTP/SAVPF 111\r\na=sendonly\r\n")
    assert offers_audio(video + "m=audio 9 UDP/TLS/RTP/SAVPF 111\r\na=sendrecv\r\n")
    assert not offers_audio(video + "m=audio 9 UDP/TLS/RTP/SAVPF 111\r\na=recvonly\r\n")


class VideoStamps:
    """Consumes the returned video: the capture time of each new frame ID -> the frame's pts."""

    def __init__(self, camera: CodedCamera) -> None:
        self.camera = camera
        self.stamps: dict[float, int] = {}

    async def consume(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            frame_id = read_id(frame.to_ndarray(format="rgb24"))
            captured = None if frame_id is None else self.camera.sent.get(frame_id)
            if captured is not None and captured not in self.stamps:
                self.stamps[captured] = int(frame.pts)


async def _publish(url: str, camera: CodedCamera, mic: BeepMicrophone | None) -> tuple[RTCPeerConnection, dict[str, str]]:
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver(camera, direction="sendrecv")
    if mic is not None:
        pc.addTransceiver(mic, direction="sendrecv")
    pc.createDataChannel("control")
    await pc.setLocalDescription(await pc.createOffer())
    body = json.dumps({"sdp": pc.localDescription.sdp, "type": "offer"}).encode()
    status, _, raw = await asyncio.to_thread(http, "POST", f"{url}/api/offer", body, {"Content-Type": "application/json"})
    assert status == 200, raw
    answer = json.loads(raw)
    await pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type="answer"))
    return pc, answer


async def test_audio_comes_back_with_the_video_pipeline_delay(live_server: Callable[..., AbstractContextManager[str]]) -> None:
    # A slow engine (about 0.3 s per chunk): unsynced audio would lead the video by far more than a frame.
    with live_server(max_streams=1, trace_stamp=True, engine_delay_ms=300) as url:
        camera = CodedCamera((128, 128), fps=30)
        mic = BeepMicrophone(every_s=2.0)
        pc, answer = await _publish(url, camera, mic)
        assert "m=audio" in answer["sdp"] and "a=sendrecv" in answer["sdp"].split("m=audio")[1]
        clocks = {r.track.kind: SenderClock(r, SAMPLE_RATE if r.track.kind == "audio" else 90_000)
                  for r in pc.getReceivers()}
        video, sound = VideoStamps(camera), AudioProbe()
        tasks = [asyncio.ensure_future(video.consume(r.track) if r.track.kind == "video" else sound.consume(r.track))
                 for r in pc.getReceivers()]
        errors: list[float] = []
        deadline = time.monotonic() + 45
        while len(errors) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            errors = sync_errors(mic.beep_times(time.monotonic() - 2.0), sound.onsets(), clocks["audio"],
                                 video.stamps, clocks["video"])
        status, _, raw = await asyncio.to_thread(http, "GET", f"{url}/api/streams/{answer['stream_id']}")
        stats = json.loads(raw)
        for task in tasks:
            task.cancel()
        await pc.close()
    assert stats["audio"] is True and stats["audio_delay_ms"] > 300, stats
    assert len(errors) >= 3, (errors, sound.peak, len(video.stamps))
    # Media time: the beep and the frames captured with it carry the same delay (one 30 fps frame,
    # plus what a busy machine adds between a packet's timestamp and its sender report).
    assert abs(float(np.median(errors))) < 0.05, errors


async def test_a_stream_without_audio_stays_video_only(live_server: Callable[..., AbstractContextManager[str]]) -> None:
    with live_server(max_streams=1) as url:
        pc, answer = await _publish(url, CodedCamera((64, 64), fps=15), None)
        assert "m=audio" not in answer["sdp"]
        viewer = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        viewer.addTransceiver("video", direction="recvonly")
        viewer.addTransceiver("audio", direction="recvonly")
        await viewer.setLocalDescription(await viewer.createOffer())
        status, _, raw = await asyncio.to_thread(
            http, "POST", f"{url}/whep/{answer['stream_id']}", viewer.localDescription.sdp.encode(),
            {"Content-Type": "application/sdp"})
        assert status == 201, raw
        audio_section = raw.decode().split("m=audio")[1]
        assert "a=inactive" in audio_section, audio_section
        status, _, raw = await asyncio.to_thread(http, "GET", f"{url}/api/streams/{answer['stream_id']}")
        assert json.loads(raw)["audio"] is False
        await viewer.close()
        await pc.close()
