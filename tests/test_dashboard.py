"""The operator dashboard: /api/dashboard against the live sessions and /metrics, and the page in Chromium."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
from test_browser_page import CHROMIUM_FLAGS
from test_obs_whip import aio  # noqa: F401  (fixture: an asyncio loop in a thread for aiortc)

from app.client import CodedCamera, http, open_session
from engine.serving.credit import Tier


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    status, _, body = http("GET", url, None, headers)
    return status, json.loads(body) if body.startswith((b"{", b"[")) else body.decode()


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


@pytest.fixture
def two_streams(
    request: pytest.FixtureRequest,
    aio: Callable[[Any], Any],  # noqa: F811  (the fixture imported above, requested by name)
    live_server: Callable[..., AbstractContextManager[str]],
) -> Iterator[tuple[str, list[str]]]:
    policy = getattr(request, "param", "slack")
    with live_server(max_streams=3, policy=policy) as url:
        sessions = [aio(open_session(url, CodedCamera((128, 128), fps=15, variant=i))) for i in range(2)]
        try:
            yield url, [s.stream_id for s in sessions]
        finally:
            for s in sessions:
                aio(s.close())


def _settled_snapshot(url: str) -> dict[str, Any]:
    def ready() -> bool:
        streams = _get(f"{url}/api/dashboard")[1]["streams"]
        return len(streams) == 2 and all(s["chunk_ms"] > 0 and s["frames_out"] > 5 for s in streams)

    _wait_for(ready)
    time.sleep(1.0)  # a second snapshot after a gap gives chunk rates
    status, data = _get(f"{url}/api/dashboard")
    assert status == 200
    return data


def _check_common(url: str, data: dict[str, Any], ids: list[str], policy: str) -> dict[str, dict[str, Any]]:
    streams = {s["stream_id"]: s for s in data["streams"]}
    assert set(streams) == set(ids)
    (worker,) = data["workers"]
    assert worker["streams"] == 2 and worker["max_streams"] == 3 and worker["device"] == "cpu"
    assert worker["policy"] == policy
    assert data["totals"]["streams"] == 2 and sum(data["totals"]["tiers"].values()) == 2
    assert worker["load"] > 0  # the engine thread is doing work for these streams
    metrics = http("GET", f"{url}/metrics")[2].decode()
    # The threads its last step ran on (the thread budget's choice), in the snapshot and in /metrics.
    assert worker["threads"] >= 1 and re.search(r'diffcast_engine_threads\{worker="0"\} [1-9]', metrics), metrics
    assert re.search(r"diffcast_engine_cores_left [0-9.]+", metrics), metrics  # what the budget follows
    for stream_id, row in streams.items():
        assert row["kind"] == "webrtc" and row["tier"] in {t.name for t in Tier}
        assert row["engine_threads"] >= 1  # its lane's last step
        # Same source as /metrics: the frame counters agree (they only grow between the two reads).
        match = re.search(
            rf'diffcast_stream_input_frames_total{{kind="webrtc",stream_id="{stream_id}"}} ([0-9.]+)', metrics
        )
        assert match is not None, metrics
        assert float(match.group(1)) >= row["frames_in"]
    return streams


@pytest.mark.parametrize("two_streams", ["fifo"], indirect=True)
def test_dashboard_computes_tiers_under_fifo(two_streams: tuple[str, list[str]]) -> None:
    url, ids = two_streams
    for row in _check_common(url, _settled_snapshot(url), ids, "fifo").values():
        # The fifo preset runs in the same engine core: its tier and credit are the core's own.
        assert row["policy"] == "fifo" and row["tier"] in ("URGENT", "NORMAL", "RELAXED")
        assert row["fidelity_steps"] == row["steps"]  # FIFO runs the stream at its own steps


def test_dashboard_shows_the_policy_decisions(two_streams: tuple[str, list[str]]) -> None:
    url, ids = two_streams
    for stream_id, row in _check_common(url, _settled_snapshot(url), ids, "slack").items():
        # Under --policy slack the tier, credit and fidelity are the policy's own (its stats fields).
        assert row["policy"] == "slackserve" and row["cpr"] >= 0
        assert row["fidelity"].startswith(f"S{row['fidelity_steps']}/W")  # the policy's config label
        assert 1 <= row["fidelity_steps"] <= row["steps"]  # the user's steps cap the policy's choice
        assert _get(f"{url}/api/streams/{stream_id}")[1]["policy"] == "slackserve"
    # GET /api/workers: the in-process engine is one worker with both streams; local, so no token needed.
    status, workers = _get(f"{url}/api/workers")
    assert status == 200
    (worker,) = workers
    assert worker["id"] == 0 and worker["device"] == "cpu" and sorted(worker["streams"]) == sorted(ids)
    assert set(worker["tiers"]) == {"urgent", "normal", "relaxed"} and sum(worker["tiers"].values()) <= 2
    assert 0 < worker["load"] <= 1 and worker["threads"] >= 1
    metrics = http("GET", f"{url}/metrics")[2].decode()
    assert "diffcast_workers 1.0" in metrics and 'diffcast_scale_events_total{direction="up"} 0.0' in metrics


def test_dashboard_needs_the_token_when_the_server_has_one(live_server: Callable[..., AbstractContextManager[str]]) -> None:
    with live_server(token="t0k-0123456789abcdef") as url:
        assert _get(f"{url}/api/dashboard")[0] == 401
        status, data = _get(f"{url}/api/dashboard", {"Authorization": "Bearer t0k-0123456789abcdef"})
        assert status == 200 and data["streams"] == [] and data["workers"][0]["streams"] == 0
        assert _get(f"{url}/api/workers")[0] == 401
        status, workers = _get(f"{url}/api/workers", {"Authorization": "Bearer t0k-0123456789abcdef"})
        assert status == 200 and workers[0]["streams"] == []


@pytest.mark.browser
def test_dashboard_page_updates_live(chromium_path: Path, two_streams: tuple[str, list[str]]) -> None:
    from playwright.sync_api import sync_playwright

    url, ids = two_streams
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium_path), args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(f"{url}/dashboard")
        page.wait_for_function("window.diffcastDashboard.polls >= 2", timeout=20_000)
        for stream_id in ids:
            page.wait_for_selector(f"tr[data-stream='{stream_id}']", timeout=10_000)
        assert page.text_content("#total-streams") == "2 / 3"
        # Polled about once a second: the history grows while we wait.
        before = page.evaluate("window.diffcastDashboard.polls")
        page.wait_for_timeout(3000)
        after = page.evaluate("window.diffcastDashboard.polls")
        assert 2 <= after - before <= 5
        assert page.evaluate("window.diffcastDashboard.errors") == 0
        tiers = page.eval_on_selector_all(".tier", "els => els.map(e => e.textContent)")
        assert len(tiers) == 2 and set(tiers) <= {"URGENT", "NORMAL", "RELAXED", "WARMING"}
        # Each row shows its stream's size as the server reports it, and the 128x128 cameras' frames
        # where they differ from it.
        for stream_id in ids:
            stats = _get(f"{url}/api/streams/{stream_id}")[1]
            stream = f"{stats['width']}x{stats['height']}"
            expected = stream if stream == "128x128" else f"{stream} ← 128x128"
            assert page.text_content(f"tr[data-stream='{stream_id}'] td.size") == expected
        browser.close()
