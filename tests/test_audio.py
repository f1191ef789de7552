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
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

from app.avsync import AudioProbe, BeepMicrophone, SenderClock, VideoStamps, sync_errors
from app.client import CodedCamera, http
from app.server.media.audio import (
    AUDIO_RECEIVE_DELAY_S,
    CODEC_DELAY_S,
    FRAME_S,
    FRAME_SAMPLES,
    RESYNC_S,
    SAMPLE_RATE,
    AudioPlayout,
    offers_audio,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


RAMP = 32767


def ramp_frame(first: int, samples: int, pts: int) -> av.AudioFrame:
    """Input whose every sample holds its own index (mod 2**15 - 1, plus 1: never 0, which is silence):
    where the output read from is visible."""
    values = ((first + np.arange(samples)) % RAMP + 1).astype(np.int16)
    frame = av.AudioFrame.from_ndarray(np.stack([values, values], axis=1).reshape(1, -1), format="s16", layout="stereo")
    frame.sample_rate = SAMPLE_RATE
    frame.pts = pts
    frame.time_base = Fraction(1, SAMPLE_RATE)
    return frame


def wrapped(diff: int) -> int:
    return (diff + RAMP // 2) % RAMP - RAMP // 2


def run_playout(minutes: float, drift_ppm: float, delays: Callable[[float], float]) -> tuple[AudioPlayout, list[int], int]:
    """Feed a publisher whose sample clock runs ``drift_ppm`` fast and read the playout every tick;
    returns the playout, per tick how far (samples) the last sample played is from the one captured
    exactly ``delays(t)`` before it (the truth, computed here from the simulated capture times), and
    the number of silent frames. Fails on a replayed sample or a non-contiguous frame."""
    clock = FakeClock()
    t0 = clock.now
    net = 0.005
    delay = {"now": delays(0.0)}
    audio = AudioPlayout(lambda: (delay["now"], 0.0), clock=clock)
    rate = SAMPLE_RATE * (1 + drift_ppm * 1e-6)  # publisher samples per second of our clock
    errors: list[int] = []
    silent = 0
    last_played: int | None = None
    written = 0
    for tick in range(int(minutes * 60 / FRAME_S)):
        due = audio.start + tick * FRAME_S
        # Input frames whose last sample was captured before now, as aiortc hands them over.
        while t0 + (written + FRAME_SAMPLES) / rate + net + AUDIO_RECEIVE_DELAY_S <= due:
            clock.now = t0 + (written + FRAME_SAMPLES) / rate + net + AUDIO_RECEIVE_DELAY_S
            audio.push(ramp_frame(written, FRAME_SAMPLES, written))
            written += FRAME_SAMPLES
        clock.now = due
        delay["now"] = delays(due - audio.start)
        out = audio.render(due)[:, 0].astype(int)
        if due - delay["now"] - t0 - net < 0.5:
            continue  # the played sample was captured before the publisher started
        heard = np.flatnonzero(out)
        if len(heard) == 0:
            silent += 1
            continue
        assert heard[-1] == FRAME_SAMPLES - 1 and np.array_equal(
            np.diff(heard), np.ones(len(heard) - 1, int)), "silence only before the audio resumes"
        assert all(wrapped(int(d)) == 1 for d in np.diff(out[heard])), "not contiguous"
        if last_played is not None:
            assert 0 < wrapped(int(out[heard[0]]) - last_played), "a sample played twice"
        last_played = int(out[-1])
        # The sample captured delay before it, less what Opus will hold back on the way (read ahead).
        played_at = due + (FRAME_SAMPLES - 1) / SAMPLE_RATE + CODEC_DELAY_S
        truth = round((played_at - delay["now"] - t0 - net) * rate) % RAMP + 1
        errors.append(wrapped(last_played - truth))
    return audio, errors, silent


def test_audio_follows_the_video_delay_through_drift_and_latency_changes() -> None:
    # The video's capture-to-output delay: 0.6 s, then the policy lowers fidelity (0.35 s), then raises it.
    def delays(t: float) -> float:
        return 0.6 if t < 40 else 0.35 if t < 80 else 0.9

    audio, errors, silent = run_playout(minutes=2, drift_ppm=150, delays=delays)
    tolerance = RESYNC_S * SAMPLE_RATE + 2
    assert np.abs(errors).max() <= tolerance, np.abs(errors).max()
    # Two minutes at 150 ppm is 18 ms of drift: a cursor move for it, plus one per latency change.
    assert 2 <= audio.resyncs <= 6, audio.resyncs
    # The delay grew by 0.55 s once: that much silence (never a replay), and none elsewhere.
    assert 0.55 / FRAME_S - 2 <= silent <= 0.55 / FRAME_S + 2, silent


def test_audio_is_silent_until_the_video_latency_is_known() -> None:
    clock = FakeClock()
    audio = AudioPlayout(lambda: None, clock=clock)
    audio.push(ramp_frame(1, FRAME_SAMPLES, 0))
    assert not audio.render(clock.now).any()


def test_lost_packets_leave_silence_in_place() -> None:
    clock = FakeClock()
    audio = AudioPlayout(lambda: None, clock=clock)
    for k in (0, 1, 4):  # packets 2 and 3 lost
        audio.push(ramp_frame(k * FRAME_SAMPLES, FRAME_SAMPLES, k * FRAME_SAMPLES))
    assert audio._read(FRAME_SAMPLES)[0, 0] == FRAME_SAMPLES % RAMP + 1
    assert not audio._read(2 * FRAME_SAMPLES).any() and not audio._read(3 * FRAME_SAMPLES).any()
    assert audio._read(4 * FRAME_SAMPLES)[0, 0] == 4 * FRAME_SAMPLES % RAMP + 1


async def test_a_consumer_behind_gets_every_tick_and_a_new_one_no_backlog() -> None:
    audio = AudioPlayout(lambda: None, clock=FakeClock())
    for tick in range(10):  # a busy event loop: ten ticks before the consumer runs again
        audio.tick(tick)
    got = []
    after = 2
    for _ in range(5):
        after, _ = await audio.next_frame(after)
        got.append(after)
    assert got == [3, 4, 5, 6, 7]
    assert audio.tick_count == 9


def test_offers_audio_reads_the_direction() -> None:
    video = "v=0\r\nm=video 9 UDP/TLS/RTP/SAVPF 96\r\na=sendrecv\r\n"
    assert not offers_audio(video)
    assert offers_audio(video + "m=audio 9 UDP/TLS/RTP/SAVPF 111\r\na=sendonly\r\n")
    assert offers_audio(video + "m=audio 9 UDP/TLS/RTP/SAVPF 111\r\na=sendrecv\r\n")
    assert not offers_audio(video + "m=audio 9 UDP/TLS/RTP/SAVPF 111\r\na=recvonly\r\n")


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
    # An engine that keeps up with a 15 fps camera (steady latency) but takes 0.15 s per chunk:
    # unsynced audio would lead the video by far more than a frame.
    with live_server(max_streams=1, trace_stamp=True, engine_delay_ms=150) as url:
        camera = CodedCamera((128, 128), fps=15)
        mic = BeepMicrophone(every_s=1.5)
        pc, answer = await _publish(url, camera, mic)
        assert "m=audio" in answer["sdp"] and "a=sendrecv" in answer["sdp"].split("m=audio")[1]
        clocks = {r.track.kind: SenderClock(r, SAMPLE_RATE if r.track.kind == "audio" else 90_000)
                  for r in pc.getReceivers()}
        video, sound = VideoStamps(camera), AudioProbe()
        tasks = [asyncio.ensure_future(video.consume(r.track) if r.track.kind == "video" else sound.consume(r.track))
                 for r in pc.getReceivers()]
        errors: list[float] = []
        deadline = time.monotonic() + 45
        while len(errors) < 5 and time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            errors = sync_errors(mic.beep_times(time.monotonic() - 2.5),
                                 [clocks["audio"].media_time(onset) for onset in sound.onsets()],
                                 [(c, clocks["video"].media_time(pts)) for c, (pts, _) in video.stamps.items()])
        status, _, raw = await asyncio.to_thread(http, "GET", f"{url}/api/streams/{answer['stream_id']}")
        stats = json.loads(raw)
        for task in tasks:
            task.cancel()
        await pc.close()
    # Audio passed straight through would lead the video by its whole delay (far beyond the tolerance).
    assert stats["audio"] is True and stats["audio_delay_ms"] > 300, stats
    assert len(errors) >= 5, (errors, sound.peak, len(video.stamps))
    # Media time: the beep and the frames captured with it carry the same delay (one 30 fps frame,
    # plus what a busy machine adds between a packet's timestamp and its sender report).
    assert abs(float(np.median(errors))) < 0.05, errors


async def test_whip_audio_reaches_whep_viewers(live_server: Callable[..., AbstractContextManager[str]]) -> None:
    """OBS's path: audio published over WHIP comes out to a WHEP viewer (its beeps, not silence)."""
    with live_server(max_streams=1) as url:
        publisher = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        publisher.addTransceiver(CodedCamera((64, 64), fps=15), direction="sendonly")
        publisher.addTransceiver(BeepMicrophone(every_s=1.0, first_s=0.2), direction="sendonly")
        await publisher.setLocalDescription(await publisher.createOffer())
        status, head, raw = await asyncio.to_thread(
            http, "POST", f"{url}/whip", publisher.localDescription.sdp.encode(), {"Content-Type": "application/sdp"})
        assert status == 201, raw
        await publisher.setRemoteDescription(RTCSessionDescription(sdp=raw.decode(), type="answer"))
        viewer = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        viewer.addTransceiver("video", direction="recvonly")
        viewer.addTransceiver("audio", direction="recvonly")
        sound = AudioProbe()
        viewer.on("track", lambda track: track.kind == "audio" and asyncio.ensure_future(sound.consume(track)))
        await viewer.setLocalDescription(await viewer.createOffer())
        status, _, raw = await asyncio.to_thread(
            http, "POST", f"{url}/whep/{head['x-diffcast-stream-id']}", viewer.localDescription.sdp.encode(),
            {"Content-Type": "application/sdp"})
        assert status == 201 and "a=sendonly" in raw.decode().split("m=audio")[1], raw
        await viewer.setRemoteDescription(RTCSessionDescription(sdp=raw.decode(), type="answer"))
        deadline = time.monotonic() + 40
        while len(sound.onsets(quiet_s=0.5)) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        await viewer.close()
        await publisher.close()
    # Two beeps a second apart (0.9 s of quiet between them), not one long tone or noise.
    assert len(sound.onsets(quiet_s=0.5)) >= 2 and sound.peak > 0.3, (sound.onsets(quiet_s=0.5), sound.peak)


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
