"""app/server/media/jitter.py: a video frame leaves the jitter buffer at its marked last packet."""

from __future__ import annotations

from aiortc import RTCPeerConnection
from aiortc.jitterbuffer import JitterBuffer
from aiortc.rtp import RtpPacket

from app.server.media.jitter import RECEIVER_ATTRIBUTE, MarkerJitterBuffer, complete_video_frames_on_marker


def packet(seq: int, timestamp: int, data: bytes, marker: bool = False) -> RtpPacket:
    p = RtpPacket(sequence_number=seq, timestamp=timestamp, marker=int(marker))
    p._data = data  # type: ignore[attr-defined]  # what aiortc's receiver sets before adding a packet
    return p


def frames_out(buffer: JitterBuffer, packets: list[RtpPacket]) -> list[tuple[int, bytes] | None]:
    out = []
    for p in packets:
        frame = buffer.add(p)[1]
        out.append(None if frame is None else (p.sequence_number, frame.data))
    return out


def test_a_marked_frame_leaves_at_its_last_packet_where_aiortc_waits_for_the_next_frame() -> None:
    stream = [packet(10, 3000, b"a"), packet(11, 3000, b"b"), packet(12, 3000, b"c", marker=True),
              packet(13, 6000, b"d", marker=True), packet(14, 9000, b"e")]
    assert frames_out(MarkerJitterBuffer(), stream) == [None, None, (12, b"abc"), (13, b"d"), None]
    # aiortc's own buffer hands each frame on one packet (one frame period) later.
    assert frames_out(JitterBuffer(capacity=512, is_video=True), stream) == [None, None, None, (13, b"abc"),
                                                                            (14, b"d")]


def test_reordered_packets_wait_for_the_gap_and_unmarked_frames_keep_aiortcs_rule() -> None:
    stream = [packet(100, 0, b"x"), packet(102, 0, b"z", marker=True), packet(101, 0, b"y"),
              packet(103, 90, b"p"), packet(104, 180, b"q")]  # frame 90 has no marker (a sender without it)
    assert frames_out(MarkerJitterBuffer(), stream) == [None, None, (101, b"xyz"), None, (104, b"p")]


async def test_video_receivers_of_a_real_peer_get_the_buffer() -> None:
    pc = RTCPeerConnection()
    try:
        pc.addTransceiver("video", direction="recvonly")
        pc.addTransceiver("audio", direction="recvonly")
        complete_video_frames_on_marker(pc)
        video, audio = pc.getTransceivers()
        assert isinstance(getattr(video.receiver, RECEIVER_ATTRIBUTE), MarkerJitterBuffer)
        assert not isinstance(getattr(audio.receiver, RECEIVER_ATTRIBUTE), MarkerJitterBuffer)
    finally:
        await pc.close()
