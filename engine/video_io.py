"""Video files in and out (PyAV), driven through a live stream chunk by chunk."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

import av
import numpy as np
from tqdm import tqdm

from engine.aspect import fit_frame

if TYPE_CHECKING:
    from engine.pipeline import Pipeline, StreamParams

log = logging.getLogger(__name__)

# Container suffix -> (codec, pixel format). H.264 in MP4 plays everywhere.
_CODECS = {
    ".mp4": ("libx264", "yuv420p"),
    ".mov": ("libx264", "yuv420p"),
    ".mkv": ("libx264", "yuv420p"),
    ".webm": ("libvpx", "yuv420p"),
    ".avi": ("mjpeg", "yuvj420p"),
}


class VideoInputError(ValueError):
    """The input file cannot be read as a video."""


def video_size(path: Path) -> tuple[int, int]:
    """(width, height) of ``path``'s first video stream, from its header."""
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise VideoInputError(f"{path} has no video stream")
            codec = container.streams.video[0].codec_context
            width, height = int(codec.width), int(codec.height)
    except (av.error.InvalidDataError, av.error.FileNotFoundError, OSError) as exc:
        raise VideoInputError(f"cannot open {path} as a video: {exc}") from exc
    if width <= 0 or height <= 0:
        raise VideoInputError(f"{path}: its video stream does not say its frame size")
    return width, height


def read_frames(path: Path, size: tuple[int, int] | None = None) -> tuple[Iterator[np.ndarray], float, int]:
    """Decode ``path`` to RGB uint8 frames (centre-cropped to ``size``'s aspect and resized to ``size``
    = (W, H) if given: never stretched, engine/aspect.py).

    Returns (frame iterator, fps, frame count estimate; 0 when the container does not say).
    """
    try:
        container = av.open(str(path))
    except (av.error.InvalidDataError, av.error.FileNotFoundError, OSError) as exc:
        raise VideoInputError(f"cannot open {path} as a video: {exc}") from exc
    if not container.streams.video:
        container.close()
        raise VideoInputError(f"{path} has no video stream")
    stream = container.streams.video[0]
    fps = float(stream.average_rate) if stream.average_rate else 16.0
    count = int(stream.frames or 0)

    def frames() -> Iterator[np.ndarray]:
        try:
            for frame in container.decode(stream):
                rgb: np.ndarray = frame.to_ndarray(format="rgb24")
                yield rgb if size is None else fit_frame(rgb, size)
        except av.error.InvalidDataError as exc:
            raise VideoInputError(f"{path} is corrupt: {exc}") from exc
        finally:
            container.close()

    return frames(), fps, count


class VideoWriter:
    def __init__(self, path: Path, fps: float, size: tuple[int, int]) -> None:
        suffix = path.suffix.lower()
        if suffix not in _CODECS:
            raise ValueError(f"unsupported output container {suffix!r}; use one of {sorted(_CODECS)}")
        codec, pix_fmt = _CODECS[suffix]
        w, h = size
        if codec != "mjpeg" and (w % 2 or h % 2):
            raise ValueError(f"{codec} needs an even frame size, got {w}x{h}; pass --size with even numbers")
        path.parent.mkdir(parents=True, exist_ok=True)
        self._container = av.open(str(path), mode="w")
        rate = Fraction(fps).limit_denominator(1001)
        self._stream: av.VideoStream = self._container.add_stream(codec, rate=rate)  # type: ignore[assignment]
        self._stream.width, self._stream.height = w, h
        self._stream.pix_fmt = pix_fmt
        self.frames = 0

    def write(self, rgb: np.ndarray) -> None:
        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        self.frames += 1

    def close(self) -> None:
        for packet in self._stream.encode():
            self._container.mux(packet)
        self._container.close()


def stylize_file(
    pipe: Pipeline,
    src: Path,
    dst: Path,
    params: StreamParams,
    size: tuple[int, int] | None = None,
    progress: bool = False,
) -> int:
    """Stylize ``src`` into ``dst`` through one live stream; returns the number of frames written.

    The output has exactly the input's frame count: a partial last chunk is padded by repeating the
    last frame and the padding is dropped from the output. Its size is ``size``, else ``params.size``,
    else the one a stream picks for the input's aspect (``pipe.stream_size``): a 4:3 or 16:9 file
    stays 4:3 or 16:9; frames of another aspect are centre-cropped, never stretched.
    """
    size = size or params.size or pipe.stream_size(video_size(src))
    frames, fps, count = read_frames(src, size)
    stream = pipe.open_stream(params.with_(size=size))
    writer = VideoWriter(dst, fps, size)
    bar = tqdm(total=count or None, unit="frame", disable=not progress, desc="stylize")
    pending: list[np.ndarray] = []
    need = pipe.first_chunk_frames
    try:
        for rgb in frames:
            pending.append(rgb)
            if len(pending) == need:
                for out in stream.process(np.stack(pending)):
                    writer.write(out)
                bar.update(len(pending))
                pending, need = [], pipe.chunk_frames
        if pending:
            real = len(pending)
            pending += [pending[-1]] * (need - real)
            for out in stream.process(np.stack(pending))[:real]:
                writer.write(out)
            bar.update(real)
    finally:
        bar.close()
        writer.close()
    if writer.frames == 0:
        raise VideoInputError(f"{src} contains no frames")
    return writer.frames
