"""Audio/video sync through a real `diffcast serve`: a beeping microphone and a frame-coded camera
published like the page (POST /api/offer, the stylized video and the delayed audio coming back on
the same peer), measured at a real aiortc receiver.

Per beep (one every 2 s), the audio's delay (beep captured -> its onset received) is compared with
the video's (frames captured within 0.5 s of the beep -> received), two ways:

* media time: the RTCP sender reports' clock, which a browser aligns audio and video by (lip sync);
* wall clock: when aiortc's receiver hands out the onset and the frames (its audio jitter buffer
  holds 80 ms, its video one about a frame: a player without lip sync would show this offset).

Side by side, the offset audio would have without the delay (the video's own delay: audio passed
straight through). Half-way the steps change (the policy's fidelity ceiling), so the latency moves.

    .venv/bin/python demos/av_sync.py                 # default model, 40 s
    .venv/bin/python demos/av_sync.py --seconds 60 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "demos"))

from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription  # noqa: E402
from bench_live import default_model, server_process  # noqa: E402

from app.avsync import RATE, AudioProbe, BeepMicrophone, SenderClock, VideoStamps, sync_errors  # noqa: E402
from app.client import CodedCamera, http  # noqa: E402
from app.server.media.ice import allow_loopback_candidates  # noqa: E402

WARMUP_S = 8.0  # the first chunk, the playout clock and the sender reports settling


def summary(errors: list[float]) -> dict[str, float | int | None]:
    values = np.abs(np.array(errors)) * 1000
    return {
        "beeps": len(errors),
        "median_ms": round(float(np.median(np.array(errors) * 1000)), 1) if errors else None,
        "p95_abs_ms": round(float(np.percentile(values, 95)), 1) if errors else None,
    }


async def measure(url: str, seconds: float, fps: float) -> dict[str, Any]:
    camera, mic = CodedCamera((256, 256), fps=fps), BeepMicrophone(every_s=2.0)
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver(camera, direction="sendrecv")
    pc.addTransceiver(mic, direction="sendrecv")
    pc.createDataChannel("control")
    await pc.setLocalDescription(await pc.createOffer())
    body = json.dumps({"sdp": pc.localDescription.sdp, "type": "offer", "steps": 1}).encode()
    status, _, raw = await asyncio.to_thread(http, "POST", f"{url}/api/offer", body, {"Content-Type": "application/json"})
    if status != 200:
        raise RuntimeError(f"offer refused: {status} {raw!r}")
    answer = json.loads(raw)
    await pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type="answer"))
    clocks = {r.track.kind: SenderClock(r, RATE if r.track.kind == "audio" else 90_000) for r in pc.getReceivers()}
    video, sound = VideoStamps(camera), AudioProbe()
    tasks = [asyncio.ensure_future(video.consume(r.track) if r.track.kind == "video" else sound.consume(r.track))
             for r in pc.getReceivers()]
    owner = {"Authorization": f"Bearer {answer['owner_token']}", "Content-Type": "application/json"}
    control = f"{url}/api/streams/{answer['stream_id']}/control"
    started = time.monotonic()
    phases: list[tuple[str, float, float]] = []
    half = WARMUP_S + (seconds - WARMUP_S) / 2
    delays_ms: dict[str, list[float]] = {"steps 1": [], "steps 2": []}
    resyncs: dict[str, int] = {}  # the server's audio cursor moves (latency changes), cumulative
    with tqdm(total=int(seconds), desc="av sync", unit="s") as bar:
        while time.monotonic() - started < seconds:
            await asyncio.sleep(1.0)
            bar.update(1)
            elapsed = time.monotonic() - started
            stats = json.loads((await asyncio.to_thread(http, "GET", f"{url}/api/streams/{answer['stream_id']}"))[2])
            phase = "steps 1" if elapsed < half else "steps 2"
            if elapsed > WARMUP_S and stats.get("audio_delay_ms") is not None:
                delays_ms[phase].append(stats["audio_delay_ms"])
                resyncs[phase] = stats["audio_resyncs"]
            if phase == "steps 2" and not phases:
                phases.append(("steps 1", started + WARMUP_S, time.monotonic()))
                await asyncio.to_thread(http, "POST", control, b'{"type": "update", "steps": 2}', owner)
    phases.append(("steps 2", phases[0][2] + 3.0, time.monotonic() - 2.5))
    for task in tasks:
        task.cancel()
    await pc.close()

    onsets = sound.onsets()
    rows = []
    for name, since, until in phases:
        beeps = [b for b in mic.beep_times(until) if b >= since]
        media = sync_errors(beeps, [clocks["audio"].media_time(o) for o in onsets],
                            [(c, clocks["video"].media_time(pts)) for c, (pts, _) in video.stamps.items()])
        wall = sync_errors(beeps, [sound.arrival(o) for o in onsets],
                           [(c, arrived) for c, (_, arrived) in video.stamps.items()])
        video_delay = [arrived - c for c, (_, arrived) in video.stamps.items() if since <= c <= until]
        rows.append({
            "phase": name,
            "server_audio_delay_ms": round(float(np.median(delays_ms[name])), 1) if delays_ms[name] else None,
            "video_delay_ms": round(1000 * float(np.median(video_delay)), 1) if video_delay else None,
            "audio_resyncs_so_far": resyncs.get(name),
            "media_time": summary(media),
            "media_errors_ms": [round(1000 * e, 1) for e in media],
            "wall_clock": summary(wall),
        })
    return {"rows": rows}


def table(result: dict[str, Any], model: str) -> str:
    lines = [
        f"A/V sync through `diffcast serve --model {model}` (aiortc receiver; offset = audio delay - video delay)",
        "| phase | video delay, capture -> received (unsynced audio would lead by about this) | "
        "synced, media time: median / p95 abs | synced, wall clock at aiortc: median / p95 abs | beeps |",
        "|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        media, wall = row["media_time"], row["wall_clock"]
        lines.append(
            f"| {row['phase']} | {row['video_delay_ms']} ms | "
            f"{media['median_ms']} / {media['p95_abs_ms']} ms | {wall['median_ms']} / {wall['p95_abs_ms']} ms | "
            f"{media['beeps']} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model for the server (default: embedded, else tiny-random)")
    parser.add_argument("--seconds", type=float, default=40.0, help="run time (the steps change half-way)")
    parser.add_argument("--fps", type=float, default=30.0, help="camera frame rate")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in the server")
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--device", default="cpu", help="the server's torch device (default cpu)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model = args.model or default_model()
    allow_loopback_candidates()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with server_process(model, args.port, args.threads, 1, args.device) as url:
        result = asyncio.run(measure(url, args.seconds, args.fps))
    print(json.dumps({"model": model, **result}, indent=2) if args.json else table(result, model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
