"""A stream's size from its camera's aspect (engine/aspect.py): the rule, a crop that never stretches, and
the live server's streams at their cameras' aspect."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import av
import cv2
import numpy as np
import pytest
from _output_checks import MIN_CONTRAST, assert_undistorted, circles_clip, contrast
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

from app.client import CodedCamera, OutputProbe, http, open_session, open_whip_session
from engine.aspect import crop_box, fit_frame, fit_size

BUDGET, GRID = 256 * 256, 16  # the embedded default model's


@pytest.mark.parametrize(("camera", "expected"), [
    ((640, 480), (288, 224)), ((1280, 720), (336, 192)), ((1920, 1080), (336, 192)), ((720, 480), (304, 208)),
    ((256, 256), (256, 256)), ((480, 640), (224, 288)), ((720, 1280), (192, 336)), ((160, 120), (288, 224)),
])
def test_common_cameras_get_the_documented_sizes(camera: tuple[int, int], expected: tuple[int, int]) -> None:
    assert fit_size(camera, BUDGET, GRID) == expected


@pytest.mark.parametrize("budget", [BUDGET, 128 * 128, 192 * 192, 832 * 480, 150 * 150])
def test_sizes_are_on_the_grid_within_the_budget_close_to_the_aspect_and_stable(budget: int) -> None:
    for width in range(48, 2000, 37):
        for height in (120, 240, 480, 720, 1080):
            if not 0.25 <= width / height <= 4:  # a camera, not a strip
                continue
            w, h = fit_size((width, height), budget, GRID)
            assert w % GRID == 0 and h % GRID == 0 and w * h <= budget
            assert w * h >= 0.7 * budget  # nothing small chosen for its exact aspect
            # The aspect within what a grid step on the shorter side can miss (3.6 % for 4:3 at 288x224).
            assert abs(np.log((w / h) / (width / height))) < 1.5 * GRID / min(w, h)
            # A stream's own size maps to itself: the server's fitted frames and the engine agree.
            assert fit_size((w, h), budget, GRID) == (w, h)


def test_a_square_stays_square_at_every_scale() -> None:
    for side in range(16, 400, 8):
        expected = side // GRID * GRID
        if expected:
            assert fit_size((256, 256), side * side, GRID) == (expected, expected)


def test_a_budget_without_one_cell_is_refused() -> None:
    with pytest.raises(ValueError, match="holds no"):
        fit_size((640, 480), 200, GRID)
    with pytest.raises(ValueError, match="positive"):
        fit_size((0, 480), BUDGET, GRID)


def test_fitting_crops_the_excess_and_keeps_a_circle_round() -> None:
    image = np.zeros((480, 640, 3), np.uint8)
    cv2.circle(image, (320, 240), 150, (255, 255, 255), -1, cv2.LINE_AA)
    assert crop_box((640, 480), (288, 224)) == (11, 0, 617, 480)  # 23 columns of 640 cropped, none stretched
    for size in ((288, 224), (336, 192), (256, 256), (224, 288)):
        out = fit_frame(image, size)
        assert out.shape == (size[1], size[0], 3)
        ys, xs = np.nonzero(out[..., 0] > 127)
        width, height = xs.max() - xs.min() + 1, ys.max() - ys.min() + 1
        assert abs(width / height - 1.0) < 0.03, f"at {size} the circle is {width}x{height}"


class StillCamera(CodedCamera):
    """A paced camera showing one picture (so the output can be compared with it whenever it arrives)."""

    def __init__(self, image: np.ndarray, fps: float = 15.0) -> None:
        super().__init__((image.shape[1], image.shape[0]), fps)
        self.image = image

    async def recv(self) -> av.VideoFrame:
        frame = await super().recv()
        still = av.VideoFrame.from_ndarray(self.image, format="rgb24")
        still.pts, still.time_base = frame.pts, frame.time_base
        return still


async def _stylized_frame(probe: OutputProbe, size: tuple[int, int], timeout_s: float = 60.0) -> np.ndarray:
    """The first output frame at ``size`` that is a picture (not the black frame shown before the first
    chunk), a few frames into the stream."""
    deadline = time.monotonic() + timeout_s
    seen = 0
    while time.monotonic() < deadline:
        image = probe.last_image
        if image is not None and image.shape == (size[1], size[0], 3) and contrast(image[None]) > MIN_CONTRAST:
            seen += 1
            if seen > 5:
                return image
        await asyncio.sleep(0.2)
    shape = None if probe.last_image is None else probe.last_image.shape
    raise AssertionError(f"no stylised {size[0]}x{size[1]} frame within {timeout_s} s (last: {shape})")


async def test_live_server_streams_4_3_and_16_9_cameras_undistorted(
        live_server: Callable[..., AbstractContextManager[str]], engine_factory: Any) -> None:
    """A 4:3 camera through the page's protocol (/api/offer) and a 16:9 one through WHIP, each watched
    over WebRTC (the 16:9 one by a WHEP viewer too): they come back at their aspect, at the sizes
    docs/default-model.md gives (the model's pixel budget, the aspect the 16-px grid can hit), undistorted
    (the circles stay circles) and stylised."""
    expected = {(640, 480): (288, 224), (640, 360): (336, 192)} if engine_factory.size == (256, 256) else \
        {(640, 480): (144, 112), (640, 360): (160, 96)}  # tiny-random: a 128x128 budget
    with live_server(max_streams=2) as url:
        still = circles_clip((640, 480), 1)[0]
        session = await open_session(url, StillCamera(still), prompt="oil painting")
        try:
            out = await _stylized_frame(session.probe, expected[(640, 480)])
            assert_undistorted(out[None], still[None], moving=False)
        finally:
            await session.close()

        wide = circles_clip((640, 360), 1)[0]
        publisher = await open_whip_session(url, StillCamera(wide), prompt="oil painting")
        viewer = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        probe = OutputProbe()
        viewer.on("track", lambda track: asyncio.ensure_future(probe.consume(track)))
        try:
            viewer.addTransceiver("video", direction="recvonly")
            await viewer.setLocalDescription(await viewer.createOffer())
            status, _, answer = await asyncio.to_thread(
                http, "POST", f"{url}/whep/{publisher.stream_id}", viewer.localDescription.sdp.encode(),
                {"Content-Type": "application/sdp"})
            assert status == 201, answer
            await viewer.setRemoteDescription(RTCSessionDescription(sdp=answer.decode(), type="answer"))
            out = await _stylized_frame(probe, expected[(640, 360)])
            assert_undistorted(out[None], wide[None], moving=False)
        finally:
            await asyncio.gather(viewer.close(), publisher.close())
