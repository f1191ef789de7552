"""Sound and recording on the page (web/record.js) in a real headless Chromium with fake devices."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
from test_browser_page import _wait, page  # noqa: F401  (the Chromium page fixture)

pytestmark = pytest.mark.browser


def test_page_sends_the_microphone_and_records(
    page: Any, live_server: Callable[..., AbstractContextManager[str]], tmp_path: Path  # noqa: F811
) -> None:
    with live_server(record_dir=str(tmp_path / "rec")) as url:
        page.goto(f"{url}/?autostart=1")
        _wait(page, "window.diffcast.status === 'live' && window.diffcast.outputFrames > 5")
        # Chromium's fake microphone goes up with the camera and its audio comes back on the output.
        _wait(page, "window.diffcast.stats && window.diffcast.stats.audio === true", 15)
        _wait(page, "document.querySelector('#output').srcObject.getAudioTracks().length === 1", 15)
        assert page.evaluate("document.querySelector('#output').muted") is False
        assert page.evaluate("document.querySelector('#input').muted") is True  # no echo of oneself

        # The viewer page (an OBS Browser Source) plays the sound too.
        viewer = page.context.new_page()
        viewer.goto(f"{url}/view/{page.evaluate('window.diffcast.streamId')}")
        _wait(viewer, "window.diffcastViewer.status === 'playing' && window.diffcastViewer.audio === true")
        assert viewer.evaluate("document.querySelector('video').muted") is False
        viewer.close()

        # Server-side recording: the button sends the control field, the list offers the file.
        assert page.is_visible("#record")
        page.click("#record")
        _wait(page, "window.diffcast.stats.recording === true", 15)
        page.wait_for_timeout(2000)
        page.click("#record")
        _wait(page, "window.diffcast.recordings.length === 1 && !window.diffcast.recordings[0].recording", 20)
        href = page.get_attribute("#recordings a", "href")
        status, kind = page.evaluate(
            "async (href) => { const r = await fetch(href); return [r.status, r.headers.get('content-type')]; }", href)
        assert status == 200 and kind == "video/mp4"

        # The client-side clip: MediaRecorder over what the page shows, saved as a download.
        page.click("#clip")
        page.wait_for_timeout(2000)
        with page.expect_download() as download:
            page.click("#clip")
        assert download.value.suggested_filename.startswith("diffcast-")
        assert page.evaluate("window.diffcast.clipBytes") > 1000

        # The microphone choice is remembered: off, the next stream is video only.
        page.click("#stop")
        _wait(page, "window.diffcast.status === 'idle'", 10)
        page.uncheck("#mic")
        page.goto(f"{url}/?autostart=1")
        _wait(page, "window.diffcast.stats && window.diffcast.stats.frames_out > 0")
        assert not page.is_checked("#mic")
        assert page.evaluate("window.diffcast.stats.audio") is False
