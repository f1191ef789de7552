"""The OpenAPI document says what the server answers (checked by schemathesis with every check,
tests/test_server_fuzz.py).

Routes declare their own answers (``responses=`` built here); :func:`document` adds the refusals
and credentials of the HTTP edge (app/server/edge/security.py: origins, body size, tokens, per-client
limit) to every operation they apply to, from the same tables the edge enforces, and the 422 every
operation with parameters can give. :func:`allow_documented_methods` makes each 405's ``Allow``
header list the methods the document gives the path, so the two cannot disagree.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.server.config import ServerConfig
from app.server.edge.security import credential, edge_refusals

SDP = "application/sdp"
# The JSON errors of /api routes and the validation handler, and the plain-text ones elsewhere
# (WHIP/WHEP, as RFC 9725 clients expect text).
ERROR_JSON: dict[str, Any] = {
    "type": "object", "properties": {"detail": {"type": "string"}}, "required": ["detail"],
}
TEXT: dict[str, Any] = {"type": "string"}
REASONS = {
    400: "The request cannot be used (the reason says why: e.g. a malformed SDP offer)",
    401: "A credential is needed (`Authorization: Bearer <token>`)",
    403: "Not allowed: an origin not in --allowed-origin, or a viewer token used for an owner action",
    404: "No such stream or session (also the answer to a token that does not grant it)",
    405: "The method is not supported here (`Allow` lists those that are)",
    410: "The stream has ended: its owner is told why for 10 minutes after (e.g. its NDI source vanished)",
    413: "The request body is over --max-body-bytes",
    415: "The body must be `application/sdp`",
    422: "The request's parameters, stream options or JSON body are not valid (the reason names each)",
    429: "The client already has --max-streams-per-client streams, or its address waits after wrong "
         "credentials (`Retry-After`)",
    503: "The server is full (--max-streams, --max-viewers or the serving policy's admission; `Retry-After`)",
}
# What the SDP check refuses first as "empty SDP offer": text with no character but blanks.
SDP_NOT_BLANK = r"\S"
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before trying again", "schema": {"type": "integer"}}}


def errors(path: str, *statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for ``statuses`` in the style the route answers errors in: JSON
    ``{"detail"}`` under /api, plain text elsewhere (app/server/edge/security.py ``refuse``)."""
    media = {"application/json": {"schema": ERROR_JSON}} if path.startswith("/api/") else {"text/plain": {"schema": TEXT}}
    entries: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        entry: dict[str, Any] = {"description": REASONS[status], "content": media}
        if status in (429, 503):
            entry["headers"] = RETRY_AFTER
        entries[status] = entry
    return entries


def sdp_body(description: str) -> dict[str, Any]:
    """``openapi_extra=`` for a route whose request body is an SDP offer."""
    return {"requestBody": {"required": True, "description": description,
                            "content": {SDP: {"schema": {"type": "string", "minLength": 1,
                                                         "pattern": SDP_NOT_BLANK}}}}}


def _headers(headers: dict[str, str]) -> dict[str, Any]:
    return {name: {"description": text, "schema": {"type": "string"}} for name, text in headers.items()}


def sdp_answer(description: str, headers: dict[str, str]) -> dict[str, Any]:
    """The 201 of WHIP/WHEP: the SDP answer, with the session's URL and any other headers."""
    return {"description": description, "content": {SDP: {"schema": TEXT}}, "headers": _headers(headers)}


def options_answer(allow: str, extra: dict[str, str] | None = None) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of an OPTIONS route: 204 with ``Allow`` (and any ``extra`` headers)."""
    headers = {"Allow": f"The methods of this resource: {allow}", **(extra or {})}
    return {204: {"description": "The methods this resource supports", "headers": _headers(headers)}}


def document(app: FastAPI, config: ServerConfig) -> None:
    """Finish ``app``'s OpenAPI document as it is generated: the edge's refusals and credentials
    (app/server/edge/security.py, from the tables the edge enforces, for this ``config``) on every
    operation, and the 422 of operations with parameters in our handler's JSON."""
    generate = app.openapi
    finished: list[dict[str, Any]] = []

    def openapi() -> dict[str, Any]:
        schema = generate()  # FastAPI's, cached until the routes change
        if not finished or finished[-1] is not schema:
            _finish(schema, config)
            finished[:] = [schema]
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise it


def _finish(schema: dict[str, Any], config: ServerConfig) -> None:
    secured = False
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            # FastAPI's default 422 (its own error shape) is replaced; a route's own 422 is kept.
            own_422 = "422" in responses and "HTTPValidationError" not in str(responses["422"])
            statuses = edge_refusals(method.upper(), path)
            if operation.get("parameters") or "requestBody" in operation:
                statuses.add(422)
            for status, entry in errors(path, *sorted(statuses)).items():
                if status == 422:
                    if own_422:
                        continue
                    entry["content"] = {"application/json": {"schema": ERROR_JSON}}
                    responses["422"] = entry
                else:
                    responses.setdefault(str(status), entry)
            need = credential(method.upper(), path, config)
            if need is not None:
                operation["security"] = [{"bearer": []}] + ([{}] if need == "optional" else [])
                secured = True
    components = schema.setdefault("components", {})
    if secured:
        components.setdefault("securitySchemes", {})["bearer"] = {
            "type": "http", "scheme": "bearer",
            "description": "An admin token (--api-token, --token) or a stream's owner or viewer token",
        }
    for unused in ("HTTPValidationError", "ValidationError"):
        components.get("schemas", {}).pop(unused, None)


def _documented_methods(app: FastAPI, path: str) -> list[str]:
    for template, operations in app.openapi().get("paths", {}).items():
        pattern = re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template))
        if re.fullmatch(pattern, path):
            return sorted(method.upper() for method in operations)
    return []


def allow_documented_methods(app: FastAPI) -> Callable[[Request, Exception], Any]:
    """A handler for HTTP errors whose 405s carry ``Allow``: the methods the document gives the
    path (Starlette's lists only the first route matching the path, e.g. GET but not DELETE)."""
    from fastapi.exception_handlers import http_exception_handler

    async def handler(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code != 405:
            return await http_exception_handler(request, exc)
        reason = f"{request.method} is not supported here"
        headers = {"Allow": ", ".join(_documented_methods(app, request.url.path))}
        if request.url.path.startswith("/api/"):
            return JSONResponse({"detail": reason}, status_code=405, headers=headers)
        return PlainTextResponse(reason + "\n", status_code=405, headers=headers)

    return handler
