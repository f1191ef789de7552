"""The page's cue panel in a real Chromium: a cue made from the page's prompt goes to the stream's set
and the key 1 fires it (outside text fields), through the control path."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from test_browser_page import _wait
from test_browser_page import page as page  # the Chromium fixture


def test_a_cue_made_on_the_page_fires_with_its_key(page: Any, live_server: Callable[..., AbstractContextManager[str]]) -> None:
    with live_server() as url:
        page.goto(f"{url}/?autostart=1")
        _wait(page, "window.diffcast && window.diffcast.status === 'live'")
        page.fill("#prompt", "charcoal drawing")
        page.fill("#cue-name", "charcoal")
        page.fill("#cue-seconds", "1")
        page.click("#cue-add")
        _wait(page, "document.querySelectorAll('#cue-list li').length === 1", 15)
        assert page.text_content("#cue-list li") == "1 · charcoal"
        page.fill("#prompt", "ink wash")
        page.click("#apply")
        _wait(page, "window.diffcast.stats && window.diffcast.stats.prompt === 'ink wash'", 15)
        page.evaluate("document.activeElement.blur()")
        page.keyboard.press("1")
        _wait(page, "window.diffcast.stats.prompt === 'charcoal drawing'", 15)
        assert page.evaluate("window.diffcast.errors") == []
