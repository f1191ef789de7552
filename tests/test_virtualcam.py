"""`diffcast virtualcam` through pyvirtualcam's own backend registry, with a recording backend."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pyvirtualcam
import torch
from _output_checks import assert_stylized, assert_undistorted
from pyvirtualcam.camera import BACKENDS
from pyvirtualcam.util import encode_fourcc

from app.cli import main
from app.client import CodedCamera, open_session, pattern_frame
from app.virtualcam import setup_message
from engine.devices import resolve_precision
from engine.pipeline import Pipeline, StreamParams
from engine.video_io import VideoWriter, read_frames

BACKEND = "diffcast-recorder"


class RecordingBackend:
    """A pyvirtualcam backend (the interface of pyvirtualcam.camera.Backend) that keeps what it gets."""

    opened: list[RecordingBackend] = []

    def __init__(self, *, width: int, height: int, fps: float, fourcc: int, device: str | None, **kw: Any) -> None:
        self.width, self.height, self.fps, self.fourcc = width, height, fps, fourcc
        self._device = device or "recorder0"
        self.frames: list[np.ndarray] = []
        self.times: list[float] = []
        self.closed = False
        RecordingBackend.opened.append(self)

    def send(self, frame: np.ndarray) -> None:
        self.times.append(time.monotonic())
        self.frames.append(frame.copy())

    def close(self) -> None:
        self.closed = True

    def device(self) -> str:
        return self._device

    def native_fourcc(self) -> int:
        return self.fourcc


@pytest.fixture
def recorder() -> Iterator[type[RecordingBackend]]:
    RecordingBackend.opened.clear()
    pyvirtualcam.register_backend(BACKEND, RecordingBackend)
    try:
        yield RecordingBackend
    finally:
        BACKENDS.pop(BACKEND, None)


def _clip(path: Path, frames: int) -> Path:
    writer = VideoWriter(path, 16.0, (160, 120))
    for i in range(frames):
        writer.write(pattern_frame(i, (160, 120)))
    writer.close()
    return path


def test_file_to_virtual_camera(recorder: type[RecordingBackend], tmp_path: Path) -> None:
    torch.set_num_threads(1)
    clip = _clip(tmp_path / "in.mp4", frames=9)  # chunks of 1, 4, 4 frames
    size, fps = (96, 64), 12.0
    code = main([  # the shipped default model: what reaches the camera must be a stylisation
        "virtualcam", "--source", str(clip), "--prompt", "oil painting",
        "--fps", str(fps), "--size", f"{size[0]}x{size[1]}", "--backend", BACKEND,
    ])
    assert code == 0
    (camera,) = recorder.opened
    assert (camera.width, camera.height, camera.fps) == (96, 64, fps)
    assert camera.fourcc == encode_fourcc(pyvirtualcam.PixelFormat.RGB.value)
    assert camera.closed
    assert len(camera.frames) == 9
    assert all(frame.size == 96 * 64 * 3 and frame.dtype == np.uint8 for frame in camera.frames)
    frames, _, _ = read_frames(clip, size)
    inputs = list(frames)
    got = np.stack([frame.reshape(64, 96, 3) for frame in camera.frames])
    # A stylisation of the file: not black, not the file, not frozen, not noise (independent of the engine).
    assert_stylized(got, np.stack(inputs))
    # And the frames reach the camera whole and in order: the engine's output for this file, at the
    # precision the command's default (auto) resolves to on this processor.
    precision = resolve_precision("auto", "cpu")
    pipe = Pipeline.load()
    stream = pipe.open_stream(pipe.with_knobs(StreamParams(prompt="oil painting", size=size), precision=precision))
    expected = np.concatenate([stream.process(np.stack(c)) for c in (inputs[:1], inputs[1:5], inputs[5:9])])
    assert np.abs(got.astype(int) - expected.astype(int)).max() <= 1
    # Paced at the camera's rate (the schedule itself: test_sink_paces_at_the_camera_rate). Wall-clock
    # intervals only ever stretch on a loaded machine, so the one bound here is that 9 frames were
    # never sent faster than their schedule (each send waits for its due time, due times a period
    # apart), with one period of margin for the first send's own delay.
    assert camera.times[-1] - camera.times[0] > (len(camera.times) - 2) / fps


def test_the_virtual_camera_takes_the_sources_aspect(recorder: type[RecordingBackend], tmp_path: Path) -> None:
    """Without --size the virtual camera opens at the stream's size: a 4:3 file at the default model's
    pixel budget is 288x224 (docs/default-model.md), and what reaches it is the undistorted file, stylised."""
    torch.set_num_threads(1)
    clip = _clip(tmp_path / "in.mp4", frames=5)  # 160x120
    assert main(["virtualcam", "--source", str(clip), "--prompt", "oil painting", "--fps", "30",
                 "--backend", BACKEND]) == 0
    (camera,) = recorder.opened
    assert (camera.width, camera.height) == (288, 224)
    got = np.stack([frame.reshape(224, 288, 3) for frame in camera.frames])
    assert_undistorted(got, np.stack([pattern_frame(i, (160, 120)) for i in range(5)]))


class FakeTime:
    """The sink's clock and ``time.sleep``: a sleep advances the clock exactly."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_sink_paces_at_the_camera_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames of a chunk go out one period apart, never faster; after a stall (a chunk that came
    late) the clock restarts from the late frame instead of bursting to catch up."""
    from app import virtualcam

    clock = FakeTime()
    monkeypatch.setattr(virtualcam.time, "sleep", clock.sleep)
    sent: list[float] = []
    camera = type("Camera", (), {"width": 8, "height": 8, "fps": 10.0, "send": lambda self, f: sent.append(clock.now),
                                 "close": lambda self: None})()
    sink = virtualcam.VirtualCamSink(camera, clock=clock)
    frame = np.zeros((8, 8, 3), np.uint8)
    for _ in range(4):  # one chunk: four frames at once
        sink.send(frame)
    clock.now += 1.0  # the next chunk is late: 0.7 s after its first frame was due
    for _ in range(4):
        sink.send(frame)
    assert np.allclose(np.diff(sent), [0.1, 0.1, 0.1, 1.0, 0.1, 0.1, 0.1])


def test_without_a_backend_the_command_explains_the_setup(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    clip = _clip(tmp_path / "in.mp4", frames=2)
    base = ["virtualcam", "--source", str(clip), "--prompt", "p", "--model", "tiny-random", "--size", "64x64"]
    # This machine has pyvirtualcam's Linux backend but no v4l2loopback device.
    assert main([*base, "--backend", "v4l2loopback"]) != 0
    err = capsys.readouterr().err
    assert "cannot open a virtual camera" in err
    assert 'sudo modprobe v4l2loopback devices=1 exclusive_caps=1 card_label="diffcast"' in err
    # No backend at all (e.g. pyvirtualcam without OBS on macOS/Windows): the steps for that OS.
    monkeypatch.setattr("pyvirtualcam.camera.BACKENDS", {})
    monkeypatch.setattr("platform.system", lambda: "Windows")
    assert main(base) != 0
    err = capsys.readouterr().err
    assert "no virtual camera backend is available" in err and "Start Virtual Camera" in err
    assert main([*base, "--backend", "obs"]) != 0
    assert "backend 'obs' is not available here; available: none" in capsys.readouterr().err
    assert "OBS Studio" in setup_message("Darwin", "x") and "modprobe" not in setup_message("Darwin", "x")


async def test_server_stream_to_virtual_camera(
    recorder: type[RecordingBackend], live_server: Callable[..., AbstractContextManager[str]]
) -> None:
    with live_server() as url:
        publisher = await open_session(url, CodedCamera((128, 128), fps=15))
        try:
            code = await asyncio.to_thread(main, [
                "virtualcam", "--source", f"stream:{publisher.stream_id}", "--server", url,
                "--size", "64x48", "--fps", "10", "--backend", BACKEND, "--max-frames", "8",
            ])
        finally:
            await publisher.close()
    assert code == 0
    (camera,) = recorder.opened
    assert len(camera.frames) == 8 and all(frame.size == 64 * 48 * 3 for frame in camera.frames)


def test_bad_sources_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["virtualcam", "--source", "nope.mp4", "--prompt", "p"]) == 2
    assert "is not 'camera', an existing video file" in capsys.readouterr().err
    assert main(["virtualcam", "--source", "stream:"]) == 2
    assert "needs a stream id" in capsys.readouterr().err
    assert main(["virtualcam", "--source", "camera"]) == 2
    assert "--prompt is required" in capsys.readouterr().err


def test_missing_webcam_is_reported(recorder: type[RecordingBackend], capsys: pytest.CaptureFixture[str]) -> None:
    # This machine has no webcam: the command says so (and closes the virtual camera it opened).
    code = main([
        "virtualcam", "--source", "camera:7", "--prompt", "p", "--model", "tiny-random",
        "--size", "64x64", "--backend", BACKEND,
    ])
    assert code == 2
    assert "cannot open camera 7" in capsys.readouterr().err
    (camera,) = recorder.opened
    assert camera.closed and camera.frames == []
