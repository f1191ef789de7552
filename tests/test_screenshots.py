"""Docs checks: screenshots of the page, playground, viewer and dashboard taken by the suite's Chromium,
and the configuration reference against the real `diffcast serve` parser.

Always checks that each surface shows real content (live video, filled stats, table rows);
with DIFFCAST_SCREENSHOTS=1 it also writes the PNGs to docs/img/ for the README and docs:

    DIFFCAST_SCREENSHOTS=1 .venv/bin/pytest tests/test_screenshots.py
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from test_browser_page import CHROMIUM_FLAGS

DOCS_IMG = Path(__file__).resolve().parents[1] / "docs" / "img"
MAX_PNG_BYTES = 400_000


def _save(png: bytes, path: Path) -> None:
    """Write a PNG under the size budget: palette-quantise screenshots that come out too big."""
    if len(png) > MAX_PNG_BYTES:
        buffer = io.BytesIO()
        Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=128).save(buffer, "PNG", optimize=True)
        png = buffer.getvalue()
    assert len(png) <= MAX_PNG_BYTES, f"{path.name}: {len(png)} bytes"
    path.write_bytes(png)


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=float)


def _live_video(page: Any, selector: str) -> None:
    """The element shows moving pictures: not the black placeholder, and not a frozen frame."""
    first = _pixels(page.locator(selector).screenshot())
    page.wait_for_timeout(500)
    second = _pixels(page.locator(selector).screenshot())
    assert first.mean() > 20, f"{selector} is black"
    assert np.abs(first - second).mean() > 0.5, f"{selector} is not moving"


@pytest.mark.browser
def test_screenshots(
    chromium_path: Path, camera_clip: Path, live_server: Callable[..., AbstractContextManager[str]], tmp_path: Path
) -> None:
    from playwright.sync_api import sync_playwright

    out = DOCS_IMG if os.environ.get("DIFFCAST_SCREENSHOTS") == "1" else tmp_path
    out.mkdir(parents=True, exist_ok=True)
    shots: dict[str, bytes] = {}
    with live_server(max_streams=4) as url, sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(chromium_path),
            args=[*CHROMIUM_FLAGS, f"--use-file-for-fake-video-capture={camera_clip}"],
        )
        context = browser.new_context(viewport={"width": 1100, "height": 760})
        page = context.new_page()
        page.goto(f"{url}/?autostart=1")
        page.wait_for_function("window.diffcast.status === 'live' && window.diffcast.outputFrames > 20", timeout=40_000)
        page.wait_for_function("window.diffcast.stats && window.diffcast.stats.frames_out > 10", timeout=20_000)
        _live_video(page, "#output")
        shots["page"] = page.screenshot(full_page=True)
        stream_id = page.evaluate("window.diffcast.streamId")

        viewer = context.new_page()
        viewer.set_viewport_size({"width": 640, "height": 640})
        viewer.goto(f"{url}/view/{stream_id}")
        viewer.wait_for_function("window.diffcastViewer.frames > 8", timeout=40_000)
        _live_video(viewer, "video")
        shots["viewer"] = viewer.screenshot()

        playground = context.new_page()
        playground.goto(f"{url}/playground/")
        playground.wait_for_function("window.diffcastPlayground && window.diffcastPlayground.ready", timeout=40_000)
        playground.click("[data-dc=start]")
        playground.wait_for_function(
            "window.diffcastPlayground.outputFrames > 20 && window.diffcastPlayground.stats", timeout=40_000
        )
        # Placeholder frames count as output frames; wait until the model's own frames are playing.
        playground.wait_for_function(
            "window.diffcastPlayground.stats.frames_out > 10", timeout=40_000
        )
        _live_video(playground, "[data-dc=output]")
        shots["playground"] = playground.screenshot(full_page=True)

        dashboard = context.new_page()
        dashboard.set_viewport_size({"width": 1280, "height": 820})
        dashboard.goto(f"{url}/dashboard")
        dashboard.wait_for_function(
            "window.diffcastDashboard.polls >= 5 && window.diffcastDashboard.last.streams.length === 2", timeout=30_000
        )
        assert dashboard.locator("tr[data-stream]").count() == 2
        shots["dashboard"] = dashboard.screenshot(full_page=True)
        browser.close()
    for name, png in shots.items():
        _save(png, out / f"{name}.png")
        assert _pixels((out / f"{name}.png").read_bytes()).std() > 1, name


def test_configuration_doc_lists_every_serve_flag() -> None:
    """docs/configuration.md documents every `diffcast serve` flag (the parser is the source of truth)."""
    from app.cli import build_parser

    parser = build_parser()
    serve = next(a for a in parser._actions if a.dest == "command").choices["serve"]  # type: ignore[attr-defined]
    flags = {flag for action in serve._actions for flag in action.option_strings if flag.startswith("--")} - {"--help"}
    doc = (DOCS_IMG.parent / "configuration.md").read_text()
    missing = sorted(flag for flag in flags if f"`{flag}" not in doc)
    assert not missing, f"docs/configuration.md does not document {missing}"
