"""WebRTC gateway (aiortc): publishers send camera video in, viewers get a stream's stylized output."""

from __future__ import annotations

import json
import logging
from fractions import Fraction

import av
from aiortc import MediaStreamTrack, RTCDataChannel, RTCPeerConnection, RTCSessionDescription
from aiortc.codecs.base import Encoder
from aiortc.contrib.media import MediaRelay
from aiortc.exceptions import OperationError
from aiortc.mediastreams import MediaStreamError

from app.server.config import ServerConfig
from app.server.edge.logs import mint_secret
from app.server.media.audio import AudioPlayout, DelayedAudioTrack, offers_audio, wants_audio
from app.server.media.encoder import encode_output_frames
from app.server.media.frame_path import ChunkAssembler, OutputFrame, Playout, video_frames
from app.server.media.ice import rtc_configuration, strip_candidates
from app.server.media.jitter import complete_video_frames_on_marker
from app.server.media.sdp import OfferError, check_offer
from app.server.media.shared_vp8 import SharedVp8Encoder
from app.server.serving.engine_bridge import StreamSettings
from app.server.serving.session import CapacityError, Session, SessionManager

log = logging.getLogger(__name__)

VIDEO_CLOCK = 90_000
VIDEO_TIME_BASE = Fraction(1, VIDEO_CLOCK)


class PlayoutTrack(MediaStreamTrack):
    """Outgoing video: one frame per playout tick, stamped with the playout clock; its sender's encoder
    is told the tick, which the stream's shared VP8 encoder keys its frames by (app/server/media/shared_vp8.py)."""

    kind = "video"

    def __init__(self, playout: Playout, encoder: SharedVp8Encoder) -> None:
        super().__init__()
        self._playout = playout
        self._viewer = encoder.viewer()
        self._tick = 0
        self._last: tuple[OutputFrame, float] | None = None

    def viewer_encoder(self) -> Encoder:
        return self._viewer

    async def recv(self) -> av.VideoFrame:
        owed = self._viewer.owed()
        if owed is not None and self._last is not None:
            # Frames the stream's encoder made while this sender was away come first: its encoder
            # sends those (the frame returned is not encoded), without waiting for the next tick.
            self._tick = owed
            out, seconds = self._last
        else:
            self._tick, out, seconds = await self._playout.next_frame(self._tick)
            self._last = out, seconds
        # The frame's planes are converted once for every track and recording of the stream; a tick
        # that repeats the last frame converts nothing (below the camera's rate, most ticks do).
        frame = out.video_frame()
        frame.pts = int(seconds * VIDEO_CLOCK)
        frame.time_base = VIDEO_TIME_BASE
        self._viewer.tick = self._tick
        return frame

    def stop(self) -> None:
        super().stop()
        self._viewer.leave()  # its bitrate no longer holds the stream's encoder down


async def read_input(track: MediaStreamTrack, assembler: ChunkAssembler) -> None:
    async for frame in video_frames(track):
        assembler.push(frame)


async def read_audio(track: MediaStreamTrack, audio: AudioPlayout) -> None:
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            return
        if isinstance(frame, av.AudioFrame):
            audio.push(frame)


async def discard(track: MediaStreamTrack) -> None:
    """Receive and drop a track's frames. A session task, so it ends with the stream: aiortc's
    MediaBlackhole runs tasks of its own, which a stream closed before its peer connected left
    waiting for ever (and asyncio then logged "Task was destroyed but it is pending")."""
    while True:
        try:
            await track.recv()
        except MediaStreamError:
            return


class Gateway:
    def __init__(self, manager: SessionManager, config: ServerConfig) -> None:
        self._manager = manager
        self._config = config
        # Unbuffered subscriptions: a buffered relay queues every frame the model cannot keep up
        # with and latency grows without bound (docs/architecture.md, "Library facts").
        self._relay = MediaRelay()

    def _peer(self) -> RTCPeerConnection:
        return RTCPeerConnection(configuration=rtc_configuration(self._config))

    def _incoming(self, sdp: str) -> RTCSessionDescription:
        return RTCSessionDescription(sdp=strip_candidates(sdp) if self._config.break_ice else sdp, type="offer")

    async def _answer(self, pc: RTCPeerConnection, offer_sdp: str) -> str:
        try:
            await pc.setRemoteDescription(self._incoming(offer_sdp))
            complete_video_frames_on_marker(pc)  # its transceivers exist now; media flows after the answer
            encode_output_frames(pc)  # the codecs are negotiated now
            answer = await pc.createAnswer()
        except OperationError as exc:  # no codec in common (e.g. an H264 profile aiortc lacks)
            raise OfferError("no codec in the offer can be negotiated: the server receives VP8 or H264 "
                             "(packetization-mode 1, baseline profiles) video") from exc
        except Exception as exc:
            # aiortc reads hostile input: whatever it raises on an offer that passed check_offer
            # is that offer's fault for the client (a 400), and a case for check_offer (logged).
            log.warning("aiortc refused an offer that passed the SDP checks", exc_info=True)
            raise OfferError("cannot negotiate this offer (the server logged why)") from exc
        # setLocalDescription gathers all candidates: the answer is complete (no trickle ICE).
        await pc.setLocalDescription(answer)
        sdp = pc.localDescription.sdp
        return strip_candidates(sdp) if self._config.break_ice else sdp

    async def publish(
        self, offer_sdp: str, settings: StreamSettings, kind: str, send_output: bool
    ) -> tuple[Session, str]:
        """A camera publisher (the page, or a WHIP client): returns the new session and the answer SDP."""
        check_offer(offer_sdp, publish=True)
        session = await self._manager.open(kind, settings)
        if offers_audio(offer_sdp):  # its audio comes back out, as late as the video (app/server/media/audio.py)
            session.enable_audio()
        pc = self._peer()
        session.publisher_session = mint_secret(16)  # the WHIP session URL's capability
        session.peers[session.publisher_session] = pc

        @pc.on("track")
        def on_track(track: MediaStreamTrack) -> None:
            if track.kind == "video":
                source = self._relay.subscribe(track, buffered=False)
                # The video ends when the publisher leaves: its RTCP BYE, or its DTLS or ICE closing.
                # Each alone ends the stream, so a lost goodbye packet (UDP) does not keep the stream
                # and its client's slot until the input watchdog.
                session.spawn(read_input(source, session.assembler), "input", ends_session=True)
            elif session.audio is not None:  # the page's microphone, OBS's Opus audio
                session.spawn(read_audio(track, session.audio), "audio-in")
            else:  # a track nobody plays: drain it, or aiortc's receive queue grows forever
                session.spawn(discard(track), "audio-sink")

        @pc.on("datachannel")
        def on_datachannel(channel: RTCDataChannel) -> None:
            self._attach_control(channel, session)

        @pc.on("connectionstatechange")
        async def on_state() -> None:
            log.info("stream %s publisher: %s", session.id, pc.connectionState)
            if pc.connectionState in ("failed", "closed"):
                await session.close(f"its publisher's connection {pc.connectionState}")

        try:
            if send_output:
                pc.addTrack(PlayoutTrack(session.playout, session.video_encoder))
                if session.audio is not None:
                    pc.addTrack(DelayedAudioTrack(session.audio))
            answer = await self._answer(pc, offer_sdp)
        except BaseException:
            await session.close()
            raise
        return session, answer

    def _attach_control(self, channel: RTCDataChannel, session: Session) -> None:
        limit = self._config.max_prompt_chars

        @channel.on("message")
        def on_message(message: str | bytes) -> None:
            async def handle() -> None:
                text = message if isinstance(message, str) else message.decode("utf-8", "replace")
                reply = await session.handle_text(text, limit)
                if channel.readyState == "open":
                    channel.send(json.dumps(reply))

            session.spawn(handle(), "control")

        async def send(text: str) -> None:
            channel.send(text)

        session.spawn(session.send_stats(send, lambda: channel.readyState == "open"), "stats")

    async def add_viewer(self, session: Session, offer_sdp: str) -> tuple[str, str]:
        """A WHEP viewer of a stream's output: returns (viewer id, answer SDP)."""
        check_offer(offer_sdp, publish=False)
        if session.viewers >= self._config.max_viewers:
            raise CapacityError(f"stream {session.id} already has {self._config.max_viewers} viewers")
        pc = self._peer()
        viewer_id = mint_secret(16)  # the viewer's session URL is its only credential
        # The slot is taken before the answer is awaited (ICE gathering): offers arriving meanwhile
        # count it, so --max-viewers holds under concurrency. A failed answer gives it back.
        session.peers[viewer_id] = pc
        pc.addTrack(PlayoutTrack(session.playout, session.video_encoder))
        if session.audio is not None and wants_audio(offer_sdp):
            pc.addTrack(DelayedAudioTrack(session.audio))

        @pc.on("connectionstatechange")
        async def on_state() -> None:
            if pc.connectionState in ("failed", "closed"):
                await self.remove_viewer(session, viewer_id)

        try:
            answer = await self._answer(pc, offer_sdp)
        except BaseException:
            await self.remove_viewer(session, viewer_id)
            raise
        return viewer_id, answer

    async def remove_viewer(self, session: Session, viewer_id: str) -> bool:
        pc = session.peer(viewer_id, publisher=False)
        if pc is None:
            return False
        del session.peers[viewer_id]
        await pc.close()
        return True
