"""The WebSocket fallback at /ws: JPEG frames both ways, JSON control and stats, clear errors."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import websockets

from app.client import pattern_frame
from app.server.media.frame_path import decode_jpeg, encode_jpeg
from app.server.media.framecode import draw_id, read_id


async def test_websocket_stream_and_errors(live_server: Callable[..., AbstractContextManager[str]]) -> None:
    with live_server(max_streams=1, trace_stamp=True) as url:
        ws_url = url.replace("http", "ws") + "/ws?prompt=ink&steps=1"
        async with websockets.connect(ws_url) as ws:
            hello = json.loads(await ws.recv())
            assert hello["type"] == "hello"
            size = (hello["width"], hello["height"])
            # Full: a second client is told so and closed with 1013 (try again later).
            async with websockets.connect(url.replace("http", "ws") + "/ws") as second:
                error = json.loads(await second.recv())
                assert error["type"] == "error" and "capacity" in error["message"]
                await asyncio.wait_for(second.wait_closed(), 5)
                assert second.close_code == 1013

            await ws.send(b"not a jpeg")
            await ws.send(json.dumps({"type": "update", "steps": 9}))
            await ws.send(json.dumps({"type": "update", "prompt": "underwater scene", "noise_scale": 0.5}))
            replies: list[dict[str, object]] = []
            ids: set[int] = set()
            sent: set[int] = set()
            deadline = time.monotonic() + 40
            index = 0
            while len(ids) < 8 and time.monotonic() < deadline:
                image = pattern_frame(index, size)
                draw_id(image, 1000 + index)
                sent.add(1000 + index)
                await ws.send(encode_jpeg(image, 90))
                index += 1
                frame_due = time.monotonic() + 0.05  # a 20 fps camera
                try:
                    while (left := frame_due - time.monotonic()) > 0:
                        message = await asyncio.wait_for(ws.recv(), left)
                        if isinstance(message, bytes):
                            frame_id = read_id(decode_jpeg(message))
                            if frame_id is not None:
                                ids.add(frame_id)
                        else:
                            replies.append(json.loads(message))
                except TimeoutError:
                    pass
            deadline = time.monotonic() + 10
            while not any(r.get("prompt") == "underwater scene" for r in replies) and time.monotonic() < deadline:
                message = await asyncio.wait_for(ws.recv(), 10)
                if isinstance(message, str):
                    replies.append(json.loads(message))
    errors = [r["message"] for r in replies if r["type"] == "error"]
    assert any("not a JPEG" in str(m) for m in errors), errors
    assert any("steps" in str(m) and "less than or equal to 4" in str(m) for m in errors), errors
    acks = [r for r in replies if r["type"] == "ack" and r["applied"] == "update"]
    assert acks and "far from every look" in acks[-1]["notice"], replies  # the embedded model has looks
    stats = [r for r in replies if r["type"] == "stats"]
    assert stats and stats[-1]["prompt"] == "underwater scene" and stats[-1]["kind"] == "ws"
    assert len(ids) >= 8, ids
    assert ids <= sent, ids - sent  # output frames made from this client's own frames
