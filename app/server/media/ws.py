"""WebSocket fallback at /ws for networks where ICE cannot connect.

Binary messages carry JPEG frames both ways; text messages carry the same JSON control messages
and stats as the WebRTC data channel. Stream options come as query parameters.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from fastapi import WebSocket, WebSocketDisconnect
from starlette.websockets import WebSocketState

from app.server.config import ServerConfig
from app.server.edge.limits import decode_frame, frame_guard
from app.server.media.frame_path import encode_jpeg
from app.server.serving.engine_bridge import StreamSettings
from app.server.serving.session import CapacityError, SessionManager

log = logging.getLogger(__name__)

TRY_AGAIN_LATER = 1013  # WebSocket close code for "server overloaded"


async def serve_websocket(
    websocket: WebSocket, manager: SessionManager, config: ServerConfig, settings_from_query: StreamSettings
) -> None:
    await websocket.accept()
    send_lock = asyncio.Lock()

    async def send_text(text: str) -> None:
        async with send_lock:
            # A client that vanishes mid-send is not a failure of its stream: the receive loop sees the
            # disconnect and ends the session (a crash would log an error with a traceback).
            with contextlib.suppress(WebSocketDisconnect):
                await websocket.send_text(text)

    try:
        session = await manager.open("ws", settings_from_query)
    except CapacityError as exc:
        await send_text(json.dumps({"type": "error", "message": str(exc)}))
        await websocket.close(code=TRY_AGAIN_LATER, reason=str(exc)[:120])
        return
    width, height = manager.size
    await send_text(json.dumps({"type": "hello", "stream_id": session.id, "width": width, "height": height}))

    def is_open() -> bool:
        return websocket.application_state == WebSocketState.CONNECTED and not session.closed.is_set()

    async def send_output() -> None:
        tick, last = 0, None
        while True:
            tick, out, _ = await session.playout.next_frame(tick)
            if out is last:
                continue  # a repeated frame: the client's canvas already shows it
            last = out
            data = await asyncio.to_thread(encode_jpeg, out.image, config.jpeg_quality)
            async with send_lock:
                try:
                    await websocket.send_bytes(data)
                except WebSocketDisconnect:
                    return  # the client left mid-send: the receive loop ends the session

    frames = frame_guard(config.max_frame_bytes, config.max_fps)
    budget_px = width * height  # the model's pixel budget: frames are decoded at a scale that holds it
    session.spawn(send_output(), "ws-output")
    session.spawn(session.send_stats(send_text, is_open), "stats")
    try:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                break
            if message.get("bytes") is not None:
                try:
                    frames.check(message["bytes"])
                    image, arrived = await asyncio.to_thread(
                        decode_frame, message["bytes"], budget_px, config.max_frame_pixels
                    )
                except ValueError as exc:  # MessageLimitError: over a limit, or not an image
                    await send_text(json.dumps({"type": "error", "message": str(exc)}))
                    continue
                session.assembler.push(image, arrived_size=arrived)
            elif message.get("text") is not None:
                reply = await session.handle_text(message["text"], config.max_prompt_chars)
                await send_text(json.dumps(reply))
    except WebSocketDisconnect:
        pass
    finally:
        await session.close("its WebSocket closed")
