"""The server's media path per frame, side by side in one run: what comes in, what goes out.

1. Camera frames in: a camera frame VP8-decoded and made the stream's RGB frame (288x224, a 4:3
   camera on the default model), sent at the camera's size (1280x720, 640x480) or at the stream's
   size as the page now sends it (web/rtc.js); "before" is RGB at the camera's size then OpenCV's
   area resize, "now" the one-pass swscale path of `app.server.media.frame_path.to_rgb`.
2. Stylized frames out: the output's VP8 encoder (app/server/media/encoder.py) beside aiortc's, on
   stylized held-out clips (the embedded model's teachers: oil paint, pencil sketch, cartoon on four
   held-out camera clips, 256x256) at aiortc's bitrate floor, its start and 1 Mbps: CPU per encoded
   frame and the decoded frames' PSNR against the encoder's input. The output encoder keeps under
   the ceiling browsers set for the frames' size (600 kbps at 256x256: "output kbps"), aiortc's does
   not (up to its 1.5 Mbps): `--bitrates 600 1500` shows what the ceiling saves.

    .venv/bin/python demos/bench_media.py
    .venv/bin/python demos/bench_media.py --frames 60 --bitrates 250 500 1000
"""

from __future__ import annotations

import argparse
import sys
import time
from fractions import Fraction
from pathlib import Path

import av
import cv2
import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiortc.codecs.vpx import Vp8Decoder, Vp8Encoder, vp8_depayload  # noqa: E402
from aiortc.jitterbuffer import JitterFrame  # noqa: E402

from app.server.media.encoder import OutputVp8Encoder, max_bitrate  # noqa: E402
from app.server.media.frame_path import fit_frame, frame_rgb, to_rgb, yuv_frame  # noqa: E402
from engine.embedded.clips import heldout_specs, render_clip  # noqa: E402
from engine.embedded.teachers import stylize_clip  # noqa: E402

STYLES = ("oil_paint", "pencil_sketch", "cartoon")
SETTLE = 5  # frames of each clip left out of the PSNR while constant bitrate rate control settles
TIME_BASE = Fraction(1, 90_000)
STREAM = (288, 224)  # a 4:3 camera's stream on the default model (docs/default-model.md, "Camera aspect")
# (label, size sent) for a 4:3 / 16:9 camera; the page's sizes are the stream's scaled up to the camera's aspect.
SENT = (("1280x720 camera, sent as it is", (1280, 720)), ("640x480 camera, sent as it is", (640, 480)),
        ("640x480 camera, sent at the stream's size", (299, 224)))


def coded(clip: np.ndarray, size: tuple[int, int]) -> list[tuple[bytes, int]]:
    """The clip at ``size`` through aiortc's VP8 encoder (a browser's stand-in): depayloaded frames."""
    encoder = Vp8Encoder()
    encoder.target_bitrate = 1_500_000
    out = []
    for i, image in enumerate(clip):
        frame = yuv_frame(cv2.resize(image, size, interpolation=cv2.INTER_CUBIC))
        frame.pts, frame.time_base = i * 3000, TIME_BASE
        payloads, timestamp = encoder.encode(frame)
        out.append((b"".join(vp8_depayload(p) for p in payloads), timestamp))
    return out


def intake(frames: list[tuple[bytes, int]]) -> tuple[float, float, float]:
    """CPU ms per frame: VP8 decode, RGB at the stream's size before (RGB then OpenCV), now (to_rgb)."""
    decoder = Vp8Decoder()
    decode = before = now = 0.0
    for data, timestamp in frames:
        start = time.process_time()
        frame = decoder.decode(JitterFrame(data=data, timestamp=timestamp))[0]
        decode += time.process_time() - start
        assert isinstance(frame, av.VideoFrame)
        start = time.process_time()
        fit_frame(frame_rgb(frame), STREAM)
        before += time.process_time() - start
        start = time.process_time()
        to_rgb(frame, STREAM)
        now += time.process_time() - start
    n = len(frames) / 1000
    return decode / n, before / n, now / n


def outgoing(make: type[Vp8Encoder], clips: list[np.ndarray], bitrate: int) -> tuple[float, float]:
    """(CPU ms per encoded frame, mean PSNR dB) over every clip, one encoder each."""
    cpu = 0.0
    scores: list[float] = []
    frames = 0
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
            decoded = decoder.decode(JitterFrame(data=b"".join(vp8_depayload(p) for p in payloads), timestamp=timestamp))
            if i >= SETTLE and decoded:
                out = decoded[0].to_ndarray(format="rgb24").astype(np.float64)  # type: ignore[attr-defined]
                scores.append(10 * np.log10(255.0**2 / np.mean((out - image.astype(np.float64)) ** 2)))
    return 1000 * cpu / frames, float(np.mean(scores))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=60, help="frames per clip")
    parser.add_argument("--clips", type=int, default=4, help="held-out camera clips (each in every style)")
    parser.add_argument("--bitrates", type=int, nargs="+", default=[250, 500, 1000], help="kbps")
    args = parser.parse_args()
    raw = [render_clip(spec) for spec in heldout_specs(frames=args.frames)[: args.clips]]

    print(f"camera frames in -> the stream's RGB frames ({STREAM[0]}x{STREAM[1]}), CPU ms per frame")
    print("sent | VP8 decode | to RGB before | to RGB now | total before | total now")
    for label, size in SENT:
        decode, before, now = intake(coded(raw[0], size))
        print(f"{label} | {decode:.3f} | {before:.3f} | {now:.3f} | {decode + before:.3f} | {decode + now:.3f}")

    clips = [stylize_clip(c, style) for c in tqdm(raw, desc="stylizing clips") for style in STYLES]
    print(f"\nstylized frames out: {len(clips)} stylized clips x {args.frames} frames, 256x256")
    # The output encoder keeps under the ceiling of the frames' size (max_bitrate: 600 kbps at 256x256).
    print("bitrate kbps | output kbps | aiortc ms/frame | output ms/frame | CPU ratio | aiortc dB | output dB | gain dB")
    for kbps in args.bitrates:
        base_ms, base_db = outgoing(Vp8Encoder, clips, kbps * 1000)
        ours_ms, ours_db = outgoing(OutputVp8Encoder, clips, kbps * 1000)
        capped = min(kbps, max_bitrate(*clips[0].shape[2:0:-1]) // 1000)
        print(f"{kbps:12d} | {capped:11d} | {base_ms:15.3f} | {ours_ms:15.3f} | {ours_ms / base_ms:9.2f} | "
              f"{base_db:9.2f} | {ours_db:9.2f} | {ours_db - base_db:+7.2f}")


if __name__ == "__main__":
    main()
