"""Limits on what clients send, each with the error it gets (app/server/edge/limits.py, security.py)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import cv2
import numpy as np
import pytest
import websockets
from _security_fixtures import REMOTE, Api, asgi_api, bearer, publisher_offer, served, tiny_factory  # noqa: F401

from app.server.control.messages import ControlError, parse_control
from app.server.edge.limits import MessageLimitError, RateLimit, control_guard, decode_frame, frame_guard
from app.server.media.frame_path import encode_jpeg, fit_frame
from app.server.media.sdp import MAX_SDP_BYTES, OfferError, check_offer

ApiFactory = Callable[..., AbstractAsyncContextManager[Api]]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_request_body_limit(asgi_api: ApiFactory) -> None:  # noqa: F811
    async with asgi_api(max_body_bytes=1000) as api:
        big = json.dumps({"sdp": "v=0" + "x" * 2000, "type": "offer"})
        response = await api.client.post("/api/offer", content=big, headers={"Content-Type": "application/json"})
        assert response.status_code == 413 and "limit of 1000 bytes" in response.json()["detail"]

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
            for _ in range(10):
                yield b"v=0" + b"x" * 300

        response = await api.client.post("/whip", content=chunked(), headers={"Content-Type": "application/sdp"})
        assert response.status_code == 413 and "limit of 1000 bytes" in response.text
        response = await api.client.post("/api/streams/x/control", content=b"{" * 1001)
        assert response.status_code == 413
        assert not api.app.state.manager.sessions


async def test_sdp_size_limit(asgi_api: ApiFactory) -> None:  # noqa: F811
    pc, offer = await publisher_offer()
    await pc.close()
    padded = offer + "a=x-padding:" + "p" * MAX_SDP_BYTES + "\r\n"
    with pytest.raises(OfferError, match=f"over the limit of {MAX_SDP_BYTES} bytes"):
        check_offer(padded, publish=True)
    check_offer(offer, publish=True)
    async with asgi_api() as api:  # within the body limit, over the SDP limit: 400 saying so
        response = await api.client.post("/whip", content=padded, headers={"Content-Type": "application/sdp"})
        assert response.status_code == 400 and "over the limit" in response.text


@pytest.mark.parametrize(
    ("prompt", "code"),
    [("ink\x1b[31m", "U+001B"), ("a\nb", "U+000A"), ("nul\x00", "U+0000"), ("evil\u202egnp.exe", "U+202E"),
     ("zero\u200bwidth", "U+200B")],
)
def test_prompt_control_characters_are_refused(prompt: str, code: str) -> None:
    with pytest.raises(ControlError, match=re.escape(f"control character {code}")):
        parse_control(json.dumps({"type": "update", "prompt": prompt}), 100)


def test_prompt_unicode_text_is_accepted() -> None:
    for prompt in ("水墨画", "نقاشی\u200cها", "👩\u200d🎨 portrait", "café au lait"):
        parse_control(json.dumps({"type": "update", "prompt": prompt}), 100)


async def test_prompt_checks_on_stream_options(asgi_api: ApiFactory) -> None:  # noqa: F811
    async with asgi_api() as api:
        response = await api.offer(prompt="tab\there")
        assert response.status_code == 422 and "control character U+0009" in response.json()["detail"]
        response = await api.offer(prompt="x" * 501)
        assert response.status_code == 422 and "limit is 500" in response.json()["detail"]


def _png(image: np.ndarray) -> bytes:
    ok, data = cv2.imencode(".png", image)
    assert ok
    return data.tobytes()


@pytest.mark.parametrize(
    "image",
    [np.zeros((1, 1, 3), np.uint8), np.full((1, 900, 3), 200, np.uint8), np.full((900, 1, 3), 50, np.uint8),
     np.zeros((7, 3, 3), np.uint8), np.zeros((33, 17), np.uint8), np.zeros((20, 30, 4), np.uint8)],
    ids=["1x1", "1-row strip", "1-column strip", "odd 3x7", "grey", "rgba"],
)
def test_odd_frames_are_fitted_never_crash(image: np.ndarray) -> None:
    out, sent = decode_frame(_png(image), 160 * 128, max_pixels=1 << 24)
    assert out.shape == (image.shape[0], image.shape[1], 3) and out.dtype == np.uint8  # RGB, as sent
    assert sent == (image.shape[1], image.shape[0])
    assert fit_frame(out, (160, 128)).shape == (128, 160, 3)  # what the engine thread makes of it


def test_large_frames_are_downscaled_and_bombs_refused() -> None:
    rng = np.random.default_rng(0)
    big = rng.integers(0, 255, (1080, 1920, 3), dtype=np.uint8)
    out, sent = decode_frame(encode_jpeg(big, 80), 128 * 128, max_pixels=4096 * 4096)
    assert out.shape == (135, 240, 3) and sent == (1920, 1080)  # decoded at 1/8: still 128x128 pixels or more
    # Compare with a full decode, crop and resize: the reduced decode shows the same picture.
    full = cv2.imdecode(np.frombuffer(encode_jpeg(big, 80), np.uint8), cv2.IMREAD_COLOR)
    assert full is not None
    reference = fit_frame(cv2.cvtColor(full, cv2.COLOR_BGR2RGB), (128, 128))
    assert np.abs(fit_frame(out, (128, 128)).astype(int) - reference.astype(int)).mean() < 12
    with pytest.raises(MessageLimitError, match="1920x1080; frames may have at most 1000000 pixels"):
        decode_frame(encode_jpeg(big, 80), 128 * 128, max_pixels=1_000_000)
    with pytest.raises(MessageLimitError, match="not a JPEG/PNG image"):
        decode_frame(b"\xff\xd8garbage", 128 * 128, max_pixels=1 << 24)


def test_rate_limit_token_bucket() -> None:
    clock = FakeClock()
    limit = RateLimit(rate=2, burst=4, clock=clock)
    assert [limit.allow() for _ in range(6)] == [True] * 4 + [False] * 2
    clock.now = 1.0  # two more tokens a second later
    assert [limit.allow() for _ in range(3)] == [True, True, False]
    assert limit.refused == 3
    guard = control_guard(max_bytes=10, per_second=1, clock=clock)
    with pytest.raises(MessageLimitError, match="11 bytes is over the limit of 10 bytes"):
        guard.check("x" * 11)
    frames = frame_guard(max_bytes=100, max_fps=5, clock=clock)  # 10 frames/s, bursts of 10
    for _ in range(10):
        frames.check(b"f")
    with pytest.raises(MessageLimitError, match="too many video frames: the limit is 10 per second"):
        frames.check(b"f")


async def test_control_message_size_and_rate(asgi_api: ApiFactory) -> None:  # noqa: F811
    async with asgi_api(max_messages_per_s=2, max_message_bytes=200) as api:
        stream = await api.create()
        control = f"/api/streams/{stream.stream_id}/control"
        owner = bearer(stream.owner)
        response = await api.client.post(control, content=json.dumps({"type": "update", "prompt": "x" * 300}),
                                          headers=owner)
        assert response.status_code == 422 and "over the limit of 200 bytes" in response.json()["message"]
        replies = [await api.client.post(control, content='{"type": "pause"}', headers=owner) for _ in range(8)]
        refused = [r for r in replies if r.status_code != 200]
        assert len(refused) >= 3 and all("too many control messages" in r.json()["message"] for r in refused)


async def test_streams_per_client_and_in_total(asgi_api: ApiFactory) -> None:  # noqa: F811
    async with asgi_api(max_streams=3, max_streams_per_client=2) as api:
        a = api.at("198.51.100.1")
        first = await a.create()
        await a.create()
        response = await a.offer()
        assert response.status_code == 429 and "already has 2 streams" in response.json()["detail"]
        assert int(response.headers["retry-after"]) > 0
        await api.at(REMOTE).create()  # another client is not affected
        response = await api.at("198.51.100.9").offer()
        assert response.status_code == 503 and "capacity" in response.json()["detail"]  # the total
        assert (await a.client.delete(f"/api/streams/{first.stream_id}", headers=bearer(first.owner))).status_code == 204
        await a.create()  # its slot is free again


async def test_websocket_frame_limits(tiny_factory: Any) -> None:  # noqa: F811
    with served(tiny_factory, max_streams=1, max_frame_bytes=50_000, max_frame_pixels=1_000_000) as (url, _):
        async with websockets.connect(url.replace("http", "ws") + "/ws") as ws:
            hello = json.loads(await ws.recv())
            assert hello["type"] == "hello"
            # ~52 KB: over max_frame_bytes, under the WebSocket message limit (max_frame_bytes + 4096).
            noise = np.random.default_rng(1).integers(0, 255, (132, 132, 3), dtype=np.uint8)
            await ws.send(_png(noise))
            await ws.send(encode_jpeg(np.zeros((1100, 1000, 3), np.uint8), 50))  # small file, 1.1 MP
            await ws.send(_png(np.zeros((1, 700, 3), np.uint8)))  # odd but fine: no error
            async def next_text() -> dict[str, str]:
                while isinstance(message := await asyncio.wait_for(ws.recv(), 10), bytes):
                    pass  # output frames
                return dict(json.loads(message))

            errors: list[str] = []
            while len(errors) < 2:
                if (message := await next_text())["type"] == "error":
                    errors.append(message["message"])
            assert "over the limit of 50000 bytes" in errors[0] and "at most 1000000 pixels" in errors[1]
            await ws.send(json.dumps({"type": "reset"}))
            while (message := await next_text())["type"] != "ack":
                assert message["type"] != "error", message  # the 1x700 strip was taken
            # Over the WebSocket message limit the socket is closed (1009) before the frame is buffered.
            noise = np.random.default_rng(1).integers(0, 255, (400, 400, 3), dtype=np.uint8)
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.send(_png(noise))  # ~480 KB
                while True:
                    await asyncio.wait_for(ws.recv(), 10)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
