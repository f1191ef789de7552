"""Helpers for the hardening tests: the real app in-process over ASGI (so a test can choose the
client's address), real aiortc offers, and stream creation that keeps the creator's tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection
from conftest import free_port, running_server

from app.client import CodedCamera, http
from app.server.serving.session import SessionManager

REMOTE = "203.0.113.7"  # TEST-NET-3: a client that is not on this machine
ROOT = Path(__file__).resolve().parents[1]


async def publisher_offer() -> tuple[RTCPeerConnection, str]:
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver(CodedCamera((128, 128), fps=15), direction="sendrecv")
    pc.createDataChannel("control")
    await pc.setLocalDescription(await pc.createOffer())
    return pc, pc.localDescription.sdp


async def viewer_offer() -> tuple[RTCPeerConnection, str]:
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("video", direction="recvonly")
    await pc.setLocalDescription(await pc.createOffer())
    return pc, pc.localDescription.sdp


@dataclass
class Created:
    stream_id: str
    owner: str
    viewer: str
    reply: dict[str, Any]
    pc: RTCPeerConnection


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class Api:
    """The app over ASGI, as seen from one client address."""

    def __init__(self, app: Any, host: str = "127.0.0.1") -> None:
        self.app = app
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, client=(host, 40000)), base_url="http://diffcast.test", timeout=30
        )
        self.peers: list[RTCPeerConnection] = []

    def at(self, host: str) -> Api:
        other = Api(self.app, host)
        other.peers = self.peers  # closed together
        return other

    async def create(self, headers: dict[str, str] | None = None, **options: Any) -> Created:
        response = await self.offer(headers, **options)
        assert response.status_code == 200, response.text
        reply = response.json()
        return Created(reply["stream_id"], reply["owner_token"], reply["viewer_token"], reply, self.peers[-1])

    async def offer(self, headers: dict[str, str] | None = None, **options: Any) -> httpx.Response:
        pc, sdp = await publisher_offer()
        self.peers.append(pc)
        body = json.dumps({"sdp": sdp, "type": "offer", **options})
        return await self.client.post("/api/offer", content=body, headers={"Content-Type": "application/json",
                                                                           **(headers or {})})

    async def close(self) -> None:
        for pc in self.peers:
            await pc.close()
        await self.client.aclose()
        await self.app.state.manager.close_all()


@pytest.fixture(scope="session")
def tiny_factory() -> Any:
    """The tiny random-weight model whatever conftest's ``engine_model`` picks: these tests are
    about the service's edge, not the model, and must stay fast."""
    import torch

    from app.server.serving.engine_bridge import InProcessFactory

    torch.set_num_threads(1)
    return InProcessFactory.load("tiny-random")


@contextmanager
def served(factory: Any, **overrides: Any) -> Iterator[tuple[str, SessionManager]]:
    """The real app over uvicorn on loopback: (base URL, its session manager)."""
    from app.server.app import create_app
    from app.server.config import ServerConfig

    app = create_app(ServerConfig(**{"allow_loopback_candidates": True, **overrides}), factory=factory)
    with running_server(app) as url:
        yield url, app.state.manager


@pytest.fixture
def asgi_api(tiny_factory: Any) -> Callable[..., AbstractAsyncContextManager[Api]]:
    """``async with asgi_api(max_streams=2, ...) as api:`` — the real app and engine, in-process."""
    from app.server.app import create_app
    from app.server.config import ServerConfig

    @asynccontextmanager
    async def start(**overrides: Any) -> AsyncIterator[Api]:
        api = Api(create_app(ServerConfig(**{"allow_loopback_candidates": True, **overrides}), factory=tiny_factory))
        try:
            yield api
        finally:
            await api.close()

    return start


@contextmanager
def serve_command(*flags: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`diffcast serve --model tiny-random --port <free port> FLAGS` in a subprocess, once its
    /healthz answers: (base URL, the process); killed at the end if a test left it running. Its
    output is piped: a test that reads it calls ``communicate()``."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--model", "tiny-random", "--port", str(port), *flags],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        try:
            if http("GET", f"{url}/healthz")[0] == 200:
                break
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"diffcast serve did not start: {process.communicate()[0].decode()[-2000:]}")
        time.sleep(0.3)
    try:
        yield url, process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
