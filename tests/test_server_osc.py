"""OSC control: a real UDP OSC client (python-osc) against a real server and stream; the same
checks, and the same reasons, as the HTTP control route."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest
from pythonosc.osc_message import OscMessage
from pythonosc.udp_client import SimpleUDPClient

from app.client import CodedCamera, http, open_session
from app.server.control import ControlError
from app.server.osc import parse


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_addresses_become_control_messages() -> None:
    parsed, port = parse("/diffcast/prompt", ["s", "t", "ink wash"])
    assert (parsed.stream_id, parsed.token, parsed.message(), port) == ("s", "t", {"type": "update", "prompt": "ink wash"}, None)
    parsed, port = parse("/diffcast/blend", ["s", "t", "oil", 0.75, "neon", 0.25, 9000])
    assert parsed.message() == {"type": "update", "prompt": ["oil", "neon"], "prompt_weights": [0.75, 0.25]}
    assert port == 9000
    # A fader's float32 0.6 is meant as 0.6.
    assert parse("/diffcast/noise", ["s", "t", 0.6000000238418579])[0].message()["noise_scale"] == 0.6
    assert parse("/diffcast/pause", ["s", "t", 0])[0].message() == {"type": "pause"}
    with pytest.raises(ControlError, match="unknown OSC address /diffcast/volume"):
        parse("/diffcast/volume", ["s", "t", 1])
    with pytest.raises(ControlError, match=r"expected /diffcast/steps <stream_id> <owner_token> <steps> \[<reply_port>\]; got 3 values"):
        parse("/diffcast/steps", ["s", "t", 1, 2, 3])
    with pytest.raises(ControlError, match="the stream id and the owner token are strings"):
        parse("/diffcast/seed", [1, "t", 2])


class OscPeer:
    """A python-osc client that also reads the server's answers on its own socket (reply port 0)."""

    def __init__(self, port: int) -> None:
        self.client = SimpleUDPClient("127.0.0.1", port)

    async def send(self, address: str, *args: Any) -> list[Any]:
        """Send with reply port 0; the answer's address and arguments."""
        self.client.send_message(address, [*args, 0])
        data = await asyncio.to_thread(self.client.receive, 30)
        message = OscMessage(data)
        return [message.address, *message.params]


def http_control(url: str, stream_id: str, token: str, message: dict[str, Any]) -> tuple[int, str]:
    status, _, raw = http("POST", f"{url}/api/streams/{stream_id}/control", json.dumps(message).encode(),
                          {"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    body = json.loads(raw)
    return status, body.get("message") or body.get("detail") or ""


def stream_stats(url: str, stream_id: str) -> dict[str, Any]:
    return dict(json.loads(http("GET", f"{url}/api/streams/{stream_id}")[2]))


async def test_osc_controls_a_stream_with_the_http_checks(
    live_server: Callable[..., AbstractContextManager[str]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="app.server.osc")
    port = free_udp_port()
    with live_server(osc_port=port) as url:
        session = await open_session(url, CodedCamera((128, 128), fps=10), prompt="oil painting")
        osc = OscPeer(port)
        sid, owner = session.stream_id, session.owner_token
        try:
            # A prompt and a knob reach the stream (read back over HTTP, not from the OSC side).
            assert await osc.send("/diffcast/prompt", sid, owner, "charcoal drawing") == \
                ["/diffcast/ack", "/diffcast/prompt", sid]
            assert await osc.send("/diffcast/steps", sid, owner, 1) == ["/diffcast/ack", "/diffcast/steps", sid]
            assert await osc.send("/diffcast/pause", sid, owner) == ["/diffcast/ack", "/diffcast/pause", sid]
            stats = stream_stats(url, sid)
            assert (stats["prompt"], stats["steps"], stats["paused"]) == ("charcoal drawing", 1, True)
            await osc.send("/diffcast/resume", sid, owner)
            assert stream_stats(url, sid)["paused"] is False

            # Refused tokens: the HTTP edge's reasons, and nothing changes.
            wrong = "x" * 32
            for token in (wrong, session.viewer_token):
                answer = await osc.send("/diffcast/prompt", sid, token, "neon")
                _, reason = http_control(url, sid, token, {"type": "update", "prompt": "neon"})
                assert answer == ["/diffcast/error", "/diffcast/prompt", sid, reason]
            assert reason.startswith("a viewer token can only watch")
            assert stream_stats(url, sid)["prompt"] == "charcoal drawing"

            # A bad value: the same reason as the HTTP control route gives.
            answer = await osc.send("/diffcast/noise", sid, owner, 5.0)
            status, reason = http_control(url, sid, owner, {"type": "update", "noise_scale": 5.0})
            assert status == 422 and "noise_scale" in reason
            assert answer == ["/diffcast/error", "/diffcast/noise", sid, reason]
            answer = await osc.send("/diffcast/blend", sid, owner, "oil", 0.0, "neon", 0.0)
            _, reason = http_control(url, sid, owner, {"type": "update", "prompt": ["oil", "neon"],
                                                       "prompt_weights": [0.0, 0.0]})
            assert answer[3] == reason and "not all zero" in reason

            # /diffcast/record maps onto the update's `record` field (this server has no --record-dir).
            answer = await osc.send("/diffcast/record", sid, owner, True)
            _, reason = http_control(url, sid, owner, {"type": "update", "record": True})
            assert answer == ["/diffcast/error", "/diffcast/record", sid, reason]
            assert "recording is not enabled on this server" in reason
        finally:
            osc.client.close()
            await session.close()
    # Refusals are logged, without the tokens that were presented.
    assert "refused" in caplog.text
    for secret in (owner, session.viewer_token, "x" * 32):
        assert secret not in caplog.text


def test_serve_says_when_the_osc_port_is_taken(caplog: pytest.LogCaptureFixture) -> None:
    from app.cli import build_parser

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        args = build_parser().parse_args(["serve", "--osc-port", str(port), "--model", "tiny-random"])
        assert args._run(args) == 2  # before the model loads or the HTTP port opens
    assert f"cannot listen for OSC on udp://127.0.0.1:{port}: Address already in use" in caplog.text


def test_refusals_are_logged_and_answered_within_a_budget(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A flood of bad datagrams (their sender may be forged) gets at most 10 log lines and answers a second."""
    import app.server.osc as osc
    from app.server.config import ServerConfig

    server = osc.OscServer(ServerConfig(), manager=None, access=None)  # type: ignore[arg-type]
    now = [100.0]
    monkeypatch.setattr(osc.time, "monotonic", lambda: now[0])
    assert [server._log_refusal("refused %d", i) for i in range(15)] == [True] * 10 + [False] * 5
    now[0] = 101.5
    assert server._log_refusal("refused again")
    assert "5 more OSC refusals in the last second were not logged" in caplog.text
    assert caplog.text.count("refused ") == 11
