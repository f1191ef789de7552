"""No secret in the logs (app/server/edge/logs.py): a real request sequence on a real server at INFO
(uvicorn's access log included) leaves no token, stream id or WHEP viewer id in any log line."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import websockets
from _security_fixtures import bearer, publisher_offer, tiny_factory, viewer_offer  # noqa: F401
from conftest import running_server

from app.server.edge.logs import fingerprint, install_log_redaction, mint_secret, redact


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name} {record.getMessage()} {record.exc_text or ''}")


@contextmanager
def captured_logs() -> Iterator[Capture]:
    """Every record that reaches the root logger or uvicorn's own (which do not propagate).
    Entered after the server starts: uvicorn's logging config replaces its loggers' handlers."""
    capture = Capture()
    loggers = [logging.getLogger(name) for name in ("", "uvicorn", "uvicorn.access")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(capture)
    logging.getLogger().setLevel(logging.INFO)
    try:
        yield capture
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(capture)
            lg.setLevel(level)


def test_a_request_sequence_logs_no_secret(tiny_factory: Any) -> None:  # noqa: F811
    from app.server.app import create_app
    from app.server.config import ServerConfig

    app = create_app(ServerConfig(allow_loopback_candidates=True, max_streams=4), factory=tiny_factory)
    secrets: list[str] = []

    async def sequence(url: str) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            publisher, sdp = await publisher_offer()
            reply = (await client.post("/api/offer", json={"sdp": sdp, "type": "offer"})).json()
            stream, owner, viewer = reply["stream_id"], reply["owner_token"], reply["viewer_token"]
            secrets.extend([stream, owner, viewer])
            assert (await client.get(f"/api/streams/{stream}?access_token={viewer}")).status_code == 200
            assert (await client.get(reply["view_url"])).status_code == 200  # /view/<id>?token=<viewer>
            watcher, offer = await viewer_offer()
            answer = await client.post(f"/whep/{stream}", content=offer,
                                       headers={"Content-Type": "application/sdp", **bearer(viewer)})
            assert answer.status_code == 201, answer.text
            session_url = answer.headers["location"]
            secrets.append(session_url.rsplit("/", 1)[1])
            assert (await client.patch(session_url)).status_code == 405
            assert (await client.post(f"/api/streams/{stream}/control", content=json.dumps({"type": "pause"}),
                                      headers=bearer(owner))).status_code == 200
            assert (await client.delete(session_url)).status_code == 200
            async with websockets.connect(f"{url.replace('http', 'ws')}/ws?access_token={owner}") as ws:
                hello = json.loads(await asyncio.wait_for(ws.recv(), 60))
                secrets.extend([hello["stream_id"], hello["owner_token"], hello["viewer_token"]])
            assert (await client.delete(f"/api/streams/{stream}", headers=bearer(owner))).status_code == 204
            await asyncio.gather(publisher.close(), watcher.close())

    with running_server(app, log_level="info") as url, captured_logs() as capture:
        asyncio.run(sequence(url))

    lines = capture.lines
    # The capture saw the access log and the service's own lines about these streams...
    assert any("uvicorn.access" in line and "/whep/" in line for line in lines), lines
    assert any(f"stream {fingerprint(secrets[0])}" in line for line in lines), lines
    # ...and none of the secrets.
    leaks = [(secret, line) for secret in secrets for line in lines if secret in line]
    assert not leaks, leaks


def test_redaction_by_shape_and_by_value() -> None:
    install_log_redaction()
    minted = mint_secret(16)
    assert redact(f"stream {minted} opened") == f"stream {fingerprint(minted)} opened"
    line = '127.0.0.1:5 - "DELETE /whep/abc/def?x=1 HTTP/1.1" 200'
    assert redact(line) == f'127.0.0.1:5 - "DELETE /whep/{fingerprint("abc")}/{fingerprint("def")}?x=1 HTTP/1.1" 200'
    assert redact("/api/streams/abc/control") == f"/api/streams/{fingerprint('abc')}/control"
    assert redact("GET /ws?prompt=x&access_token=t0k") == f"GET /ws?prompt=x&access_token={fingerprint('t0k')}"
    assert redact("Authorization: Bearer t0k") == f"Authorization: Bearer {fingerprint('t0k')}"
    assert redact("GET /api/streams HTTP/1.1") == "GET /api/streams HTTP/1.1"  # nothing secret: unchanged
    # Arguments keep their types (uvicorn's access formatter reads them one by one).
    record = logging.getLogger("uvicorn.access").makeRecord(
        "uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s" %d', ("127.0.0.1:5", "GET", f"/view/{minted}", 200),
        None)
    assert record.args == ("127.0.0.1:5", "GET", f"/view/{fingerprint(minted)}", 200)
