"""Who may do what to which stream, enforced at the HTTP/WebSocket edge (one ASGI middleware).

Every stream gets two unguessable capabilities (``secrets.token_urlsafe``) when it is created,
returned only to its creator (the /api/offer JSON, the WHIP 201 headers, the /ws hello):

* the **owner token** controls, stops and watches the stream;
* the **viewer token** watches it (WHEP, stats) and nothing else: it is the one to share.

Admin credentials (``--api-token``, and the WHIP ``--token``, which is the operator's) may do
everything, and only they may list streams (``/api/streams``, ``/api/dashboard``, ``/metrics``:
the ids are what WHEP needs); with neither configured, only a local client may list: a loopback
peer that names this machine in its Host header (a DNS-rebinding page names its own domain) and
came through no proxy. A browser presents the API token once, to ``POST /api/login``, and then
holds it as a signed HttpOnly SameSite cookie (``AdminSessions``) that stands for it on this
origin: the page, the dashboard and the playground, which is gated like stream creation.

WHIP and WHEP session URLs (``/whip/<id>/<session>``, ``/whep/<id>/<viewer>``) are capabilities
of their own: holding one lets its client end (``DELETE``) its session, as RFC 9725 clients do.

Refusals never tell a caller without rights whether a stream exists: no token -> 401 whether the
id exists or not; a wrong token -> the same 404 as an unknown id; only a valid viewer token used for
an owner action gets 403 (its holder already knows the stream exists).

Wrong credentials earn their client address a growing wait (``GuessThrottle``): the admin tokens
wherever the edge checks them, a stream token that grants nothing, the login form, the recordings'
owner check and the WHIP ``--token``. An address that is waiting gets 429 with ``Retry-After`` and
its credential is not even compared (were it, the answer would tell a guesser when it is right),
so a right token from that address waits too; every other address is untouched. The address is
the socket's peer, or behind ``--forwarded-allow-ips`` the client the proxy names.

The middleware also enforces the request-body and upload limits, the allowed origins (WHIP and
WHEP answer any page, so that third-party players work; everything else only the service's own
pages and ``--allowed-origin``), the service-wide API token on stream creation and on the
playground, and the streams-per-client limit (app/server/edge/limits.py has the rest).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote

from starlette.middleware.cors import CORSMiddleware

from app.server.config import ServerConfig
from app.server.edge.logs import SECRETS, mint_secret

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OWNER_HEADER = "X-Diffcast-Owner-Token"
VIEWER_HEADER = "X-Diffcast-Viewer-Token"
# The WHIP 201's stream id: its Location is the publisher's session URL, a capability of its own.
STREAM_ID_HEADER = "X-Diffcast-Stream-Id"
SESSION_COOKIE = "diffcast_session"
SESSION_TTL_S = 12 * 3600
LOGIN_PAGE = "/login"
TOKEN_BYTES = 24  # 192 bits: unguessable by any number of online attempts
POLICY_VIOLATION = 1008  # WebSocket close code
# Wrong credentials per client address: the first FREE_FAILURES - 1 cost nothing (typos), then each
# makes the address wait FIRST_WAIT_S, doubling up to MAX_WAIT_S: after a minute, one guess a
# minute. An address is forgotten FORGET_S after its last failure; at most MAX_ADDRESSES are kept
# (the longest quiet go first), so a flood of addresses cannot fill the memory.
FREE_FAILURES = 5
FIRST_WAIT_S = 1.0
MAX_WAIT_S = 60.0
FORGET_S = 600.0
MAX_ADDRESSES = 10_000
# An ended stream's owner is told why (410) this long after, for at most this many streams at once.
ENDED_KEPT_S = 600.0
ENDED_KEPT = 256


class Access(enum.IntEnum):
    NONE = 0
    VIEWER = 1
    OWNER = 2
    ADMIN = 3


@dataclass(frozen=True)
class Grant:
    owner: str
    viewer: str


# Per-stream routes and the access each needs; the stream id is the first group. WHIP and WHEP
# session URLs (/whip/{id}/{session}, /whep/{id}/{viewer}) are capability URLs handed only to their
# client: the routes themselves answer 404 for any that is not a live session, whatever part is wrong.
STREAM_RULES: tuple[tuple[str, re.Pattern[str], Access], ...] = (
    ("GET", re.compile(r"^/api/streams/([^/]+)$"), Access.VIEWER),
    ("DELETE", re.compile(r"^/api/streams/([^/]+)$"), Access.OWNER),
    ("POST", re.compile(r"^/api/streams/([^/]+)/control$"), Access.OWNER),
    ("GET", re.compile(r"^/api/streams/([^/]+)/cues$"), Access.OWNER),
    ("PUT", re.compile(r"^/api/streams/([^/]+)/cues$"), Access.OWNER),
    ("DELETE", re.compile(r"^/whip/([^/]+)$"), Access.OWNER),
    ("POST", re.compile(r"^/whep/([^/]+)$"), Access.VIEWER),
)
# A stream's recordings: its owner's, also after the stream ended (app/server/control/recordings.py checks).
RECORDINGS = re.compile(r"^/api/streams/[^/]+/recordings(/[^/]+)?$")
# Routes that reveal every stream's id: admin only.
LISTING = {("GET", "/api/streams"), ("GET", "/api/dashboard"), ("GET", "/api/workers"), ("GET", "/metrics")}
# Routes that create a stream: the API token (when set) and the per-client limit apply.
CREATION = {("POST", "/api/offer"), ("POST", "/api/ndi"), ("POST", "/whip"), ("WEBSOCKET", "/ws")}
# The Gradio playground runs engine work and stores uploads: it needs what creating a stream needs.
PLAYGROUND = "/playground"
# Its file uploads: bounded by --max-upload-bytes (announced in Content-Length) instead of the body
# limit, and passed on as they arrive rather than held in memory.
PLAYGROUND_UPLOAD = "/playground/gradio_api/upload"
# Headers a reverse proxy adds: a request that carries one came through a proxy, so its peer
# address is the proxy's, not the client's (uvicorn rewrites it from trusted proxies only).
FORWARDING_HEADERS = ("forwarded", "x-forwarded-for", "x-forwarded-host", "x-real-ip")


def is_signalling(path: str) -> bool:
    """WHIP and WHEP: players on other sites call these, so they answer any origin by default."""
    return path == "/whip" or path.startswith(("/whip/", "/whep/"))


def is_playground(path: str) -> bool:
    return path == PLAYGROUND or path.startswith(PLAYGROUND + "/")


def edge_refusals(method: str, path: str) -> set[int]:
    """The statuses EdgeGuard may answer on ``method`` ``path`` (a route template such as
    /api/streams/{stream_id}) instead of the route: for the OpenAPI document."""
    statuses = {403, 413}  # an origin not in --allowed-origin; a body over its limit (every route has one)
    if (method, path) in LISTING:
        statuses |= {401, 403, 429}  # 429: the address waits after wrong credentials
    elif (method, path) in CREATION:
        statuses |= {401, 429}
    if any(rule == method and pattern.match(path) for rule, pattern, _ in STREAM_RULES):
        statuses |= {401, 403, 404, 410, 429}  # 410: an ended stream, to its owner
    return statuses


def credential(method: str, path: str, config: ServerConfig) -> str | None:
    """Whether ``Authorization: Bearer`` is "required" or "optional" on ``method`` ``path`` under
    ``config``, or not asked for (None): for the OpenAPI document."""
    if config.token is not None and path.startswith(("/whip", "/whep")) and method != "OPTIONS":
        return "required"  # the WHIP/WHEP --token (app/server/media/whip.py)
    if (method, path) in LISTING:
        return "required" if config.api_token or config.token else None  # else loopback only
    if (method, path) in CREATION:
        return "required" if config.api_token else None
    for rule_method, pattern, need in STREAM_RULES:
        if rule_method == method and pattern.match(path):
            return "optional" if need == Access.VIEWER and not config.private_viewing else "required"
    if RECORDINGS.match(path):
        return "required"  # the owner's, checked by the routes (app/server/control/recordings.py)
    return None


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


def presented_token(scope: Scope) -> str | None:
    """The Bearer token of a request: ``Authorization: Bearer <t>``, or ``?access_token=<t>``
    (RFC 6750 §2.3) for clients that cannot set headers (a browser's WebSocket)."""
    scheme, _, given = _headers(scope).get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and given.strip():
        return given.strip()
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("access_token")
    return values[0] if values else None


def client_host(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


def is_loopback(host: str) -> bool:
    """An address or name of this machine: a loopback IP, or localhost and its subdomains (RFC 6761)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost" or host.endswith(".localhost")


def host_name(host_header: str) -> str:
    """The name in a Host header, without its port ("[::1]:8080" -> "::1")."""
    if host_header.startswith("["):
        return host_header[1:].partition("]")[0]
    return host_header.rpartition(":")[0] if host_header.count(":") == 1 else host_header


def is_local(scope: Scope) -> bool:
    """A client on this machine, asking for this machine: a loopback peer, a Host naming this
    machine (a DNS-rebinding page's requests name the attacker's domain) and no proxy in between
    (behind a local proxy every client's peer address is loopback)."""
    headers = _headers(scope)
    if any(name in headers for name in FORWARDING_HEADERS):
        return False
    return is_loopback(client_host(scope)) and is_loopback(host_name(headers.get("host", "")))


def cookie(scope: Scope, name: str) -> str | None:
    for part in _headers(scope).get("cookie", "").split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return None


def address_key(host: str) -> str:
    """The address a client's failures count against: its IPv4 address, or its IPv6 /64 (one
    subscriber's prefix: rotating addresses inside it would escape a per-address count)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{ip}/64", strict=False))
    return str(ip)


class Throttled(Exception):
    """A client address waiting out its backoff presented a credential: 429, not compared."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"too many wrong credentials from this address: try again in {retry_after_s} s")
        self.headers = {"Retry-After": str(retry_after_s)}


@dataclass
class _Failures:
    count: int = 0
    last: float = 0.0
    until: float = 0.0  # the address may present a credential again from then on


class GuessThrottle:
    """Wrong credentials per client address, and the wait they earn (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._failures: OrderedDict[str, _Failures] = OrderedDict()  # the longest quiet first

    def check(self, host: str) -> None:
        """Raises Throttled while ``host`` waits: call it before comparing what it presented."""
        entry = self._failures.get(address_key(host))
        wait = 0.0 if entry is None else entry.until - self._clock()
        if wait > 0:
            raise Throttled(math.ceil(wait))

    def failed(self, host: str, token: str) -> None:
        """``host`` presented ``token`` and it grants nothing here."""
        if token in SECRETS:  # one the server minted (another stream's, an ended one's): not a guess
            return
        now = self._clock()
        while self._failures:
            oldest = next(iter(self._failures.values()))
            if now - oldest.last < FORGET_S and len(self._failures) < MAX_ADDRESSES:
                break
            self._failures.popitem(last=False)
        key = address_key(host)
        entry = self._failures.pop(key, None) or _Failures()
        entry.count += 1
        entry.last = now
        if entry.count >= FREE_FAILURES:
            wait = min(MAX_WAIT_S, FIRST_WAIT_S * 2.0 ** min(entry.count - FREE_FAILURES, 30))
            entry.until = now + wait
            log.warning("%d wrong credentials from %s: it waits %g s before the next is checked",
                        entry.count, key, wait)
        self._failures[key] = entry


class AdminSessions:
    """The API token held by a browser: a signed, expiring cookie value and no server state.

    ``POST /api/login`` takes the token once and sets the cookie (HttpOnly: page scripts never see
    it; SameSite=Strict: other sites' requests do not carry it). The key derives from the API
    token, so rotating the token ends every session."""

    def __init__(self, api_token: str | None, ttl_s: float = SESSION_TTL_S,
                 clock: Callable[[], float] = time.time) -> None:
        self._key = None if api_token is None else hmac.new(
            api_token.encode(), b"diffcast admin session", hashlib.sha256).digest()
        self.ttl_s = ttl_s
        self._clock = clock

    def issue(self) -> str:
        if self._key is None:
            raise RuntimeError("no API token: there is nothing to hold a session for")
        expires = int(self._clock() + self.ttl_s)
        return f"{expires}.{self._sign(expires)}"

    def valid(self, value: str | None) -> bool:
        if self._key is None or value is None:
            return False
        expires, _, signature = value.partition(".")
        if not expires.isdigit():
            return False
        return hmac.compare_digest(signature, self._sign(int(expires))) and int(expires) > self._clock()

    def _sign(self, expires: int) -> str:
        assert self._key is not None
        return hmac.new(self._key, str(expires).encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Ended:
    """A stream that ended, as its owner is told for a while after: 410 and why (its NDI source
    vanished, say) instead of the 404 of an id that never was."""

    owner: str
    reason: str
    at: float


class AccessControl:
    """The capabilities of live streams. A grant dies with its stream (checked through ``is_live``);
    an ended stream's owner token is kept ENDED_KEPT_S (at most ENDED_KEPT of them), so that its
    owner learns why it ended."""

    def __init__(self, config: ServerConfig, is_live: Callable[[str], bool],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._admin_tokens = tuple(t for t in (config.api_token, config.token) if t)
        self._is_live = is_live
        self._grants: dict[str, Grant] = {}
        self._ended: dict[str, Ended] = {}
        self._clock = clock
        self.private_viewing = config.private_viewing

    def ended(self, stream_id: str, reason: str) -> None:
        """Stream ``stream_id`` ended for ``reason`` (SessionManager.on_ended): its owner is told so."""
        grant = self._grants.pop(stream_id, None)
        if grant is None:
            return
        now = self._clock()
        self._ended[stream_id] = Ended(grant.owner, reason, now)
        for old in [s for s, e in self._ended.items() if now - e.at > ENDED_KEPT_S]:
            del self._ended[old]
        while len(self._ended) > ENDED_KEPT:
            del self._ended[next(iter(self._ended))]

    def end_reason(self, token: str | None, stream_id: str) -> str | None:
        """Why stream ``stream_id`` ended, for its owner (or an admin) within ENDED_KEPT_S; else None."""
        ended = self._ended.get(stream_id)
        if ended is None or token is None or self._clock() - ended.at > ENDED_KEPT_S or self._is_live(stream_id):
            return None
        return ended.reason if self.is_admin(token) or hmac.compare_digest(token, ended.owner) else None

    @property
    def has_admin_token(self) -> bool:
        return bool(self._admin_tokens)

    def grant(self, stream_id: str) -> Grant:
        self._prune()
        grant = Grant(mint_secret(TOKEN_BYTES), mint_secret(TOKEN_BYTES))
        self._grants[stream_id] = grant
        return grant

    def _prune(self) -> None:
        for stream_id in [s for s in self._grants if not self._is_live(s)]:
            del self._grants[stream_id]

    @property
    def grants(self) -> int:
        self._prune()
        return len(self._grants)

    def owner_token(self, stream_id: str) -> str | None:
        """The owner token of a live stream (recordings keep its digest for after the stream)."""
        grant = self._grants.get(stream_id)
        return grant.owner if grant is not None and self._is_live(stream_id) else None

    def is_admin(self, token: str | None) -> bool:
        return token is not None and any(hmac.compare_digest(token, t) for t in self._admin_tokens)

    def access(self, token: str | None, stream_id: str) -> Access:
        if self.is_admin(token):
            return Access.ADMIN
        grant = self._grants.get(stream_id)
        if token is None or grant is None or not self._is_live(stream_id):
            return Access.NONE
        if hmac.compare_digest(token, grant.owner):
            return Access.OWNER
        if hmac.compare_digest(token, grant.viewer):
            return Access.VIEWER
        return Access.NONE

    def refusal(self, token: str | None, stream_id: str, need: Access) -> tuple[int, str] | None:
        """None when ``token`` may do what needs ``need`` on the stream; else (status, reason)."""
        reason = self.end_reason(token, stream_id)
        if reason is not None:
            return 410, f"stream {stream_id} has ended: {reason}"
        level = self.access(token, stream_id)
        if level >= need:
            return None
        if need == Access.VIEWER and not self.private_viewing and self._is_live(stream_id):
            return None  # public viewing: the (unguessable, unlisted) id is the viewing capability
        if token is None:
            wanted = "the stream's owner token" if need == Access.OWNER else "the stream's viewer or owner token"
            return 401, f"this needs {wanted} as 'Authorization: Bearer <token>'"
        if level == Access.VIEWER:
            return 403, "a viewer token can only watch this stream; controlling or stopping it needs the owner token"
        return 404, f"no stream {stream_id}"  # the same answer as for an id that does not exist


class ClientSlots:
    """Streams per client address: live streams it created plus creations in flight."""

    def __init__(self, limit: int, is_live: Callable[[str], bool]) -> None:
        self.limit = limit
        self._is_live = is_live
        self._pending: dict[str, int] = {}
        self._owned: dict[str, str] = {}  # stream id -> client host

    def count(self, host: str) -> int:
        for stream_id in [s for s in self._owned if not self._is_live(s)]:
            del self._owned[stream_id]
        return self._pending.get(host, 0) + sum(1 for h in self._owned.values() if h == host)

    def try_reserve(self, host: str) -> bool:
        if self.count(host) >= self.limit:
            return False
        self._pending[host] = self._pending.get(host, 0) + 1
        return True

    def release(self, host: str, stream_id: str | None) -> None:
        """The creation finished: ``stream_id`` is the stream it made, if any."""
        left = self._pending.get(host, 0) - 1
        if left > 0:
            self._pending[host] = left
        else:
            self._pending.pop(host, None)
        if stream_id is not None:
            self._owned[stream_id] = host


async def _send_http(send: Send, status: int, body: bytes, content_type: str, headers: dict[str, str]) -> None:
    raw = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def refuse(scope: Scope, receive: Receive, send: Send, status: int, reason: str,
                 headers: dict[str, str] | None = None) -> None:
    """An error in the style of the route: JSON ``{"detail"}`` under /api, plain text elsewhere;
    on a WebSocket, an error message and a close (1008, or 1013 for a 503/429)."""
    headers = dict(headers or {})
    if status == 401:
        headers.setdefault("WWW-Authenticate", "Bearer")
    if scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.send", "text": json.dumps({"type": "error", "message": reason})})
        code = 1013 if status in (429, 503) else POLICY_VIOLATION
        await send({"type": "websocket.close", "code": code, "reason": reason[:120]})
        return
    if scope["path"].startswith("/api/"):
        await _send_http(send, status, json.dumps({"detail": reason}).encode(), "application/json", headers)
    else:
        await _send_http(send, status, (reason + "\n").encode(), "text/plain; charset=utf-8", headers)


class EdgeGuard:
    """ASGI middleware: origins, body size, listing rights, API token and per-client limit on
    creation, per-stream capabilities; hands the creator its tokens."""

    def __init__(self, app: ASGIApp, config: ServerConfig, access: AccessControl, slots: ClientSlots,
                 sessions: AdminSessions, guesses: GuessThrottle) -> None:
        self.app = app
        self.config = config
        self.access = access
        self.slots = slots
        self.sessions = sessions
        self.guesses = guesses

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._guard(scope, receive, send)
        except Throttled as throttled:
            # Only this guard's own checks raise it here, before anything was sent: the routes'
            # checks are answered inside the app (its handler for Throttled).
            await refuse(scope, receive, send, 429, str(throttled), throttled.headers)

    def _is_admin(self, scope: Scope, token: str | None) -> bool:
        """Whether ``token`` is an admin credential; a wrong one counts against the client's address
        (Throttled while the address waits)."""
        if token is None:
            return False
        host = client_host(scope)
        self.guesses.check(host)
        if self.access.is_admin(token):
            return True
        self.guesses.failed(host, token)
        return False

    def _stream_refusal(self, scope: Scope, token: str | None, stream_id: str, need: Access) -> tuple[int, str] | None:
        """AccessControl.refusal, with a token that grants nothing counted against the client's address."""
        if token is None:
            return self.access.refusal(None, stream_id, need)
        host = client_host(scope)
        self.guesses.check(host)
        refusal = self.access.refusal(token, stream_id, need)
        if refusal is not None and refusal[0] == 404:
            self.guesses.failed(host, token)
        return refusal

    async def _guard(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        method = "WEBSOCKET" if scope["type"] == "websocket" else scope["method"]
        path = scope["path"]
        denied = self._origin_refusal(scope)
        if denied is not None:
            await refuse(scope, receive, send, 403, denied)
            return
        token = presented_token(scope) or self._session_token(scope)
        if is_playground(path):
            await self._playground(scope, receive, send, token)
            return
        if scope["type"] == "http":
            buffered = await self._buffered(scope, receive, send)
            if buffered is None:
                return
            receive = buffered
        if (method, path) in LISTING:
            refusal = self._listing_refusal(scope, token)
            if refusal is not None:
                await refuse(scope, receive, send, *refusal)
                return
        elif (method, path) in CREATION:
            await self._create(scope, receive, send, token)
            return
        for rule_method, pattern, need in STREAM_RULES:
            match = pattern.match(path) if rule_method == method else None
            if match is not None:
                refusal = self._stream_refusal(scope, token, match.group(1), need)
                if refusal is not None:
                    await refuse(scope, receive, send, *refusal)
                    return
                break
        await self.app(scope, receive, send)

    def _foreign_origin(self, scope: Scope) -> str | None:
        """The Origin of a browser request from a page that is neither the service's own nor an
        --allowed-origin; None for those and for non-browser clients (OBS, curl send none)."""
        headers = _headers(scope)
        origin = headers.get("origin")
        if origin is None or origin in self.config.allowed_origins:
            return None
        if origin.split("://", 1)[-1] == headers.get("host", ""):
            return None  # the service's own page
        return origin

    def _origin_refusal(self, scope: Scope) -> str | None:
        origin = self._foreign_origin(scope)
        if origin is None or (not self.config.allowed_origins and is_signalling(scope["path"])):
            return None
        return f"origin {origin} is not allowed: only the service's own pages and --allowed-origin may call this"

    def _session_token(self, scope: Scope) -> str | None:
        """The API token, for a request carrying a valid admin session cookie from this origin's pages."""
        if not self.sessions.valid(cookie(scope, SESSION_COOKIE)) or self._foreign_origin(scope) is not None:
            return None  # a cookie also rides on requests another page makes: only this origin's count
        return self.config.api_token

    async def _playground(self, scope: Scope, receive: Receive, send: Send, token: str | None) -> None:
        """The playground: the API token (when set) as for creating a stream, then the body limits."""
        if self.config.api_token is not None and not self._is_admin(scope, token):
            headers = _headers(scope)
            if scope.get("method") == "GET" and "text/html" in headers.get("accept", ""):
                # A browser opening the playground: the login form, and back here after it.
                location = f"{LOGIN_PAGE}?next={quote(scope['path'], safe='/')}"
                await _send_http(send, 303, b"", "text/plain", {"Location": location})
                return
            await refuse(scope, receive, send, 401, "the playground needs the API token (log in at /login)")
            return
        if scope["type"] == "http" and scope["path"] == PLAYGROUND_UPLOAD:
            length = _headers(scope).get("content-length", "")
            if not length.isdigit():
                await refuse(scope, receive, send, 411, "an upload must say its size in Content-Length")
                return
            if int(length) > self.config.max_upload_bytes:
                await refuse(scope, receive, send, 413, f"an upload of {int(length)} bytes is larger than "
                                                        f"the limit of {self.config.max_upload_bytes} bytes")
                return
        elif scope["type"] == "http":
            buffered = await self._buffered(scope, receive, send)
            if buffered is None:
                return
            receive = buffered
        await self.app(scope, receive, send)

    async def _buffered(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """The request's body read whole and replayed to the app; None when it passed the limit
        (the client then has its 413)."""
        body = await self._read_body(receive)
        if body is None:
            await refuse(scope, receive, send, 413,
                         f"request body is larger than the limit of {self.config.max_body_bytes} bytes")
            return None
        return _replay(body, receive)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None once it passes the limit (the rest is not read)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.config.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    def _listing_refusal(self, scope: Scope, token: str | None) -> tuple[int, str] | None:
        if self.access.has_admin_token:
            if self._is_admin(scope, token):
                return None
            return 401, "listing streams needs an admin token as 'Authorization: Bearer <token>'"
        if is_local(scope):
            return None
        return 403, ("listing streams is only open to local clients (a loopback address and Host, no proxy) "
                     "unless the server has --api-token")

    async def _create(self, scope: Scope, receive: Receive, send: Send, token: str | None) -> None:
        if self.config.api_token is not None and not self._is_admin(scope, token):
            await refuse(scope, receive, send, 401, "creating a stream needs the API token as 'Authorization: Bearer <token>'")
            return
        host = client_host(scope)
        if not self.slots.try_reserve(host):
            await refuse(scope, receive, send, 429,
                         f"client {host} already has {self.slots.limit} streams (--max-streams-per-client)",
                         {"Retry-After": str(self.config.retry_after_s)})
            return
        created: list[str] = []
        try:
            await self.app(scope, receive, self._minting_send(scope, send, created))
        finally:
            self.slots.release(host, created[0] if created else None)

    def _minting_send(self, scope: Scope, send: Send, created: list[str]) -> Send:
        """Wraps ``send`` so the creator's response carries the new stream's tokens."""
        if scope["type"] == "websocket":
            async def ws_send(message: Message) -> None:
                if message["type"] == "websocket.send" and not created and message.get("text"):
                    hello = json.loads(message["text"])
                    if hello.get("type") == "hello":
                        grant = self._mint(hello["stream_id"], created)
                        hello.update(owner_token=grant.owner, viewer_token=grant.viewer)
                        message = {**message, "text": json.dumps(hello)}
                await send(message)

            return ws_send

        held: list[Message] = []

        async def http_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                held.append(message)  # until the body says which stream was created
                return
            if message["type"] == "http.response.body" and held:
                head, message = self._with_tokens(scope["path"], held.pop(), message, created)
                await send(head)
            await send(message)

        return http_send

    def _with_tokens(self, path: str, head: Message, body: Message, created: list[str]) -> tuple[Message, Message]:
        if path in ("/api/offer", "/api/ndi") and head["status"] == 200:
            if body.get("more_body"):
                raise RuntimeError(f"{path} answered with a streamed body")
            reply = json.loads(body["body"])
            grant = self._mint(reply["stream_id"], created)
            reply.update(owner_token=grant.owner, viewer_token=grant.viewer,
                         view_url=f"{reply['view_url']}?token={grant.viewer}")
            data = json.dumps(reply).encode()
            headers = [(k, str(len(data)).encode() if k == b"content-length" else v) for k, v in head["headers"]]
            return {**head, "headers": headers}, {**body, "body": data}
        if path == "/whip" and head["status"] == 201:
            grant = self._mint(dict(head["headers"])[STREAM_ID_HEADER.lower().encode()].decode(), created)
            extra = [(OWNER_HEADER.lower().encode(), grant.owner.encode()),
                     (VIEWER_HEADER.lower().encode(), grant.viewer.encode())]
            return {**head, "headers": [*head["headers"], *extra]}, body
        return head, body

    def _mint(self, stream_id: str, created: list[str]) -> Grant:
        created.append(stream_id)
        return self.access.grant(stream_id)


class RouteCors:
    """CORS by route: WHIP and WHEP for any origin (third-party players; --allowed-origin narrows
    them too), everything else (listing, control, the playground) for --allowed-origin only: by
    default no other site's page may read the API's answers."""

    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        common: dict[str, Any] = {
            "allow_methods": ["GET", "POST", "DELETE", "PATCH", "OPTIONS"],
            "allow_headers": ["*"],
            "expose_headers": ["Location", "Accept-Post", "Retry-After", OWNER_HEADER, VIEWER_HEADER, STREAM_ID_HEADER],
        }
        self._signalling = CORSMiddleware(app, allow_origins=list(config.allowed_origins) or ["*"], **common)
        self._api = CORSMiddleware(app, allow_origins=list(config.allowed_origins), **common)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        signalling = scope["type"] == "http" and is_signalling(scope["path"])
        await (self._signalling if signalling else self._api)(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the already-read body once, then waits for the disconnect."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
