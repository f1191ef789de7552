"""One VP8 encode per output frame, shared by every WebRTC viewer of a stream.

Each viewer's RTCRtpSender (the page publisher's return track and every WHEP viewer: they all play
the stream's ``Playout``) would otherwise run a libvpx encoder of its own on the same frames. Here a
stream has one ``SharedVp8Encoder`` and each sender a ``ViewerEncoder`` (installed in place of
aiortc's, app/server/media/encoder.py) that hands it the stream's encoded frames: the first sender to
ask for a playout tick encodes it, the others get the same RTP payloads (each sender adds its own
SSRC, sequence numbers and timestamp origin). Rules that keep every viewer's decoder in step:

- The encoded frames form one sequence (ascending playout ticks). A viewer sends them in order and
  never skips one: a delta frame decodes only on top of the frame before it. A viewer that fell a
  little behind (its sender's loop missed a tick) catches up on the frames it is owed, kept for
  ``HISTORY`` frames; one further behind, a viewer that joins and one whose receiver asks for a
  keyframe (PLI/FIR) drop out of step and skip frames until a keyframe, the next frame encoded. A frame
  already encoded as a delta is never encoded again as a keyframe: the viewers in step have it.
- Bitrate: aiortc sets each sender's ``target_bitrate`` from its receiver's estimate (REMB); the
  stream is encoded at the lowest of its viewers' (a viewer on a poor link lowers it for all of them:
  the price of one encode). A change of more than 10 % reopens the codec (aiortc's rule), whose first
  frame is a keyframe for everyone.
- Viewers that leave (their track stopped) no longer count. A slow viewer holds no one up: encoding
  happens on whichever sender's executor thread asks first, and a track asking on the event loop
  what its sender is owed never waits for an encode.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import av
from aiortc.codecs.base import Encoder
from aiortc.codecs.vpx import DEFAULT_BITRATE, MAX_BITRATE, MIN_BITRATE, VpxPayloadDescriptor
from av.frame import Frame
from av.packet import Packet

from app.server.media.encoder import OutputVp8Encoder

HISTORY = 15  # encoded frames kept for viewers catching up: half a second at 30 fps


@dataclass(frozen=True)
class EncodedFrame:
    index: int  # its place in the stream's sequence of encoded frames
    tick: int  # the playout tick it shows
    payloads: list[bytes]  # RTP payloads (VP8 payload descriptor + data)
    timestamp: int  # 90 kHz, the same for every viewer (each sender adds its own origin)
    keyframe: bool


def is_keyframe(payloads: list[bytes]) -> bool:
    """The VP8 frame header's inverse key frame bit (RFC 6386 9.1), read past the payload descriptor."""
    _, data = VpxPayloadDescriptor.parse(payloads[0])
    return not data[0] & 1


class SharedVp8Encoder:
    """A stream's VP8 encoder and the sequence of frames it encoded, shared by its viewers."""

    def __init__(self) -> None:
        self._codec = OutputVp8Encoder()
        # Two locks: the sequence and its viewers (held briefly, also by a track's recv on the event
        # loop), and libvpx (held for an encode, on executor threads only), so that the event loop
        # never waits for an encode.
        self._lock = threading.Lock()
        self._encoding = threading.Lock()
        self._history: deque[EncodedFrame] = deque(maxlen=HISTORY)
        self._viewers: set[ViewerEncoder] = set()
        self._keyframe_wanted = False
        self.encodes = 0  # libvpx encodes: one per encoded frame, however many viewers send it
        self.keyframes = 0

    def viewer(self) -> ViewerEncoder:
        """The encoder of one more sender; it counts (bitrate, keyframes) from its first frame on."""
        return ViewerEncoder(self)

    def owed(self, viewer: ViewerEncoder) -> int | None:
        """The tick of the next encoded frame ``viewer`` may send now (it has not sent it yet), if any."""
        with self._lock:
            frame = self._next_for(viewer) if viewer in self._viewers else None
            return None if frame is None else frame.tick

    def encode(self, viewer: ViewerEncoder, frame: av.VideoFrame, tick: int,
               force_keyframe: bool) -> tuple[list[bytes], int]:
        """The payloads ``viewer`` sends next, given the playout tick its track read: a frame it is owed,
        else ``frame`` encoded now, else nothing (a tick another viewer's encode passed, or a viewer out
        of step whose keyframe is not encoded yet: aiortc's sender sends nothing for an empty list)."""
        with self._encoding:  # the viewers of one tick wait here for its encode, then find it done
            with self._lock:
                if viewer.left:  # a sender stopping while its last encode was on its way
                    return [], 0
                if viewer not in self._viewers:  # its first frame: it starts at a keyframe of this tick or later
                    self._viewers.add(viewer)
                    viewer.sent = max((e.index for e in self._history if e.tick < tick), default=-1)
                if force_keyframe:
                    viewer.in_step = False
                encoded = self._next_for(viewer)
                if encoded is None:
                    newest = self._history[-1] if self._history else None
                    if newest is not None and tick <= newest.tick:
                        return [], 0
                    keyframe = self._keyframe_wanted or not viewer.in_step
                    self._codec.target_bitrate = min(v.target_bitrate for v in self._viewers)
            if encoded is None:
                payloads, timestamp = self._codec.encode(frame, keyframe)
                with self._lock:
                    encoded = self._append(tick, payloads, timestamp)
            with self._lock:
                viewer.sent, viewer.in_step = encoded.index, True
            return encoded.payloads, encoded.timestamp

    def leave(self, viewer: ViewerEncoder) -> None:
        with self._lock:
            viewer.left = True
            self._viewers.discard(viewer)

    def _next_for(self, viewer: ViewerEncoder) -> EncodedFrame | None:
        """In step: the frame after the last it sent, while kept. Out of step: a keyframe newer than the
        last it sent (none yet: the next frame encoded will be one)."""
        if viewer.in_step and self._history:
            wanted = viewer.sent + 1
            first = self._history[0].index
            if wanted > self._history[-1].index:
                return None
            if wanted >= first:
                return self._history[wanted - first]
            viewer.in_step = False  # the frames it missed are gone: it waits for a keyframe
        for encoded in self._history:
            if encoded.keyframe and encoded.index > viewer.sent:
                return encoded
        self._keyframe_wanted = True
        return None

    def _append(self, tick: int, payloads: list[bytes], timestamp: int) -> EncodedFrame:
        """A frame just encoded joins the sequence."""
        newest = self._history[-1] if self._history else None
        if newest is not None:
            # Viewers read the playout clock at different moments: keep the sequence's times ascending.
            timestamp = max(timestamp, newest.timestamp + 1)
        encoded = EncodedFrame(newest.index + 1 if newest else 0, tick, payloads, timestamp, is_keyframe(payloads))
        self._history.append(encoded)
        self.encodes += 1
        if encoded.keyframe:
            self.keyframes += 1
            self._keyframe_wanted = False
        return encoded


class ViewerEncoder(Encoder):
    """One sender's view of the stream's shared encoder (aiortc calls ``encode`` on an executor thread).
    Its track sets ``tick`` to the playout tick of the frame it hands the sender, which encodes that frame
    before it reads the next (app/server/media/gateway.py, PlayoutTrack). Not ``VideoFrame.opaque``:
    PyAV keys it by ``id()``, so frames of one small-int tick share it and the first freed clears it."""

    def __init__(self, shared: SharedVp8Encoder) -> None:
        self._shared = shared
        self._target_bitrate = DEFAULT_BITRATE
        self.tick = 0
        self.sent = -1  # index of the last encoded frame this viewer sent (or the last before the tick it joined at)
        self.in_step = False
        self.left = False

    @property
    def target_bitrate(self) -> int:
        """Bits per second this viewer's receiver can take (aiortc sets it from REMB, as for its own
        encoder: clamped to aiortc's VP8 range)."""
        return self._target_bitrate

    @target_bitrate.setter
    def target_bitrate(self, bitrate: int) -> None:
        self._target_bitrate = max(MIN_BITRATE, min(bitrate, MAX_BITRATE))

    def owed(self) -> int | None:
        return self._shared.owed(self)

    def leave(self) -> None:
        self._shared.leave(self)

    def encode(self, frame: Frame, force_keyframe: bool = False) -> tuple[list[bytes], int]:
        assert isinstance(frame, av.VideoFrame)
        return self._shared.encode(self, frame, self.tick, force_keyframe)

    def pack(self, packet: Packet) -> tuple[list[bytes], int]:
        raise TypeError("the stream's output tracks send frames, not encoded packets")
