"""Live-service benchmark: 1, 2 and 4 concurrent streams through a real `diffcast serve` process.

For each stream count it starts synthetic WebRTC clients (streams the server's admission control
refuses are counted, the rest measured) (app.client: moving frames with
frame IDs drawn into the pixels), lets them run, and reports per stream, averaged over streams:
output FPS (new frames per second at the client), TTFF (offer sent -> first stylized frame
decoded), glass-to-glass latency p50/p95 (client capture -> client decode, via the server's trace
stamp) and the dropped-frame ratio (frames the server skipped or discarded / frames it received).

    .venv/bin/python demos/bench_live.py                    # default model (tiny-random until the embedded one exists)
    .venv/bin/python demos/bench_live.py --streams 1 --seconds 30 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.client import CodedCamera, http, open_session  # noqa: E402
from app.server.framecode import MAX_ID  # noqa: E402
from app.server.ice import allow_loopback_candidates  # noqa: E402

WARMUP_S = 3.0  # excluded from FPS and latency: the first chunk and the playout clock settling


@dataclass
class Result:
    streams: int
    admitted: int
    fps: float
    ttff_s: float
    latency_p50_ms: float
    latency_p95_ms: float
    dropped_ratio: float
    server_chunk_ms: float


def default_model() -> str:
    from engine.pipeline import DEFAULT_MODEL

    return "default" if DEFAULT_MODEL.is_file() else "tiny-random"


@contextmanager
def server_process(model: str, port: int, threads: int, max_streams: int, device: str = "cpu",
                   profile: str | None = None) -> Iterator[str]:
    command = [
        sys.executable, "-m", "app.cli", "serve", "--model", model, "--port", str(port),
        "--allow-loopback-candidates", "--trace-stamp", "--max-streams", str(max_streams),
        "--max-streams-per-client", str(max_streams),  # every client here comes from 127.0.0.1
        "--threads", str(threads), "--device", device,
    ]
    if profile is not None:
        command += ["--profile", profile]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited: {process.stderr.read() if process.stderr else ''}")
            try:
                if http("GET", f"{url}/healthz")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not come up within 180 s")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=20)


async def run_streams(url: str, count: int, seconds: float, fps: float) -> Result:
    config = json.loads(http("GET", f"{url}/api/config")[2])
    size = (config["width"], config["height"])
    cameras = [CodedCamera(size, fps=fps, variant=i, id_offset=i * MAX_ID // count) for i in range(count)]
    sessions, refusals = [], []
    for camera in cameras:
        try:
            sessions.append(await open_session(url, camera, prompt="oil painting"))
        except RuntimeError as exc:  # admission control (capacity, serving policy) said no
            refusals.append(str(exc))
    if refusals:
        logging.warning("%d of %d streams refused: %s", len(refusals), count, refusals[0])
    if not sessions:
        raise RuntimeError(f"every stream was refused: {refusals[0]}")
    for _ in tqdm(range(int(seconds)), desc=f"{count} stream(s)", unit="s", leave=False):
        await asyncio.sleep(1)
    stats = [json.loads((await asyncio.to_thread(http, "GET", f"{url}/api/streams/{s.stream_id}"))[2]) for s in sessions]
    await asyncio.gather(*(s.close() for s in sessions))
    await asyncio.sleep(1.0)  # let the server notice and free the slots

    fps_values, ttffs, latencies = [], [], []
    for session in sessions:
        probe = session.probe
        if probe.first_frame_at is None:
            raise RuntimeError(f"stream {session.stream_id} produced no frame in {seconds} s")
        ttffs.append(probe.first_frame_at - session.started)
        since = probe.first_frame_at + WARMUP_S
        steady = [t for t, _, _ in probe.records if t >= since]
        span = (steady[-1] - steady[0]) if len(steady) > 1 else float("nan")
        fps_values.append((len(steady) - 1) / span if span > 0 else 0.0)
        latencies.extend(probe.latencies(since))
    received = sum(s["frames_in"] for s in stats)
    dropped = sum(s["dropped_frames"] for s in stats)
    lat = np.array(latencies) * 1000
    return Result(
        streams=count,
        admitted=len(sessions),
        fps=float(np.mean(fps_values)),
        ttff_s=float(np.mean(ttffs)),
        latency_p50_ms=float(np.percentile(lat, 50)) if lat.size else float("nan"),
        latency_p95_ms=float(np.percentile(lat, 95)) if lat.size else float("nan"),
        dropped_ratio=dropped / received if received else float("nan"),
        server_chunk_ms=float(np.mean([s["chunk_ms"] for s in stats])),
    )


def table(results: list[Result], model: str) -> str:
    lines = [
        f"model: {model}",
        "streams | admitted | fps/stream | TTFF s | g2g p50 ms | g2g p95 ms | dropped | chunk ms",
        "------- | -------- | ---------- | ------ | ---------- | ---------- | ------- | --------",
    ]
    for r in results:
        lines.append(
            f"{r.streams:7d} | {r.admitted:8d} | {r.fps:10.1f} | {r.ttff_s:6.2f} | {r.latency_p50_ms:10.0f} | "
            f"{r.latency_p95_ms:10.0f} | {r.dropped_ratio:7.1%} | {r.server_chunk_ms:8.0f}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model for the server (default: embedded, else tiny-random)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4], help="stream counts to run")
    parser.add_argument("--seconds", type=float, default=20.0, help="run time per stream count")
    parser.add_argument("--fps", type=float, default=30.0, help="camera frame rate of each client")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in the server")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--device", default="cpu", help="the server's torch device (default cpu)")
    parser.add_argument("--profile", default=None, help="fidelity profile for the server's policy (default: bundled)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model = args.model or default_model()
    allow_loopback_candidates()  # the clients run on the same machine as the server
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = []
    with server_process(model, args.port, args.threads, max(args.streams), args.device, args.profile) as url:
        for count in args.streams:
            results.append(asyncio.run(run_streams(url, count, args.seconds, args.fps)))
    if args.json:
        print(json.dumps({"model": model, "results": [asdict(r) for r in results]}, indent=2))
    else:
        print(table(results, model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
