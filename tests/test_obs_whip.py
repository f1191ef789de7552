"""OBS Studio's WHIP output, imitated with aiortc, into diffcast; the result on /view/<id> in Chromium.

OBS (>= 30, Settings -> Stream -> Service "WHIP") offers Opus audio plus H.264 constrained
baseline (profile-level-id 42e01f) and sends the Bearer token from its settings. The publisher
below offers exactly that (codec preferences forced), and the stylized output is then played by
the viewer page an OBS Browser Source would load.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCRtpSender, RTCSessionDescription
from aiortc.mediastreams import AudioStreamTrack
from aiortc.sdp import SessionDescription
from conftest import launched_chromium
from test_browser_page import CHROMIUM_FLAGS

from app.client import CodedCamera, http

pytestmark = pytest.mark.browser

TOKEN = "obs-stream-key-0123"
OBS_H264 = "42e01f"


def _obs_codecs(kind: str) -> list[Any]:
    codecs = RTCRtpSender.getCapabilities(kind).codecs
    if kind == "audio":
        return [c for c in codecs if c.mimeType == "audio/opus"]
    return [c for c in codecs if c.mimeType == "video/H264" and c.parameters.get("profile-level-id") == OBS_H264]


async def _obs_publisher() -> tuple[RTCPeerConnection, str]:
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    audio = pc.addTransceiver(AudioStreamTrack(), direction="sendonly")
    video = pc.addTransceiver(CodedCamera((320, 240), fps=15), direction="sendonly")
    audio.setCodecPreferences(_obs_codecs("audio"))
    video.setCodecPreferences(_obs_codecs("video"))
    await pc.setLocalDescription(await pc.createOffer())
    return pc, pc.localDescription.sdp


def _codecs(sdp: str, kind: str) -> list[tuple[str, str]]:
    media = next(m for m in SessionDescription.parse(sdp).media if m.kind == kind)
    return [(c.mimeType, str(c.parameters.get("profile-level-id", ""))) for c in media.rtp.codecs]


@pytest.fixture
def browser(chromium_path: Path) -> Iterator[Any]:
    with launched_chromium(chromium_path, CHROMIUM_FLAGS) as browser:
        yield browser


@pytest.fixture
def aio() -> Iterator[Callable[[Any], Any]]:
    """Run coroutines on an event loop in a background thread: the sync Playwright API owns this one."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="aiortc", daemon=True)
    thread.start()
    try:
        yield lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=60)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)


def test_obs_whip_publish_plays_on_viewer_page(
    browser: Any, aio: Callable[[Any], Any], live_server: Callable[..., AbstractContextManager[str]]
) -> None:
    publisher, offer = aio(_obs_publisher())
    # The offer is OBS's: Opus only for audio, H.264 42e01f only for video.
    assert {name for name, _ in _codecs(offer, "audio")} == {"audio/opus"}
    assert {c for c in _codecs(offer, "video") if c[0] != "video/rtx"} == {("video/H264", OBS_H264)}
    headers = {"Content-Type": "application/sdp", "Authorization": f"Bearer {TOKEN}"}
    with live_server(token=TOKEN) as url:
        # Without OBS's Bearer token the endpoint refuses.
        assert http("POST", f"{url}/whip", offer.encode(), {"Content-Type": "application/sdp"})[0] == 401
        status, head, body = http("POST", f"{url}/whip", offer.encode(), headers)
        assert status == 201, body
        location = head["location"]  # the publisher's own session URL
        stream_id = head["x-diffcast-stream-id"]
        answer = body.decode()
        assert {name for name, _ in _codecs(answer, "video")} - {"video/rtx"} == {"video/H264"}
        aio(publisher.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer")))

        # An OBS Browser Source on the viewer page: stylized frames arrive and keep advancing.
        page = browser.new_page(viewport={"width": 640, "height": 480})
        page.on("console", lambda message: print(f"[viewer] {message.type}: {message.text}"))
        page.goto(f"{url}/view/{stream_id}?token={TOKEN}")
        page.wait_for_function(
            "window.diffcastViewer.status === 'playing' && window.diffcastViewer.frames > 10", timeout=40_000
        )
        first = int(page.evaluate("window.diffcastViewer.frames"))
        page.wait_for_timeout(2000)
        assert int(page.evaluate("window.diffcastViewer.frames")) > first

        # The server decoded OBS's H.264 and stylized it (frames in, frames out, a viewer attached).
        status, _, raw = http("GET", f"{url}/api/streams/{stream_id}", None, headers)
        stats = json.loads(raw)
        assert status == 200 and stats["kind"] == "whip", stats
        assert stats["frames_in"] > 10 and stats["frames_out"] > 10 and stats["viewers"] == 1
        # OBS ends the stream with DELETE on the Location, with its token.
        assert http("DELETE", url + location, None, headers)[0] == 200
    aio(publisher.close())
