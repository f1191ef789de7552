"""The edge's rules for browsers and proxies (app/server/edge/security.py): same-origin by default (WHIP
and WHEP excepted), local rights only for this machine asking for itself, X-Forwarded-* only from
--forwarded-allow-ips, the API token held by a login cookie, and the playground under the same
rules and bounds as every other entry point."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
from _security_fixtures import (  # noqa: F401
    REMOTE,
    Api,
    asgi_api,
    bearer,
    publisher_offer,
    tiny_factory,
    viewer_offer,
)
from conftest import running_server

from app.client import http
from app.server.config import ServerConfig
from app.server.edge.security import SESSION_COOKIE, AdminSessions

ApiFactory = Callable[..., AbstractAsyncContextManager[Api]]
EVIL = {"Origin": "https://evil.example"}
LOCAL = {"Host": "localhost:8080"}
OWN_PAGE = {**LOCAL, "Origin": "http://localhost:8080"}
UPLOAD = "/playground/gradio_api/upload"


async def test_api_is_same_origin_by_default_while_whip_and_whep_answer_any_origin(asgi_api: ApiFactory) -> None:  # noqa: F811
    async with asgi_api(max_streams=2) as api:
        stream = await api.create()
        # Another site's page in the operator's own browser (loopback) reads and controls nothing.
        for method, path in (("GET", "/api/streams"), ("GET", f"/api/streams/{stream.stream_id}"),
                             ("GET", "/api/dashboard"), ("GET", "/metrics"), ("POST", "/api/offer"),
                             ("POST", f"/api/streams/{stream.stream_id}/control")):
            response = await api.client.request(method, path, headers={**LOCAL, **EVIL}, content=b"{}")
            assert response.status_code == 403 and "evil.example" in response.text, (method, path)
            assert stream.stream_id not in response.text and "access-control-allow-origin" not in response.headers
        preflight = await api.client.options("/api/streams", headers={
            **LOCAL, **EVIL, "Access-Control-Request-Method": "GET"})
        assert "access-control-allow-origin" not in preflight.headers
        # The service's own page is not another origin.
        response = await api.client.get("/api/streams", headers=OWN_PAGE)
        assert response.status_code == 200 and stream.stream_id in response.text
        # WHIP and WHEP: a third-party player's page may negotiate (it still needs what a stream needs).
        preflight = await api.client.options("/whip", headers={**EVIL, "Access-Control-Request-Method": "POST",
                                                               "Access-Control-Request-Headers": "content-type"})
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
        pc, offer = await viewer_offer()
        api.peers.append(pc)
        response = await api.client.post(f"/whep/{stream.stream_id}", content=offer,
                                         headers={**EVIL, "Content-Type": "application/sdp"})
        assert response.status_code == 201 and response.headers["access-control-allow-origin"] == "*"
        assert "location" in response.headers["access-control-expose-headers"].lower()


async def test_a_browser_logs_in_once_and_its_cookie_stands_for_the_api_token(asgi_api: ApiFactory) -> None:  # noqa: F811
    async with asgi_api(max_streams=2, api_token="adm1n-0123456789ab") as api:
        # The playground, like stream creation, needs the token: a browser goes to the login form,
        # and an upload or a job without it stores nothing and runs nothing.
        response = await api.client.get("/playground/", headers={"Accept": "text/html"})
        assert response.status_code == 303 and response.headers["location"] == "/login?next=/playground/"
        for method, path in (("POST", UPLOAD), ("POST", "/playground/gradio_api/queue/join"),
                             ("GET", "/playground/config")):
            response = await api.client.request(method, path, files={"files": ("a.mp4", b"x" * 1000)})
            assert response.status_code == 401 and "API token" in response.text, path
        assert "<form" in (await api.client.get("/login")).text
        login = {"Content-Type": "application/x-www-form-urlencoded", **OWN_PAGE}
        response = await api.client.post("/api/login", content=b"token=wrong&next=/playground/", headers=login)
        assert response.status_code == 303 and "failed=1" in response.headers["location"]
        assert "set-cookie" not in response.headers
        response = await api.client.post("/api/login", content=b"token=adm1n-0123456789ab&next=//evil.example/", headers=login)
        assert response.status_code == 303 and response.headers["location"] == "/"  # never an open redirect
        response = await api.client.post("/api/login", content=b"token=adm1n-0123456789ab&next=/playground/", headers=login)
        assert response.status_code == 303 and response.headers["location"] == "/playground/"
        set_cookie = response.headers["set-cookie"]
        assert "httponly" in set_cookie.lower() and "samesite=strict" in set_cookie.lower(), set_cookie
        assert "adm1n-0123456789ab" not in set_cookie  # a signed session, not the token itself
        jar = {"Cookie": set_cookie.split(";", 1)[0]}
        api.client.cookies.clear()  # sent by hand below, where a test wants it
        # The cookie stands for the API token on this origin: create, list, control.
        stream = await api.create(headers={**jar, **OWN_PAGE})
        response = await api.client.get("/api/streams", headers={**jar, **OWN_PAGE})
        assert response.status_code == 200 and stream.stream_id in response.text
        response = await api.client.get("/playground/", headers={**jar, "Accept": "text/html"})
        assert response.status_code == 200 and "gradio" in response.text.lower()
        # Not on another site's requests (a cookie rides along on those), not tampered, not without it.
        assert (await api.offer(headers={**jar, **EVIL})).status_code == 403
        assert (await api.client.post("/whip", content=b"v=0", headers={**jar, **EVIL})).status_code == 401
        forged = {"Cookie": f"{SESSION_COOKIE}=99999999999.{'0' * 64}"}
        assert (await api.client.get("/api/streams", headers={**forged, **OWN_PAGE})).status_code == 401
        assert (await api.offer(headers=OWN_PAGE)).status_code == 401


def test_admin_sessions_expire_and_die_with_the_token() -> None:
    now = [1000.0]
    sessions = AdminSessions("adm1n-0123456789ab", ttl_s=60, clock=lambda: now[0])
    value = sessions.issue()
    assert sessions.valid(value)
    assert not AdminSessions("rotated", clock=lambda: now[0]).valid(value)
    assert not AdminSessions(None).valid(value)
    expires, _, signature = value.partition(".")
    assert not sessions.valid(f"{int(expires) + 3600}.{signature}")  # a later expiry is not signed
    now[0] += 61
    assert not sessions.valid(value)


async def test_playground_uploads_are_bounded_in_size_and_count(asgi_api: ApiFactory) -> None:  # noqa: F811
    async with asgi_api(max_streams=1, max_upload_bytes=8192, max_uploads=2) as api:
        def clip(n: int, size: int = 1000) -> dict[str, Any]:
            return {"files": (f"clip{n}.mp4", bytes([n]) * size, "video/mp4")}

        response = await api.client.post(UPLOAD, files=clip(1))
        assert response.status_code == 200, response.text
        (first,) = [Path(p) for p in response.json()]
        assert first.read_bytes() == bytes([1]) * 1000
        # Over the size limit: refused before a byte is stored (Content-Length says it).
        response = await api.client.post(UPLOAD, files=clip(2, size=9000))
        assert response.status_code == 413 and "8192" in response.text
        assert (await api.client.post(UPLOAD, files=clip(3))).status_code == 200
        # Two kept: a third is refused, and a request that brings several at once leaves none behind.
        response = await api.client.post(UPLOAD, files=clip(4))
        assert response.status_code == 429 and "--max-uploads" in response.text
        first.unlink()  # as a job does when it is done with its upload
        response = await api.client.post(UPLOAD, files=[("files", (f"many{n}.mp4", bytes([n + 9]) * 100, "video/mp4"))
                                                        for n in range(3)])
        assert response.status_code == 429
        assert not list(first.parent.parent.glob("*/many*.mp4"))
        assert (await api.client.post(UPLOAD, files=clip(5))).status_code == 200
        # The rest of the playground has the ordinary body limit.
        response = await api.client.post("/playground/gradio_api/queue/join", content=b"x" * 70_000)
        assert response.status_code == 413


@pytest.mark.parametrize("trusted", [False, True])
async def test_serve_believes_forwarded_headers_only_from_forwarded_allow_ips(
    tiny_factory: Any, monkeypatch: pytest.MonkeyPatch, trusted: bool  # noqa: F811
) -> None:
    from app.server.app import create_app
    from app.server.edge.http_server import uvicorn_server

    config = ServerConfig(allow_loopback_candidates=True, max_streams=4, max_streams_per_client=1,
                          forwarded_allow_ips=("127.0.0.1",) if trusted else ())
    app = create_app(config, factory=tiny_factory)
    # The server `diffcast serve` runs: uvicorn's default would trust 127.0.0.1 whatever the flag.
    assert uvicorn_server(app, config).config.proxy_headers is trusted
    with running_server(app) as url:
        async def offer(forwarded_for: str) -> int:
            pc, sdp = await publisher_offer()
            try:
                body = json.dumps({"sdp": sdp, "type": "offer"}).encode()
                headers = {"Content-Type": "application/json", "X-Forwarded-For": forwarded_for}
                return (await asyncio.to_thread(http, "POST", f"{url}/api/offer", body, headers))[0]
            finally:
                await pc.close()

        # One stream per client address: behind a trusted proxy two clients are two addresses; from an
        # untrusted peer the header is a claim, and both count as the peer.
        assert await offer("198.51.100.1") == 200
        assert await offer("198.51.100.2") == (200 if trusted else 429)
        assert await offer("198.51.100.1") == 429
        # Through a proxy is never local: listing needs the admin token.
        status, _, body = await asyncio.to_thread(http, "GET", f"{url}/api/streams", None,
                                                  {"X-Forwarded-For": "127.0.0.1"})
        assert status == 403, body


async def test_trailing_slash_redirects_are_relative(asgi_api: ApiFactory) -> None:  # noqa: F811
    """Starlette built the 307's Location from the Host header (``http://evil.example/api/streams``)
    before any credential was checked; the redirect is now a path, and never a ``//host`` one."""
    async with asgi_api(max_streams=1) as api:
        for path, location in (("/api/streams/", "/api/streams"), ("/api/config/?a=1&b=%2F", "/api/config?a=1&b=%2F"),
                               ("/playground", "/playground/"), ("/login/", "/login")):
            response = await api.client.get(path, headers={"Host": "evil.example"})
            assert response.status_code == 307 and response.headers["location"] == location, (path, response.headers)
        for path in ("//evil.example/", "/\\evil.example/", "/no/such/route/"):
            response = await api.client.get(f"http://diffcast.test{path}", headers={"Host": "evil.example"})
            assert response.status_code == 404 and "location" not in response.headers, path


async def test_the_offer_schema_refuses_what_the_server_calls_an_empty_offer(asgi_api: ApiFactory) -> None:  # noqa: F811
    """The document let `sdp` be "" while /api/offer answered 400 "empty SDP offer": each SDP body
    the schema refuses is that 400, and one it accepts gets past that check."""
    import jsonschema

    async with asgi_api(max_streams=1) as api:
        document = (await api.client.get("/openapi.json")).json()
        offer_sdp = document["components"]["schemas"]["OfferRequest"]["properties"]["sdp"]
        whip_sdp = document["paths"]["/whip"]["post"]["requestBody"]["content"]["application/sdp"]["schema"]
        assert offer_sdp["minLength"] == whip_sdp["minLength"] == 1
        for sdp in ("", " ", "\r\n\t", "v=0", " v=0\r\n"):
            valid = jsonschema.Draft202012Validator(offer_sdp).is_valid(sdp)
            assert valid == jsonschema.Draft202012Validator(whip_sdp).is_valid(sdp), sdp
            response = await api.client.post("/api/offer", json={"sdp": sdp, "type": "offer"})
            assert response.status_code == 400, (sdp, response.text)
            assert ("empty SDP offer" in response.json()["detail"]) is not valid, (sdp, response.text)
            response = await api.client.post("/whip", content=sdp.encode(), headers={"Content-Type": "application/sdp"})
            assert response.status_code == 400 and ("empty SDP offer" in response.text) is not valid, (sdp, response.text)
