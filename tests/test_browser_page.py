"""The page in a real headless Chromium with a fake camera fed from a generated .y4m clip."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.browser

# docs/architecture.md, "Library facts". Playwright gives every launch a fresh profile directory itself.
CHROMIUM_FLAGS = [
    "--use-fake-device-for-media-stream",
    "--use-fake-ui-for-media-stream",
    "--autoplay-policy=no-user-gesture-required",
    "--allow-loopback-in-peer-connection",
    "--disable-features=WebRtcHideLocalIpsWithMdns",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def page(chromium_path: Path, camera_clip: Path) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(chromium_path),
            args=[*CHROMIUM_FLAGS, f"--use-file-for-fake-video-capture={camera_clip}"],
        )
        page = browser.new_context(viewport={"width": 1000, "height": 800}).new_page()
        page.on("console", lambda message: print(f"[browser] {message.type}: {message.text}"))
        try:
            yield page
        finally:
            browser.close()


def _wait(page: Any, expression: str, timeout_s: float = 45) -> None:
    page.wait_for_function(expression, timeout=timeout_s * 1000)


def _assert_output_advances(page: Any) -> None:
    _wait(page, "window.diffcast.outputFrames > 10")
    frames_before = page.evaluate("window.diffcast.outputFrames")
    page.wait_for_timeout(2000)
    assert page.evaluate("window.diffcast.outputFrames") > frames_before


def _assert_output_keeps_the_cameras_aspect(page: Any, output: str) -> None:
    """The fake camera is 4:3 (320x240): the stream keeps that aspect (288x224 on the default model, the
    16-px grid's nearest within its 256x256 budget) and the output's pane takes the picture's aspect, so
    it shows it whole and unstretched (object-fit: contain)."""
    width, height = page.evaluate(f"(e => [e.videoWidth ?? e.width, e.videoHeight ?? e.height])"
                                  f"(document.querySelector('{output}'))")
    assert abs(width / height - 4 / 3) < 0.06, (width, height)
    pane = page.locator("#output-pane").bounding_box()
    assert pane and abs(pane["width"] / pane["height"] - width / height) < 0.02, (pane, width, height)


def test_page_streams_over_webrtc(page: Any, live_server: Callable[..., AbstractContextManager[str]]) -> None:
    with live_server() as url:
        page.goto(f"{url}/?autostart=1")
        _wait(page, "window.diffcast && window.diffcast.status === 'live'")
        assert page.evaluate("window.diffcast.transport") == "webrtc"
        assert page.text_content("#transport") == "WebRTC"
        # Stylized frames arrive and keep advancing (requestVideoFrameCallback on the output video).
        _assert_output_advances(page)
        _assert_output_keeps_the_cameras_aspect(page, "#output")
        # The stats panel shows live values from the server.
        _wait(page, "window.diffcast.stats && window.diffcast.stats.frames_out > 0")
        for cell in ("#stat-fps", "#stat-latency", "#stat-slack", "#stat-fidelity", "#stat-dropped"):
            assert page.text_content(cell) not in ("", "–"), cell
        assert "steps" in page.text_content("#stat-fidelity")
        # A prompt typed into the page reaches the stream.
        page.fill("#prompt", "cyberpunk neon city")
        page.click("#apply")
        _wait(page, "window.diffcast.stats.prompt === 'cyberpunk neon city'", 15)
        # Sliders too.
        page.eval_on_selector("#steps", "el => { el.value = 1; el.dispatchEvent(new Event('change')); }")
        _wait(page, "window.diffcast.stats.steps === 1", 15)
        assert page.evaluate("window.diffcast.errors") == []
        # The bare viewer page (OBS Browser Source) plays the same stream over WHEP.
        viewer = page.context.new_page()
        viewer.goto(f"{url}/view/{page.evaluate('window.diffcast.streamId')}")
        _wait(viewer, "window.diffcastViewer.status === 'playing' && window.diffcastViewer.frames > 10")
        # The stream has the fake microphone's sound: the viewer plays it (autoplay allowed here).
        _wait(viewer, "window.diffcastViewer.audio === true")
        assert viewer.evaluate("document.querySelector('video').muted") is False
        viewer.close()
        # Phone-sized screen: the two videos stack instead of sitting side by side.
        page.set_viewport_size({"width": 390, "height": 844})
        boxes = [page.locator(sel).bounding_box() for sel in ("#input", "#output")]
        assert boxes[0] and boxes[1] and boxes[1]["y"] >= boxes[0]["y"] + boxes[0]["height"] - 1
        page.click("#stop")
        _wait(page, "window.diffcast.status === 'idle'", 10)


def _mean_output(page: Any, samples: int) -> np.ndarray:
    shots = []
    for _ in range(samples):
        shots.append(np.array(page.evaluate("window.diffcast.snapshot()"), dtype=float).reshape(32, 32, 4)[..., :3])
        page.wait_for_timeout(250)
    return np.mean(shots, axis=0)


def test_prompt_change_visibly_changes_output(
    page: Any, live_server: Callable[..., AbstractContextManager[str]], engine_model: str
) -> None:
    if engine_model == "tiny-random":
        pytest.skip(
            "needs the embedded default model: the tiny random-weight model's output does not depend "
            "measurably on the prompt (measured: time-averaged output moves as much between two windows "
            "of one prompt as across a prompt change)"
        )
    with live_server() as url:
        page.goto(f"{url}/?autostart=1")
        _wait(page, "window.diffcast.status === 'live' && window.diffcast.outputFrames > 15")
        page.wait_for_timeout(1000)
        before_a = _mean_output(page, 8)
        before_b = _mean_output(page, 8)
        page.fill("#prompt", "cyberpunk neon city")
        page.click("#apply")
        _wait(page, "window.diffcast.stats.prompt === 'cyberpunk neon city'", 15)
        page.wait_for_timeout(2000)
        after = _mean_output(page, 8)
        # The page says what a prompt is served as: one naming two looks, half of each.
        page.fill("#prompt", "pencil sketch and watercolor")
        page.click("#apply")
        _wait(page, "document.querySelector('#looks').textContent.includes('pencil sketch 50 %')", 15)
        assert page.text_content("#looks") == "look: pencil sketch 50 % · watercolor 50 %"
        assert page.is_visible("#looks")
    within = np.abs(before_a - before_b).mean()
    across = np.abs(before_b - after).mean()
    print(f"time-averaged output change: within one prompt {within:.2f}, across the change {across:.2f}")
    assert across > 2 * within + 2, (within, across)


def test_page_falls_back_to_websocket(page: Any, live_server: Callable[..., AbstractContextManager[str]]) -> None:
    with live_server(break_ice=True) as url:
        page.goto(f"{url}/?autostart=1&ice_timeout_ms=4000")
        _wait(page, "window.diffcast && window.diffcast.status === 'live'", 60)
        assert page.evaluate("window.diffcast.transport") == "websocket"
        assert page.evaluate("window.diffcast.streamId")
        assert "WebSocket fallback" in page.text_content("#notice")
        assert page.text_content("#transport") == "WebSocket fallback"
        _assert_output_advances(page)
        _assert_output_keeps_the_cameras_aspect(page, "#output-canvas")
        _wait(page, "window.diffcast.stats && window.diffcast.stats.kind === 'ws' && window.diffcast.stats.frames_out > 0")
        # Once the stats say the stream's size, the JPEGs come at it (320x240 camera, 288x224 stream:
        # 299x224), no smaller in either side (the server crops, it does not scale up).
        _wait(page, "(s => s.input_width >= s.width && s.input_height >= s.height"
                    " && s.input_width * s.input_height < 1.1 * s.width * s.height)(window.diffcast.stats)", 15)
        page.fill("#prompt", "charcoal drawing")
        page.click("#apply")
        _wait(page, "window.diffcast.stats.prompt === 'charcoal drawing'", 15)
