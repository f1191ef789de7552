"""One WebRTC hop's latency with aiortc's video jitter buffer and with app/server/media/jitter.py's.

Two aiortc peers on loopback: a synthetic 30 fps camera (frame IDs drawn into the pixels) sends
VP8 to a receiver that reads each frame's ID; capture -> decoded, p50 / p95, side by side, runs
alternating. aiortc's buffer hands a frame on when the next frame's first packet arrives (one frame
period later); the marker-bit buffer at its own last packet. The live path has two such hops.

    .venv/bin/python demos/bench_jitter.py --seconds 12 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiortc import RTCPeerConnection  # noqa: E402

from app.client import CodedCamera, OutputProbe  # noqa: E402
from app.server.media.ice import allow_loopback_candidates  # noqa: E402
from app.server.media.jitter import complete_video_frames_on_marker  # noqa: E402

WARMUP_S = 2.0


async def hop(marker: bool, seconds: float, fps: float) -> tuple[float, float]:
    """(p50, p95) ms of capture -> decoded over one loopback hop."""
    sender, receiver = RTCPeerConnection(), RTCPeerConnection()
    camera = CodedCamera((256, 256), fps=fps)
    sender.addTrack(camera)
    probe = OutputProbe(camera)
    tasks: list[asyncio.Task[None]] = []
    receiver.on("track", lambda track: tasks.append(asyncio.ensure_future(probe.consume(track))))
    await sender.setLocalDescription(await sender.createOffer())
    await receiver.setRemoteDescription(sender.localDescription)
    if marker:
        complete_video_frames_on_marker(receiver)
    await receiver.setLocalDescription(await receiver.createAnswer())
    await sender.setRemoteDescription(receiver.localDescription)
    await asyncio.sleep(seconds)
    await sender.close()
    await receiver.close()
    if probe.first_frame_at is None:
        raise RuntimeError("no frame crossed the hop")
    latencies = probe.latencies(probe.first_frame_at + WARMUP_S) * 1000
    return float(np.percentile(latencies, 50)), float(np.percentile(latencies, 95))


async def main_async(seconds: float, rounds: int, fps: float) -> None:
    print("jitter buffer | p50 ms | p95 ms")
    for _ in range(rounds):
        for marker in (False, True):
            p50, p95 = await hop(marker, seconds, fps)
            print(f"{'marker bit' if marker else 'aiortc':13s} | {p50:6.1f} | {p95:6.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=12.0, help="run time per measurement")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of both buffers")
    parser.add_argument("--fps", type=float, default=30.0, help="camera frame rate")
    args = parser.parse_args()
    allow_loopback_candidates()
    asyncio.run(main_async(args.seconds, args.rounds, args.fps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
