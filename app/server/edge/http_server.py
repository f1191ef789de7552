"""The HTTP/WebSocket server under the app: uvicorn, with the limits and timeouts a public service
needs on what a client sends before the app sees it, and a stop that drains every connection.

What plain uvicorn (0.54, httptools + websockets-sansio) did with hostile clients, and the answer here:

* A request head of any size was read (httptools has no limit: a 1 MB header was accepted).
  Here h11 parses requests with a bound on the head, and :class:`LimitedH11Connection` refuses a
  request line over ``max_request_line`` bytes (414), more than ``max_header_fields`` fields, a
  field over ``max_field_bytes`` or a head over ``max_head_bytes`` (431).
* A WebSocket upgrade that the websockets parser refused (its own 8 KB line / 128 header limits,
  a body on the GET) got no answer and the connection was held; stopping the server with one
  open then failed on an assertion in uvicorn. :class:`AnsweringWebSocketProtocol` sends the
  refusal and closes; the limits above also refuse such requests before the upgrade.
* Nothing timed out between connecting and the end of the headers, or inside a body (one byte
  every few seconds held a connection for ever). :class:`GuardedH11Protocol` answers 408 once
  the head has not arrived within ``header_timeout_s``, or the body arrives slower than
  ``min_body_rate`` bytes/s after a grace of ``body_timeout_s`` (mod_reqtimeout's rule: large
  uploads on slow links still pass, a trickle does not).
* SIGTERM drained, then re-raised the signal (exit status -15/143). :func:`serve_until_stopped`
  treats SIGTERM and SIGINT as the normal way to stop: connections are closed (WebSocket
  clients get 1012, a request still sending its body gets 503), the lifespan closes every
  stream, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import http
import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from app.server.config import ServerConfig
from app.server.edge.logs import install_log_redaction

log = logging.getLogger(__name__)

# Room for the WebSocket message header around the largest accepted video frame.
WS_FRAME_OVERHEAD = 4096
GRACEFUL_SHUTDOWN_S = 10


@dataclass(frozen=True)
class HttpLimits:
    """What a request head may be, and how long a client may take to send a request."""

    # Below the websockets parser's own limits (8192-byte lines, 128 headers), so an upgrade
    # request always meets these first and gets the same answers as any other request.
    max_request_line: int = 8000
    max_header_fields: int = 100
    max_field_bytes: int = 8000
    max_head_bytes: int = 32768
    # The two timeouts are server options (--header-timeout-s, --body-timeout-s): their defaults are
    # ServerConfig's.
    header_timeout_s: float = ServerConfig.header_timeout_s
    body_timeout_s: float = ServerConfig.body_timeout_s
    # A body may take body_timeout_s plus one second per this many bytes (about 8 kbit/s).
    min_body_rate: float = 1000.0

    @classmethod
    def from_config(cls, config: ServerConfig) -> HttpLimits:
        return cls(header_timeout_s=config.header_timeout_s, body_timeout_s=config.body_timeout_s)


@dataclass(frozen=True)
class Refusal:
    status: int
    reason: str


class LimitedH11Connection(h11.Connection):
    """An h11 server connection that refuses request heads over :class:`HttpLimits`. A refusal
    is raised as h11's RemoteProtocolError (which uvicorn answers and closes on) and kept in
    ``refusal`` so the answer can say which limit it was."""

    def __init__(self, limits: HttpLimits) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=limits.max_head_bytes)
        self.limits = limits
        self.refusal: Refusal | None = None

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.refusal = self._refusal_for(exc)
            raise
        if isinstance(event, h11.Request):
            self.refusal = self._check_head(event)
            if self.refusal is not None:
                raise h11.RemoteProtocolError(self.refusal.reason, self.refusal.status)
        return event

    def _refusal_for(self, exc: h11.RemoteProtocolError) -> Refusal:
        limits = self.limits
        if exc.error_status_hint == 431:  # h11's bound on an incomplete head
            buffered = self.trailing_data[0]
            if b"\n" not in buffered[: limits.max_request_line + 2]:
                return Refusal(414, f"the request line is longer than {limits.max_request_line} bytes")
            return Refusal(431, f"the request head is larger than {limits.max_head_bytes} bytes")
        log.debug("malformed HTTP request: %s", exc)
        return Refusal(400, "malformed HTTP request: its request line or a header field cannot be parsed")

    def _check_head(self, request: h11.Request) -> Refusal | None:
        limits = self.limits
        line = len(request.method) + len(request.target) + 10  # "GET <target> HTTP/1.1"
        if line > limits.max_request_line:
            return Refusal(414, f"the request line is longer than {limits.max_request_line} bytes")
        if len(request.headers) > limits.max_header_fields:
            return Refusal(431, f"the request has {len(request.headers)} header fields; "
                                f"the limit is {limits.max_header_fields}")
        longest = max((len(name) + len(value) + 2 for name, value in request.headers), default=0)
        if longest > limits.max_field_bytes:
            return Refusal(431, f"a header field is longer than {limits.max_field_bytes} bytes")
        return None


def _plain_answer(status: int, reason: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A complete ``Connection: close`` response, written below h11 (which may be in a state
    where it would not send one: no request yet, or a request half received)."""
    body = (reason + "\n").encode()
    head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}".encode()]
    head += [name + b": " + value for name, value in default_headers]
    head += [b"content-type: text/plain; charset=utf-8", f"content-length: {len(body)}".encode(),
             b"connection: close"]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with :class:`HttpLimits`: limits on the head (through
    :class:`LimitedH11Connection`) and deadlines on receiving the head and the body."""

    limits: ClassVar[HttpLimits] = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn: LimitedH11Connection = LimitedH11Connection(self.limits)
        self._phase: str | None = None  # "head" or "body" while a request is being received
        self._deadline: float | None = None
        self._body_received = 0
        self._timer: asyncio.TimerHandle | None = None
        self._upgraded = False  # the connection now belongs to the WebSocket protocol

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_deadline(None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.SEND_BODY:
            self._body_received += len(data)
        super().data_received(data)
        if not self._upgraded and not self.transport.is_closing():
            self._track()

    def _track(self) -> None:
        """Start the deadline of the part of a request now being received: its head (from the
        connection, or from the first byte of the next request on a kept-alive connection) or
        its body; none once the request is in (the app has it) or between requests (uvicorn's
        keep-alive timeout)."""
        state = self.conn.their_state
        phase = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if phase == self._phase:
            return
        self._phase = phase
        self._body_received = 0
        if phase is None:
            self._set_deadline(None)
        else:
            timeout = self.limits.header_timeout_s if phase == "head" else self.limits.body_timeout_s
            self._set_deadline(self.loop.time() + timeout)

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._upgraded = True  # the WebSocket protocol takes the connection (it has its pings)
        self._set_deadline(None)
        super().handle_websocket_upgrade(event)

    def send_400_response(self, msg: str) -> None:
        refusal = self.conn.refusal or Refusal(400, msg)
        self.logger.warning("%s: refused with %d: %s", self._peer(), refusal.status, refusal.reason)
        self._answer_and_close(refusal.status, refusal.reason)

    def shutdown(self) -> None:
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            # A client still sending its body would hold the drain until the graceful timeout.
            self._answer_and_close(503, "the server is shutting down")
            return
        super().shutdown()

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "client"

    def _set_deadline(self, deadline: float | None) -> None:
        self._deadline = deadline
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if deadline is not None:
            self._timer = self.loop.call_at(deadline, self._on_deadline)

    def _on_deadline(self) -> None:
        self._timer = None
        if self._deadline is None or self.transport.is_closing():
            return
        if self._phase == "body":
            # The body's deadline moves by one second per min_body_rate bytes received.
            deadline = self._deadline + self._body_received / self.limits.min_body_rate
            self._body_received = 0
            if deadline > self.loop.time():
                self._set_deadline(deadline)
                return
            reason = f"the request body was not received in time (at least {self.limits.min_body_rate:g} bytes/s)"
        else:
            reason = f"the request head was not received within {self.limits.header_timeout_s:g} s"
        self.logger.warning("%s: refused with 408: %s", self._peer(), reason)
        self._answer_and_close(408, reason)

    def _answer_and_close(self, status: int, reason: str) -> None:
        self._set_deadline(None)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # The app may be waiting for the rest of the body: it now sees a disconnect, and
            # anything it still sends is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
            if cycle.response_started:
                self.transport.close()
                return
        self.transport.write(_plain_answer(status, reason, self.server_state.default_headers))
        self.transport.close()


def guarded_protocol(limits: HttpLimits) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn instantiates per connection, bound to ``limits``."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


class AnsweringWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's websockets-sansio protocol, answering handshakes the websockets parser refuses.

    When websockets cannot read the upgrade request (a line over 8 KB, over 128 headers, a
    Content-Length on the GET), it queues its refusal (or only an EOF) and produces no event;
    uvicorn then neither writes it nor closes, so the client waits for ever, and at shutdown
    uvicorn's 500 trips websockets' "EOF already sent" assertion. Here the refusal is sent and
    the connection closed at once."""

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.handshake_initiated or self.conn.handshake_exc is None or self.transport.is_closing():
            return
        answer = b"".join(self.conn.data_to_send())  # a 414/431 from websockets, or b"" (EOF only)
        if not answer:
            answer = _plain_answer(400, "malformed WebSocket upgrade request", self.default_headers)
        self.handshake_complete = True
        self.close_sent = True
        self.transport.write(answer)
        self.transport.close()


def uvicorn_server(app: Any, config: ServerConfig, *, port: int | None = None,
                   log_level: str = "info") -> uvicorn.Server:
    """The server `diffcast serve` runs (and the tests run): ``app`` on ``config``'s host and
    ``port`` (default ``config.port``) with the guarded protocols and redacted logs."""
    if config.https and not (config.ssl_certfile and config.ssl_keyfile):
        # Never plain HTTP for a config that asks for TLS.
        raise ValueError("https=True needs ssl_certfile and ssl_keyfile: resolve the config with "
                         "app.server.edge.tls.with_certificate first")
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port if port is None else port, log_level=log_level,
        http=guarded_protocol(HttpLimits.from_config(config)), ws=AnsweringWebSocketProtocol,
        lifespan="on",
        # A WebSocket message over the frame limit closes the socket (1009) before it is buffered.
        ws_max_size=config.max_frame_bytes + WS_FRAME_OVERHEAD,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        # X-Forwarded-* from --forwarded-allow-ips only; uvicorn's own default trusts 127.0.0.1,
        # which would let any local process (or a misconfigured local proxy) set client addresses.
        proxy_headers=bool(config.forwarded_allow_ips),
        forwarded_allow_ips=list(config.forwarded_allow_ips) or None,
        # TLS for --https (app/server/edge/tls.py has filled both paths in by now).
        ssl_certfile=config.ssl_certfile, ssl_keyfile=config.ssl_keyfile,
    ))
    # After uvicorn.Config, which (re)configures the uvicorn loggers.
    install_log_redaction()
    return server


@contextmanager
def stop_signals_end_normally() -> Iterator[None]:
    """SIGTERM and SIGINT stop the server and then end the process normally (exit status 0).

    uvicorn drains on these signals and then raises the signal again with the handler that was
    installed before it started; with the default handlers that kills the process (-15) or
    raises KeyboardInterrupt after a clean drain. Installed here, the handler that uvicorn
    restores and calls only notes the stop."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only; a server in a thread is stopped by its owner
        return

    def stopped(signum: int, frame: FrameType | None) -> None:
        log.info("stopped by %s; every connection and stream is closed", signal.Signals(signum).name)

    before = {sig: signal.signal(sig, stopped) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def serve_until_stopped(server: uvicorn.Server) -> None:
    with stop_signals_end_normally():
        server.run()
