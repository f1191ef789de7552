"""The output's VP8 encoder (app/server/encoder.py) beside aiortc's, on stylized frames.

Stylized held-out clips (the embedded model's teachers: oil paint, pencil sketch, cartoon on four
held-out camera clips, 256x256), each frame encoded the way the server sends it (constant bitrate,
real-time deadline, one thread), at aiortc's bitrate floor, its start and 1 Mbps: CPU per encoded
frame and the decoded frames' PSNR against the encoder's input, side by side in one run.

    .venv/bin/python demos/bench_encoder.py
    .venv/bin/python demos/bench_encoder.py --frames 60 --bitrates 250 500 1000
"""

from __future__ import annotations

import argparse
import sys
import time
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiortc.codecs.vpx import Vp8Decoder, Vp8Encoder, vp8_depayload  # noqa: E402
from aiortc.jitterbuffer import JitterFrame  # noqa: E402

from app.server.encoder import OutputVp8Encoder  # noqa: E402
from engine.embedded.clips import heldout_specs, render_clip  # noqa: E402
from engine.embedded.teachers import stylize_clip  # noqa: E402

STYLES = ("oil_paint", "pencil_sketch", "cartoon")
SETTLE = 5  # frames of each clip left out of the PSNR while constant bitrate rate control settles
TIME_BASE = Fraction(1, 90_000)


def measure(make: type[Vp8Encoder], clips: list[np.ndarray], bitrate: int) -> tuple[float, float, float]:
    """(CPU ms per encoded frame, mean PSNR dB, bytes per frame) over every clip, one encoder each."""
    cpu = 0.0
    scores: list[float] = []
    size = frames = 0
    for clip in clips:
        encoder, decoder = make(), Vp8Decoder()
        encoder.target_bitrate = bitrate
        for i, image in enumerate(clip):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24").reformat(format="yuv420p")
            frame.pts, frame.time_base = i * 3000, TIME_BASE
            start = time.process_time()
            payloads, timestamp = encoder.encode(frame)
            cpu += time.process_time() - start
            frames += 1
            data = b"".join(vp8_depayload(p) for p in payloads)
            size += len(data)
            decoded = decoder.decode(JitterFrame(data=data, timestamp=timestamp))
            if i >= SETTLE and decoded:
                out = decoded[0].to_ndarray(format="rgb24").astype(np.float64)  # type: ignore[attr-defined]
                scores.append(10 * np.log10(255.0**2 / np.mean((out - image.astype(np.float64)) ** 2)))
    return 1000 * cpu / frames, float(np.mean(scores)), size / frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=60, help="frames per clip")
    parser.add_argument("--clips", type=int, default=4, help="held-out camera clips (each in every style)")
    parser.add_argument("--bitrates", type=int, nargs="+", default=[250, 500, 1000], help="kbps")
    args = parser.parse_args()
    raw = [render_clip(spec) for spec in heldout_specs(frames=args.frames)[: args.clips]]
    clips = [stylize_clip(c, style) for c in tqdm(raw, desc="stylizing clips") for style in STYLES]
    print(f"{len(clips)} stylized clips x {args.frames} frames, 256x256")
    print("bitrate kbps | aiortc ms/frame | output ms/frame | CPU ratio | aiortc dB | output dB | gain dB")
    for kbps in args.bitrates:
        base_ms, base_db, _ = measure(Vp8Encoder, clips, kbps * 1000)
        ours_ms, ours_db, _ = measure(OutputVp8Encoder, clips, kbps * 1000)
        print(f"{kbps:12d} | {base_ms:15.3f} | {ours_ms:15.3f} | {ours_ms / base_ms:9.2f} | {base_db:9.2f} | "
              f"{ours_db:9.2f} | {ours_db - base_db:+7.2f}")


if __name__ == "__main__":
    main()
