"""Recording one stream's output: what viewers see, with its audio, to MP4 (PyAV), plus the prompt
timeline as a sidecar JSON.

The event loop only copies references into a bounded queue (each playout tick's frame, each
audio tick's samples); a thread of the recording's own encodes and muxes, so neither the event loop
nor the engine thread ever waits on the encoder. Timestamps come from the two playout clocks, both
on ``time.monotonic``: the file shows what was played when it was played (variable frame rate,
repeated frames included), with the audio in sync as the viewers heard it.

A recording survives the server being killed (SIGKILL, a crash, the OOM killer): the MP4 is
fragmented as it is written (an empty ``moov``, then a ``moof`` + ``mdat`` fragment at least every
second, each flushed to the file), and the sidecar's facts so far sit in ``<rec>.json.part``. At the
next start :func:`finish_leftovers` cuts each ``.mp4.part`` after its last whole fragment, names it
``.mp4`` and writes its ``.json`` (``"ended": "interrupted"``): playable, listed, deletable.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np

from app.server.media.audio import FRAME_S, FRAME_SAMPLES, SAMPLE_RATE, AudioPlayout, audio_frame
from app.server.media.frame_path import OutputFrame, Playout
from engine.aspect import fit_frame

log = logging.getLogger(__name__)

VIDEO_CLOCK_HZ = 90_000
VIDEO_TIME_BASE = Fraction(1, VIDEO_CLOCK_HZ)
# H.264 where the installed FFmpeg has libx264 (PyAV's wheels do), else FFmpeg's own MPEG-4 Part 2.
VIDEO_CODEC = "libx264" if "libx264" in av.codecs_available else "mpeg4"
X264_OPTIONS = {"preset": "veryfast", "tune": "zerolatency", "crf": "20"}
AUDIO_CODEC = "aac"
# Fragmented MP4, a fragment at least every second and each packet flushed to the file: a server
# killed mid-recording loses about the last second, and the rest plays (finish_leftovers).
MP4_OPTIONS = {"movflags": "frag_keyframe+empty_moov+default_base_moof", "frag_duration": "1000000",
               "flush_packets": "1"}
INTERRUPTED = "interrupted"  # the sidecar's "ended" of a recording the server was killed during
QUEUE_ITEMS = 512  # about 8 s of video and audio: the encoder falling further behind drops frames
SIZE_CHECK_S = 1.0  # how often the encoder checks the storage quota


@dataclass
class PromptMark:
    t: float  # seconds since the recording started
    prompt: str


@dataclass
class RecordingInfo:
    """What the sidecar JSON says about a finished recording."""

    stream_id: str
    name: str
    started_at: str
    prompts: list[PromptMark] = field(default_factory=list)
    duration_s: float = 0.0
    frames: int = 0
    audio: bool = False
    dropped: int = 0
    ended: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "stream_id": self.stream_id, "recording": self.name, "started_at": self.started_at,
            "duration_s": round(self.duration_s, 3), "frames": self.frames, "video_codec": VIDEO_CODEC,
            "audio": self.audio, "audio_codec": AUDIO_CODEC if self.audio else None,
            "dropped_frames": self.dropped, "ended": self.ended,
            "prompts": [{"t": round(m.t, 3), "prompt": m.prompt} for m in self.prompts],
        }


def even_size(image: np.ndarray) -> np.ndarray:
    """H.264 in 4:2:0 wants even dimensions: drop a last odd row or column."""
    h, w = image.shape[:2]
    return image if h % 2 == 0 and w % 2 == 0 else image[: h - h % 2, : w - w % 2]


class Recorder:
    """One recording: ``<dir>/<name>.mp4`` and ``<dir>/<name>.json`` (each ``.part`` while it runs)."""

    def __init__(
        self, directory: Path, name: str, stream_id: str, prompt: str, playout: Playout,
        audio: AudioPlayout | None, fits: Callable[[], bool], clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self.name = name
        self._playout = playout
        self._audio = audio
        self._fits = fits
        self._clock = clock
        self.started = clock()
        self.info = RecordingInfo(stream_id, name,
                                  datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                                  [PromptMark(0.0, prompt)], audio=audio is not None)
        # Video frames (shared with the stream's other outputs) and audio samples, with their times.
        self._queue: queue.Queue[tuple[OutputFrame | np.ndarray, float] | None] = queue.Queue(QUEUE_ITEMS)
        self.full = threading.Event()  # the encoder stopped: the storage quota was reached
        # No part of the recording id in the thread's name: it would reach logs that name threads.
        self._thread = threading.Thread(target=self._encode, name="record", daemon=True)
        self._thread.start()

    @property
    def part_path(self) -> Path:
        return self.directory / f"{self.name}.mp4.part"

    @property
    def facts_path(self) -> Path:
        return self.directory / f"{self.name}.json.part"

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self.started

    def note_prompt(self, prompt: str) -> None:
        self.info.prompts.append(PromptMark(self.elapsed_s, prompt))

    def _put(self, data: OutputFrame | np.ndarray, at: float) -> None:
        try:
            self._queue.put_nowait((data, at))
        except queue.Full:
            self.info.dropped += 1

    async def feed_video(self) -> None:
        """Event loop: every playout tick from now on (ends when the encoder stops)."""
        tick = self._playout.tick_count
        while not self.full.is_set():
            tick, frame, seconds = await self._playout.next_frame(tick)
            self._put(frame, self._playout.started_at + seconds)

    async def feed_audio(self) -> None:
        audio = self._audio
        if audio is None:
            return
        tick = audio.tick_count
        while not self.full.is_set():
            tick, samples = await audio.next_frame(tick)
            self._put(samples, audio.start + tick * FRAME_S)

    async def finish(self, reason: str) -> RecordingInfo:
        """Stop taking frames, let the thread finish the file, and wait for it (off the loop)."""
        if not self.info.ended:
            self.info.ended = reason
        self.info.duration_s = self.elapsed_s
        while True:  # the sentinel must get in, even past a full queue
            try:
                self._queue.put_nowait(None)
                break
            except queue.Full:
                await asyncio.sleep(0.01)
        await asyncio.to_thread(self._thread.join)
        return self.info

    # -- the recording's thread ----------------------------------------------------------------

    def _encode(self) -> None:
        try:
            self._write()
        except Exception:
            log.exception("recording %s failed; what was written is kept", self.name)
            self.full.set()
        if self.info.frames == 0:  # stopped before the first frame: nothing to keep
            self.part_path.unlink(missing_ok=True)
            self.facts_path.unlink(missing_ok=True)
            return
        self._write_facts()
        try:
            self.part_path.rename(self.directory / f"{self.name}.mp4")
        except OSError:
            log.exception("recording %s: cannot finish the file", self.name)
        # The JSON's name last, in one rename: a listed recording always has its whole sidecar.
        self.facts_path.replace(self.directory / f"{self.name}.json")

    def _write_facts(self) -> None:
        """The sidecar as it stands, to ``.json.part`` (what finish_leftovers starts from)."""
        self.facts_path.write_text(json.dumps(self.info.to_json(), indent=1))

    def _write(self) -> None:
        container = av.open(str(self.part_path), mode="w", format="mp4", options=MP4_OPTIONS)
        video: Any = None
        sound: Any = None
        last_video_pts = -1
        audio_pts: int | None = None
        next_check = self._clock() + SIZE_CHECK_S
        prompts_written = len(self.info.prompts)
        self._write_facts()
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    break
                data, at = item
                if isinstance(data, OutputFrame):
                    image = even_size(data.image)
                    if video is not None and image.shape[:2] != (video.height, video.width):
                        # The black frame before the stream's first chunk can be at the model's default
                        # size: the encoder would stretch a frame of another size, so it is cropped.
                        image = fit_frame(image, (video.width, video.height))
                    if video is None:
                        video = container.add_stream(VIDEO_CODEC, rate=30, options=X264_OPTIONS if VIDEO_CODEC == "libx264" else {})
                        video.width, video.height = image.shape[1], image.shape[0]
                        video.pix_fmt = "yuv420p"
                        video.codec_context.time_base = VIDEO_TIME_BASE
                        if self._audio is not None:
                            sound = container.add_stream(AUDIO_CODEC, rate=SAMPLE_RATE, layout="stereo")
                    # The frame's yuv420p planes, shared with the stream's tracks (converted once for
                    # all); only a cropped frame is converted here.
                    frame = data.video_frame() if image is data.image else \
                        av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
                    last_video_pts = max(round((at - self.started) * VIDEO_CLOCK_HZ), last_video_pts + 1)
                    frame.pts = last_video_pts
                    frame.time_base = VIDEO_TIME_BASE
                    container.mux(video.encode(frame))
                    self.info.frames += 1
                elif sound is not None:  # audio before the first video frame has no stream yet
                    if audio_pts is None:
                        audio_pts = max(0, round((at - self.started) * SAMPLE_RATE))
                    else:
                        audio_pts += FRAME_SAMPLES
                    container.mux(sound.encode(audio_frame(data, 0, audio_pts)))
                if self._clock() >= next_check:
                    next_check = self._clock() + SIZE_CHECK_S
                    if len(self.info.prompts) != prompts_written:  # the timeline survives a kill too
                        prompts_written = len(self.info.prompts)
                        self._write_facts()
                    if not self._fits():
                        log.warning("recording %s stopped: the recording storage is full", self.name)
                        self.info.ended = "storage full"
                        self.info.duration_s = self.elapsed_s
                        self.full.set()
                        break
        finally:
            for stream in (video, sound):
                if stream is not None:
                    container.mux(stream.encode(None))
            container.close()


# -- recordings a killed server left behind ------------------------------------------------------


def whole_fragments_end(path: Path) -> int:
    """How many leading bytes of a fragmented MP4 are whole boxes ending with a whole fragment
    (``moof`` then ``mdat``, after the ``moov``); 0 when there is no such fragment. A server killed
    while it wrote leaves a box cut short at the end, which FFmpeg's demuxer refuses outright when
    it is a ``moof``."""
    end = good = 0
    has_moov = in_fragment = False
    with path.open("rb") as file:
        total = os.fstat(file.fileno()).st_size
        while end + 8 <= total:
            file.seek(end)
            header = file.read(16)
            size, kind = struct.unpack(">I4s", header[:8])
            if size == 1 and len(header) == 16:  # a 64-bit size follows the type
                size = struct.unpack(">Q", header[8:])[0]
            if size < 8 or end + size > total:  # cut short (or size 0, "to the end": not written whole)
                break
            if kind == b"moov":
                has_moov = True
            elif kind == b"moof":
                in_fragment = True
            elif kind == b"mdat" and in_fragment and has_moov:
                good, in_fragment = end + size, False
            end += size
    return good


def _probe(path: Path) -> tuple[int, float, bool]:
    """(video frames, seconds, whether it has audio) of an MP4, from its packets (no decoding)."""
    with av.open(str(path)) as container:
        if not container.streams.video:
            return 0, 0.0, bool(container.streams.audio)
        video = container.streams.video[0]
        frames, end = 0, 0.0
        for packet in container.demux(video):
            if packet.size and packet.pts is not None and video.time_base is not None:
                frames += 1
                end = max(end, float((packet.pts + (packet.duration or 0)) * video.time_base))
        return frames, end, bool(container.streams.audio)


def finish_leftovers(directory: Path) -> list[str]:
    """Finish the recordings of ``directory`` (one stream's) that a killed server left running:
    each ``<rec>.mp4.part`` is cut after its last whole fragment and becomes ``<rec>.mp4``, and
    each ``.mp4`` without a ``.json`` gets one (the facts of its ``.json.part``, the frames and
    duration the file holds, ``"ended": "interrupted"``). A leftover without a single whole
    fragment holds no frame and is removed. Returns the names of the recordings finished."""
    finished = []
    for part in sorted(directory.glob("*.mp4.part")):
        name = part.name.removesuffix(".mp4.part")
        keep = whole_fragments_end(part)
        if keep == 0:
            part.unlink()
            (directory / f"{name}.json.part").unlink(missing_ok=True)
            continue
        os.truncate(part, keep)
        part.rename(directory / f"{name}.mp4")
    for video in sorted(directory.glob("*.mp4")):
        sidecar = video.with_suffix(".json")
        facts_part = video.with_suffix(".json.part")
        if sidecar.exists():
            facts_part.unlink(missing_ok=True)
            continue
        facts = _leftover_facts(directory.name, video, facts_part)
        try:
            facts["frames"], duration, facts["audio"] = _probe(video)
            facts["duration_s"] = round(duration, 3)
            facts["audio_codec"] = AUDIO_CODEC if facts["audio"] else None
        except av.FFmpegError:  # kept all the same: its owner can still download or delete it
            log.warning("recording %s left by a stopped server does not demux", video.stem)
        facts_part.write_text(json.dumps(facts, indent=1))
        facts_part.replace(sidecar)
        finished.append(video.stem)
    for orphan in directory.glob("*.json.part"):  # the facts of a recording that never had a frame
        orphan.unlink()
    return finished


def _leftover_facts(stream_id: str, video: Path, facts_part: Path) -> dict[str, Any]:
    """The sidecar facts written while the recording ran; what the file says where they are lost."""
    try:
        facts = dict(json.loads(facts_part.read_text()))
    except (OSError, ValueError):  # never written, or killed between its truncation and its write
        started = datetime.datetime.fromtimestamp(video.stat().st_mtime, datetime.UTC)
        facts = RecordingInfo(stream_id, video.stem, started.isoformat(timespec="seconds")).to_json()
    facts["ended"] = facts.get("ended") or INTERRUPTED
    return facts
