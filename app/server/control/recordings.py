"""Server-side recordings: where they live, the disk quota, and the owner's API to list, download
and delete them.

Layout: ``<--record-dir>/<stream id>/<recording id>.mp4`` and ``.json`` (the prompt timeline and
facts), ``.mp4.part`` and ``.json.part`` while recording, and ``owner`` (SHA-256 of the stream's owner token, so
that the owner keeps access after the stream has ended and its capabilities are gone). Stream and
recording ids are 128-bit random strings; names are matched against that shape before any path is
built, so no request names a file outside the directory.

Retention: recordings are kept until their owner (or an admin) deletes them. ``--record-max-gb``
bounds the whole directory: a recording running when it fills up is finished there (the file is
valid, its JSON says ``"ended": "storage full"``), and new recordings are refused with "recording
storage is full" until recordings are deleted. Nothing is deleted behind the owner's back.

A server killed while recording leaves ``.part`` files: the next one to open the directory
finishes them (app/server/control/recorder.py ``finish_leftovers``) before it serves, so they are listed,
downloadable and deletable by their owner (the ``owner`` file was written when the recording
started) and counted once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse, JSONResponse

from app.server.control.messages import ControlError
from app.server.control.recorder import finish_leftovers
from app.server.edge.logs import mint_secret
from app.server.edge.openapi import ERROR_JSON, errors
from app.server.edge.security import Access, AccessControl, GuessThrottle, client_host, presented_token

STREAM_ID = re.compile(r"[A-Za-z0-9_-]{8,64}")
FILE_NAME = re.compile(r"([A-Za-z0-9_-]{22})\.(mp4|json)")
OWNER_FILE = "owner"
NOT_ENABLED = "recording is not enabled on this server (start it with --record-dir)"
GB = 1024**3

log = logging.getLogger(__name__)


class RecordingError(ControlError):
    """A recording cannot start (not enabled, or the storage is full); the text goes to the client."""


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class RecordingStore:
    """The recordings directory: quota, owners, listing and deletion."""

    def __init__(self, root: Path, max_bytes: int, owner_of: Callable[[str], str | None]) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._owner_of = owner_of
        self.running: dict[str, set[str]] = {}  # stream id -> names of its recordings in progress
        root.mkdir(parents=True, exist_ok=True)
        finished = sum(len(finish_leftovers(d)) for d in root.iterdir() if d.is_dir() and STREAM_ID.fullmatch(d.name))
        if finished:
            log.warning("finished %d recording(s) that a stopped server left running", finished)

    def used_bytes(self) -> int:
        total = 0
        for stream_dir in self.root.iterdir():
            if stream_dir.is_dir():
                total += sum(entry.stat().st_size for entry in os.scandir(stream_dir) if entry.is_file())
        return total

    def fits(self) -> bool:
        return self.used_bytes() < self.max_bytes

    def check_room(self) -> None:
        """RecordingError when the directory has reached its quota."""
        used = self.used_bytes()
        if used >= self.max_bytes:
            raise RecordingError(
                f"recording storage is full ({used / GB:.2f} GB of the server's {self.max_bytes / GB:g} GB): "
                "delete recordings (DELETE /api/streams/{id}/recordings/{name}) to make room"
            )

    def new_recording(self, stream_id: str) -> tuple[Path, str]:
        """A directory and a fresh name for a recording of ``stream_id``; RecordingError when full."""
        self.check_room()
        directory = self.root / stream_id
        directory.mkdir(exist_ok=True)
        owner = self._owner_of(stream_id)
        owner_file = directory / OWNER_FILE
        if owner is not None and not owner_file.exists():
            owner_file.write_text(_digest(owner))
        name = mint_secret(16)
        self.running.setdefault(stream_id, set()).add(name)
        return directory, name

    def finished(self, stream_id: str, name: str) -> None:
        names = self.running.get(stream_id, set())
        names.discard(name)
        if not names:
            self.running.pop(stream_id, None)

    def is_owner(self, token: str, stream_id: str) -> bool:
        """The owner token of ``stream_id`` as written when it first recorded (the stream may be gone)."""
        try:
            stored = (self.root / stream_id / OWNER_FILE).read_text().strip()
        except OSError:
            return False
        return hmac.compare_digest(stored, _digest(token))

    def listing(self, stream_id: str) -> list[dict[str, Any]]:
        directory = self.root / stream_id
        if not directory.is_dir():
            return []
        items = []
        for name in sorted(self.running.get(stream_id, set())):
            items.append({"name": f"{name}.mp4", "recording": True, "bytes": _size(directory / f"{name}.mp4.part")})
        for sidecar in directory.glob("*.json"):
            try:
                facts = json.loads(sidecar.read_text())
            except (OSError, ValueError):
                continue
            video = sidecar.with_suffix(".mp4")
            items.append({
                "name": video.name, "recording": False, "bytes": _size(video), "prompts": sidecar.name,
                **{k: facts.get(k) for k in ("started_at", "duration_s", "frames", "audio", "ended")},
            })
        return sorted(items, key=lambda item: (not item["recording"], str(item.get("started_at", ""))))

    def file(self, stream_id: str, name: str) -> Path | None:
        match = FILE_NAME.fullmatch(name)
        if match is None:
            return None
        path = self.root / stream_id / name
        return path if path.is_file() else None

    def is_running(self, stream_id: str, name: str) -> bool:
        match = FILE_NAME.fullmatch(name)
        return match is not None and match.group(1) in self.running.get(stream_id, set())

    def delete(self, stream_id: str, name: str) -> bool:
        """Remove a finished recording (its MP4 and JSON, named by either)."""
        match = FILE_NAME.fullmatch(name)
        if match is None:
            return False
        directory = self.root / stream_id
        removed = False
        for suffix in (".mp4", ".json"):
            path = directory / f"{match.group(1)}{suffix}"
            if path.is_file():
                path.unlink()
                removed = True
        return removed


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _error(status: int, reason: str) -> JSONResponse:
    return JSONResponse({"detail": reason}, status_code=status)


LISTING_SCHEMA: dict[str, Any] = {"type": "array", "items": {"type": "object", "required": ["name", "recording", "bytes"]}}
FILE_CONTENT: dict[str, Any] = {"video/mp4": {"schema": {"type": "string", "format": "binary"}},
                                "application/json": {"schema": {"type": "object"}}}
BUSY: dict[int | str, dict[str, Any]] = {409: {"description": "The recording is still running: stop it first (control message "
                             "`{\"type\": \"update\", \"record\": false}`)",
              "content": {"application/json": {"schema": ERROR_JSON}}}}


def recordings_router(store: RecordingStore | None, access: AccessControl, guesses: GuessThrottle) -> APIRouter:
    """GET /api/streams/{id}/recordings, GET and DELETE /api/streams/{id}/recordings/{name}: the
    stream's owner token (or an admin token) as ``Authorization: Bearer`` or ``?access_token=``."""
    router = APIRouter()

    def owned(request: Request, stream_id: str) -> RecordingStore | JSONResponse:
        """The store when the request holds the stream's owner (or an admin) token; else the refusal
        (Throttled, a 429, while the client's address waits after wrong credentials)."""
        token = presented_token(request.scope)
        if token is None:
            return _error(401, "this needs the stream's owner token as 'Authorization: Bearer <token>'")
        if store is None:
            return _error(404, NOT_ENABLED)
        host = client_host(request.scope)
        guesses.check(host)
        allowed = STREAM_ID.fullmatch(stream_id) is not None and (
            access.access(token, stream_id) >= Access.OWNER or store.is_owner(token, stream_id))
        if not allowed:  # the same answer for an unknown stream and a token that is not its owner's
            guesses.failed(host, token)
            return _error(404, f"no recordings of stream {stream_id}")
        return store

    @router.get("/api/streams/{stream_id}/recordings",
                responses={200: {"description": "The stream's recordings, running ones first",
                                 "content": {"application/json": {"schema": LISTING_SCHEMA}}},
                           **errors("/api/streams/{stream_id}/recordings", 401, 404, 429)})
    async def list_recordings(stream_id: str, request: Request) -> Response:
        found = owned(request, stream_id)
        if isinstance(found, JSONResponse):
            return found
        return JSONResponse(found.listing(stream_id))

    @router.get("/api/streams/{stream_id}/recordings/{name}",
                responses={200: {"description": "The MP4, or its JSON (prompt timeline)", "content": FILE_CONTENT},
                           **errors("/api/streams/{stream_id}/recordings/{name}", 401, 404, 429), **BUSY})
    async def get_recording(stream_id: str, name: str, request: Request) -> Response:
        found = owned(request, stream_id)
        if isinstance(found, JSONResponse):
            return found
        if found.is_running(stream_id, name):
            return _error(409, "this recording is still running: stop it first")
        path = found.file(stream_id, name)
        if path is None:
            return _error(404, f"no recording {name}")
        media = "video/mp4" if path.suffix == ".mp4" else "application/json"
        return FileResponse(path, media_type=media, filename=name)

    @router.delete("/api/streams/{stream_id}/recordings/{name}", status_code=204,
                   responses={204: {"description": "Deleted (the MP4 and its JSON)"},
                              **errors("/api/streams/{stream_id}/recordings/{name}", 401, 404, 429), **BUSY})
    async def delete_recording(stream_id: str, name: str, request: Request) -> Response:
        found = owned(request, stream_id)
        if isinstance(found, JSONResponse):
            return found
        if found.is_running(stream_id, name):
            return _error(409, "this recording is still running: stop it first")
        if not found.delete(stream_id, name):
            return _error(404, f"no recording {name}")
        return Response(status_code=204)

    return router
