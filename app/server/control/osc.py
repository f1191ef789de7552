"""OSC control (`diffcast serve --osc-port N`): VJ and streaming tools (TouchOSC, Resolume, Max, a
MIDI-to-OSC bridge) drive a stream's prompt and knobs over UDP.

A message is ``/diffcast/<control> <stream_id> <owner_token> <values...> [<reply_port>]``
(docs/osc.md has the table). It becomes the JSON control message ``POST /api/streams/{id}/control``
takes, and goes through what that route goes through: the owner-token rule of the HTTP edge
(:meth:`AccessControl.refusal` with ``Access.OWNER``, the same reasons), then the stream's own size,
rate and value checks and its application (:meth:`Session.handle_text`, the same ControlError
reasons). UDP has no answer: a refusal is logged (stream ids and tokens are redacted, the token is
never put in a line) and, when the message ends with a reply port (0: the port it was sent from) or
the server has ``--osc-reply``, answered with ``/diffcast/error <address> <stream_id> <reason>``;
an applied message is then acknowledged with ``/diffcast/ack <address> <stream_id>``.

Messages are applied one at a time in arrival order (bundles' time tags are not waited for).
Packets are read by :mod:`app.server.control.osc_packet`, under bounds, not by python-osc's parser (which
hung the event loop on hostile packets); nothing a packet holds reaches the loop's exception
handler: every failure is a refusal, logged and answered within one budget.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from pythonosc.osc_message_builder import OscMessageBuilder

from app.server.config import ServerConfig
from app.server.control.messages import ControlError
from app.server.control.osc_packet import Message, OscPacketError, Unsupported, read_packet
from app.server.edge.security import Access, AccessControl
from app.server.serving.session import SessionManager

log = logging.getLogger(__name__)

PREFIX = "/diffcast/"
QUEUE_LIMIT = 256  # messages waiting to be applied; more are dropped (and logged)
REFUSALS_LOGGED_PER_S = 10  # a flood of bad packets must not flood the log

Sender = tuple[str, int]


@dataclass(frozen=True)
class OscControl:
    """One address: the values it takes (``None``: prompt/weight pairs) and the control message they make."""

    takes: str
    count: int | None
    build: Callable[[Sequence[Any]], dict[str, Any]]


def _update(field: str) -> Callable[[Sequence[Any]], dict[str, Any]]:
    return lambda values: {"type": "update", field: values[0]}


def _blend(values: Sequence[Any]) -> dict[str, Any]:
    return {"type": "update", "prompt": list(values[0::2]), "prompt_weights": list(values[1::2])}


CONTROLS: dict[str, OscControl] = {
    "prompt": OscControl("<text>", 1, _update("prompt")),
    "blend": OscControl("<text> <weight> [<text> <weight> ...]", None, _blend),
    "noise": OscControl("<noise_scale>", 1, _update("noise_scale")),
    "steps": OscControl("<steps>", 1, _update("steps")),
    "seed": OscControl("<seed>", 1, _update("seed")),
    "stabilize": OscControl("<true|false>", 1, _update("stabilize")),
    # The `record` field of an update: without --record-dir, the control's own refusal answers.
    "record": OscControl("<true|false>", 1, _update("record")),
    "cue": OscControl("<name>", 1, lambda values: {"type": "cue", "name": values[0]}),
    "pause": OscControl("", 0, lambda _: {"type": "pause"}),
    "resume": OscControl("", 0, lambda _: {"type": "resume"}),
    "reset": OscControl("", 0, lambda _: {"type": "reset"}),
}


def _exact(value: Any) -> Any:
    """An OSC float (32-bit) as the shortest decimal that is the same float32: a fader's 0.6 arrives
    as 0.6000000238418579 and is meant as 0.6. Other values (and 64-bit floats) are kept."""
    if isinstance(value, float) and np.isfinite(value) and float(np.float32(value)) == value:
        return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))
    return value


class OscFormError(ControlError):
    """A message that is not one of the documented forms; keeps the reply port it named, if any."""

    def __init__(self, reason: str, reply_port: int | None) -> None:
        super().__init__(reason)
        self.reply_port = reply_port


@dataclass(frozen=True)
class Parsed:
    stream_id: str
    token: str
    control: OscControl
    values: Sequence[Any]

    def message(self) -> dict[str, Any]:
        """The control message, as the HTTP control route would take it."""
        return self.control.build(self.values)


def parse(address: str, params: Sequence[Any]) -> tuple[Parsed, int | None]:
    """An OSC message -> (the stream, the presented token, the control message) and the reply port
    it names (None: none). :class:`OscFormError` in plain words when it is not one of the documented
    forms."""
    params = list(params)
    control = CONTROLS.get(address.removeprefix(PREFIX)) if address.startswith(PREFIX) else None
    if control is None:
        raise OscFormError(f"unknown OSC address {address}; the addresses are "
                           + ", ".join(PREFIX + name for name in CONTROLS), None)
    values = params[2:]
    expected = control.count if control.count is not None else len(values) - len(values) % 2
    reply_port = None
    last = values[-1] if values else None
    if len(values) == expected + 1 and isinstance(last, int) and not isinstance(last, bool) and 0 <= last < 65536:
        reply_port = values.pop()
    form = f"expected {address} <stream_id> <owner_token> {control.takes}".rstrip() + " [<reply_port>]"
    if len(params) < 2 or not all(isinstance(p, str) for p in params[:2]):
        raise OscFormError(f"{form}: the stream id and the owner token are strings", reply_port)
    # Before anything is made of the values: a blob once reached json.dumps (a TypeError, no answer).
    unsupported = next((v for v in values if isinstance(v, Unsupported)), None)
    if unsupported is not None:
        raise OscFormError(f"{form}: an OSC {unsupported.name} ('{unsupported.tag}') is not a value any "
                           "control takes; the values are strings (s), numbers (i, h, f, d) and T/F", reply_port)
    if len(values) != expected or (control.count is None and not values):
        raise OscFormError(f"{form}; got {len(values)} values", reply_port)
    values = [_exact(v) for v in values]
    return Parsed(params[0], params[1], control, values), reply_port


class OscBindError(OSError):
    """The OSC port cannot be opened; the text says which and why."""


def bind(config: ServerConfig) -> socket.socket:
    """The OSC UDP socket, bound now: a port in use stops `diffcast serve` before the model loads,
    with a message, instead of failing later inside the server's start-up."""
    assert config.osc_port is not None
    family = socket.AF_INET6 if ":" in config.osc_host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.bind((config.osc_host, config.osc_port))
    except OSError as exc:
        sock.close()
        raise OscBindError(f"cannot listen for OSC on udp://{config.osc_host}:{config.osc_port}: "
                           f"{exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


class OscServer(asyncio.DatagramProtocol):
    """The UDP endpoint: parses packets, queues their messages, applies them one at a time."""

    def __init__(self, config: ServerConfig, manager: SessionManager, access: AccessControl) -> None:
        self.config = config
        self.manager = manager
        self.access = access
        self.transport: asyncio.DatagramTransport | None = None
        self.queue: asyncio.Queue[tuple[Message, Sender]] = asyncio.Queue(QUEUE_LIMIT)
        self._worker: asyncio.Task[None] | None = None
        self._window = (0.0, 0, 0)  # log throttle: (second it started, lines logged, lines held back)

    @classmethod
    async def start(cls, config: ServerConfig, sock: socket.socket, manager: SessionManager,
                    access: AccessControl) -> OscServer:
        """Serve OSC on ``sock`` (from :func:`bind`) in the running loop."""
        loop = asyncio.get_running_loop()
        server = cls(config, manager, access)
        await loop.create_datagram_endpoint(lambda: server, sock=sock)
        server._worker = asyncio.create_task(server._run(), name="osc")
        log.info("OSC control on udp://%s:%d (docs/osc.md)", config.osc_host, config.osc_port)
        return server

    async def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        self._report_held(self._window[2])  # every refusal is counted in the log, the last second's too

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's UDP transport has DatagramTransport's methods without being its subclass.
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        sender = (str(addr[0]), int(addr[1]))
        try:
            messages = read_packet(data)
        except Exception as exc:  # OscPacketError; anything else is a reader bug, still one budgeted line
            self._log_refusal("an OSC packet from %s:%d was dropped: %s", *sender, _described(exc))
            return
        for message in messages:
            try:
                self.queue.put_nowait((message, sender))
            except asyncio.QueueFull:
                self._log_refusal("OSC message %s from %s dropped: %d messages are waiting",
                                  message.address, sender[0], QUEUE_LIMIT)

    async def _run(self) -> None:
        while True:
            message, sender = await self.queue.get()
            try:
                await self.handle(message.address, message.params, sender)
            except Exception as exc:  # one message must never end control for every stream
                # A sender can repeat what failed: one budgeted line each, no traceback per message.
                self._log_refusal("OSC message %s from %s could not be handled: %s",
                                  message.address, sender[0], _described(exc))

    async def handle(self, address: str, params: Sequence[Any], sender: Sender) -> None:
        reply_port = self.config.osc_reply_port
        stream_id = params[0] if params and isinstance(params[0], str) else ""
        given_port: int | None = None
        try:
            parsed, given_port = parse(address, params)
            reason = await self.apply(parsed)
        except OscFormError as exc:
            reason, given_port = str(exc), exc.reply_port
        if given_port is not None:
            reply_port = given_port
        if reason is not None:
            # Refusals are logged and answered within one budget: UDP senders can be spoofed, and
            # answers to a flood of bad messages would be a reflection attack on someone else.
            if self._log_refusal("OSC %s for stream %s from %s refused: %s",
                                 address, stream_id or "-", sender[0], reason):
                self._reply(sender, reply_port, "/diffcast/error", address, stream_id, reason)
        else:
            self._reply(sender, reply_port, "/diffcast/ack", address, stream_id)

    async def apply(self, parsed: Parsed) -> str | None:
        """Apply the message as the HTTP control route does; the reason it was refused, or None."""
        refusal = self.access.refusal(parsed.token, parsed.stream_id, Access.OWNER)
        if refusal is not None:
            return refusal[1]
        session = self.manager.get(parsed.stream_id)
        if session is None:
            return f"no stream {parsed.stream_id}"
        # As JSON text, so the stream's size and rate limits and its parser (which refuses the NaN
        # and Infinity that json.dumps writes) see exactly what the HTTP route's body would be.
        reply = await session.handle_text(json.dumps(parsed.message()), self.config.max_prompt_chars)
        return str(reply["message"]) if reply["type"] == "error" else None

    def _reply(self, sender: Sender, port: int | None, address: str, *args: str) -> None:
        if port is None or self.transport is None:
            return
        builder = OscMessageBuilder(address)
        for arg in args:
            builder.add_arg(arg)
        try:
            self.transport.sendto(builder.build().dgram, (sender[0], port or sender[1]))
        except OSError as exc:  # the sender's network is gone: nothing to tell it
            log.debug("OSC answer to %s:%d not sent: %s", sender[0], port or sender[1], exc)

    def _log_refusal(self, text: str, *args: Any) -> bool:
        """Log a refusal within REFUSALS_LOGGED_PER_S; whether it was within that budget."""
        now = time.monotonic()
        started, logged, held = self._window
        if now - started >= 1.0:
            self._report_held(held)
            started, logged, held = now, 0, 0
        within = logged < REFUSALS_LOGGED_PER_S
        if within:
            log.warning(text, *args)
            logged += 1
        else:
            held += 1
        self._window = (started, logged, held)
        return within

    @staticmethod
    def _report_held(held: int) -> None:
        if held:
            log.warning("%d more OSC refusals were not logged (at most %d a second are)",
                        held, REFUSALS_LOGGED_PER_S)


def _described(exc: Exception) -> str:
    """An exception as part of one log line: a packet's fault in its own words, a bug by its type."""
    return str(exc) if isinstance(exc, OscPacketError) else f"{type(exc).__name__}: {exc}"
