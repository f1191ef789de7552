"""Video frames leave aiortc's jitter buffer when their last packet is in, not one frame later.

aiortc's video jitter buffer (aiortc/jitterbuffer.py) hands a frame to the decoder only when the
first packet of the *next* frame arrives: every receiver adds one camera frame period (33 ms at
30 fps) of latency, so the live path paid it twice (the camera into the server, the stylized track
into the client). RTP marks the last packet of a video frame (the marker bit: RFC 7741 for VP8,
RFC 6184 for H264; browsers, OBS and aiortc's own sender set it): a frame whose packets are all in
up to a marked one is complete at once. Everything else (reordering, loss, overflow, PLI) stays
aiortc's own code.
"""

from __future__ import annotations

import logging

from aiortc import RTCPeerConnection
from aiortc.jitterbuffer import JitterBuffer, JitterFrame
from aiortc.rtp import RtpPacket

log = logging.getLogger(__name__)

VIDEO_CAPACITY = 512  # packets, as aiortc's receiver sizes its video buffer
# Where aiortc's RTCRtpReceiver keeps its jitter buffer (a name-mangled private attribute).
RECEIVER_ATTRIBUTE = "_RTCRtpReceiver__jitter_buffer"


class MarkerJitterBuffer(JitterBuffer):
    """aiortc's video jitter buffer, completing a frame at its marked last packet as well."""

    def __init__(self) -> None:
        super().__init__(capacity=VIDEO_CAPACITY, is_video=True)

    def _remove_frame(self, sequence_number: int) -> JitterFrame | None:
        if self._origin is None:
            return None
        packets: list[RtpPacket] = []
        for count in range(self.capacity):
            packet = self._packets[(self._origin + count) % self._capacity]
            if packet is None:
                return None  # a gap: the frame is not complete yet
            if packets and packet.timestamp != packets[0].timestamp:
                return self._complete(packets, count)  # the next frame began (aiortc's rule)
            packets.append(packet)
            if packet.marker:
                return self._complete(packets, count + 1)
        return None

    def _complete(self, packets: list[RtpPacket], count: int) -> JitterFrame:
        self.remove(count)
        # aiortc's receiver sets `_data` (the depayloaded bytes) on every packet before adding it.
        return JitterFrame(data=b"".join(p._data for p in packets),  # type: ignore[attr-defined]
                           timestamp=packets[0].timestamp)


def complete_video_frames_on_marker(pc: RTCPeerConnection) -> None:
    """Give every video receiver of ``pc`` a :class:`MarkerJitterBuffer` (call before media flows:
    once its transceivers exist, before the connection is up). Receivers already given one, and
    aiortc versions that keep the buffer elsewhere, are left as they are."""
    for transceiver in pc.getTransceivers():
        receiver = transceiver.receiver
        if transceiver.kind != "video" or isinstance(getattr(receiver, RECEIVER_ATTRIBUTE, None), MarkerJitterBuffer):
            continue
        if not isinstance(getattr(receiver, RECEIVER_ATTRIBUTE, None), JitterBuffer):
            log.warning("aiortc's receiver keeps no jitter buffer at %s: video keeps one frame of extra latency",
                        RECEIVER_ATTRIBUTE)
            continue
        setattr(receiver, RECEIVER_ATTRIBUTE, MarkerJitterBuffer())
