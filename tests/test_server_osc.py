"""OSC control: a real UDP OSC client (python-osc) against a real server and stream; the same
checks, and the same reasons, as the HTTP control route."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from pythonosc.osc_message import OscMessage
from pythonosc.udp_client import SimpleUDPClient

from app.client import CodedCamera, ProbeSession, http, open_session
from app.server.control.messages import ControlError
from app.server.control.osc import OscFormError, parse
from app.server.control.osc_packet import Unsupported

ROOT = Path(__file__).resolve().parents[1]


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
    # A blob (or MIDI, an array, ...) is refused by name, and the answer still goes to its reply port;
    # a blob once reached json.dumps: a TypeError, a traceback and no answer.
    with pytest.raises(OscFormError, match=r"an OSC blob \('b'\) is not a value any control takes") as refused:
        parse("/diffcast/prompt", ["s", "t", Unsupported("b"), 0])
    assert refused.value.reply_port == 0
    with pytest.raises(OscFormError, match=r"an OSC MIDI message \('m'\)"):
        parse("/diffcast/blend", ["s", "t", "oil", Unsupported("m")])


class OscPeer:
    """A python-osc client that also reads the server's answers on its own socket (reply port 0)."""

    def __init__(self, port: int) -> None:
        self.port = port
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


@asynccontextmanager
async def osc_stream(live_server: Callable[..., AbstractContextManager[str]]
                     ) -> AsyncIterator[tuple[str, ProbeSession, OscPeer]]:
    """A live server with OSC on, a stream on it and an OSC peer: (its URL, the stream, the peer)."""
    port = free_udp_port()
    with live_server(osc_port=port) as url:
        session = await open_session(url, CodedCamera((128, 128), fps=10), prompt="oil painting")
        osc = OscPeer(port)
        try:
            yield url, session, osc
        finally:
            osc.client.close()
            await session.close()


async def test_osc_controls_a_stream_with_the_http_checks(
    live_server: Callable[..., AbstractContextManager[str]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="app.server.control.osc")
    async with osc_stream(live_server) as (url, session, osc):
        sid, owner = session.stream_id, session.owner_token
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

        # A blob from the owner: a refusal that names it (before: a TypeError and no answer).
        answer = await osc.send("/diffcast/prompt", sid, owner, b"\x00\x01")
        assert answer[:3] == ["/diffcast/error", "/diffcast/prompt", sid]
        assert "an OSC blob ('b') is not a value any control takes" in answer[3]

        # /diffcast/record maps onto the update's `record` field (this server has no --record-dir).
        answer = await osc.send("/diffcast/record", sid, owner, True)
        _, reason = http_control(url, sid, owner, {"type": "update", "record": True})
        assert answer == ["/diffcast/error", "/diffcast/record", sid, reason]
        assert "recording is not enabled on this server" in reason
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
    import app.server.control.osc as osc
    from app.server.config import ServerConfig

    server = osc.OscServer(ServerConfig(), manager=None, access=None)  # type: ignore[arg-type]
    now = [100.0]
    monkeypatch.setattr(osc.time, "monotonic", lambda: now[0])
    assert [server._log_refusal("refused %d", i) for i in range(15)] == [True] * 10 + [False] * 5
    now[0] = 101.5
    assert server._log_refusal("refused again")
    assert "5 more OSC refusals were not logged (at most 10 a second are)" in caplog.text
    assert caplog.text.count("refused ") == 11
    # Those held back in the last window are counted when the server stops, not lost.
    assert [server._log_refusal("refused later") for _ in range(12)].count(False) == 3  # 1 + 9 logged
    asyncio.run(server.close())
    assert "3 more OSC refusals were not logged" in caplog.text


def nested_bundles(depth: int) -> bytes:
    packet = b"/diffcast/pause\0,\0\0\0"
    for _ in range(depth):
        packet = b"#bundle\0" + b"\0" * 8 + struct.pack(">i", len(packet)) + packet
    return packet


# Issue 35's packets, each once an unhandled exception or a hang on the event loop, and what the
# one log line about each says now.
FINDINGS = {
    b"#bundle\0" + b"\0" * 8 + struct.pack(">i", -4) + b"abcd": "a bundle element claims -4 bytes",  # hung
    b"/di\xff\0\0\0\0": "the address is not '/' and up to 127 printable ASCII",  # UnicodeDecodeError
    b"/a\0\0,s\0\0\xc3\x28\0\0": "a string of /a is not UTF-8",  # UnicodeDecodeError
    nested_bundles(1200): "the packet has 24020 bytes; the limit is 16384",  # RecursionError
    nested_bundles(100): "bundles are nested more than 8 deep",
    b"/a\0\0,ix\0" + b"\0" * 8: "an argument of unknown OSC type 'x'",  # python-osc: a root warning per tag
}
# The real protocol handler, fed each packet in a child process: before the fix the first packet
# never returned, so the test's deadline, not a hung test run, reports it.
HANDLER = """
import json, logging, sys
from app.server.config import ServerConfig
from app.server.control.osc import OscServer
records = []
handler = logging.Handler()
handler.emit = lambda r: records.append([r.name, r.levelname, r.getMessage(), r.exc_info is not None])
logging.getLogger().addHandler(handler)
server = OscServer(ServerConfig(), manager=None, access=None)
for packet in json.load(sys.stdin):
    server.datagram_received(bytes.fromhex(packet), ("127.0.0.1", 9))
print(json.dumps(records))
"""


def test_hostile_packets_cost_the_handler_one_line_each() -> None:
    result = subprocess.run([sys.executable, "-c", HANDLER], input=json.dumps([p.hex() for p in FINDINGS]),
                            capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    records = json.loads(result.stdout)
    assert len(records) == len(FINDINGS)
    for (name, level, text, has_traceback), reason in zip(records, FINDINGS.values(), strict=True):
        assert (name, level, has_traceback) == ("app.server.control.osc", "WARNING", False)
        assert text.startswith("an OSC packet from 127.0.0.1:9 was dropped: ") and reason in text


async def test_a_failure_inside_the_handler_is_one_line_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in reading or applying a message costs one budgeted line, and the next message is applied."""
    import app.server.control.osc as osc
    from app.server.config import ServerConfig

    server = osc.OscServer(ServerConfig(), manager=None, access=None)  # type: ignore[arg-type]
    handled: list[str] = []

    async def handle(address: str, params: Any, sender: Any) -> None:
        handled.append(address)
        if address == "/bug":
            raise RuntimeError("handler bug")

    def read_packet(data: bytes) -> Any:
        raise RuntimeError("reader bug")

    monkeypatch.setattr(server, "handle", handle)
    server.datagram_received(b"/bug\0\0\0\0", ("127.0.0.1", 9))
    server.datagram_received(b"/next\0\0\0", ("127.0.0.1", 9))
    with monkeypatch.context() as patch:
        patch.setattr(osc, "read_packet", read_packet)
        server.datagram_received(b"/x\0\0", ("127.0.0.1", 9))
    worker = asyncio.create_task(server._run())
    try:
        async with asyncio.timeout(30):
            while len(handled) < 2:
                await asyncio.sleep(0.01)
    finally:
        worker.cancel()
    assert handled == ["/bug", "/next"]
    assert [(r.levelname, r.getMessage(), r.exc_info) for r in caplog.records] == [
        ("WARNING", "an OSC packet from 127.0.0.1:9 was dropped: RuntimeError: reader bug", None),
        ("WARNING", "OSC message /bug from 127.0.0.1 could not be handled: RuntimeError: handler bug", None),
    ]
