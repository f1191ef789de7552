"""app/server/media/encoder.py: the output's VP8 encoder keeps aiortc's stream and codes stylized frames better."""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np
from aiortc import RTCPeerConnection, RTCRtpSender, VideoStreamTrack
from aiortc.codecs.vpx import MAX_BITRATE, Vp8Decoder, Vp8Encoder, vp8_depayload
from aiortc.jitterbuffer import JitterFrame

from app.server.media.encoder import (
    SENDER_ATTRIBUTE,
    CameraVp8Encoder,
    OutputVp8Encoder,
    encode_output_frames,
    max_bitrate,
)
from engine.embedded.clips import heldout_specs, render_clip
from engine.embedded.teachers import stylize_clip

TIME_BASE = Fraction(1, 90_000)


def stylized_clip(frames: int = 24) -> np.ndarray:
    """What the server sends: a stylized moving clip (a teacher's oil painting of a held-out clip)."""
    return stylize_clip(render_clip(heldout_specs(frames=frames)[0]), "oil_paint")


def round_trip(encoder: Vp8Encoder, clip: np.ndarray) -> np.ndarray:
    """Every frame through the encoder, its RTP payloads depayloaded and decoded by aiortc's decoder."""
    decoder = Vp8Decoder()
    out = []
    for i, image in enumerate(clip):
        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24").reformat(format="yuv420p")
        frame.pts, frame.time_base = i * 3000, TIME_BASE
        payloads, timestamp = encoder.encode(frame)
        data = b"".join(vp8_depayload(p) for p in payloads)
        decoded = decoder.decode(JitterFrame(data=data, timestamp=timestamp))
        assert len(decoded) == 1
        out.append(decoded[0].to_ndarray(format="rgb24"))  # type: ignore[attr-defined]
    return np.stack(out)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(255.0**2 / np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)))


def test_stylized_frames_come_back_nearer_than_through_aiortcs_encoder() -> None:
    clip = stylized_clip()
    ours = round_trip(OutputVp8Encoder(), clip)
    theirs = round_trip(Vp8Encoder(), clip)
    settled = range(4, len(clip))  # past the first frames, where constant bitrate rate control settles
    ours_db = np.mean([psnr(ours[i], clip[i]) for i in settled])
    theirs_db = np.mean([psnr(theirs[i], clip[i]) for i in settled])
    # Without the temporal denoiser nothing of the previous frames is smeared into the next.
    assert ours_db > 30 and ours_db > theirs_db + 0.3, (ours_db, theirs_db)
    for i in settled:  # each decoded frame is its own input's, not a frozen or lagging one
        assert psnr(ours[i], clip[i]) > psnr(ours[i], clip[i - 2]) + 3


def test_a_new_bitrate_reopens_the_codec_with_the_output_settings() -> None:
    clip = stylized_clip(frames=20)
    decoded = []
    for encoder in (OutputVp8Encoder(), Vp8Encoder()):
        round_trip(encoder, clip[:6])
        first = encoder.codec
        encoder.target_bitrate = encoder.target_bitrate // 2  # the receiver's estimate fell (REMB)
        decoded.append(round_trip(encoder, clip[6:]))
        assert encoder.codec is not first and encoder.codec is not None
        assert encoder.codec.bit_rate == encoder.target_bitrate
    # The reopened context still codes without the denoiser: nearer than aiortc's at the same bitrate.
    settled = range(4, len(clip) - 6)
    ours, theirs = (np.mean([psnr(d[i], clip[6 + i]) for i in settled]) for d in decoded)
    assert ours > theirs + 0.1, (ours, theirs)


def test_a_streams_bitrate_stays_under_the_ceiling_browsers_set_for_its_size() -> None:
    # libwebrtc's default ceilings by pixel count, within aiortc's VP8 range (1.5 Mbps)
    assert max_bitrate(256, 256) == max_bitrate(320, 240) == 600_000
    assert max_bitrate(640, 480) == max_bitrate(1280, 720) == MAX_BITRATE == 1_500_000
    clip = stylized_clip(frames=12)  # 256x256
    for encoder in (OutputVp8Encoder(), CameraVp8Encoder()):
        encoder.target_bitrate = MAX_BITRATE  # a receiver on a fast link (REMB)
        decoded = round_trip(encoder, clip)
        assert encoder.codec is not None and encoder.codec.bit_rate == 600_000
        encoder.target_bitrate = 300_000  # below the ceiling the receiver's estimate rules
        round_trip(encoder, clip[:2])
        assert encoder.codec.bit_rate == 300_000
        assert np.mean([psnr(decoded[i], clip[i]) for i in range(4, len(clip))]) > 30
    payloads = []
    for ceiling in (False, True):  # what the ceiling saves: bytes on the wire
        encoder = OutputVp8Encoder() if ceiling else Vp8Encoder()
        encoder.target_bitrate = MAX_BITRATE
        total = 0
        for i, image in enumerate(clip):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24").reformat(format="yuv420p")
            frame.pts, frame.time_base = i * 3000, TIME_BASE
            total += sum(len(p) for p in encoder.encode(frame)[0])
        payloads.append(total)
    assert payloads[1] < 0.7 * payloads[0], payloads


async def _output_encoder(codec: str) -> object:
    """The encoder a server-side peer's video sender holds once a viewer's recvonly offer preferring
    ``codec`` is negotiated (before media flows)."""
    viewer, server = RTCPeerConnection(), RTCPeerConnection()
    try:
        video = viewer.addTransceiver("video", direction="recvonly")
        video.setCodecPreferences([c for c in RTCRtpSender.getCapabilities("video").codecs
                                   if c.mimeType == f"video/{codec}"])
        await viewer.setLocalDescription(await viewer.createOffer())
        sender = server.addTrack(VideoStreamTrack())
        await server.setRemoteDescription(viewer.localDescription)
        encode_output_frames(server)
        return getattr(sender, SENDER_ATTRIBUTE)
    finally:
        await viewer.close()
        await server.close()


async def test_vp8_senders_of_a_real_peer_get_the_encoder_and_h264_keeps_aiortcs() -> None:
    assert isinstance(await _output_encoder("VP8"), OutputVp8Encoder)
    assert await _output_encoder("H264") is None  # aiortc makes its own when it sends the first frame
