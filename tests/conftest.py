"""Shared fixtures: a live server on a free port, the tiny real engine, a synthetic camera clip."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

CHROMIUM = Path("/usr/bin/chromium")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def running_server(app: Any, startup_timeout_s: float = 60.0, log_level: str = "warning") -> Iterator[str]:
    """Run an app from ``create_app`` on the server `diffcast serve` runs (guarded protocols,
    redacted logs; app/server/edge/http_server.py) in a background thread; yield its base URL."""
    from app.server.edge.http_server import uvicorn_server

    port = free_port()
    server = uvicorn_server(app, app.state.config, port=port, log_level=log_level)
    thread = threading.Thread(target=server.run, name=f"uvicorn:{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"server on port {port} did not start")
        time.sleep(0.05)
    try:
        yield f"{'https' if app.state.config.ssl_certfile else 'http'}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


@pytest.fixture(scope="session")
def engine_model() -> str:
    """The embedded default model once it has been trained and committed, else the tiny random one."""
    from engine.pipeline import DEFAULT_MODEL

    return "default" if DEFAULT_MODEL.is_file() else "tiny-random"


@pytest.fixture(scope="session")
def engine_factory(engine_model: str) -> Any:
    """The real engine pipeline, loaded once per test session."""
    import torch

    from app.server.serving.engine_bridge import InProcessFactory

    torch.set_num_threads(1)
    return InProcessFactory.load(engine_model)


@pytest.fixture
def live_server(engine_factory: Any) -> Callable[..., AbstractContextManager[str]]:
    """``with live_server(max_streams=1, ...) as url:`` — the real app and engine, loopback ICE."""
    from app.server.app import create_app
    from app.server.config import ServerConfig

    def start(**overrides: Any) -> AbstractContextManager[str]:
        config = ServerConfig(**{"allow_loopback_candidates": True, **overrides})
        return running_server(create_app(config, factory=engine_factory))

    return start


def write_y4m(path: Path, frames: list[np.ndarray], fps: int = 30) -> Path:
    """uint8 RGB frames -> a YUV4MPEG2 (4:2:0) clip, the format Chromium's fake camera reads."""
    height, width = frames[0].shape[:2]
    with path.open("wb") as out:
        out.write(f"YUV4MPEG2 W{width} H{height} F{fps}:1 Ip A1:1 C420jpeg\n".encode())
        for frame in frames:
            out.write(b"FRAME\n")
            out.write(cv2.cvtColor(frame, cv2.COLOR_RGB2YUV_I420).tobytes())
    return path


@pytest.fixture(scope="session")
def camera_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two seconds of moving synthetic video (loops in Chromium's fake camera)."""
    from app.client import pattern_frame

    frames = [pattern_frame(i, (320, 240)) for i in range(60)]
    return write_y4m(tmp_path_factory.mktemp("camera") / "camera.y4m", frames)


@contextmanager
def launched_chromium(path: Path, args: list[str]) -> Iterator[Any]:
    """A headless Chromium (playwright) with ``args``, closed at the end."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(path), args=args)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def chromium_path() -> Path:
    if not CHROMIUM.exists():
        pytest.skip(f"browser tests need Debian's chromium at {CHROMIUM} (CI installs it: apt-get install chromium)")
    return CHROMIUM


@pytest.fixture
def libvpx_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every libvpx encode the server's VP8 encoder runs (a spy around the real one): frame widths."""
    import av

    from app.server.media.encoder import OutputVp8Encoder

    calls: list[int] = []
    encode = OutputVp8Encoder.encode

    def counting(self: OutputVp8Encoder, frame: av.VideoFrame, force_keyframe: bool = False) -> tuple[list[bytes], int]:
        calls.append(frame.width)
        return encode(self, frame, force_keyframe)

    monkeypatch.setattr(OutputVp8Encoder, "encode", counting)
    return calls
