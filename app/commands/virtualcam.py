"""`diffcast virtualcam`: stylized video to a virtual camera (Zoom, Meet, OBS, Discord see a webcam).

    diffcast virtualcam --source camera --prompt "oil painting"            # local webcam, local engine
    diffcast virtualcam --source clip.mp4 --prompt "anime" --loop          # a video file
    diffcast virtualcam --source stream:<stream-id> --server http://host:8080   # a server stream's output
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from app.commands.arguments import parse_size
from app.commands.stylize import chunk_precision
from engine.fidelity import PRECISION_CHOICES

if TYPE_CHECKING:
    import numpy as np

    from engine.pipeline import Pipeline

NAME = "virtualcam"
HELP = "send stylized video to a virtual camera (OBS Virtual Camera, v4l2loopback) via pyvirtualcam"

log = logging.getLogger(__name__)

STREAM_PREFIX = "stream:"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--source", required=True,
        help="'camera' (or camera:N for device N), a video FILE, or stream:<stream-id> (a stream on --server)",
    )
    parser.add_argument("--prompt", default=None, help="style prompt (camera and file sources)")
    parser.add_argument("--model", default=None, help="model path or 'tiny-random'; default: the embedded model")
    parser.add_argument("--device", default="cpu", help="torch device for the engine (default cpu)")
    parser.add_argument("--precision", choices=PRECISION_CHOICES, default="auto",
                        help="compute precision (default auto: bf16 where the processor has bf16 units, else fp32)")
    parser.add_argument("--fps", type=float, default=15.0, help="virtual camera frame rate (default 15)")
    parser.add_argument("--size", type=parse_size, default=None,
                        help="virtual camera WxH (default: the stream's size, the source's aspect at the model's "
                             "pixel budget; 640x480 for stream: sources)")
    parser.add_argument("--backend", default=None, help="pyvirtualcam backend (obs, v4l2loopback, unitycapture, ...)")
    parser.add_argument("--camera-device", default=None, help="virtual camera device, e.g. /dev/video10")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (1-4); default: the model's own")
    parser.add_argument("--noise-scale", type=float, default=None, help="noise strength; default: the model's own")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loop", action="store_true", help="loop a FILE source forever")
    parser.add_argument("--server", default="http://127.0.0.1:8080", help="diffcast server for stream: sources")
    parser.add_argument("--token", default=None, help="Bearer token of the server (its --token)")
    parser.add_argument("--max-frames", type=int, default=None, help="stop after this many frames")


def _fail(message: str) -> int:
    print(f"diffcast virtualcam: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from app.virtualcam import VirtualCameraError, VirtualCamSink, open_camera

    source: str = args.source
    from_stream = source.startswith(STREAM_PREFIX)
    if args.fps <= 0:
        return _fail(f"--fps must be positive, got {args.fps}")
    if from_stream and not source[len(STREAM_PREFIX):]:
        return _fail("--source stream:<stream-id> needs a stream id, e.g. stream:3f2a9c1d0b7e4a11")
    if not from_stream and not args.prompt:
        return _fail("--prompt is required for camera and file sources")
    is_camera = source == "camera" or source.startswith("camera:")
    if is_camera and not source.partition(":")[2].isdigit() and source != "camera":
        return _fail(f"--source {source!r}: the camera index must be a number, e.g. camera:1")
    if not from_stream and not is_camera and not Path(source).is_file():
        return _fail(f"--source {source!r} is not 'camera', an existing video file, or stream:<stream-id>")
    pipe: Pipeline | None = None
    source_frames: Iterator[np.ndarray] | None = None
    size = args.size or (640, 480)
    if not from_stream and args.size is None:
        # The camera takes the stream's size: the source's aspect at the model's pixel budget.
        pipe = _load(args)
        if pipe is None:
            return 2
        try:
            source_frames, size = _sized_source(args, source, pipe)
        except (VirtualCameraError, ValueError) as exc:  # VideoInputError is a ValueError
            return _fail(str(exc))
    # Open the camera before the (slow) model load when possible: with no backend, fail at once
    # with the setup steps.
    try:
        sink = VirtualCamSink(open_camera(size[0], size[1], args.fps, args.backend, args.camera_device))
    except VirtualCameraError as exc:
        return _fail(str(exc))
    if not from_stream and pipe is None:
        pipe = _load(args)
        if pipe is None:
            sink.close()
            return 2
    log.info("virtual camera %s (%s) %dx%d @ %.1f fps", sink.camera.device, sink.camera.backend, *size, args.fps)
    try:
        frames = _frames(args, source, pipe, size, source_frames)
        sent = sink.play(frames, args.max_frames)
    except VirtualCameraError as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        sent = sink.frames
    finally:
        sink.close()
    log.info("sent %d frames", sent)
    return 0


def _load(args: argparse.Namespace) -> Pipeline | None:
    from engine.pipeline import ModelNotAvailableError, Pipeline

    try:
        return Pipeline.load(args.model, device=args.device)
    except ModelNotAvailableError as exc:
        _fail(str(exc))
        return None


def _source_frames(args: argparse.Namespace, source: str, size: tuple[int, int] | None) -> Iterator[np.ndarray]:
    """A camera's or a file's frames (a file's at ``size``; None: as they come)."""
    from app.virtualcam import camera_frames, file_frames

    if source == "camera" or source.startswith("camera:"):
        return camera_frames(int(source.partition(":")[2] or 0))
    return file_frames(Path(source), size, loop=args.loop)


def _sized_source(args: argparse.Namespace, source: str, pipe: Pipeline) -> tuple[Iterator[np.ndarray], tuple[int, int]]:
    """The source's frames and the size a stream of them runs at (``Pipeline.stream_size``): a file's
    from its header, a camera's from its first frame."""
    import itertools

    from app.virtualcam import VirtualCameraError
    from engine.video_io import video_size

    if not (source == "camera" or source.startswith("camera:")):
        size = pipe.stream_size(video_size(Path(source)))
        return _source_frames(args, source, size), size
    frames = _source_frames(args, source, None)
    first = next(frames, None)
    if first is None:
        raise VirtualCameraError(f"{source} delivered no frame")
    return itertools.chain([first], frames), pipe.stream_size((first.shape[1], first.shape[0]))


def _frames(
    args: argparse.Namespace, source: str, pipe: Pipeline | None, size: tuple[int, int],
    source_frames: Iterator[np.ndarray] | None = None,
) -> Iterator[np.ndarray]:
    from app.virtualcam import stylized_frames, whep_frames
    from engine.pipeline import StreamParams

    if pipe is None:  # stream: source, stylized by the server already
        return whep_frames(args.server, source[len(STREAM_PREFIX):], args.token)
    params = StreamParams(prompt=args.prompt, steps=args.steps, noise_scale=args.noise_scale, seed=args.seed,
                          size=size)
    stream = pipe.open_stream(pipe.with_knobs(params, precision=chunk_precision(args)))
    return stylized_frames(source_frames if source_frames is not None else _source_frames(args, source, size), stream)
