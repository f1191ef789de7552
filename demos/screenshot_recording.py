"""Screenshot of the page recording on the server (docs/img/recording.png): a real `diffcast serve
--record-dir`, Chromium with its fake camera and microphone, ● Record pressed, a few seconds
recorded, stopped, and the recordings list showing the file.

    .venv/bin/python demos/screenshot_recording.py            # default model
    .venv/bin/python demos/screenshot_recording.py --out /tmp/recording.png
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "demos"))

from bench_live import default_model  # noqa: E402

from app.client import http  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
# Chromium's fake devices and permissions, as in the browser tests (docs/architecture.md, "Library facts").
FLAGS = [
    "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream",
    "--autoplay-policy=no-user-gesture-required", "--allow-loopback-in-peer-connection",
    "--disable-features=WebRtcHideLocalIpsWithMdns", "--no-sandbox", "--disable-gpu", "--no-first-run",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model for the server (default: embedded, else tiny-random)")
    parser.add_argument("--port", type=int, default=8768)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "recording.png")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    url = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory() as records:
        server = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--model", args.model or default_model(), "--port",
             str(args.port), "--allow-loopback-candidates", "--threads", "2", "--record-dir", records],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 180
            while True:
                try:
                    if http("GET", f"{url}/healthz")[0] == 200:
                        break
                except OSError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the server did not come up")
                time.sleep(0.5)
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
                page = browser.new_context(viewport={"width": 1100, "height": 760}).new_page()
                page.goto(f"{url}/?autostart=1")
                page.wait_for_function("window.diffcast.status === 'live' && window.diffcast.outputFrames > 20",
                                       timeout=60_000)
                page.wait_for_function("window.diffcast.stats && window.diffcast.stats.audio", timeout=20_000)
                for _ in range(2):  # two recordings, a few seconds each
                    page.click("#record")
                    page.wait_for_function("window.diffcast.stats.recording === true", timeout=15_000)
                    page.wait_for_timeout(3000)
                    page.click("#record")
                    page.wait_for_function("window.diffcast.stats.recording === false", timeout=15_000)
                page.wait_for_function("window.diffcast.recordings.filter((r) => !r.recording).length === 2",
                                       timeout=20_000)
                page.click("#record")  # a third one running while the shot is taken
                page.wait_for_function("window.diffcast.stats.recording === true", timeout=15_000)
                page.wait_for_timeout(1500)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(args.out), full_page=True)
                browser.close()
        finally:
            server.terminate()
            server.wait(timeout=20)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
