"""No secret in any log line: capability URLs, tokens and stream ids are replaced by a fingerprint.

A stream id (with public viewing), a WHEP viewer id and the owner/viewer tokens are credentials:
whoever reads them in a log could watch or control the stream. uvicorn's access log prints every
path and query string (``/whep/<id>/<viewer>``, ``/view/<id>?token=``, ``?access_token=``), and the
service logs stream ids. Each is replaced by ``[secret:<first 8 hex digits of its SHA-256>]``:
lines about one stream still correlate (an operator who has the id from the admin listing can
compute the same fingerprint), but the log no longer grants anything.

Two mechanisms, because a secret may appear anywhere in a line:

* by shape: the capability paths, the token query parameters and ``Bearer`` credentials;
* by value: every capability is minted through :func:`mint_secret`, which remembers it, and any
  remembered value is replaced wherever it appears (``stream <id> opened`` from the service, an
  id inside an exception message).

The redaction runs where log records are made (a record factory), not as a filter on some
loggers or handlers: a logger's filters do not see records propagated from its children, and
handlers are added by whoever configures logging (uvicorn, the CLI, a test harness).
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import threading
from collections import deque
from typing import Any

# Path segments that are capabilities: the stream id after these prefixes, and a WHEP viewer id.
_CAPABILITY_PATH = re.compile(
    r"(?P<prefix>/(?:whep|whip|view|api/streams)/)(?P<id>[^/\s?#\"'<>]+)"
    r"(?:(?P<sep>/)(?P<viewer>[^/\s?#\"'<>]+))?"
)
_TOKEN_PARAM = re.compile(r"(?P<prefix>[?&](?:access_token|token)=)(?P<id>[^&\s#\"'<>]+)")
_BEARER = re.compile(r"(?P<prefix>\bBearer\s+)(?P<id>[^\s\"',;]+)", re.IGNORECASE)
# secrets.token_urlsafe(16) is 22 characters; shorter runs are never minted here.
_SECRET_SHAPED = re.compile(r"[A-Za-z0-9_-]{22,}")
# The WHEP viewer segment of these paths is a route word, not a viewer id.
_ROUTE_WORDS = {"control"}
# Remembered secrets: enough for thousands of streams (3 each, plus viewers) in bounded memory.
MAX_REMEMBERED = 20000


def fingerprint(secret: str) -> str:
    return f"[secret:{hashlib.sha256(secret.encode('utf-8', 'replace')).hexdigest()[:8]}]"


class SecretRegistry:
    """The most recent ``limit`` minted secrets (older ones belong to long-gone streams)."""

    def __init__(self, limit: int = MAX_REMEMBERED) -> None:
        self._order: deque[str] = deque()
        self._known: set[str] = set()
        self._limit = limit
        self._lock = threading.Lock()  # log records are made on engine and codec threads too

    def add(self, secret: str) -> None:
        with self._lock:
            if secret in self._known:
                return
            self._order.append(secret)
            self._known.add(secret)
            if len(self._order) > self._limit:
                self._known.discard(self._order.popleft())

    def __contains__(self, text: object) -> bool:
        return text in self._known


SECRETS = SecretRegistry()


def mint_secret(nbytes: int) -> str:
    """``secrets.token_urlsafe(nbytes)``, remembered so that logs never show it."""
    secret = secrets.token_urlsafe(nbytes)
    SECRETS.add(secret)
    return secret


def redact(text: str) -> str:
    def path(match: re.Match[str]) -> str:
        viewer = match.group("viewer")
        tail = ""
        if viewer is not None:
            tail = match.group("sep") + (viewer if viewer in _ROUTE_WORDS else fingerprint(viewer))
        return match.group("prefix") + fingerprint(match.group("id")) + tail

    def value(match: re.Match[str]) -> str:
        return match.group("prefix") + fingerprint(match.group("id"))

    def known(match: re.Match[str]) -> str:
        return fingerprint(match.group()) if match.group() in SECRETS else match.group()

    text = _CAPABILITY_PATH.sub(path, text)
    text = _TOKEN_PARAM.sub(value, text)
    text = _BEARER.sub(value, text)
    return _SECRET_SHAPED.sub(known, text)


def _redact_arg(arg: Any) -> Any:
    if isinstance(arg, (int, float)) or arg is None:
        return arg  # keeps %d / %f formatting working; no secret is a number
    text = arg if isinstance(arg, str) else str(arg)
    cleaned = redact(text)
    return arg if cleaned == text else cleaned


class RedactSecrets(logging.Filter):
    """Rewrites a record's message, arguments and traceback text without the secrets; keeps the
    record (uvicorn's access formatter reads the arguments one by one, so they stay a tuple)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = _redact_arg(record.msg)
        if isinstance(record.args, dict):
            record.args = {key: _redact_arg(v) for key, v in record.args.items()}
        elif record.args:
            record.args = tuple(_redact_arg(v) for v in record.args)
        if record.exc_info and not record.exc_text:
            # Formatted now so the traceback's exception messages are redacted too.
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return True


_install_lock = threading.Lock()
_installed = False


def install_log_redaction() -> None:
    """Redact every log record made in this process from now on (idempotent)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        make_record = logging.getLogRecordFactory()
        redactor = RedactSecrets()

        def redacted_record(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = make_record(*args, **kwargs)
            redactor.filter(record)
            return record

        logging.setLogRecordFactory(redacted_record)
        _installed = True
