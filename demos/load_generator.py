"""Multi-user load generator: synthetic WebRTC users against a running diffcast server.

Each user is a real aiortc peer (app.client): a paced synthetic camera with frame IDs drawn
into its pixels, a control data channel, and a probe on the stylized track that comes back. Users
arrive at random (Poisson, --rate per second), stay --duration seconds, and switch prompts now and
then, like people trying styles. Refused users (503 at capacity) are counted, not retried.

    diffcast serve --model tiny-random --allow-loopback-candidates --trace-stamp --max-streams 8 &
    .venv/bin/python demos/load_generator.py --server http://127.0.0.1:8080 --users 6 --rate 0.5 --duration 20

Glass-to-glass latency needs the server's --trace-stamp; without it only fps and TTFF are reported.
Watch the run live on http://127.0.0.1:8080/dashboard.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.client import CodedCamera, http, open_session  # noqa: E402
from app.server.media.framecode import MAX_ID  # noqa: E402
from app.server.media.ice import allow_loopback_candidates  # noqa: E402

PROMPTS = ("oil painting", "watercolor sketch", "anime cel shading", "cyberpunk neon city", "charcoal drawing")


@dataclass
class UserResult:
    user: int
    stream_id: str | None
    refused: str | None
    ttff_s: float | None
    fps: float
    latency_p50_ms: float | None
    latency_p95_ms: float | None
    prompt_switches: int


async def user(index: int, server: str, size: tuple[int, int], duration: float, switch_every: float) -> UserResult:
    camera = CodedCamera(size, fps=30.0, variant=index, id_offset=(index * 997) % MAX_ID)
    rng = random.Random(index)
    try:
        session = await open_session(server, camera, prompt=rng.choice(PROMPTS))
    except RuntimeError as exc:  # refused: at capacity (503) or a bad option
        return UserResult(index, None, str(exc), None, 0.0, None, None, 0)
    switches = 0
    end = time.monotonic() + duration
    while time.monotonic() < end:
        await asyncio.sleep(min(switch_every, max(0.0, end - time.monotonic())))
        if time.monotonic() < end and session.channel.readyState == "open":
            session.channel.send(json.dumps({"type": "update", "prompt": rng.choice(PROMPTS), "transition_chunks": 2}))
            switches += 1
    await session.close()
    probe = session.probe
    shown = [t for t, _, _ in probe.records]
    fps = (len(shown) - 1) / (shown[-1] - shown[0]) if len(shown) > 1 and shown[-1] > shown[0] else 0.0
    lat = probe.latencies() * 1000
    return UserResult(
        user=index,
        stream_id=session.stream_id,
        refused=None,
        ttff_s=None if probe.first_frame_at is None else round(probe.first_frame_at - session.started, 3),
        fps=round(fps, 2),
        latency_p50_ms=round(float(np.percentile(lat, 50)), 1) if lat.size else None,
        latency_p95_ms=round(float(np.percentile(lat, 95)), 1) if lat.size else None,
        prompt_switches=switches,
    )


async def run(args: argparse.Namespace) -> list[UserResult]:
    config = json.loads(http("GET", f"{args.server}/api/config")[2])
    size = (int(config["width"]), int(config["height"]))
    rng = random.Random(args.seed)
    tasks = []
    for index in range(args.users):
        tasks.append(asyncio.create_task(user(index, args.server, size, args.duration, args.switch_every)))
        print(f"user {index} joined", file=sys.stderr)
        if index + 1 < args.users:
            await asyncio.sleep(rng.expovariate(args.rate))
    return list(await asyncio.gather(*tasks))


def _num(value: float | None, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def report(results: list[UserResult]) -> str:
    lines = ["user | stream   | TTFF s | fps  | g2g p50 ms | g2g p95 ms | switches", "-" * 68]
    for r in results:
        if r.refused:
            lines.append(f"{r.user:4d} | refused: {r.refused}")
            continue
        lines.append(
            f"{r.user:4d} | {(r.stream_id or '')[:8]} | {_num(r.ttff_s, '6.2f')} | {r.fps:4.1f} | "
            f"{_num(r.latency_p50_ms, '10.0f')} | {_num(r.latency_p95_ms, '10.0f')} | {r.prompt_switches}"
        )
    served = [r for r in results if not r.refused]
    if served:
        lines.append(f"served {len(served)}/{len(results)} users, mean fps {np.mean([r.fps for r in served]):.1f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default="http://127.0.0.1:8080", help="base URL of a running diffcast server")
    parser.add_argument("--users", type=int, default=4, help="how many synthetic users join")
    parser.add_argument("--rate", type=float, default=0.5, help="arrivals per second (Poisson)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds each user stays")
    parser.add_argument("--switch-every", type=float, default=6.0, help="seconds between a user's prompt switches")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    if args.users < 1 or args.rate <= 0 or args.duration <= 0:
        parser.error("--users, --rate and --duration must be positive")
    logging.basicConfig(level=logging.WARNING)
    if urlparse(args.server).hostname in ("127.0.0.1", "localhost"):
        allow_loopback_candidates()  # aioice leaves out loopback candidates (docs/architecture.md, "Library facts")
    results = asyncio.run(run(args))
    print(json.dumps([asdict(r) for r in results], indent=2) if args.json else report(results))
    return 0 if any(not r.refused for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
