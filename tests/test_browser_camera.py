"""The page's camera choices (web/camera.js) in a real headless Chromium: two fake cameras, the
picker, a camera switch and a resolution change mid-stream, mirror, layout, full screen, the PNG
snapshot, choices that survive a reload; and the page over HTTPS (`serve --https`)."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from conftest import launched_chromium
from test_browser_page import CHROMIUM_FLAGS, _assert_output_advances, _wait

from app.client import http

pytestmark = pytest.mark.browser

# Chromium's own fake cameras (not a file), each with the usual sizes up to 1920x1080. The second
# (fake_device_1) delivers Y16, a depth camera's format, which WebRTC cannot encode (measured: a
# sender given its track sends nothing), so the switch goes to the third (fake_device_2, MJPEG).
FAKE_CAMERAS = [flag for flag in CHROMIUM_FLAGS if not flag.startswith("--use-fake-device-for-media-stream")]
FAKE_CAMERAS.append("--use-fake-device-for-media-stream=device-count=3")

# Output and input, sampled in one task with the snapshot (the same frames), 32x32 RGB.
SAME_MOMENT = """() => {
  const sample = (source) => {
    const canvas = document.createElement("canvas");
    canvas.width = 32; canvas.height = 32;
    const context = canvas.getContext("2d", { willReadFrequently: true });
    context.drawImage(source, 0, 0, 32, 32);
    return Array.from(context.getImageData(0, 0, 32, 32).data);
  };
  const png = window.diffcast.camera.snapshotCanvas().toDataURL("image/png");
  const output = document.getElementById("output");
  return { png, output: sample(output), input: sample(document.getElementById("input")),
           width: output.videoWidth, height: output.videoHeight };
}"""


@pytest.fixture
def browser(chromium_path: Path) -> Iterator[Any]:
    with launched_chromium(chromium_path, FAKE_CAMERAS) as browser:
        yield browser


def _page(browser: Any, **context: Any) -> Any:
    page = browser.new_context(viewport={"width": 1000, "height": 900}, accept_downloads=True, **context).new_page()
    page.on("console", lambda message: print(f"[browser] {message.type}: {message.text}"))
    return page


def _rgb(samples: list[int]) -> np.ndarray:
    return np.array(samples, dtype=float).reshape(32, 32, 4)[..., :3]


def _video_track(page: Any) -> dict[str, Any]:
    return dict(page.evaluate("""() => {
      const track = window.diffcast.camera.track(), sent = window.diffcast.camera.sender().track;
      return { ...track.getSettings(), state: track.readyState, sentIsShown: sent === track };
    }"""))


def _assert_sent_at_the_streams_size(url: str, stream_id: str, camera: tuple[int, int]) -> None:
    """The page sends the camera scaled down to the stream's size, not below it (web/rtc.js): the
    frames the server receives are the stream's size up to the camera's aspect, far from the camera's."""
    deadline = time.monotonic() + 20
    while True:
        stats = json.loads(http("GET", f"{url}/api/streams/{stream_id}")[2])
        sent, stream = (stats["input_width"], stats["input_height"]), (stats["width"], stats["height"])
        at_stream_size = (stream[0] <= sent[0] and stream[1] <= sent[1]
                          and min(sent[0] / stream[0], sent[1] / stream[1]) < 1.1)
        if at_stream_size or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert at_stream_size and sent[0] * sent[1] * 4 < camera[0] * camera[1], (sent, stream, camera)


def test_camera_choices(browser: Any, live_server: Callable[..., AbstractContextManager[str]]) -> None:
    page = _page(browser)
    offers: list[str] = []
    page.on("request", lambda request: offers.append(request.url) if request.url.endswith("/api/offer") else None)
    with live_server() as url:
        page.goto(url)
        page.click("#start")
        _wait(page, "window.diffcast.status === 'live'")
        stream_id = page.evaluate("window.diffcast.streamId")
        # The picker lists the cameras the browser reports (read here independently of the page).
        cameras = page.evaluate("""async () => (await navigator.mediaDevices.enumerateDevices())
            .filter((d) => d.kind === 'videoinput').map((d) => [d.deviceId, d.label])""")
        assert len(cameras) == 3 and all(device_id for device_id, _ in cameras)
        options = page.eval_on_selector_all("#camera-select option", "els => els.map(e => [e.value, e.text])")
        assert options[1:] == [list(c) for c in cameras]

        # Switch to another camera mid-stream: the sent track is swapped, no new offer, same stream.
        assert _video_track(page)["deviceId"] == cameras[0][0]
        other = next(device_id for device_id, label in cameras if label == "fake_device_2")
        page.select_option("#camera-select", other)
        _wait(page, f"window.diffcast.camera.track().getSettings().deviceId === {json.dumps(other)}", 15)
        track = _video_track(page)
        assert track["sentIsShown"] and track["state"] == "live"
        assert offers == [f"{url}/api/offer"] and page.evaluate("window.diffcast.streamId") == stream_id
        frames_in = json.loads(http("GET", f"{url}/api/streams/{stream_id}")[2])["frames_in"]
        _assert_output_advances(page)
        later = json.loads(http("GET", f"{url}/api/streams/{stream_id}")[2])["frames_in"]
        assert later > frames_in  # the new camera's frames reach the server

        # A resolution change reaches the live track.
        for choice, size in (("1280x720", (1280, 720)), ("320x240", (320, 240))):
            page.select_option("#resolution-select", choice)
            _wait(page, f"(s => s.width === {size[0]} && s.height === {size[1]})"
                        "(window.diffcast.camera.track().getSettings())", 15)
            if size == (1280, 720):
                _assert_sent_at_the_streams_size(url, stream_id, size)

        # Mirror flips both videos on screen.
        page.check("#mirror")
        for selector in ("#input", "#output"):
            transform = page.eval_on_selector(selector, "el => getComputedStyle(el).transform")
            assert transform == "matrix(-1, 0, 0, 1, 0, 0)", (selector, transform)

        # The snapshot is the output (as shown: mirrored), at the stream's size, not the camera.
        shot = page.evaluate(SAME_MOMENT)
        png = cv2.imdecode(np.frombuffer(base64.b64decode(shot["png"].split(",", 1)[1]), np.uint8), cv2.IMREAD_COLOR)
        assert png.shape[:2] == (shot["height"], shot["width"])
        unmirrored = cv2.resize(png[:, ::-1, ::-1], (32, 32), interpolation=cv2.INTER_AREA).astype(float)
        to_output = np.abs(unmirrored - _rgb(shot["output"])).mean()
        to_input = np.abs(unmirrored - _rgb(shot["input"])).mean()
        print(f"snapshot vs output {to_output:.1f}, vs input {to_input:.1f}")
        assert to_output < 12 and to_output * 3 < to_input
        # The button downloads it as a PNG file.
        with page.expect_download() as download:
            page.click("#snapshot")
        saved = Path(download.value.path()).read_bytes()
        assert download.value.suggested_filename.endswith(".png") and saved.startswith(b"\x89PNG\r\n\x1a\n")
        assert cv2.imdecode(np.frombuffer(saved, np.uint8), cv2.IMREAD_COLOR).shape[:2] == (shot["height"], shot["width"])

        # Layouts: output only; side by side even on a phone-sized screen.
        page.select_option("#layout-select", "output")
        assert not page.is_visible("#input") and page.is_visible("#output")
        page.select_option("#layout-select", "side")
        page.set_viewport_size({"width": 390, "height": 844})
        boxes = [page.locator(sel).bounding_box() for sel in ("#input", "#output")]
        assert boxes[0] and boxes[1] and abs(boxes[0]["y"] - boxes[1]["y"]) < 1 and boxes[1]["x"] > boxes[0]["x"]

        # Full screen output.
        page.click("#fullscreen")
        _wait(page, "document.fullscreenElement && document.fullscreenElement.id === 'output-pane'", 10)
        page.evaluate("document.exitFullscreen()")

        # The choices survive a reload, and the next stream opens the remembered camera and size.
        page.click("#stop")
        _wait(page, "window.diffcast.status === 'idle'", 10)
        page.reload()
        _wait(page, f"document.querySelector('#camera-select').value === {json.dumps(other)}", 15)
        assert page.input_value("#resolution-select") == "320x240"
        assert page.is_checked("#mirror") and page.input_value("#layout-select") == "side"
        page.click("#start")
        _wait(page, "window.diffcast.status === 'live'")
        settings = _video_track(page)
        assert (settings["deviceId"], settings["width"], settings["height"]) == (other, 320, 240)
        page.click("#stop")
        _wait(page, "window.diffcast.status === 'idle'", 10)


def test_page_streams_over_https(
    browser: Any, live_server: Callable[..., AbstractContextManager[str]], tmp_path: Path
) -> None:
    """The phone flow: `serve --https --host 0.0.0.0` with its self-signed certificate, the page
    opened at the machine's LAN address (a secure context only through TLS), the camera streams."""
    from app.server.edge.tls import lan_addresses, self_signed

    cert = self_signed(tmp_path / "tls")
    lan = next((str(a) for a in lan_addresses() if a.version == 4 and not a.is_loopback), "127.0.0.1")
    page = _page(browser, ignore_https_errors=True)  # self-signed: as a user who accepted it
    with live_server(host="0.0.0.0", https=True, ssl_certfile=str(cert.certfile),
                     ssl_keyfile=str(cert.keyfile)) as url:
        assert url.startswith("https://")
        page.goto(f"{url.replace('127.0.0.1', lan)}/?autostart=1")
        _wait(page, "window.diffcast.status === 'live'")
        assert page.evaluate("[window.isSecureContext, location.hostname]") == [True, lan]
        assert page.evaluate("window.diffcast.transport") == "webrtc"
        _assert_output_advances(page)
        page.click("#stop")
        _wait(page, "window.diffcast.status === 'idle'", 10)
