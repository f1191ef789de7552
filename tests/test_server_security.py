"""Access: per-stream owner/viewer capabilities, admin-only listing, the API token and origins
(app/server/edge/security.py). Each refusal is checked, and that refusals never reveal whether a
stream exists to a caller without rights to it."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest
import websockets
from _security_fixtures import (  # noqa: F401
    REMOTE,
    Api,
    asgi_api,
    bearer,
    publisher_offer,
    served,
    tiny_factory,
    viewer_offer,
)

from app.server.config import ServerConfig
from app.server.edge.security import (
    ENDED_KEPT,
    ENDED_KEPT_S,
    OWNER_HEADER,
    STREAM_ID_HEADER,
    VIEWER_HEADER,
    Access,
    AccessControl,
)

ApiFactory = Callable[..., AbstractAsyncContextManager[Api]]
UPDATE = json.dumps({"type": "update", "seed": 3})
LOCAL_HOST = {"Host": "localhost:8080"}


async def test_owner_controls_viewer_only_watches(asgi_api: ApiFactory) -> None:  # noqa: F811
    async with asgi_api(max_streams=4) as api:
        stream = await api.create()
        # Unguessable: 128-bit ids and 192-bit tokens, all different.
        assert re.fullmatch(r"[A-Za-z0-9_-]{22}", stream.stream_id)
        assert len({stream.stream_id, stream.owner, stream.viewer}) == 3 and len(stream.owner) >= 32
        assert stream.reply["view_url"] == f"/view/{stream.stream_id}?token={stream.viewer}"
        control = f"/api/streams/{stream.stream_id}/control"

        response = await api.client.post(control, content=UPDATE)
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        response = await api.client.post(control, content=UPDATE, headers=bearer(stream.viewer))
        assert response.status_code == 403 and "owner token" in response.json()["detail"]
        response = await api.client.post(control, content=UPDATE, headers=bearer(stream.owner))
        assert response.status_code == 200 and response.json() == {"type": "ack", "applied": "update"}
        stats = (await api.client.get(f"/api/streams/{stream.stream_id}", headers=bearer(stream.viewer))).json()
        assert stats["seed"] == 3

        assert (await api.client.delete(f"/api/streams/{stream.stream_id}", headers=bearer(stream.viewer))).status_code == 403
        assert (await api.client.delete(f"/api/streams/{stream.stream_id}")).status_code == 401
        assert (await api.client.delete(f"/api/streams/{stream.stream_id}", headers=bearer(stream.owner))).status_code == 204
        # The capability died with its stream: its owner is only told that it ended (410), and why.
        gone = await api.client.post(control, content=UPDATE, headers=bearer(stream.owner))
        assert gone.status_code == 410 and gone.json()["detail"].endswith("has ended: stopped by its owner")
        assert api.app.state.access.grants == 0


async def test_refusals_do_not_reveal_existence(asgi_api: ApiFactory) -> None:  # noqa: F811
    async with asgi_api(max_streams=4, private_viewing=True) as api:
        a = await api.create()
        b = await api.create()
        missing = "A" * 22
        for method, path in (("POST", "/api/streams/{}/control"), ("DELETE", "/api/streams/{}"),
                             ("GET", "/api/streams/{}"), ("DELETE", "/whip/{}")):
            answers = []
            for stream_id, headers in ((b.stream_id, bearer(a.owner)), (missing, bearer(a.owner)),
                                       (b.stream_id, {}), (missing, {})):
                response = await api.client.request(method, path.format(stream_id), content=UPDATE, headers=headers)
                answers.append((response.status_code, response.text.replace(stream_id, "<id>")))
            # Another stream's owner token on b is as good as nothing: the same 404 as an unknown id;
            # no token at all: the same 401 whether the stream exists or not.
            assert answers[0] == answers[1] and answers[0][0] == 404, (method, path, answers)
            assert answers[2] == answers[3] and answers[2][0] == 401, (method, path, answers)
        assert (await api.client.get(f"/api/streams/{b.stream_id}", headers=bearer(b.viewer))).status_code == 200
        # PATCH (trickle ICE) is not supported: one 405 for every session URL and credential.
        answers = {(r.status_code, r.text) for r in [
            await api.client.patch(path, headers=headers)
            for path in (f"/whip/{b.stream_id}", f"/whip/{missing}", f"/whep/{b.stream_id}/publisher",
                         f"/whep/{missing}/publisher") for headers in (bearer(b.owner), {})]}
        assert len(answers) == 1 and answers.pop()[0] == 405


async def test_private_viewing_needs_the_viewer_token(asgi_api: ApiFactory) -> None:  # noqa: F811
    async with asgi_api(max_streams=2, private_viewing=True) as api:
        stream = await api.create()
        sdp_headers = {"Content-Type": "application/sdp"}
        pc, offer = await viewer_offer()
        api.peers.append(pc)
        response = await api.client.post(f"/whep/{stream.stream_id}", content=offer, headers=sdp_headers)
        assert response.status_code == 401
        assert (await api.client.get(f"/api/streams/{stream.stream_id}")).status_code == 401
        response = await api.client.post(f"/whep/{stream.stream_id}", content=offer,
                                         headers={**sdp_headers, **bearer(stream.viewer)})
        assert response.status_code == 201 and response.headers["location"].startswith(f"/whep/{stream.stream_id}/")
    async with asgi_api(max_streams=2) as api:  # public viewing (default): the unlisted id suffices
        stream = await api.create()
        assert (await api.client.get(f"/api/streams/{stream.stream_id}")).status_code == 200
        assert (await api.client.post(f"/api/streams/{stream.stream_id}/control", content=UPDATE)).status_code == 401


async def test_listing_needs_admin_rights(asgi_api: ApiFactory) -> None:  # noqa: F811
    async with asgi_api(max_streams=2) as api:
        stream = await api.create()
        remote = api.at(REMOTE)
        for path in ("/api/streams", "/api/dashboard", "/metrics"):
            response = await remote.client.get(path, headers=LOCAL_HOST)
            assert response.status_code == 403 and stream.stream_id not in response.text, path
            # The operator, on loopback, naming this machine.
            assert (await api.client.get(path, headers=LOCAL_HOST)).status_code == 200, path
            # A loopback peer is not enough: a DNS-rebinding page names its own domain in Host, and
            # behind a local reverse proxy every client's peer address is loopback.
            for headers in ({"Host": "rebound.evil.example:8080"}, {**LOCAL_HOST, "X-Forwarded-For": REMOTE},
                            {**LOCAL_HOST, "X-Real-IP": REMOTE}, {**LOCAL_HOST, "Forwarded": f"for={REMOTE}"}):
                response = await api.client.get(path, headers=headers)
                assert response.status_code == 403 and stream.stream_id not in response.text, (path, headers)
        for host in ("127.0.0.1:8080", "[::1]:8080", "localhost", "app.localhost:8080"):
            assert (await api.client.get("/api/streams", headers={"Host": host})).status_code == 200, host
    async with asgi_api(max_streams=2, api_token="adm1n-0123456789ab") as api:
        stream = await api.create(headers=bearer("adm1n-0123456789ab"))
        for path in ("/api/streams", "/api/dashboard", "/metrics"):
            assert (await api.client.get(path)).status_code == 401, path
            assert (await api.client.get(path, headers=bearer(stream.owner))).status_code == 401, path
            response = await api.at(REMOTE).client.get(path, headers=bearer("adm1n-0123456789ab"))
            assert response.status_code == 200 and stream.stream_id in response.text, path
        # The admin may control and stop any stream.
        control = f"/api/streams/{stream.stream_id}/control"
        assert (await api.client.post(control, content=UPDATE, headers=bearer("adm1n-0123456789ab"))).status_code == 200
        assert (await api.client.delete(f"/api/streams/{stream.stream_id}", headers=bearer("adm1n-0123456789ab"))).status_code == 204


async def test_api_token_gates_creation(asgi_api: ApiFactory) -> None:  # noqa: F811
    async with asgi_api(max_streams=2, api_token="adm1n-0123456789ab") as api:
        response = await api.offer()
        assert response.status_code == 401 and "API token" in response.json()["detail"]
        assert (await api.offer(headers=bearer("wrong"))).status_code == 401
        assert not api.app.state.manager.sessions
        stream = await api.create(headers=bearer("adm1n-0123456789ab"))
        # The creator's own tokens work without the API token.
        response = await api.client.post(f"/api/streams/{stream.stream_id}/control", content=UPDATE,
                                         headers=bearer(stream.owner))
        assert response.status_code == 200


async def test_whip_creator_gets_tokens_in_headers(asgi_api: ApiFactory) -> None:  # noqa: F811
    async with asgi_api(max_streams=2) as api:
        pc, offer = await publisher_offer()
        api.peers.append(pc)
        response = await api.client.post("/whip", content=offer, headers={"Content-Type": "application/sdp"})
        assert response.status_code == 201
        stream_id = response.headers[STREAM_ID_HEADER]
        owner, viewer = response.headers[OWNER_HEADER], response.headers[VIEWER_HEADER]
        # The stream id is public to every viewer: stopping the stream by it needs the owner token.
        assert (await api.client.delete(f"/whip/{stream_id}", headers=bearer(viewer))).status_code == 403
        assert (await api.client.delete(f"/whip/{stream_id}")).status_code == 401
        assert (await api.client.delete(f"/whip/{stream_id}", headers=bearer(owner))).status_code == 200


async def test_origins(asgi_api: ApiFactory) -> None:  # noqa: F811
    async with asgi_api(max_streams=4, max_streams_per_client=4, allowed_origins=("https://good.example",)) as api:
        response = await api.offer(headers={"Origin": "https://evil.example"})
        assert response.status_code == 403 and "evil.example" in response.json()["detail"]
        assert "access-control-allow-origin" not in response.headers
        assert (await api.offer(headers={"Origin": "https://good.example"})).status_code == 200
        assert (await api.offer(headers={"Origin": "http://diffcast.test"})).status_code == 200  # its own page
        assert (await api.offer()).status_code == 200  # no Origin: OBS, curl
        preflight = await api.client.options("/api/offer", headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
        assert preflight.headers.get("access-control-allow-origin") is None


async def test_websocket_gates(tiny_factory: Any) -> None:  # noqa: F811
    with served(tiny_factory, max_streams=2, api_token="adm1n-0123456789ab", allowed_origins=("https://good.example",)) as (url, _):
        ws_url = url.replace("http", "ws") + "/ws"
        for target, headers, reason in ((ws_url, {}, "API token"),
                                        (ws_url + "?access_token=adm1n-0123456789ab", {"Origin": "https://evil.example"}, "origin")):
            async with websockets.connect(target, additional_headers=headers) as ws:
                error = json.loads(await ws.recv())
                assert error["type"] == "error" and reason in error["message"], error
                await asyncio.wait_for(ws.wait_closed(), 5)
                assert ws.close_code == 1008
        async with websockets.connect(ws_url + "?access_token=adm1n-0123456789ab") as ws:
            hello = json.loads(await ws.recv())
            assert hello["type"] == "hello" and len(hello["owner_token"]) >= 32 and hello["viewer_token"]


@pytest.mark.parametrize("token", [None, "s3cret-0123456789ab"])
async def test_legacy_whip_token_is_an_operator_credential(asgi_api: ApiFactory, token: str | None) -> None:  # noqa: F811
    async with asgi_api(max_streams=2, token=token) as api:
        stream = await api.create()
        response = await api.client.delete(f"/api/streams/{stream.stream_id}", headers=bearer("s3cret-0123456789ab"))
        assert response.status_code == (204 if token else 404)


def test_an_ended_stream_tells_its_owner_why_for_a_while() -> None:
    """After its stream ends (an NDI source vanishing, say) the owner gets 410 and the reason on the
    stream's routes, for ENDED_KEPT_S; anyone else gets the 404 of an id that never was."""
    now = [0.0]
    live = {"s1", "s2"}
    access = AccessControl(ServerConfig(), is_live=lambda stream_id: stream_id in live, clock=lambda: now[0])
    mine, other = access.grant("s1"), access.grant("s2")
    access.ended("s1", "NDI source 'STUDIO (cam)' vanished")
    live.discard("s1")
    assert access.refusal(mine.owner, "s1", Access.OWNER) == (410, "stream s1 has ended: NDI source 'STUDIO (cam)' vanished")
    assert access.refusal(mine.owner, "s1", Access.VIEWER) is not None  # no watching an ended stream either
    assert access.refusal(mine.viewer, "s1", Access.VIEWER) == (404, "no stream s1")
    assert access.refusal(other.owner, "s1", Access.OWNER) == (404, "no stream s1")
    assert access.refusal(None, "s1", Access.OWNER)[0] == 401  # type: ignore[index]
    assert access.refusal(other.owner, "s2", Access.OWNER) is None  # the live one undisturbed
    now[0] = ENDED_KEPT_S + 1
    assert access.refusal(mine.owner, "s1", Access.OWNER) == (404, "no stream s1")


def test_ended_streams_are_remembered_within_a_bound() -> None:
    live: set[str] = set()
    access = AccessControl(ServerConfig(), is_live=lambda stream_id: stream_id in live)
    grants = {f"s{i}": access.grant(f"s{i}") for i in range(ENDED_KEPT + 1)}
    for stream_id in grants:
        access.ended(stream_id, "stream ended")
    assert access.refusal(grants["s0"].owner, "s0", Access.OWNER) == (404, "no stream s0")  # the oldest forgotten
    last = f"s{ENDED_KEPT}"
    assert access.refusal(grants[last].owner, last, Access.OWNER) == (410, f"stream {last} has ended: stream ended")
