"""README screenshots of the page's camera choices, its cue panel and the phone flow, taken with Chromium
on the embedded default model (tiny-random when it is absent); not run in CI.

    .venv/bin/python demos/page_screenshots.py                 # writes docs/img/page-*.png
    .venv/bin/python demos/page_screenshots.py --out /tmp/shots

A real server (the app `diffcast serve` runs, over HTTPS with a throw-away self-signed certificate)
and Chromium's own fake camera; each shot waits until the stylized output is live.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from webcam_browser import default_model  # noqa: E402

from app.server.app import create_app  # noqa: E402
from app.server.config import ServerConfig  # noqa: E402
from app.server.edge.http_server import uvicorn_server  # noqa: E402
from app.server.edge.tls import self_signed  # noqa: E402

DOCS_IMG = Path(__file__).resolve().parents[1] / "docs" / "img"
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream",
         "--autoplay-policy=no-user-gesture-required", "--allow-loopback-in-peer-connection",
         "--no-sandbox", "--disable-gpu", "--no-first-run"]


def live(page: object, url: str, frames: int) -> None:
    page.goto(f"{url}/?autostart=1")  # type: ignore[attr-defined]
    page.wait_for_function(  # type: ignore[attr-defined]
        f"window.diffcast && window.diffcast.status === 'live' && window.diffcast.outputFrames > {frames}",
        timeout=300_000)
    page.wait_for_timeout(1500)  # type: ignore[attr-defined]


def cue_set(page: object) -> None:
    """A performer's set: a cue per look from the prompt box (the panel's "+ Cue"), then the first
    fired by its key mid-stream, gliding over two seconds."""
    for prompt, name in (("pencil sketch", "sketch"), ("watercolor", "wash"), ("thermal camera", "heat")):
        page.fill("#prompt", prompt)  # type: ignore[attr-defined]
        page.press("#prompt", "Enter")  # type: ignore[attr-defined]
        page.wait_for_timeout(800)  # type: ignore[attr-defined]
        page.fill("#cue-name", name)  # type: ignore[attr-defined]
        page.click("#cue-add")  # type: ignore[attr-defined]
    page.click("body", position={"x": 5, "y": 5})  # type: ignore[attr-defined]  # keys fire cues outside text fields
    page.keyboard.press("1")  # type: ignore[attr-defined]
    page.wait_for_timeout(3000)  # type: ignore[attr-defined]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model (default: the embedded one, else tiny-random)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=DOCS_IMG)
    parser.add_argument("--port", type=int, default=8743)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    model = args.model or default_model()
    with tempfile.TemporaryDirectory() as tls_dir:
        cert = self_signed(Path(tls_dir))
        config = ServerConfig(port=args.port, model=model, device=args.device, allow_loopback_candidates=True,
                              https=True, ssl_certfile=str(cert.certfile), ssl_keyfile=str(cert.keyfile))
        server = uvicorn_server(create_app(config), config, log_level="warning")
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.1)
        url = f"https://127.0.0.1:{args.port}"
        args.out.mkdir(parents=True, exist_ok=True)
        try:
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
                desktop = browser.new_context(viewport={"width": 1200, "height": 860}, ignore_https_errors=True)
                page = desktop.new_page()
                live(page, url, 30)
                page.screenshot(path=str(args.out / "page-camera.png"))
                cue_set(page)
                page.screenshot(path=str(args.out / "page-cues.png"), full_page=True)
                page.select_option("#layout-select", "output")
                page.check("#mirror")
                page.evaluate("window.scrollTo(0, 0)")
                page.wait_for_timeout(1000)
                page.screenshot(path=str(args.out / "page-output-only.png"))
                page.select_option("#layout-select", "auto")  # the next visit's defaults
                page.uncheck("#mirror")
                page.click("#stop")
                phone = browser.new_context(viewport={"width": 390, "height": 844}, device_scale_factor=2,
                                            is_mobile=True, has_touch=True, ignore_https_errors=True)
                page = phone.new_page()
                live(page, url, 30)
                page.screenshot(path=str(args.out / "page-phone-https.png"))
                page.click("#stop")
                browser.close()
        finally:
            server.should_exit = True
            thread.join(timeout=30)
    for name in ("page-camera.png", "page-cues.png", "page-output-only.png", "page-phone-https.png"):
        path = args.out / name
        print(f"{path} ({path.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
