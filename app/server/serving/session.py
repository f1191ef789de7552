"""Streams and their lifetime: one Session per camera (page, WHIP publisher or WebSocket client)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from aiortc import RTCPeerConnection

from app.server.config import ServerConfig
from app.server.control.messages import (
    ControlError,
    ControlMessage,
    CueMessage,
    CueSpec,
    PauseMessage,
    ResetMessage,
    ResumeMessage,
    UpdateMessage,
    parse_control,
)
from app.server.control.recorder import Recorder
from app.server.control.recordings import NOT_ENABLED, RecordingError, RecordingStore
from app.server.edge.limits import InputTimeout, MessageGuard, control_guard, watch_input
from app.server.edge.logs import mint_secret
from app.server.media.audio import SPREAD_WINDOW_S, SYNC_WINDOW_S, AudioPlayout
from app.server.media.frame_path import ChunkAssembler, Playout, StreamRunner
from app.server.media.ndi import DEFAULT_LABEL, NDI_OUT_OFF, SourceNames
from app.server.media.ndi_out import NdiOutput
from app.server.media.shared_vp8 import SharedVp8Encoder
from app.server.serving.engine_bridge import ProcessorFactory, StreamSettings
from engine.streaming.prompts import seconds_to_chunks

if TYPE_CHECKING:
    from app.server.serving.executors import ServingLoop

log = logging.getLogger(__name__)

# Why a stream ended when nothing said more (its recording's sidecar, its owner's 410).
DEFAULT_END_REASON = "stream ended"

STATS_INTERVAL_S = 1.0


class CapacityError(RuntimeError):
    """The server already runs --max-streams streams."""


class Session:
    def __init__(
        self, stream_id: str, kind: str, settings: StreamSettings, runner: StreamRunner,
        assembler: ChunkAssembler, playout: Playout, on_close: Callable[[str], None],
    ) -> None:
        self.id = stream_id
        self.kind = kind  # "webrtc" (the page), "whip" or "ws"
        self.settings = settings
        self.runner = runner
        self.assembler = assembler
        self.playout = playout
        # Its output's VP8 encoder, shared by every WebRTC viewer (the publisher's return track, WHEP).
        self.video_encoder = SharedVp8Encoder()
        self.created = time.monotonic()
        # WebRTC peers by session id: the last part of each one's session URL (/whip/<id>/<session>,
        # /whep/<id>/<viewer>), 128 random bits each: holding one is the right to end that session.
        self.peers: dict[str, RTCPeerConnection] = {}
        self.publisher_session: str | None = None  # the key of the publisher's peer (WebRTC and WHIP)
        self.closed = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._on_close = on_close
        self._closing: asyncio.Task[None] | None = None
        # The serving policy's fields (tier, credit, fidelity, ...) of this stream.
        self.policy_stats: Callable[[], dict[str, Any]] | None = None
        # Tells the policy the user's step count, the ceiling of the stream's fidelity.
        self.on_steps: Callable[[int], None] | None = None
        # Size and rate limit of this stream's control messages, over every transport (limits.py).
        self.control_guard: MessageGuard | None = None
        # The publisher's audio, played out as late as the video (None: a video-only stream).
        self.audio: AudioPlayout | None = None
        # The stream's cue list (PUT /api/streams/{id}/cues), fired by name (docs/cues.md).
        self.cues: list[CueSpec] = []
        # Server-side recording (--record-dir; None: not enabled) and the one running, if any.
        self.recordings: RecordingStore | None = None
        self.recorder: Recorder | None = None
        self.record_error: str | None = None
        self._record_task: asyncio.Task[Any] | None = None
        # Why the stream ends, as its recording's sidecar says (its owner reads it after the end).
        self.end_reason = DEFAULT_END_REASON
        # What the stream is called where a name is shown (its NDI source); the NDI names of the
        # server (None: no --ndi-out) and the stream's NDI output while it publishes one.
        self.label = DEFAULT_LABEL
        self.ndi_names: SourceNames | None = None
        self.ndi_fps = 30.0
        self.ndi: NdiOutput | None = None
        self._ndi_task: asyncio.Task[Any] | None = None
        # What a new prompt is served as on a model with looks (None: the model has none): the notice
        # for prompts far from every look it ships and the looks the prompt gets.
        self.prompt_report: Callable[[tuple[str, ...], list[float] | None], Awaitable[dict[str, Any]]] | None = None

    def enable_audio(self) -> AudioPlayout:
        """The stream has audio: start its delayed playout (fed by the publisher's audio track)."""
        if self.audio is None:
            self.audio = AudioPlayout(self.video_delay_s)
            self.spawn(self.audio.run(), "audio-playout")
        return self.audio

    def video_delay_s(self) -> tuple[float, float] | None:
        """Input capture -> output shown, as the audio must be delayed, and how much it varies: the
        playout's latency (arrival -> shown); the video receiver hands a frame on at its last packet
        (app/server/media/jitter.py), so arrival is capture plus the network."""
        recent, longer = self.playout.recent_latency_s(SYNC_WINDOW_S), self.playout.recent_latency_s(SPREAD_WINDOW_S)
        if recent is None or longer is None:
            return None
        return recent[0], longer[1]

    def check_recording(self) -> None:
        """RecordingError when a recording could not start now (not enabled, storage full)."""
        if self.recorder is None:
            if self.recordings is None:
                raise RecordingError(NOT_ENABLED)
            self.recordings.check_room()

    def start_recording(self) -> None:
        """Record the output (with its audio) from now on; RecordingError when the server cannot."""
        if self.recorder is not None:
            return
        if self.recordings is None:
            raise RecordingError(NOT_ENABLED)
        directory, name = self.recordings.new_recording(self.id)
        self.recorder = Recorder(directory, name, self.id, self.settings.prompt, self.playout, self.audio,
                                 fits=self.recordings.fits)
        self.record_error = None
        self._record_task = self.spawn(self._record(self.recorder), "record")
        log.info("stream %s: recording %s started", self.id, name)

    async def _record(self, recorder: Recorder) -> None:
        await asyncio.gather(recorder.feed_video(), recorder.feed_audio())
        # The feeds end by themselves only when the encoder stopped: the storage quota was reached.
        if self.recorder is recorder:
            self.recorder = None
            self.record_error = "recording storage is full"
            await self._finish_recording(recorder, "storage full")

    async def stop_recording(self, reason: str) -> None:
        recorder, task = self.recorder, self._record_task
        if recorder is None:
            return
        self.recorder = None
        if task is not None:
            task.cancel()
        await self._finish_recording(recorder, reason)

    async def _finish_recording(self, recorder: Recorder, reason: str) -> None:
        try:
            info = await recorder.finish(reason)
        finally:  # the thread finishes the file even if this wait is cancelled (the stream closing)
            if self.recordings is not None:
                self.recordings.finished(self.id, recorder.name)
        log.info("stream %s: recording %s finished (%s, %d frames)", self.id, recorder.name, info.ended, info.frames)

    def start_ndi(self) -> None:
        """Publish the output (with its audio) as an NDI source named after the label."""
        if self.ndi is not None:
            return
        if self.ndi_names is None:
            raise ControlError(NDI_OUT_OFF)
        self.ndi = NdiOutput(self.ndi_names, self.label, self.playout, self.audio, self.ndi_fps)
        self._ndi_task = self.spawn(self.ndi.feed(), "ndi-out")

    async def stop_ndi(self) -> None:
        ndi, task = self.ndi, self._ndi_task
        if ndi is None:
            return
        self.ndi = None
        if task is not None:
            task.cancel()
        await ndi.close()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str, ends_session: bool = False) -> asyncio.Task[Any]:
        """Run a task that lives as long as the session; a crash ends the session, and so does the
        task's end when ``ends_session`` (the publisher's input: a track ends when its peer leaves)."""
        # The name says what the task does, never whose: a prefix of the stream id would reach logs
        # (asyncio names tasks in its own messages) where the redaction cannot recognise it.
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._task_done(done, ends_session))
        return task

    def _task_done(self, task: asyncio.Task[Any], ends_session: bool) -> None:
        self._tasks.discard(task)
        if task.cancelled() or self.closed.is_set():
            return
        exc = task.exception()
        if exc is not None:
            self.fail(task.get_name(), exc)
        elif ends_session:
            log.info("stream %s: %s ended", self.id, task.get_name())
            self._closing = asyncio.get_running_loop().create_task(self.close(f"its {task.get_name()} ended"))

    def fail(self, what: str, exc: BaseException) -> None:
        """Something this stream depends on crashed (one of its tasks, or its chunk on the engine)."""
        if self.closed.is_set():
            return
        if isinstance(exc, InputTimeout):  # the watchdog doing its job (a vanished client): no crash
            log.warning("stream %s closed: %s", self.id, exc)
            reason = str(exc)
        else:
            log.error("stream %s: %s failed: %r", self.id, what, exc, exc_info=exc)
            reason = f"its {what} failed"
        self._closing = asyncio.get_running_loop().create_task(self.close(reason))  # keep a reference

    async def apply(self, message: ControlMessage) -> None:
        if isinstance(message, UpdateMessage):
            await self._update(message)
        elif isinstance(message, CueMessage):
            cue = next((c for c in self.cues if c.name == message.name), None)
            if cue is None:
                raise ControlError(f"no cue {message.name!r} on this stream (it has {len(self.cues)} cues)")
            chunks = seconds_to_chunks(cue.transition_s, self.playout.chunk_duration_s)
            # Built, not validated: the cue was checked when the set was put, and a transition in
            # seconds may take more chunks than an update message may ask for.
            await self._update(UpdateMessage.model_construct(
                type="update", prompt=cue.prompt, prompt_weights=cue.prompt_weights, loras=cue.loras,
                noise_scale=cue.noise_scale, transition_chunks=chunks or None), cue=cue.name)
        elif isinstance(message, PauseMessage):
            self.runner.pause()
        elif isinstance(message, ResumeMessage):
            self.runner.resume()
        elif isinstance(message, ResetMessage):
            await self.runner.reset()

    async def _update(self, message: UpdateMessage, cue: str | None = None) -> None:
        """Apply an update message (``cue``: the name of the cue it comes from, for the recording's
        prompt timeline)."""
        if message.record:
            self.check_recording()  # first: a refusal (not enabled, storage full) applies nothing
        if message.ndi_out and self.ndi_names is None:
            raise ControlError(NDI_OUT_OFF)  # first, like recording: nothing is applied
        changes = message.changes()
        if changes:
            await self.runner.update(**changes)
        if message.record:
            self.start_recording()
        if message.ndi_out:
            self.start_ndi()
        elif message.ndi_out is False:
            await self.stop_ndi()
        shown: dict[str, Any] = {k: changes[k] for k in ("noise_scale", "steps", "seed", "stabilize") if k in changes}
        if "loras" in changes:
            shown["loras"] = {**self.settings.loras, **changes["loras"]}
        if isinstance(message.prompt, str):
            shown["prompt"] = message.prompt
        elif message.prompt is not None:
            shown["prompt"] = " + ".join(message.prompt)
        self.settings = dataclasses.replace(self.settings, **shown)
        if "prompt" in shown and self.recorder is not None:
            self.recorder.note_prompt(shown["prompt"] if cue is None else f"cue {cue}: {shown['prompt']}")
        if message.record is False:
            await self.stop_recording("requested")
        if "steps" in changes and self.on_steps is not None:
            self.on_steps(int(changes["steps"]))

    async def handle_text(self, text: str, max_prompt_chars: int) -> dict[str, Any]:
        """One control message from a client -> the reply to send back (ack or error)."""
        try:
            if self.control_guard is not None:
                self.control_guard.check(text)
            message = parse_control(text, max_prompt_chars)
            await self.apply(message)
        except ValueError as exc:  # ControlError, MessageLimitError, or the engine refusing a value
            return {"type": "error", "message": str(exc)}
        reply: dict[str, Any] = {"type": "ack", "applied": message.type}
        if isinstance(message, UpdateMessage) and message.prompt is not None and self.prompt_report is not None:
            # Every transport (data channel, /ws, HTTP control, OSC) answers a new prompt the same way;
            # a None notice says the new prompt is near a look, so a client clears an old notice.
            prompts = (message.prompt,) if isinstance(message.prompt, str) else tuple(message.prompt)
            reply.update(await self.prompt_report(prompts, message.prompt_weights))
        return reply

    def peer(self, session: str, publisher: bool) -> RTCPeerConnection | None:
        """The publisher's peer (``publisher``) or a WHEP viewer's behind a session id; None when the
        id is not one of that kind here: every wrong URL gets the same answer."""
        if (session == self.publisher_session) != publisher:
            return None
        return self.peers.get(session)

    @property
    def viewers(self) -> int:
        return sum(1 for key in self.peers if key != self.publisher_session)

    @property
    def dropped_frames(self) -> int:
        return self.assembler.dropped + self.playout.dropped

    def stats(self) -> dict[str, Any]:
        latency = self.playout.latency_s()
        ttff = None if self.playout.first_frame_at is None else self.playout.first_frame_at - self.created
        return {
            "type": "stats",
            "stream_id": self.id,
            "kind": self.kind,
            "fps": round(self.playout.output_fps(), 2),
            "latency_ms": round(1000 * latency["last"], 1) if latency else None,
            "latency_p50_ms": round(1000 * latency["p50"], 1) if latency else None,
            "latency_p95_ms": round(1000 * latency["p95"], 1) if latency else None,
            "slack_s": round(self.playout.slack_s, 3),
            "ttff_s": None if ttff is None else round(ttff, 3),
            "prompt": self.settings.prompt,
            "noise_scale": self.settings.noise_scale,
            "steps": self.settings.steps,
            "seed": self.settings.seed,
            "stabilize": self.settings.stabilize,
            "loras": self.settings.loras,
            "chunk_ms": round(1000 * self.runner.chunk_seconds, 1),
            "paused": self.runner.paused,
            "frames_in": self.assembler.received,
            # The stream's size, and the camera frames' as they arrive: the page scales what it sends
            # down to the stream's size (web/rtc.js), so the server decodes no pixels it throws away.
            "width": self.runner.size[0],
            "height": self.runner.size[1],
            "input_width": None if self.assembler.camera_size is None else self.assembler.camera_size[0],
            "input_height": None if self.assembler.camera_size is None else self.assembler.camera_size[1],
            "frames_out": self.playout.frames_shown,
            "dropped_frames": self.dropped_frames,
            "dropped_input_frames": self.assembler.dropped,  # camera frames the engine never took
            "dropped_output_frames": self.playout.dropped,  # engine output never played (overflow, prompt switch)
            "repeated_frames": self.playout.repeats,
            "viewers": self.viewers,
            "encoded_frames": self.video_encoder.encodes,  # VP8 encodes, shared by the WebRTC viewers
            "keyframes": self.video_encoder.keyframes,
            "recording": self.recorder is not None,
            "record_error": self.record_error,
            "audio": self.audio is not None,
            "label": self.label,
            "ndi_out": None if self.ndi is None else self.ndi.name,  # the NDI source's name, while published
            "audio_delay_ms": None if self.audio is None or self.audio.delay_s is None
            else round(1000 * self.audio.delay_s, 1),
            "audio_resyncs": None if self.audio is None else self.audio.resyncs,
            **(self.policy_stats() if self.policy_stats is not None else {}),
        }

    async def send_stats(self, send: Callable[[str], Awaitable[None]], is_open: Callable[[], bool]) -> None:
        """Stats to a client about once a second, while its channel is open."""
        while is_open():
            await send(json.dumps(self.stats()))
            await asyncio.sleep(STATS_INTERVAL_S)

    async def close(self, reason: str | None = None) -> None:
        """End the stream; ``reason`` says why (its recording's sidecar and its owner's 410 say it),
        unless a reason was already given (an NDI source vanishing, say)."""
        if self.closed.is_set():
            return
        if reason is not None and self.end_reason == DEFAULT_END_REASON:
            self.end_reason = reason
        self.closed.set()
        self._on_close(self.id)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(pc.close() for pc in self.peers.values()), return_exceptions=True)
        self.peers.clear()
        await self.stop_recording(self.end_reason)  # a recording is finished properly, never cut
        await self.stop_ndi()  # the NDI source goes off the network with the stream
        log.info("stream %s (%s) closed", self.id, self.kind)


class SessionManager:
    """Creates and tracks sessions; all engine work goes through one dedicated thread."""

    def __init__(self, factory: ProcessorFactory, config: ServerConfig) -> None:
        self.factory = factory
        self.config = config
        # Engine threads: one for an in-process engine (synchronous, CPU-heavy, not thread-safe);
        # engines behind a thread-safe router (Ray workers) say how many chunks they run at once.
        self.engine_threads = ThreadPoolExecutor(max_workers=max(1, factory.parallel_chunks), thread_name_prefix="engine")
        self.sessions: dict[str, Session] = {}
        self._opening = 0
        self.opened = 0
        self.closed_totals = {"dropped_frames": 0, "output_frames": 0}
        # Told (stream id, why) as each stream ends: the edge answers its owner 410 with the reason
        # for a while (AccessControl.ended).
        self.on_ended: Callable[[str, str], None] | None = None
        # The serving loop (the engine core; app/server/serving/serving_loop.py builds it): admission, order, fidelity, batching,
        # eviction and preemption by the serving policy (--policy); set by create_app.
        self.serving: ServingLoop | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._policy_ids: dict[str, int] = {}
        # The recordings directory (--record-dir; set by create_app), None when recording is off.
        self.recordings: RecordingStore | None = None
        # The NDI source names of this server's streams (--ndi-out; set by create_app), None when off.
        self.ndi_names: SourceNames | None = None

    @property
    def size(self) -> tuple[int, int]:
        """The model's default size: a stream's until its first frame says its camera's aspect."""
        return self.factory.size

    async def prompt_report(self, prompts: tuple[str, ...], weights: list[float] | None = None) -> dict[str, Any]:
        """What prompts (mixed by ``weights``) are served as: ``notice``, for prompts far from every look
        the loaded model ships, naming the nearest ones (None for a near prompt or a model without
        looks), and ``looks``, the shipped looks they get with their shares of the blend (empty for an
        open-vocabulary model). The text encoder runs on the engine thread, like every engine call."""
        pipe = self.factory.pipeline
        if pipe is None:
            return {"notice": None, "looks": []}

        def report() -> dict[str, Any]:
            looks = [{"look": name, "share": round(share, 3)} for name, share in pipe.prompt_looks(prompts, weights)]
            return {"notice": pipe.prompt_notice(prompts), "looks": looks}

        result: dict[str, Any] = await asyncio.get_running_loop().run_in_executor(self.engine_threads, report)
        return result

    def check_capacity(self) -> None:
        if len(self.sessions) + self._opening >= self.config.max_streams:
            raise CapacityError(f"server is at capacity ({self.config.max_streams} streams)")

    async def open(self, kind: str, settings: StreamSettings) -> Session:
        self.check_capacity()
        serving = self.serving
        if serving is None:
            raise RuntimeError("the session manager has no engine loop (create_app sets one)")
        # Every served LoRA's strength for this stream, spelled out (its stats show what runs).
        served = {lora["name"]: lora["strength"] for lora in self.factory.loras}
        settings = dataclasses.replace(settings, loras={**served, **settings.loras})
        policy_id = serving.admit(settings.steps)  # AdmissionError -> 503
        self._opening += 1
        loop = asyncio.get_running_loop()
        try:
            processor = await loop.run_in_executor(self.engine_threads, self.factory.open, settings)
        except BaseException as exc:
            serving.remove(policy_id)  # admitted, but never opened
            if isinstance(exc, ValueError):  # the engine refusing an option (e.g. a prompt it cannot encode)
                raise ControlError(str(exc)) from exc
            raise
        finally:
            self._opening -= 1
        cfg = self.config
        # A frame of input backlog: a lane busy with another stream's step often comes for this one's
        # chunk a frame late, and that frame is kept rather than dropped (four streams on two cores:
        # 0.9-1.4 % of frames dropped against 1.8-1.9 % without, p95 ~10 ms later; two frames of
        # backlog dropped no fewer and added ~70 ms, docs/service.md).
        assembler = ChunkAssembler(capacity=max(processor.first_chunk_frames, processor.chunk_frames),
                                   backlog=1)
        playout = Playout(self.size, processor.chunk_frames, cfg.max_fps, cfg.min_fps)
        runner = StreamRunner(processor, assembler, playout, self.engine_threads, self.size, cfg.trace_stamp)
        # Unguessable (128 bits): with public viewing, knowing the id is what lets a viewer watch.
        session = Session(
            mint_secret(16), kind, settings, runner, assembler, playout, on_close=self._forget
        )
        session.control_guard = control_guard(cfg.max_message_bytes, cfg.max_messages_per_s)
        session.recordings = self.recordings
        session.ndi_names = self.ndi_names
        session.ndi_fps = cfg.max_fps
        pipe = self.factory.pipeline
        if pipe is not None and pipe.styles is not None:
            session.prompt_report = self.prompt_report  # an open-vocabulary model's acks carry no notice
        self.sessions[session.id] = session
        self.opened += 1
        serving.attach(policy_id, runner, playout, on_failure=lambda exc: session.fail("engine chunk", exc))
        self._policy_ids[session.id] = policy_id
        session.policy_stats = lambda: serving.stats(policy_id)
        session.on_steps = lambda steps: serving.core.set_max_steps(policy_id, steps)
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = loop.create_task(serving.run(), name="engine-core-loop")
        session.spawn(playout.run(), "playout")
        session.spawn(watch_input(assembler, cfg.input_timeout_s), "input-watch")
        log.info("stream %s (%s) opened: %s", session.id, kind, settings)
        return session

    def get(self, stream_id: str) -> Session | None:
        return self.sessions.get(stream_id)

    def policy_ids(self) -> dict[str, int]:
        """Each open stream's id in the serving policy (its engine core), by session id."""
        return dict(self._policy_ids)

    def _forget(self, stream_id: str) -> None:
        session = self.sessions.get(stream_id)
        if session is not None and self.on_ended is not None:
            self.on_ended(stream_id, session.end_reason)
        policy_id = self._policy_ids.pop(stream_id, None)
        if self.serving is not None and policy_id is not None:
            self.serving.remove(policy_id)
        session = self.sessions.pop(stream_id, None)
        if session is not None:
            self.closed_totals["dropped_frames"] += session.dropped_frames
            self.closed_totals["output_frames"] += session.playout.frames_shown

    def totals(self) -> dict[str, int]:
        """Counters over the server's life, closed streams included (per-stream series vanish)."""
        live = list(self.sessions.values())
        return {
            "streams_opened": self.opened,
            "dropped_frames": self.closed_totals["dropped_frames"] + sum(s.dropped_frames for s in live),
            "output_frames": self.closed_totals["output_frames"] + sum(s.playout.frames_shown for s in live),
        }

    async def close(self, stream_id: str, reason: str | None = None) -> bool:
        session = self.sessions.get(stream_id)
        if session is None:
            return False
        await session.close(reason)
        return True

    async def close_all(self) -> None:
        await asyncio.gather(*(self.close(sid, "the server stopped") for sid in list(self.sessions)))
        if self._loop_task is not None:
            self._loop_task.cancel()
        self.engine_threads.shutdown(wait=False, cancel_futures=True)
