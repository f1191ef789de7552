"""app/server/media/shared_vp8.py: a stream's viewers share one VP8 encode per frame, and every viewer's
decoder stays in step (real libvpx, aiortc's VP8 depacketizer and decoder; no network)."""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np
from aiortc.codecs.vpx import MAX_BITRATE, MIN_BITRATE, Vp8Decoder, vp8_depayload
from aiortc.jitterbuffer import JitterFrame

from app.client import pattern_frame
from app.server.media.shared_vp8 import HISTORY, SharedVp8Encoder, ViewerEncoder, is_keyframe

SIZE = (96, 64)


def frame_at(tick: int) -> av.VideoFrame:
    frame = av.VideoFrame.from_ndarray(pattern_frame(tick, SIZE), format="rgb24").reformat(format="yuv420p")
    frame.pts, frame.time_base = tick * 3000, Fraction(1, 90_000)
    return frame


class Receiver:
    """One viewer: what its sender sends for a tick, through aiortc's VP8 decoder."""

    def __init__(self, viewer: ViewerEncoder) -> None:
        self.viewer = viewer
        self.decoder = Vp8Decoder()
        self.sent: list[tuple[int, list[bytes]]] = []  # (timestamp, RTP payloads) of every frame sent
        self.decoded: dict[int, np.ndarray] = {}  # timestamp -> the picture decoded

    def send(self, tick: int, force_keyframe: bool = False) -> bool:
        """The sender's step for the frame of ``tick`` (or a frame it is owed): False when it sent nothing."""
        self.viewer.tick = tick
        payloads, timestamp = self.viewer.encode(frame_at(tick), force_keyframe)
        if not payloads:
            return False
        self.sent.append((timestamp, payloads))
        data = b"".join(vp8_depayload(p) for p in payloads)
        pictures = self.decoder.decode(JitterFrame(data=data, timestamp=timestamp))
        assert len(pictures) == 1, "a frame its decoder could not decode"
        self.decoded[timestamp] = pictures[0].to_ndarray(format="rgb24")  # type: ignore[attr-defined]
        return True

    def catch_up(self) -> int:
        """Send every frame it is owed, as its track's recv would hand them over at once."""
        sent = 0
        while (owed := self.viewer.owed()) is not None:
            assert self.send(owed)
            sent += 1
        return sent


def test_viewers_get_one_encode_per_frame_and_decode_the_same_pictures(libvpx_calls: list[int]) -> None:
    shared = SharedVp8Encoder()
    a, b, c = (Receiver(shared.viewer()) for _ in range(3))
    for tick in range(1, 11):
        for receiver in (a, b, c):
            assert receiver.send(tick)
    assert len(libvpx_calls) == shared.encodes == 10
    assert a.sent == b.sent == c.sent  # the same bitstream, frame after frame
    assert shared.keyframes == 1 and is_keyframe(a.sent[0][1]) and not is_keyframe(a.sent[1][1])
    for timestamp, picture in a.decoded.items():
        np.testing.assert_array_equal(picture, c.decoded[timestamp])
    # The pictures are the frames', not one frozen or lagging picture.
    for tick, (timestamp, _) in enumerate(a.sent, start=1):
        picture = a.decoded[timestamp].astype(float)
        near = np.abs(picture - pattern_frame(tick, SIZE)).mean()
        assert near < 12 and near < np.abs(picture - pattern_frame(tick - 1, SIZE)).mean()


def test_a_viewer_that_joins_late_waits_for_the_next_frame_encoded_and_it_is_a_keyframe_for_everyone() -> None:
    shared = SharedVp8Encoder()
    a = Receiver(shared.viewer())
    for tick in range(1, 6):
        assert a.send(tick)
    late = Receiver(shared.viewer())
    assert a.send(6)  # a delta frame, already encoded when the late viewer asks for tick 6
    assert not late.send(6)  # never encoded twice: it sends nothing for now
    assert late.send(7) and a.send(7)
    assert shared.encodes == 7 and shared.keyframes == 2
    assert late.sent == a.sent[-1:] and is_keyframe(late.sent[0][1])
    for tick in range(8, 12):
        assert late.send(tick) and a.send(tick)
    for timestamp, picture in late.decoded.items():
        np.testing.assert_array_equal(picture, a.decoded[timestamp])


def test_a_keyframe_request_never_reencodes_a_delta_the_others_have() -> None:
    shared = SharedVp8Encoder()
    a, b = Receiver(shared.viewer()), Receiver(shared.viewer())
    for tick in range(1, 5):
        assert a.send(tick) and b.send(tick)
    assert a.send(5)
    assert not b.send(5, force_keyframe=True)  # its receiver lost a frame (PLI): it skips until a keyframe
    assert a.send(6) and b.send(6)  # the next frame encoded is one, for both
    assert shared.encodes == 6 and shared.keyframes == 2
    assert [t for t, _ in b.sent] == [t for t, _ in a.sent if t != 5 * 3000]
    for tick in range(7, 10):
        assert a.send(tick) and b.send(tick)
    assert a.sent[5:] == b.sent[4:]


def test_a_viewer_behind_catches_up_in_order_and_one_too_far_behind_waits_for_a_keyframe() -> None:
    shared = SharedVp8Encoder()
    a, b = Receiver(shared.viewer()), Receiver(shared.viewer())
    assert a.send(1) and b.send(1)
    for tick in range(2, 5):  # b's sender missed three ticks
        assert a.send(tick)
    assert b.send(5)  # its encoder hands it the frames it is owed first (tick 2), then the rest
    assert b.catch_up() == 2
    assert a.send(5) and b.catch_up() == 1
    assert b.sent == a.sent and shared.encodes == 5 and shared.keyframes == 1
    for tick in range(6, 7 + HISTORY):  # b now misses more frames than the encoder keeps
        assert a.send(tick)
    assert b.viewer.owed() is None
    assert b.send(7 + HISTORY) and a.send(7 + HISTORY)  # a new frame: encoded as a keyframe, for both
    assert shared.keyframes == 2 and b.sent[-1] == a.sent[-1] and is_keyframe(b.sent[-1][1])


def test_the_stream_is_encoded_at_its_lowest_viewers_bitrate_until_that_viewer_leaves() -> None:
    shared = SharedVp8Encoder()
    slow, fast = Receiver(shared.viewer()), Receiver(shared.viewer())
    slow.viewer.target_bitrate, fast.viewer.target_bitrate = 300_000, 10 * MAX_BITRATE  # their receivers' REMB
    assert fast.viewer.target_bitrate == MAX_BITRATE  # aiortc's range, as for its own encoder
    for tick in range(1, 4):
        assert slow.send(tick) and fast.send(tick)
    codec = shared._codec.codec
    assert codec is not None and codec.bit_rate == 300_000
    slow.viewer.leave()
    assert not slow.send(4)
    assert fast.send(4)
    codec = shared._codec.codec
    # The fast viewer's estimate, under the ceiling of the frames' size (libwebrtc's, 600 kbps up to 320x240)
    assert codec is not None and codec.bit_rate == 600_000 < MAX_BITRATE
    assert shared.keyframes == 2  # the reopened codec's first frame, for every viewer
    slow.viewer.target_bitrate = MIN_BITRATE // 2
    assert slow.viewer.target_bitrate == MIN_BITRATE
