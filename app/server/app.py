"""The FastAPI application: page, offer/answer API, WHIP/WHEP, WebSocket fallback, health, metrics."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs, quote

from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import generate_latest
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Router
from starlette.types import Receive, Scope, Send

from app.dashboard import dashboard_router
from app.server.config import ServerConfig
from app.server.control.messages import (
    MAX_CUES,
    ControlError,
    CueSet,
    StreamOptions,
    describe_errors,
    options_from_query,
    parse_cue_set,
)
from app.server.control.recordings import GB, RecordingStore, recordings_router
from app.server.edge.metrics import CONTENT_TYPE, build_registry
from app.server.edge.openapi import SDP_NOT_BLANK, allow_documented_methods, document, errors
from app.server.edge.refusals import REFUSED, refusal_for
from app.server.edge.security import (
    LOGIN_PAGE,
    SESSION_COOKIE,
    AccessControl,
    AdminSessions,
    ClientSlots,
    EdgeGuard,
    GuessThrottle,
    RouteCors,
    Throttled,
    client_host,
)
from app.server.edge.workers import workers_router
from app.server.media.gateway import Gateway
from app.server.media.ice import allow_loopback_candidates, browser_ice_servers
from app.server.media.ndi import SourceNames, allowed
from app.server.media.whip import whip_router
from app.server.media.ws import serve_websocket
from app.server.serving.engine_bridge import InProcessFactory, ProcessorFactory
from app.server.serving.serving_loop import build_serving_loop
from app.server.serving.session import SessionManager
from engine.capabilities import ModelCapabilities

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
WEB_DIR = ROOT / "web"
STATIC_DIR = ROOT / "static"
TRACE_ROWS = 300


class OfferRequest(StreamOptions):
    # The schema says what the SDP check refuses first, "empty SDP offer" (a 400 with that reason):
    # an offer with no character but blanks. The rest of the SDP grammar is the check's (400s too).
    sdp: str = Field(json_schema_extra={"minLength": 1, "pattern": SDP_NOT_BLANK})
    type: Literal["offer"]


class NdiRequest(StreamOptions):
    # An NDI source's full name, as NDI tools list it: "MACHINE (SOURCE)".
    source: str = Field(min_length=1, max_length=256)


class NdiReply(BaseModel):
    stream_id: str
    whep_url: str
    view_url: str
    owner_token: str  # added by the edge (app/server/edge/security.py), as for /api/offer
    viewer_token: str


# How long POST /api/ndi looks for the source before answering that it is not on the network.
NDI_FIND_S = 3.0


class LookShare(BaseModel):
    look: str  # a look the model ships, by name as users type it
    share: float  # its share of the blend the prompt is served as


class OfferReply(BaseModel):
    sdp: str
    type: Literal["answer"]
    stream_id: str
    whep_url: str
    view_url: str
    notice: str | None = None  # the prompt is far from every look the model ships (names the nearest)
    looks: list[LookShare] = []  # the looks the prompt is served as (a model with looks)
    owner_token: str  # added by the edge (app/server/edge/security.py), like the viewer token
    viewer_token: str


class ControlReply(BaseModel):
    type: Literal["ack", "error"]
    applied: str | None = None
    message: str | None = None
    notice: str | None = None  # an update's prompt is far from every look the model ships
    looks: list[LookShare] | None = None  # the looks an update's prompt is served as (a model with looks)


# The body of POST /api/streams/{id}/control: a control message (docs/api.md), read as text so that
# size, rate and parse errors all get the same {"type": "error"} reply as on the data channel.
CONTROL_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["type"],
    "properties": {"type": {"type": "string", "enum": ["update", "pause", "resume", "reset", "cue"]}},
}}}}}


# The body of PUT /api/streams/{id}/cues: a cue set (docs/cues.md), read as text so that a NaN gets the
# same clear refusal as in a control message.
CUES_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["cues"],
    "properties": {"cues": {"type": "array", "maxItems": MAX_CUES, "items": {"type": "object"}}},
}}}}}


def _json_error(status: int, reason: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": reason}, status_code=status, headers=headers)


def served_capabilities(config: ServerConfig, factory: ProcessorFactory) -> ModelCapabilities:
    """The capabilities of the model the factory serves (or, for factories that hold no pipeline
    here, those ``config.model``'s config declares)."""
    from engine.pipeline import model_capabilities

    pipe = factory.pipeline
    return pipe.capabilities if pipe is not None else model_capabilities(config.model)


def with_model_defaults(config: ServerConfig, caps: ModelCapabilities) -> ServerConfig:
    """Fill unset stream defaults (and, for a model trained on a few looks, the presets) from the
    served model's capabilities."""
    changes: dict[str, Any] = {}
    if config.default_noise_scale is None:
        changes["default_noise_scale"] = caps.noise_scale
    if config.default_steps is None:
        changes["default_steps"] = caps.steps
    if caps.looks and config.presets == ServerConfig.presets:
        changes["presets"] = caps.looks
        if config.default_prompt == ServerConfig.default_prompt and config.default_prompt not in caps.looks:
            changes["default_prompt"] = caps.looks[0]
    return replace(config, **changes) if changes else config


def relative_slash_redirects(router: Router) -> None:
    """A path no route matches, but which one does with or without its trailing slash, gets a 307 to
    that path, as Starlette's ``redirect_slashes`` answers, but with a relative ``Location``:
    Starlette's is built from the Host header (``http://<any Host>/path``) before any credential
    is checked. Never to ``//host`` (a protocol-relative URL: an open redirect)."""
    router.redirect_slashes = False
    not_found = router.not_found

    def routed(scope: Scope, path: str) -> bool:
        if not path.startswith("/") or path.startswith(("//", "/\\")):
            return False
        return any(route.matches({**scope, "path": path})[0] != Match.NONE for route in router.routes)

    async def default(scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        other = path.rstrip("/") if path.endswith("/") else path + "/"
        if scope["type"] == "http" and routed(scope, other):
            query = scope.get("query_string", b"").decode("latin-1")
            await RedirectResponse(other + (f"?{query}" if query else ""), status_code=307)(scope, receive, send)
            return
        await not_found(scope, receive, send)

    router.default = default


def started_default_executor(loop: asyncio.AbstractEventLoop) -> ThreadPoolExecutor:
    """The event loop's default executor, with all its threads started now.

    aiortc encodes and decodes frames there (``run_in_executor(None, ...)``). asyncio's own default
    pool starts a thread only when every running one is busy and keeps it, so its size followed
    the peak load seen, which looked like a thread leak to leak checks; a pool started whole keeps
    one thread count for the server's life."""
    workers = min(32, (os.cpu_count() or 1) + 4)  # asyncio's own default size
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="codec")
    barrier = threading.Barrier(workers)
    for _ in range(workers):  # each task holds its thread until all have one: every thread starts
        pool.submit(barrier.wait)
    loop.set_default_executor(pool)
    return pool


def create_app(config: ServerConfig, factory: ProcessorFactory | None = None) -> FastAPI:
    """Build the app. ``factory`` defaults to the real engine pipeline loaded from ``config.model``."""
    if config.allow_loopback_candidates:
        allow_loopback_candidates()
    osc_socket = None
    if config.osc_port is not None:  # before the model loads: a port in use is said at once
        from app.server.control.osc import bind

        osc_socket = bind(config)
    if factory is None:
        factory = InProcessFactory.load(config.model, config.device, config.loras, config.lanes, config.dtype,
                                        config.vae)
    caps = served_capabilities(config, factory)
    caps.require("v2v")  # live streams restyle a camera: a model without video-to-video cannot serve them
    config = with_model_defaults(config, caps)
    manager = SessionManager(factory, config)
    manager.serving = build_serving_loop(config, factory, manager.engine_threads)
    if config.ndi_out:
        manager.ndi_names = SourceNames()
    gateway = Gateway(manager, config)
    registry = build_registry(manager)

    def _refused(exc: Exception) -> JSONResponse:
        answer = refusal_for(exc, config.retry_after_s)
        return _json_error(answer.status, answer.reason, answer.headers)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        codec_pool = started_default_executor(asyncio.get_running_loop())
        osc = None
        if osc_socket is not None:
            from app.server.control.osc import OscServer

            osc = await OscServer.start(config, osc_socket, manager, access)
        if config.ndi_in is not None:
            await open_ndi_in(config.ndi_in)
        yield
        if osc is not None:
            await osc.close()
        await manager.close_all()
        codec_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="diffcast", lifespan=lifespan)
    relative_slash_redirects(app.router)
    app.state.manager = manager
    app.state.config = config
    # Capabilities, listing rights, body size, origins, API token, streams per client
    # (app/server/edge/security.py). Added before CORS, so CORS wraps it: refusals get CORS headers too.
    access = AccessControl(config, is_live=lambda stream_id: stream_id in manager.sessions)
    app.state.access = access
    manager.on_ended = access.ended
    sessions = AdminSessions(config.api_token)
    guesses = GuessThrottle()  # wrong credentials per client address, wherever one is checked
    app.add_middleware(
        EdgeGuard, config=config, access=access,
        slots=ClientSlots(config.max_streams_per_client, is_live=lambda stream_id: stream_id in manager.sessions),
        sessions=sessions, guesses=guesses,
    )
    # Browser WHIP/WHEP clients on other origins need CORS, and must be able to read Location; the
    # rest of the API answers other origins only when --allowed-origin lists them.
    app.add_middleware(RouteCors, config=config)
    app.include_router(whip_router(manager, gateway, config, guesses))
    if config.record_dir is not None:
        manager.recordings = RecordingStore(Path(config.record_dir), int(config.record_max_gb * GB), access.owner_token)
    app.include_router(recordings_router(manager.recordings, access, guesses))
    # Operator dashboard at /dashboard and the JSON it polls (app/dashboard.py).
    app.include_router(dashboard_router(manager, config))
    app.include_router(workers_router(manager))

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default echoes each bad input, and a NaN or Infinity in the body (which
        # Python's JSON parser accepts) then makes the 422 itself fail to encode: a 500.
        return _json_error(422, f"bad request: {describe_errors(exc.errors())}")

    @app.exception_handler(Throttled)
    async def throttled(request: Request, exc: Throttled) -> Response:
        # A route's own credential check (login, recordings, WHIP --token), in the route's style.
        if request.url.path.startswith("/api/"):
            return _json_error(429, str(exc), exc.headers)
        return PlainTextResponse(f"{exc}\n", status_code=429, headers=exc.headers)

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html")

    @app.get("/view/{stream_id}", include_in_schema=False)
    async def viewer(stream_id: str) -> FileResponse:
        # Served for any id: an OBS Browser Source is set up before its stream starts, and the
        # page retries WHEP until the stream exists.
        return FileResponse(WEB_DIR / "view.html")

    @app.get(LOGIN_PAGE, include_in_schema=False)
    async def login_page() -> FileResponse:
        return FileResponse(WEB_DIR / "login.html")

    @app.post("/api/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        """The login form: the API token once -> a signed HttpOnly cookie that stands for it here."""
        if config.api_token is None:
            return _json_error(404, "this server has no --api-token: there is nothing to log in to")
        form = parse_qs((await request.body()).decode("utf-8", "replace"))
        given = (form.get("token") or [""])[0]
        target = (form.get("next") or ["/"])[0]
        if not target.startswith("/") or target.startswith(("//", "/\\")):
            target = "/"  # only this site's pages: never an open redirect
        host = client_host(request.scope)
        guesses.check(host)  # Throttled: 429, the token not compared
        if not hmac.compare_digest(given.encode(), config.api_token.encode()):
            guesses.failed(host, given)
            log.warning("failed login from %s", host)
            return RedirectResponse(f"{LOGIN_PAGE}?failed=1&next={quote(target)}", status_code=303)
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(SESSION_COOKIE, sessions.issue(), max_age=int(sessions.ttl_s), path="/", httponly=True,
                            samesite="strict", secure=request.url.scheme == "https")
        return response

    loras = list(factory.loras)  # name, rank, layers, targets, strength (docs/lora.md)

    @app.get("/api/config")
    async def client_config() -> dict[str, Any]:
        width, height = manager.size
        return {
            "iceServers": browser_ice_servers(config),
            "presets": list(config.presets),
            "defaultPrompt": config.default_prompt,
            "defaultNoiseScale": config.default_noise_scale,
            "defaultSteps": config.default_steps,
            "maxPromptChars": config.max_prompt_chars,
            "recording": manager.recordings is not None,
            "width": width,
            "height": height,
            "loras": loras,
            "capabilities": caps.to_json(),
        }

    @app.post("/api/offer", responses={200: {"model": OfferReply}, **errors("/api/offer", 400, 503)})
    async def offer(body: OfferRequest) -> Response:
        try:
            settings = body.to_settings(
                config.default_prompt, config.max_prompt_chars, *config.stream_defaults()
            )
            session, answer = await gateway.publish(body.sdp, settings, kind="webrtc", send_output=True)
            session.label = body.label or session.label
        except REFUSED as exc:
            return _refused(exc)
        return JSONResponse(
            {
                "sdp": answer,
                "type": "answer",
                "stream_id": session.id,
                "whep_url": f"/whep/{session.id}",
                "view_url": f"/view/{session.id}",
                **await manager.prompt_report((settings.prompt,)),
            }
        )

    async def open_ndi_in(source: str) -> None:
        """--ndi-in: the operator's NDI source as a stream; a failure is logged, the server goes on."""
        from app.server.media.ndi_in import open_ndi_stream

        try:
            settings = StreamOptions().to_settings(config.default_prompt, config.max_prompt_chars,
                                                   *config.stream_defaults())
            session = await open_ndi_stream(manager, source, settings, None)
        except Exception:
            log.exception("--ndi-in %r: the stream could not open", source)
            return
        log.info("--ndi-in %r: stream %s opened", source, session.id)

    @app.post("/api/ndi", responses={200: {"model": NdiReply}, **errors("/api/ndi", 400, 403, 404, 503)})
    async def ndi_stream(body: NdiRequest) -> Response:
        """A stream whose camera is an NDI source the operator allows (--ndi-allow), with audio."""
        if not allowed(body.source, config.ndi_allow):
            return _json_error(403, f"NDI source {body.source!r} is not one this server lets streams open "
                                    "(the operator allows sources with diffcast serve --ndi-allow PATTERN)")
        from app.server.media.ndi_in import open_ndi_stream, source_exists

        try:
            settings = body.to_settings(config.default_prompt, config.max_prompt_chars, *config.stream_defaults())
            manager.check_capacity()  # before looking for the source
            await asyncio.to_thread(source_exists, body.source, NDI_FIND_S)
            session = await open_ndi_stream(manager, body.source, settings, body.label)
        except REFUSED as exc:
            return _refused(exc)
        return JSONResponse({"stream_id": session.id, "whep_url": f"/whep/{session.id}",
                             "view_url": f"/view/{session.id}"})

    @app.get("/api/streams", responses=errors("/api/streams", 401))
    async def streams() -> Response:
        # Every stream id (what WHEP viewers need): the edge lets only admins (or a local client) in.
        return JSONResponse([s.stats() for s in manager.sessions.values()])

    @app.get("/api/streams/{stream_id}", responses=errors("/api/streams/{stream_id}", 404))
    async def stream(stream_id: str) -> Response:
        session = manager.get(stream_id)
        if session is None:
            return _json_error(404, f"no stream {stream_id}")
        trace = list(session.playout.trace)[-TRACE_ROWS:]
        return JSONResponse(
            {**session.stats(), "trace": [{"seq": q, "arrival": a, "shown": s} for q, a, s in trace]}
        )

    @app.post("/api/streams/{stream_id}/control", openapi_extra=CONTROL_BODY,
              responses={200: {"model": ControlReply}, 422: {"model": ControlReply, "description": (
                  "The message cannot be applied, or is over a size or rate limit")},
                         **errors("/api/streams/{stream_id}/control", 404)})
    async def control(stream_id: str, request: Request) -> Response:
        session = manager.get(stream_id)
        if session is None:
            return _json_error(404, f"no stream {stream_id}")
        text = (await request.body()).decode("utf-8", "replace")
        reply = await session.handle_text(text, config.max_prompt_chars)
        return JSONResponse(reply, status_code=422 if reply["type"] == "error" else 200)

    @app.get("/api/streams/{stream_id}/cues", responses={
        200: {"description": "The stream's cue list, as the file PUT takes (docs/cues.md)"},
        **errors("/api/streams/{stream_id}/cues", 404)})
    async def get_cues(stream_id: str) -> Response:
        session = manager.get(stream_id)
        if session is None:
            return _json_error(404, f"no stream {stream_id}")
        return JSONResponse(CueSet(cues=session.cues).model_dump(exclude_none=True))

    @app.put("/api/streams/{stream_id}/cues", openapi_extra=CUES_BODY, responses={
        200: {"description": "The cue list now in place"},
        422: {"description": "The set is not valid: nothing changed"},
        **errors("/api/streams/{stream_id}/cues", 404)})
    async def put_cues(stream_id: str, request: Request) -> Response:
        session = manager.get(stream_id)
        if session is None:
            return _json_error(404, f"no stream {stream_id}")
        try:
            cues = parse_cue_set((await request.body()).decode("utf-8", "replace"), config.max_prompt_chars)
        except ControlError as exc:
            return _refused(exc)
        session.cues = list(cues.cues)
        return JSONResponse(cues.model_dump(exclude_none=True))

    @app.delete("/api/streams/{stream_id}", status_code=204, responses=errors("/api/streams/{stream_id}", 404))
    async def stop(stream_id: str) -> Response:
        if not await manager.close(stream_id, "stopped by its owner"):
            return _json_error(404, f"no stream {stream_id}")
        return Response(status_code=204)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "streams": len(manager.sessions), "max_streams": config.max_streams}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text format", "content": {CONTENT_TYPE: {}}}})
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE)

    @app.websocket("/ws")
    async def websocket(ws: WebSocket) -> None:
        try:
            options = options_from_query(ws.query_params)
            settings = options.to_settings(
                config.default_prompt, config.max_prompt_chars, *config.stream_defaults()
            )
        except ControlError as exc:
            await ws.accept()
            await ws.send_json({"type": "error", "message": str(exc)})
            await ws.close(code=1008, reason=str(exc)[:120])
            return
        await serve_websocket(ws, manager, config, settings)

    if config.playground:
        # The Gradio playground at /playground (app/playground.py); its file and text tabs need the
        # local pipeline, which only the real engine factory has.
        from app.playground import mount_playground

        mount_playground(app, config, factory.pipeline, manager.engine_threads)
    app.mount("/web", StaticFiles(directory=WEB_DIR), name="web")
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    document(app, config)
    app.add_exception_handler(StarletteHTTPException, allow_documented_methods(app))
    return app


def serve(config: ServerConfig, factory: ProcessorFactory | None = None) -> None:
    """Build the app on ``factory`` (see :func:`create_app`) and serve it until SIGTERM/SIGINT: the
    one place `diffcast serve` runs uvicorn, in process and in rank 0 of ``--gpus N`` alike (the
    guarded server of app/server/edge/http_server.py)."""
    from app.server.edge.http_server import serve_until_stopped, uvicorn_server
    from app.server.edge.tls import page_urls

    app = create_app(config, factory)
    log.info("serving on %s", " ".join(page_urls(config)))
    serve_until_stopped(uvicorn_server(app, config))
