"""Bad SDP, codecs and JSON get a 4xx with a reason in plain words, never a 500 or a Python
error's text (app/server/media/sdp.py checks, the gateway's mapping of aiortc's exceptions, the
validation-error handler)."""

from __future__ import annotations

import asyncio
import gc
import json
import re
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import pytest
from _security_fixtures import Api, asgi_api, publisher_offer, tiny_factory, viewer_offer  # noqa: F401

ApiFactory = Callable[..., AbstractAsyncContextManager[Api]]
# What a leaked Python error looks like in a reason.
PYTHON_ERROR = re.compile(r"\b[A-Z]\w*(Error|Exception)\b|Traceback|object at 0x|invalid literal|StopIteration")


def _video_twice(sdp: str) -> str:
    """The m=video section repeated, under the same mid."""
    head, _, rest = sdp.partition("m=video")
    video, application = rest.split("m=application", 1)
    return head + "m=video" + video + "m=video" + video + "m=application" + application


def _one_mid(sdp: str) -> str:
    """The data channel's section under the video's mid."""
    return sdp.replace("a=mid:1", "a=mid:0")


BAD_OFFERS: list[tuple[str, Callable[[str], str], str]] = [
    ("H265 only", lambda sdp: re.sub(r"(VP8|H264)/90000", "H265/90000", sdp), "no codec the server can receive"),
    ("video twice under one mid", _video_twice, "2 m=video sections"),
    ("two sections, one mid", _one_mid, "same a=mid:0"),
    ("bad DTLS setup", lambda sdp: sdp.replace("a=setup:actpass", "a=setup:junk"), "a=setup must be one of"),
    ("no DTLS setup", lambda sdp: sdp.replace("a=setup:actpass\r\n", ""), "no a=setup"),
    ("rtpmap without clock", lambda sdp: sdp.replace("VP8/90000", "VP8"), "a=rtpmap is"),
    ("fmtp for an unknown type", lambda sdp: sdp.replace("a=fmtp:98 apt=97", "a=fmtp:120 apt=97"), "without an a=rtpmap"),
    ("bad candidate", lambda sdp: re.sub(r"a=candidate:[^\r\n]+", "a=candidate:x 1", sdp), "a candidate is"),
    ("no ICE password", lambda sdp: re.sub(r"a=ice-pwd:\S+\r\n", "", sdp), "ice-pwd"),
    ("huge port", lambda sdp: re.sub(r"m=video \d+", "m=video 99999999999999999999", sdp), "port must be"),
    ("video without rtcp-mux", lambda sdp: sdp.replace("a=rtcp-mux\r\n", ""), "rtcp-mux"),
    ("video without a direction", lambda sdp: sdp.replace("a=sendrecv\r\n", ""), "no direction"),
    ("an unknown kind", lambda sdp: sdp.replace("m=application", "m=message"), "kind the server does not take"),
    ("BUNDLE of a missing mid", lambda sdp: sdp.replace("a=group:BUNDLE 0 1", "a=group:BUNDLE 0 7"), "mid 7"),
    ("junk line", lambda sdp: sdp.replace("s=-", "s=-\r\nhello"), "line 4"),
]


@pytest.mark.parametrize(("mangle", "reason"), [case[1:] for case in BAD_OFFERS], ids=[case[0] for case in BAD_OFFERS])
async def test_bad_offers_get_a_plain_400(asgi_api: ApiFactory, mangle: Callable[[str], str], reason: str) -> None:  # noqa: F811
    async with asgi_api(max_streams=4) as api:
        pc, sdp = await publisher_offer()
        api.peers.append(pc)
        bad = mangle(sdp)
        assert bad != sdp
        response = await api.client.post("/api/offer", json={"sdp": bad, "type": "offer"})
        assert response.status_code == 400, response.text
        detail = response.json()["detail"]
        assert reason in detail and not PYTHON_ERROR.search(detail), detail
        response = await api.client.post("/whip", content=bad, headers={"Content-Type": "application/sdp"})
        assert response.status_code == 400 and reason in response.text, response.text
        assert not api.app.state.manager.sessions  # nothing was opened, or it was closed again


async def test_bad_viewer_offers_get_a_plain_400(asgi_api: ApiFactory) -> None:  # noqa: F811
    async with asgi_api(max_streams=4) as api:
        stream = await api.create()
        pc, sdp = await viewer_offer()
        api.peers.append(pc)
        for bad in (re.sub(r"(VP8|H264)/90000", "H265/90000", sdp), sdp.replace("a=setup:actpass", "a=setup:x")):
            response = await api.client.post(f"/whep/{stream.stream_id}", content=bad,
                                              headers={"Content-Type": "application/sdp"})
            assert response.status_code == 400 and not PYTHON_ERROR.search(response.text), response.text


@pytest.mark.parametrize("field", ["noise_scale", "steps", "seed"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
async def test_non_finite_numbers_get_a_422(asgi_api: ApiFactory, field: str, value: str) -> None:  # noqa: F811
    """Python's JSON parser accepts NaN and Infinity; they are refused, and the refusal encodes
    (before: the 422 echoed the NaN, could not be encoded, and the client got a 500)."""
    async with asgi_api() as api:
        body = f'{{"sdp": "v=0", "type": "offer", "{field}": {value}}}'
        response = await api.client.post("/api/offer", content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 422, response.text
        assert response.json() == {"detail": f"bad request: {field}: must be a finite number"}


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ('{"type": "offer"}', "sdp: is required"),
        ('{"sdp": "v=0", "type": "answer"}', "type: must be 'offer'"),
        ('{"sdp": "v=0", "type": "offer", "junk": 1}', "junk: is not a known field"),
        ('{"sdp": "v=0", "type": "offer", "steps": 9}', "steps: must be less than or equal to 4"),
        ('{"sdp": ', "the body is not valid JSON"),
        ("[1, 2]", "must be a valid dictionary"),
    ],
)
async def test_validation_errors_are_sentences(asgi_api: ApiFactory, body: str, reason: str) -> None:  # noqa: F811
    async with asgi_api() as api:
        response = await api.client.post("/api/offer", content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 422
        detail = response.json()["detail"]
        assert isinstance(detail, str) and reason in detail and not PYTHON_ERROR.search(detail), detail
        assert json.dumps(response.json())


@pytest.mark.parametrize(
    "mangle",
    [lambda sdp: sdp.replace("a=group:BUNDLE 0 1", "a=group:"), lambda sdp: sdp.replace("\r\n", "\n"),
     lambda sdp: sdp.replace("a=ssrc-group", "a=x-ssrc-group")],
    ids=["empty group", "LF line endings", "unknown attribute"],
)
async def test_odd_but_usable_offers_are_answered(asgi_api: ApiFactory, mangle: Callable[[str], str]) -> None:  # noqa: F811
    async with asgi_api(max_streams=4) as api:
        pc, sdp = await publisher_offer()
        api.peers.append(pc)
        response = await api.client.post("/api/offer", json={"sdp": mangle(sdp), "type": "offer"})
        assert response.status_code == 200, response.text


async def test_a_stream_closed_before_its_peer_connected_leaves_no_task(
    asgi_api: ApiFactory, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    """An OBS-like offer (audio and video): its audio is drained by a task of the stream, which
    ends with it (aiortc's MediaBlackhole left its own tasks waiting for ever: asyncio logged
    "Task was destroyed but it is pending" once they were collected; found by demos/fuzz_edge.py)."""
    from aiortc import RTCConfiguration, RTCPeerConnection

    from app.client import CodedCamera

    async with asgi_api(max_streams=4) as api:
        for _ in range(3):
            pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
            api.peers.append(pc)
            pc.addTransceiver("audio", direction="sendonly")
            pc.addTransceiver(CodedCamera((128, 128), fps=15), direction="sendonly")
            await pc.setLocalDescription(await pc.createOffer())
            response = await api.client.post("/whip", content=pc.localDescription.sdp,
                                              headers={"Content-Type": "application/sdp"})
            assert response.status_code == 201, response.text
            owner = response.headers["x-diffcast-owner-token"]
            assert (await api.client.delete(response.headers["location"],
                                            headers={"Authorization": f"Bearer {owner}"})).status_code == 200
            await pc.close()
        await asyncio.sleep(0.2)
        gc.collect()
        await asyncio.sleep(0.1)
    assert not [r for r in caplog.records if "Task was destroyed" in r.getMessage()]
