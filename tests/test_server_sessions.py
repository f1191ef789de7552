"""Sessions under concurrency and at their end: admission that holds when offers race, session URLs
that are their client's credential (RFC 9725), one answer for absent and foreign ids on every route
shape, and a stream that ends as soon as its publisher leaves (app/server/media/gateway.py, whip.py)."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx
from _security_fixtures import (  # noqa: F401
    Api,
    Created,
    asgi_api,
    bearer,
    publisher_offer,
    tiny_factory,
    viewer_offer,
)
from aiortc import RTCPeerConnection, RTCSessionDescription
from fastapi.routing import APIRoute

from app.server.edge.security import STREAM_ID_HEADER

ApiFactory = Callable[..., AbstractAsyncContextManager[Api]]
SDP = {"Content-Type": "application/sdp"}


async def _wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(0.05)


async def _connect(pc: RTCPeerConnection, answer: str) -> None:
    await pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
    await _wait_for(lambda: pc.connectionState == "connected", 20, "ICE and DTLS")


async def _watch(api: Api, stream: Created, viewer_token: str | None = None) -> httpx.Response:
    pc, offer = await viewer_offer()
    api.peers.append(pc)
    headers = {**SDP, **bearer(viewer_token)} if viewer_token else SDP
    return await api.client.post(f"/whep/{stream.stream_id}", content=offer, headers=headers)


async def test_viewer_limit_holds_under_concurrent_offers(asgi_api: ApiFactory) -> None:  # noqa: F811
    async with asgi_api(max_streams=1, max_viewers=8) as api:
        stream = await api.create()
        # Twelve offers in flight at once: each one's answer (ICE gathering) is awaited while the
        # others arrive, so a check-then-add admission would let all twelve in.
        replies = await asyncio.gather(*(_watch(api, stream) for _ in range(12)))
        assert Counter(r.status_code for r in replies) == {201: 8, 503: 4}, [r.text for r in replies]
        assert all("8 viewers" in r.text and int(r.headers["retry-after"]) > 0 for r in replies if r.status_code == 503)
        session = api.app.state.manager.sessions[stream.stream_id]
        assert session.viewers == 8
        # A viewer that leaves gives its slot back.
        location = next(r.headers["location"] for r in replies if r.status_code == 201)
        assert (await api.client.delete(location)).status_code == 200
        assert session.viewers == 7 and (await _watch(api, stream)).status_code == 201


async def test_stream_limits_hold_under_concurrent_offers(asgi_api: ApiFactory) -> None:  # noqa: F811
    # The same race on stream creation: the total and the per-client limit are reserved before any await.
    async with asgi_api(max_streams=3, max_streams_per_client=10) as api:
        replies = await asyncio.gather(*(api.offer() for _ in range(8)))
        assert Counter(r.status_code for r in replies) == {200: 3, 503: 5}
        assert len(api.app.state.manager.sessions) == 3
    async with asgi_api(max_streams=10, max_streams_per_client=2) as api:
        replies = await asyncio.gather(*(api.offer() for _ in range(8)))
        assert Counter(r.status_code for r in replies) == {200: 2, 429: 6}
        assert len(api.app.state.manager.sessions) == 2


async def test_whip_session_url_ends_its_session_without_other_credentials(asgi_api: ApiFactory) -> None:  # noqa: F811
    for token in (None, "obs-key-0123456789"):  # OBS sends its Bearer token on DELETE only where the server has one
        async with asgi_api(max_streams=2, token=token) as api:
            pc, offer = await publisher_offer()
            api.peers.append(pc)
            auth = bearer(token) if token else {}
            response = await api.client.post("/whip", content=offer, headers={**SDP, **auth})
            assert response.status_code == 201, response.text
            location, stream_id = response.headers["location"], response.headers[STREAM_ID_HEADER]
            # The Location is the publisher's own URL: not the public stream id every viewer knows.
            session_id = location.removeprefix(f"/whip/{stream_id}/")
            assert re.fullmatch(r"[A-Za-z0-9_-]{22}", session_id) and session_id != stream_id
            # What a viewer knows (the stream id, its own WHEP session URL) does not end the stream.
            watched = await api.client.post(f"/whep/{stream_id}", content=(await viewer_offer())[1],
                                            headers={**SDP, **auth})
            viewer_location = watched.headers["location"]
            assert (await api.client.delete(f"/whip/{stream_id}")).status_code == 401
            assert (await api.client.delete(f"/whip/{stream_id}/{viewer_location.rsplit('/', 1)[1]}")).status_code == 404
            assert (await api.client.delete(f"/whip/{stream_id}/publisher")).status_code == 404
            patch = await api.client.patch(location, content=b"a=end-of-candidates\r\n")
            assert patch.status_code == 405 and "DELETE" in patch.headers["allow"]
            assert stream_id in api.app.state.manager.sessions
            # RFC 9725 §4.2: DELETE on the Location, with the credentials of the POST (here: none).
            assert (await api.client.delete(location)).status_code == 200
            assert stream_id not in api.app.state.manager.sessions
            assert (await api.client.delete(location)).status_code == 404


def _api_routes(routes: list[Any]) -> Iterator[APIRoute]:
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        included = getattr(route, "original_router", None)  # FastAPI keeps an included router whole
        if included is not None:
            yield from _api_routes(included.routes)  # (ours are included without a prefix)


def _fill(template: str, stream_id: str, session_id: str) -> str:
    path = template.replace("{stream_id}", stream_id)
    return re.sub(r"\{[a-z_]+\}", session_id, path)


async def test_every_stream_route_answers_absent_and_foreign_alike(asgi_api: ApiFactory) -> None:  # noqa: F811
    async with asgi_api(max_streams=4, private_viewing=True) as api:
        live, other = await api.create(), await api.create()
        sessions = api.app.state.manager.sessions
        watched = await _watch(api, other, other.viewer)
        other_viewer = watched.headers["location"].rsplit("/", 1)[1]
        unknown = "A" * 22
        # Every route shape with a stream id, from the app itself: a new route is covered too.
        shapes = sorted({(method, route.path) for route in _api_routes(api.app.routes)
                         if "{stream_id}" in route.path for method in route.methods})
        assert ("PATCH", "/whep/{stream_id}/{viewer_id}") in shapes and len(shapes) >= 14, shapes
        # Absent, or not the caller's: an unknown stream; and for session URLs, ids that are no
        # session of that kind on the live stream (the "publisher" key once was one).
        variants = [(unknown, "B" * 22), (live.stream_id, "publisher"), (live.stream_id, "B" * 22),
                    (live.stream_id, other_viewer), (live.stream_id, str(sessions[other.stream_id].publisher_session))]
        for method, template in shapes:
            for credentials in ({}, bearer(other.owner)):  # no token; another stream's owner token
                answers = set()
                for stream_id, session_id in variants:
                    response = await api.client.request(method, _fill(template, stream_id, session_id),
                                                        content=b"{}", headers=credentials)
                    text = response.text.replace(stream_id, "<id>").replace(session_id, "<session>")
                    answers.add((response.status_code, text, response.headers.get("allow"),
                                 response.headers.get("www-authenticate")))
                assert len(answers) == 1, (method, template, credentials, answers)
        assert len(sessions) == 2


def _lose_dtls_goodbye(pc: RTCPeerConnection) -> None:
    """The peer's DTLS close_notify never arrives: one UDP datagram, lost, or never sent by the client."""

    async def silent_stop() -> None:
        return None

    for transceiver in pc.getTransceivers():
        transceiver.sender.transport.stop = silent_stop  # type: ignore[method-assign]


async def test_a_publisher_that_leaves_ends_its_stream_at_once(asgi_api: ApiFactory) -> None:  # noqa: F811
    # The input watchdog (60 s here) is not what ends it, nor ICE consent freshness (~30 s).
    async with asgi_api(max_streams=2, max_streams_per_client=1, input_timeout_s=60) as api:
        manager = api.app.state.manager
        stream = await api.create()
        await _connect(stream.pc, stream.reply["sdp"])
        session = manager.sessions[stream.stream_id]
        await _wait_for(lambda: session.assembler.received > 0, 30, "input frames")
        _lose_dtls_goodbye(stream.pc)
        await stream.pc.close()  # still says goodbye on RTP (RTCP BYE) and SCTP (ABORT)
        await _wait_for(lambda: session.closed.is_set() and not session.peers, 10, "the stream's end")
        assert stream.stream_id not in manager.sessions
        # Its client's slot is free at once: a page reload gets a new stream, not a 429.
        again = await api.create()
        await _connect(again.pc, again.reply["sdp"])
        # A clean close (DTLS close_notify, as Chromium and aiortc send) ends it too.
        await again.pc.close()
        await _wait_for(lambda: again.stream_id not in manager.sessions, 10, "the stream's end")


async def test_a_viewer_that_leaves_frees_its_slot(asgi_api: ApiFactory) -> None:  # noqa: F811
    async with asgi_api(max_streams=1, max_viewers=1) as api:
        stream = await api.create()
        await _connect(stream.pc, stream.reply["sdp"])
        pc, offer = await viewer_offer()
        api.peers.append(pc)
        response = await api.client.post(f"/whep/{stream.stream_id}", content=offer, headers=SDP)
        await _connect(pc, response.text)
        session: Any = api.app.state.manager.sessions[stream.stream_id]
        assert session.viewers == 1
        await pc.close()  # no DELETE: the peer's close alone
        await _wait_for(lambda: session.viewers == 0, 10, "the viewer's leave")
        assert (await _watch(api, stream)).status_code == 201
        assert stream.stream_id in api.app.state.manager.sessions  # a viewer leaving ends nothing else
