"""Autoscaling and a policy-driven re-home of a stream a real Chromium is playing; not run in CI.

    .venv/bin/python demos/cluster_demo.py            # prints a timeline, writes docs/img/cluster-dashboard.png

What it runs, all on loopback and CPU:

1. ``diffcast serve --ray --workers 1 --min-workers 1 --max-workers 2 --worker-delay-ms D,0`` (the
   tiny-random model; worker 0 is made slower than the worker the autoscaler will add).
2. A headless Chromium (Chromium's own fake camera) opens the page with ``?autostart=1`` and plays.
3. Load: ``demos/load_generator.py`` joins aiortc users. The autoscaler sees the utilisation pass its
   band and starts a second Ray actor; once it has loaded its replica, the slack policy re-homes streams
   that fell behind on the slow worker 0 to it (the state moves at a chunk boundary).
4. The load leaves; after ``--scale-in-cooldown-s`` the autoscaler drains a worker, re-homes what is
   left on it, and removes it.

Once a second, a timeline row: the workers (``/api/dashboard``: id, streams, draining), where the
Chromium stream lives, ``diffcast_rehomes_total`` and ``diffcast_scale_events_total`` from ``/metrics``,
and the page's own counters (frames the output video presented, its ``currentTime``). At the end it
checks that the page's frames and ``currentTime`` advanced across every move of its stream. The
dashboard is captured just after the Chromium stream's re-home, while both workers serve.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS_IMG = ROOT / "docs" / "img"
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream",
         "--autoplay-policy=no-user-gesture-required", "--allow-loopback-in-peer-connection",
         "--disable-features=WebRtcHideLocalIpsWithMdns", "--no-sandbox", "--disable-gpu", "--no-first-run"]
PAGE_STATE = """() => {
  const d = window.diffcast, v = document.querySelector('#output');
  return {status: d && d.status, stream: d && d.streamId, frames: d ? d.outputFrames : 0,
          time: v ? v.currentTime : 0};
}"""


@dataclass
class Sample:
    t: float
    phase: str
    workers: list[tuple[str, int, bool]]  # (id, streams, draining)
    home: str | None  # the worker the Chromium stream lives on
    rehomes: int
    scale_up: int
    scale_down: int
    frames: int
    current_time: float

    def row(self) -> str:
        workers = " ".join(f"{w}:{n}{'(draining)' if d else ''}" for w, n, d in self.workers)
        return (f"{self.t:6.1f}  {self.phase:<9} {len(self.workers)}  {workers:<34} {self.home or '-':<9} "
                f"{self.rehomes:3d}  {self.scale_up}/{self.scale_down}  {self.frames:6d}  {self.current_time:7.2f}")


HEADER = "   t s  phase     W  workers (id:streams)               chromium  re-homes  up/down  frames  video t"


@dataclass
class Timeline:
    started: float = field(default_factory=time.monotonic)
    samples: list[Sample] = field(default_factory=list)
    moves: list[dict[str, Any]] = field(default_factory=list)  # the Chromium stream's re-homes (dashboard)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return str(reply.read().decode())


def metric(text: str, name: str, labels: str = "") -> int:
    match = re.search(rf"^{name}{re.escape(labels)} ([0-9.e+]+)$", text, re.MULTILINE)
    return int(float(match.group(1))) if match else 0


def sample(url: str, page: Any, timeline: Timeline, phase: str) -> Sample:
    board = json.loads(get(f"{url}/api/dashboard"))
    metrics = get(f"{url}/metrics")
    state = page.evaluate(PAGE_STATE)
    stream = state["stream"]
    home = next((w["id"] for w in board["workers"] if stream in w["stream_ids"]), None)
    for action in board["actions"]:
        if action.get("action") == "rehome" and action.get("stream") == stream and action not in timeline.moves:
            timeline.moves.append(action)
    row = Sample(
        t=time.monotonic() - timeline.started, phase=phase,
        workers=[(w["id"], w["streams"], bool(w["draining"])) for w in board["workers"]], home=home,
        rehomes=metric(metrics, "diffcast_rehomes_total"),
        scale_up=metric(metrics, "diffcast_scale_events_total", '{direction="up"}'),
        scale_down=metric(metrics, "diffcast_scale_events_total", '{direction="down"}'),
        frames=int(state["frames"]), current_time=float(state["time"]),
    )
    timeline.samples.append(row)
    print(row.row(), flush=True)
    return row


def start_server(args: argparse.Namespace, log_path: Path) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "app.cli", "serve", "--model", args.model, "--device", "cpu",
        "--port", str(args.port), "--allow-loopback-candidates", "--ray", "--workers", "1",
        "--min-workers", "1", "--max-workers", "2", "--worker-delay-ms", f"{args.slow_ms},0",
        "--scale-in-cooldown-s", str(args.cooldown_s), "--max-streams", str(args.users + 2),
        "--max-streams-per-client", str(args.users + 2), "--policy", "slack",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited ({server.returncode}); see {log_path}")
        try:
            get(f"http://127.0.0.1:{args.port}/healthz")
            return server
        except OSError:
            time.sleep(1)
    server.terminate()
    raise SystemExit(f"the server did not come up in 300 s; see {log_path}")


def start_load(args: argparse.Namespace, url: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, str(ROOT / "demos" / "load_generator.py"), "--server", url,
               "--users", str(args.users), "--rate", "2", "--duration", str(args.load_s),
               "--switch-every", str(args.load_s)]
    return subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def check_moves(timeline: Timeline) -> list[str]:
    """For each move of the Chromium stream: the page's frames and video time at the samples before the
    move, after it, and the next ones (the page kept playing when both kept rising)."""
    lines = []
    samples = timeline.samples
    for i in range(1, len(samples)):
        before, after = samples[i - 1], samples[i]
        if not (before.home and after.home and before.home != after.home):
            continue
        window = samples[max(0, i - 3): i + 3]
        frames = ", ".join(f"{s.frames} at {s.t:.1f} s" for s in window)
        times = ", ".join(f"{s.current_time:.2f}" for s in window)
        later = samples[i + 1] if i + 1 < len(samples) else after
        playing = after.frames > before.frames and later.frames > after.frames and \
            later.current_time > before.current_time
        lines.append(f"move {before.home} -> {after.home} between t={before.t:.1f} and {after.t:.1f} s: page frames "
                     f"{frames}; video time {times} s ({'kept playing' if playing else 'STALLED'})")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--port", type=int, default=8761)
    parser.add_argument("--slow-ms", type=int, default=40, help="--worker-delay-ms of worker 0 (default 40)")
    parser.add_argument("--users", type=int, default=4, help="aiortc load users (default 4)")
    parser.add_argument("--load-s", type=float, default=70.0, help="seconds each load user stays (default 70)")
    parser.add_argument("--cooldown-s", type=float, default=20.0, help="--scale-in-cooldown-s (default 20)")
    parser.add_argument("--screenshot", type=Path, default=DOCS_IMG / "cluster-dashboard.png")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    url = f"http://127.0.0.1:{args.port}"
    log_path = Path(tempfile.mkdtemp(prefix="cluster-demo-")) / "server.log"
    print(f"server log: {log_path}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the clean-up below
    server = start_server(args, log_path)
    timeline = Timeline()
    shot = False
    load: subprocess.Popen[bytes] | None = None
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            page = browser.new_context(viewport={"width": 1000, "height": 760}).new_page()
            page.goto(f"{url}/?autostart=1")
            page.wait_for_function("window.diffcast && window.diffcast.outputFrames > 5", timeout=300_000)
            board = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
            board.goto(f"{url}/dashboard")
            print(HEADER, flush=True)
            # At least 10 s of Chromium alone, and until one worker serves it (the first chunks, slow
            # while the replica warms up, can make the calibrated speed look low enough to scale out).
            quiet_until = time.monotonic() + 10
            give_up = time.monotonic() + args.cooldown_s + 60
            while time.monotonic() < give_up:
                row = sample(url, page, timeline, "chromium")
                if time.monotonic() > quiet_until and len(row.workers) == 1:
                    break
                time.sleep(1)
            downs_before = timeline.samples[-1].scale_down
            load = start_load(args, url)
            phase_end = time.monotonic() + args.load_s + 5
            while time.monotonic() < phase_end:
                row = sample(url, page, timeline, "load")
                if not shot and timeline.moves and len(row.workers) == 2:
                    time.sleep(2)  # the dashboard polls once a second
                    args.screenshot.parent.mkdir(parents=True, exist_ok=True)
                    board.screenshot(path=str(args.screenshot), full_page=True)
                    print(f"dashboard screenshot: {args.screenshot}", flush=True)
                    shot = True
                time.sleep(1)
            load.wait(timeout=60)
            deadline = time.monotonic() + args.cooldown_s + 60
            while time.monotonic() < deadline:
                row = sample(url, page, timeline, "after")
                if len(row.workers) == 1 and row.scale_down > downs_before:
                    break
                time.sleep(1)
            for _ in range(5):
                sample(url, page, timeline, "after")
                time.sleep(1)
            if not shot:
                board.screenshot(path=str(args.screenshot), full_page=True)
                print(f"dashboard screenshot (no move of the Chromium stream seen): {args.screenshot}")
            browser.close()
    finally:
        if load is not None and load.poll() is None:
            load.terminate()
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:  # a Ray shutdown that hangs
            server.kill()
    last = timeline.samples[-1]
    print(f"\nChromium stream moves (policy actions): {json.dumps(timeline.moves)}")
    for line in check_moves(timeline):
        print(line)
    print(f"workers at most {max(len(s.workers) for s in timeline.samples)}, at the end {len(last.workers)}; "
          f"scale events up {last.scale_up}, down {last.scale_down}; re-homes {last.rehomes}; "
          f"page frames {last.frames}, video time {last.current_time:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
