"""The VP8 encoder of the server's stylized video: aiortc's, tuned for frames the engine drew.

aiortc's VP8 encoder is set up for a camera: libvpx's temporal denoiser on (``noise-sensitivity``
4) at speed ``cpu-used`` -6. The server's outgoing frames are the engine's, already steadied by the
temporal stabilizer: there is no sensor noise to remove, and the denoiser smears their detail into
the next frames. Measured on teacher-stylized held-out clips at 256x256 (`demos/bench_media.py`;
docs/service.md, "The output's VP8 encoder"): without the denoiser and at ``cpu-used`` -8, an encode
takes 0.53-0.81 ms instead of 0.66-0.99 (250 kbps-1 Mbps) and the decoded frames are 0.5-1.2 dB
nearer the encoder's input (-10 saves another ~0.08 ms but gives the quality back at aiortc's lowest
bitrate). Rate control, packetization and bitrate changes from the receiver's estimates stay
aiortc's, under one more ceiling: the size's (`max_bitrate`).

**The ceiling by size.** aiortc lets a VP8 stream climb to 1.5 Mbps whatever its size, and on a good
link (loopback, a LAN) the receiver's estimate takes it there. libwebrtc, the browser's engine, caps a
stream by its pixel count instead (``GetMaxDefaultVideoBitrateKbps``: 600 kbps up to 320x240 pixels,
1.7 Mbps up to 640x480, 2 Mbps up to 960x540, 2.5 Mbps above): 1.5 Mbps for a 256x256 frame is 0.76
bits a pixel, past where VP8's quality still moves much. The encoders here (the stream's output, and
the synthetic clients' cameras of app/client.py, which thus send as a browser would) keep under both
ceilings. At 256x256 (`demos/bench_media.py --bitrates 600 1500`, three runs) aiortc's encoder took
1.9-2.2 ms a frame at 600 kbps against 2.2-2.7 ms at 1.5 Mbps; the output's frames come back at
36.6 dB against the encoder's input (38.7 dB at 1.5 Mbps), and each frame takes about 40 % fewer
bytes, thus fewer RTP packets, each of them Python on the event loop (SRTP, RTCP) at both ends.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import av
from aiortc import MediaStreamTrack, RTCPeerConnection
from aiortc.codecs.base import Encoder
from aiortc.codecs.vpx import MAX_BITRATE, Vp8Encoder, number_of_threads
from av.frame import Frame

log = logging.getLogger(__name__)

# libvpx options that differ from aiortc's (aiortc/codecs/vpx.py, Vp8Encoder.encode).
OUTPUT_OPTIONS: dict[str, str] = {"noise-sensitivity": "0", "cpu-used": "-8"}
# Where aiortc's RTCRtpSender keeps its encoder (a name-mangled private attribute; it makes one with
# get_encoder(codec) when the first frame is sent and this is still None).
SENDER_ATTRIBUTE = "_RTCRtpSender__encoder"
# libwebrtc's default ceiling by pixel count (media/engine: GetMaxDefaultVideoBitrateKbps): (pixels, bps).
SIZE_CEILINGS = ((320 * 240, 600_000), (640 * 480, 1_700_000), (960 * 540, 2_000_000))
LARGE_CEILING = 2_500_000


def max_bitrate(width: int, height: int) -> int:
    """The most bits per second a VP8 stream of frames this size is sent at: libwebrtc's ceiling for the
    size, within aiortc's VP8 range."""
    pixels = width * height
    ceiling = next((bps for most, bps in SIZE_CEILINGS if pixels <= most), LARGE_CEILING)
    return min(ceiling, MAX_BITRATE)


def keep_under_ceiling(encoder: Vp8Encoder, frame: av.VideoFrame) -> None:
    """Lower ``encoder``'s target to the frame size's ceiling (the receiver's estimate may set it higher
    again; every encode brings it back, and aiortc reopens the context only once it moves by 10 %)."""
    ceiling = max_bitrate(frame.width, frame.height)
    if encoder.target_bitrate > ceiling:
        encoder.target_bitrate = ceiling


class CameraVp8Encoder(Vp8Encoder):
    """aiortc's VP8 encoder (its camera settings) under the size's ceiling: a synthetic client's
    camera sends as a browser's would."""

    def encode(self, frame: Frame, force_keyframe: bool = False) -> tuple[list[bytes], int]:
        assert isinstance(frame, av.VideoFrame)
        keep_under_ceiling(self, frame)
        return super().encode(frame, force_keyframe)


class OutputVp8Encoder(Vp8Encoder):
    """aiortc's VP8 encoder opening its libvpx context with ``OUTPUT_OPTIONS``."""

    def encode(self, frame: Frame, force_keyframe: bool = False) -> tuple[list[bytes], int]:
        assert isinstance(frame, av.VideoFrame)
        keep_under_ceiling(self, frame)
        if self.codec is None or self._must_reopen(frame):
            self.codec = self._open(frame)
        # aiortc's encode finds its context open at this size and bitrate and keeps it.
        return super().encode(frame, force_keyframe)

    def _must_reopen(self, frame: av.VideoFrame) -> bool:
        """aiortc's rule for a new context: another frame size, or a bitrate more than 10 % off."""
        assert self.codec is not None
        bitrate = self.codec.bit_rate or self.target_bitrate
        return (frame.width != self.codec.width or frame.height != self.codec.height
                or abs(self.target_bitrate - bitrate) / bitrate > 0.1)

    def _open(self, frame: av.VideoFrame) -> av.VideoCodecContext:
        """aiortc's context (constant bitrate, real-time deadline, no lag), with ``OUTPUT_OPTIONS``."""
        bitrate = self.target_bitrate
        codec = av.CodecContext.create("libvpx", "w")
        assert isinstance(codec, av.VideoCodecContext)
        codec.width = frame.width
        codec.height = frame.height
        codec.bit_rate = bitrate
        codec.pix_fmt = "yuv420p"
        codec.gop_size = 3000  # kf_max_dist
        codec.qmin = 2
        codec.qmax = 56
        codec.options = {
            "bufsize": str(bitrate),  # rc_buf_sz 1000 ms
            "deadline": "realtime",
            "lag-in-frames": "0",
            "minrate": str(bitrate),  # minrate = maxrate = bit_rate: constant bitrate
            "maxrate": str(bitrate),
            "overshoot-pct": "15",
            "partitions": "0",
            "static-thresh": "1",
            "undershoot-pct": "100",
            **OUTPUT_OPTIONS,
        }
        codec.thread_count = number_of_threads(frame.width * frame.height, multiprocessing.cpu_count())
        return codec


@runtime_checkable
class SharedOutput(Protocol):
    """A track whose frames its stream encodes once for all its viewers (app/server/media/shared_vp8.py)."""

    def viewer_encoder(self) -> Encoder: ...


def encode_output_frames(pc: RTCPeerConnection) -> None:
    """Give every video sender of ``pc`` (the server sends only the stylized output) whose negotiated
    codec is VP8 the encoder its track shares with the stream's other viewers, or an
    :class:`OutputVp8Encoder` of its own (call after setRemoteDescription, before media flows).
    H264 keeps aiortc's encoder, as does an aiortc that keeps it elsewhere."""
    install_vp8_encoders(pc, lambda track: track.viewer_encoder() if isinstance(track, SharedOutput)
                         else OutputVp8Encoder())


def install_vp8_encoders(pc: RTCPeerConnection, make: Callable[[MediaStreamTrack], Encoder]) -> None:
    """Give every video sender of ``pc`` whose negotiated codec is VP8 and that has no encoder yet the
    encoder ``make`` returns for its track (call after setRemoteDescription, before media flows)."""
    for transceiver in pc.getTransceivers():
        sender = transceiver.sender
        codecs = getattr(transceiver, "_codecs", None)
        if transceiver.kind != "video" or sender.track is None or not codecs:
            continue
        if codecs[0].mimeType.lower() != "video/vp8":
            continue
        if not hasattr(sender, SENDER_ATTRIBUTE):
            log.warning("aiortc's sender keeps no encoder at %s: the video keeps aiortc's VP8 settings",
                        SENDER_ATTRIBUTE)
            continue
        if getattr(sender, SENDER_ATTRIBUTE) is None:
            setattr(sender, SENDER_ATTRIBUTE, make(sender.track))
