"""WHIP ingest (RFC 9725) and WHEP playback over the gateway.

Each WHIP publisher and WHEP viewer gets a session URL of its own (``Location``:
``/whip/<stream id>/<session>``, ``/whep/<stream id>/<viewer>``, 128 random bits in the last part)
and holding it is what ends the session: ``DELETE`` on it needs no other credential, as RFC 9725
clients expect (OBS sends its Bearer token only where the server has one). The stream id alone is
public to every viewer, so ``DELETE /whip/<stream id>`` still needs the stream's owner token.
Any session URL that is not a live session of its kind answers the same 404.

No trickle ICE: answers carry every candidate, so PATCH on a session gets 405 with an Allow
header, as RFC 9725 §4.3.1 asks of servers without trickle ICE or ICE restart support.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse

from app.server.config import ServerConfig
from app.server.control.messages import options_from_query
from app.server.edge.openapi import errors, options_answer, sdp_answer, sdp_body
from app.server.edge.refusals import REFUSED, refusal_for
from app.server.edge.security import OWNER_HEADER, STREAM_ID_HEADER, VIEWER_HEADER, GuessThrottle, client_host
from app.server.media.gateway import Gateway
from app.server.serving.session import SessionManager

SDP = "application/sdp"
SESSION_METHODS = "DELETE, OPTIONS"


def _error(status: int, reason: str, headers: dict[str, str] | None = None) -> PlainTextResponse:
    return PlainTextResponse(reason + "\n", status_code=status, headers=headers)


def _sdp_response(answer: str, location: str, stream_id: str) -> Response:
    return Response(answer, status_code=201, media_type=SDP,
                    headers={"Location": location, STREAM_ID_HEADER: stream_id})


NO_WHIP_SESSION = "no WHIP session at this URL"
NO_WHEP_SESSION = "no WHEP session at this URL"


def bearer_ok(request: Request, token: str | None, guesses: GuessThrottle) -> bool:
    """True when no token is configured or the request carries ``Authorization: Bearer <token>``;
    a wrong one counts against the client's address (Throttled, a 429, while it waits)."""
    if token is None:
        return True
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return False
    host = client_host(request.scope)
    guesses.check(host)
    if hmac.compare_digest(given.strip(), token):
        return True
    guesses.failed(host, given.strip())
    return False


class _Refusal(Exception):
    def __init__(self, response: Response) -> None:
        self.response = response


def whip_router(manager: SessionManager, gateway: Gateway, config: ServerConfig, guesses: GuessThrottle) -> APIRouter:
    router = APIRouter()

    def check_auth(request: Request) -> None:
        if not bearer_ok(request, config.token, guesses):
            raise _Refusal(
                _error(401, "a valid 'Authorization: Bearer <token>' header is required", {"WWW-Authenticate": "Bearer"})
            )

    async def read_offer(request: Request) -> str:
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != SDP:
            raise _Refusal(_error(415, f"Content-Type must be {SDP}, got {content_type or 'none'}", {"Accept-Post": SDP}))
        return (await request.body()).decode("utf-8", "replace")

    async def guarded(request: Request, handler: Callable[[], Awaitable[Response]], session_url: bool = False) -> Response:
        try:
            if not session_url:  # a session URL is its own credential
                check_auth(request)
            return await handler()
        except _Refusal as refusal:
            return refusal.response
        except REFUSED as exc:
            answer = refusal_for(exc, config.retry_after_s)
            return _error(answer.status, answer.reason, answer.headers)

    endpoint_methods = options_answer("POST, OPTIONS", {"Accept-Post": f"The body type of POST: {SDP}"})

    def endpoint_options() -> Response:
        return Response(status_code=204, headers={"Accept-Post": SDP, "Allow": "POST, OPTIONS"})

    @router.options("/whip", status_code=204, responses=endpoint_methods)
    async def whip_options() -> Response:
        return endpoint_options()

    @router.options("/whep/{stream_id}", status_code=204, responses=endpoint_methods)
    async def whep_options(stream_id: str) -> Response:
        return endpoint_options()

    @router.post("/whip", status_code=201, openapi_extra=sdp_body("The publisher's SDP offer (RFC 9725)"),
                 responses={201: sdp_answer("The SDP answer; Location is the session's URL", {
                     "Location": "/whip/<stream id>: DELETE it to stop", OWNER_HEADER: "The stream's owner token",
                     VIEWER_HEADER: "The stream's viewer token"}), **errors("/whip", 400, 401, 415, 422, 503)})
    async def whip_publish(request: Request) -> Response:
        async def handle() -> Response:
            options = options_from_query(request.query_params)
            settings = options.to_settings(config.default_prompt, config.max_prompt_chars, *config.stream_defaults())
            manager.check_capacity()  # before reading a large body or touching the engine
            offer = await read_offer(request)
            session, answer = await gateway.publish(offer, settings, kind="whip", send_output=False)
            session.label = options.label or session.label
            return _sdp_response(answer, f"/whip/{session.id}/{session.publisher_session}", session.id)

        return await guarded(request, handle)

    def has_session(stream_id: str, session_id: str, publisher: bool) -> bool:
        session = manager.get(stream_id)
        return session is not None and session.peer(session_id, publisher) is not None

    @router.delete("/whip/{stream_id}", responses=errors("/whip/{stream_id}", 401, 404))
    async def whip_stop(stream_id: str, request: Request) -> Response:
        async def handle() -> Response:  # the owner token (checked at the edge): the id is public
            if not await manager.close(stream_id, "stopped by its owner"):
                return _error(404, f"no WHIP session {stream_id}")
            return Response(status_code=200)

        return await guarded(request, handle)

    @router.delete("/whip/{stream_id}/{session_id}", responses=errors("/whip/{stream_id}/{session_id}", 404))
    async def whip_session_stop(stream_id: str, session_id: str, request: Request) -> Response:
        async def handle() -> Response:  # holding the session URL is the credential (RFC 9725 §4.2)
            if not has_session(stream_id, session_id, publisher=True):
                return _error(404, NO_WHIP_SESSION)
            await manager.close(stream_id, "its publisher ended the WHIP session")
            return Response(status_code=200)

        return await guarded(request, handle, session_url=True)

    # PATCH is not supported (RFC 9725 §4.3.1): the same 405 for every session URL, existing or
    # not, with or without credentials (so it reveals nothing), and not in the OpenAPI document.
    @router.patch("/whip/{stream_id}", include_in_schema=False)
    @router.patch("/whip/{stream_id}/{session_id}", include_in_schema=False)
    @router.patch("/whep/{stream_id}/{viewer_id}", include_in_schema=False)
    async def no_trickle() -> Response:
        return _error(405, "trickle ICE and ICE restarts are not supported", {"Allow": SESSION_METHODS})

    @router.options("/whip/{stream_id}", status_code=204, responses=options_answer(SESSION_METHODS))
    async def whip_stream_options(stream_id: str) -> Response:
        return Response(status_code=204, headers={"Allow": SESSION_METHODS})

    @router.options("/whip/{stream_id}/{session_id}", status_code=204, responses=options_answer(SESSION_METHODS))
    async def whip_session_options(stream_id: str, session_id: str) -> Response:
        return Response(status_code=204, headers={"Allow": SESSION_METHODS})

    @router.options("/whep/{stream_id}/{viewer_id}", status_code=204, responses=options_answer(SESSION_METHODS))
    async def whep_session_options(stream_id: str, viewer_id: str) -> Response:
        return Response(status_code=204, headers={"Allow": SESSION_METHODS})

    @router.post("/whep/{stream_id}", status_code=201, openapi_extra=sdp_body("The viewer's SDP offer (WHEP)"),
                 responses={201: sdp_answer("The SDP answer", {"Location": "/whep/<stream id>/<viewer id>: "
                                                                           "DELETE it to leave"}),
                            **errors("/whep/{stream_id}", 400, 401, 404, 415, 503)})
    async def whep_play(stream_id: str, request: Request) -> Response:
        async def handle() -> Response:
            session = manager.get(stream_id)
            if session is None:
                return _error(404, f"no stream {stream_id}")
            offer = await read_offer(request)
            viewer_id, answer = await gateway.add_viewer(session, offer)
            return _sdp_response(answer, f"/whep/{stream_id}/{viewer_id}", stream_id)

        return await guarded(request, handle)

    @router.delete("/whep/{stream_id}/{viewer_id}", responses=errors("/whep/{stream_id}/{viewer_id}", 401, 404))
    async def whep_stop(stream_id: str, viewer_id: str, request: Request) -> Response:
        async def handle() -> Response:
            session = manager.get(stream_id)
            if session is None or not await gateway.remove_viewer(session, viewer_id):
                return _error(404, NO_WHEP_SESSION)
            return Response(status_code=200)

        return await guarded(request, handle, session_url=True)

    return router
