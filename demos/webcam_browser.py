"""Your webcam in the browser, stylized live: starts `diffcast serve` and opens the page.

    .venv/bin/python demos/webcam_browser.py                       # the embedded model (tiny-random if absent)
    .venv/bin/python demos/webcam_browser.py --open playground     # the Gradio playground instead
    .venv/bin/python demos/webcam_browser.py --host 0.0.0.0 --no-browser   # serve a phone on the LAN

Browsers only give camera access to https:// pages or to http://localhost; for another device on
the LAN run `diffcast serve --https --host 0.0.0.0` (docs/service.md, "A phone as the camera").
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import webbrowser
from pathlib import Path
from urllib.parse import urljoin

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.cli import main as diffcast  # noqa: E402
from app.client import http  # noqa: E402

PAGES = {"page": "/", "playground": "/playground/", "dashboard": "/dashboard"}


def default_model() -> str:
    from engine.pipeline import DEFAULT_MODEL

    return "default" if DEFAULT_MODEL.is_file() else "tiny-random"


def open_when_up(url: str, timeout_s: float = 300) -> None:
    health = urljoin(url, "/healthz")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if http("GET", health)[0] == 200:
                print(f"opening {url}")
                webbrowser.open(url)
                return
        except OSError:
            pass
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model (default: the embedded one, else tiny-random)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--device", default="cpu", help="cuda for a GPU")
    parser.add_argument("--open", choices=sorted(PAGES), default="page", help="which page to open")
    parser.add_argument("--no-browser", action="store_true")
    args = parser.parse_args()
    model = args.model or default_model()
    shown = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{shown}:{args.port}{PAGES[args.open]}"
    print(f"model {model}; page {url} (playground /playground/, dashboard /dashboard); Ctrl+C stops")
    if not args.no_browser:
        threading.Thread(target=open_when_up, args=(url,), daemon=True).start()
    serve = ["serve", "--model", model, "--host", args.host, "--port", str(args.port), "--device", args.device]
    if args.host in ("127.0.0.1", "localhost"):
        serve.append("--allow-loopback-candidates")  # browser and server on one machine
    return diffcast(serve)


if __name__ == "__main__":
    sys.exit(main())
