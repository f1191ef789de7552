"""Evaluate the embedded model on held-out clips at 256x256: fidelity, temporal stability, speed.

    python -m engine.embedded.evaluate [--config engine/weights/default.json] [--out DIR] [--grid PNG]

* fidelity: PSNR / SSIM of the model's output against the teacher's, per style;
* temporal stability: warp error (DESIGN.md §2): output frame t−1 warped to t with DIS optical flow
  estimated on the *input* frames, mean absolute error in [0, 1] units; model vs teacher ratio;
* speed: per-chunk encode / DiT / decode / stabilizer times of one 256x256 stream (4 pixel frames per chunk).

The shipped output is the model's decoded frames through the temporal stabilizer the checkpoint's
config enables (engine/streaming/stabilizer.py), as ``serve`` and ``stylize`` run it; the model's own
frames before the stabilizer are scored too ("raw"), from the same run.

Prints a table and writes ``metrics.json`` (and the picture grid) so the model card can quote them.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from skimage.metrics import structural_similarity
from tqdm import tqdm

from engine.embedded.clips import ClipSpec, heldout_specs, render_clip
from engine.embedded.model import DEFAULT_CONFIG, EmbeddedModel
from engine.embedded.teachers import stylize_clip
from engine.frames import frames_to_tensor, tensor_to_frames
from engine.streaming.stabilizer import StabilizerState, TemporalStabilizer

log = logging.getLogger(__name__)


Timings = tuple[float, float, float, float]  # encode, DiT, decode, stabilizer (seconds per chunk)


def stylize_stream(model: EmbeddedModel, frames: np.ndarray, prompt: str, seed: int = 0, num_steps: int | None = None,
                   noise_scale: float | None = None) -> tuple[np.ndarray, np.ndarray, list[Timings]]:
    """Run a clip (1 + 4k frames) through a stream chunk by chunk: 1 + 4 frames first, then 4 at a time.

    Returns (shipped output = stabilised, the model's raw output, per-chunk timings).
    """
    if frames.shape[0] % 4 != 1:
        raise ValueError(f"clip needs 1 + 4k frames, got {frames.shape[0]}")
    stream = model.open_stream(prompt, seed=seed, num_steps=num_steps, noise_scale=noise_scale)
    stabilizer, state = TemporalStabilizer(model.spec.stabilizer), StabilizerState()
    outs, raws, timings = [], [], []
    bounds = [0, min(5, frames.shape[0])] + list(range(9, frames.shape[0] + 1, 4))
    for a, b in zip(bounds[:-1], bounds[1:], strict=False):
        pixels = frames_to_tensor(frames[a:b])[None]
        raw = stream.process(pixels).clamp(-1, 1)
        started = time.perf_counter()
        out = stabilizer(state, pixels[0], raw[0])[None]
        t = stream.last_timings
        timings.append((t.encode_s, t.dit_s, t.decode_s, time.perf_counter() - started))
        outs.append(tensor_to_frames(out[0]))
        raws.append(tensor_to_frames(raw[0]))
    return np.concatenate(outs), np.concatenate(raws), timings


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 10.0 * np.log10(255.0**2 / max(mse, 1e-10))


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean([structural_similarity(x, y, channel_axis=2, data_range=255) for x, y in zip(a, b, strict=True)]))


def input_flows(frames: np.ndarray) -> list[np.ndarray]:
    """DIS flow from frame t to frame t−1 (for t ≥ 1), estimated on the input frames."""
    dis = cv2.DISOpticalFlow_create(cv2.DISOPTICAL_FLOW_PRESET_MEDIUM)  # type: ignore[attr-defined]
    gray = [cv2.cvtColor(f, cv2.COLOR_RGB2GRAY) for f in frames]
    return [dis.calc(gray[t], gray[t - 1], None) for t in range(1, len(frames))]


def warp_error(output: np.ndarray, flows: list[np.ndarray]) -> float:
    """Mean |out_t − warp(out_{t−1})| in [0, 1] units, pixels whose flow leaves the frame excluded."""
    h, w = output.shape[1:3]
    gy, gx = np.mgrid[0:h, 0:w].astype(np.float32)
    errs = []
    for t, flow in enumerate(flows, start=1):
        mx, my = gx + flow[..., 0], gy + flow[..., 1]
        warped = cv2.remap(output[t - 1], mx, my, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
        valid = (mx >= 0) & (mx <= w - 1) & (my >= 0) & (my <= h - 1)
        diff = np.abs(output[t].astype(np.float32) - warped.astype(np.float32)).mean(axis=2) / 255.0
        errs.append(float(diff[valid].mean()))
    return float(np.mean(errs))


def evaluate(model: EmbeddedModel, clips: int | None = None, grid_path: Path | None = None,
             num_steps: int | None = None, noise_scale: float | None = None) -> dict[str, Any]:
    specs = heldout_specs()[:clips]
    styles = list(model.spec.styles)
    keys = ("psnr", "ssim", "warp_model", "warp_teacher", "psnr_raw", "warp_raw")
    per: dict[str, dict[str, list[float]]] = {s: {k: [] for k in keys} for s in styles}
    all_timings: list[Timings] = []
    grid_rows = []
    for ci, spec in enumerate(tqdm(specs, desc="eval clips")):
        frames = render_clip(spec)
        flows = input_flows(frames)
        for style in styles:
            teacher = stylize_clip(frames, style)
            out, raw, timings = stylize_stream(model, frames, model.spec.styles[style][0], seed=ci,
                                               num_steps=num_steps, noise_scale=noise_scale)
            all_timings += timings[1:]  # steady-state chunks (the first holds the 1-frame warm-up group)
            per[style]["psnr"].append(psnr(out, teacher))
            per[style]["ssim"].append(ssim(out, teacher))
            per[style]["warp_model"].append(warp_error(out, flows))
            per[style]["warp_teacher"].append(warp_error(teacher, flows))
            per[style]["psnr_raw"].append(psnr(raw, teacher))
            per[style]["warp_raw"].append(warp_error(raw, flows))
            if ci == 0 and grid_path is not None:
                k = len(frames) // 2
                grid_rows.append(np.concatenate([frames[k], teacher[k], out[k]], axis=1))
    result: dict[str, Any] = {"clips": len(specs), "frames_per_clip": int(specs[0].frames), "styles": {}}
    for style, m in per.items():
        wm, wt, wr = (float(np.mean(m[k])) for k in ("warp_model", "warp_teacher", "warp_raw"))
        result["styles"][style] = {
            "psnr": float(np.mean(m["psnr"])), "ssim": float(np.mean(m["ssim"])),
            "warp_model": wm, "warp_teacher": wt, "warp_ratio": wm / wt,
            "psnr_raw": float(np.mean(m["psnr_raw"])), "warp_raw": wr, "warp_ratio_raw": wr / wt,
        }
    wt_all = float(np.mean([v["warp_teacher"] for v in result["styles"].values()]))
    for key, suffix in (("warp_model", ""), ("warp_raw", "_raw")):
        result[f"warp_ratio_overall{suffix}"] = float(np.mean([v[key] for v in result["styles"].values()])) / wt_all
    result["timing_ms_eval_threads"] = _timing_summary(all_timings)
    if grid_path is not None:
        _save_grid(grid_rows, styles, grid_path)
    return result


def _timing_summary(timings: list[Timings]) -> dict[str, float]:
    enc, dit, dec, stab = (statistics.median(t[i] for t in timings) * 1000 for i in range(4))
    return {"encode": enc, "dit": dit, "decode": dec, "stabilize": stab, "total": enc + dit + dec + stab}


def benchmark(model: EmbeddedModel, threads: int, chunks: int = 30) -> dict[str, float]:
    """Per-chunk times of one 256x256 stream (median over ``chunks`` steady-state chunks)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        frames = render_clip(ClipSpec(heldout_specs()[0].source, heldout_specs()[0].motion, 1 + 4 * (chunks + 1)))
        _, _, timings = stylize_stream(model, frames, model.spec.styles[next(iter(model.spec.styles))][0])
    finally:
        torch.set_num_threads(prev)
    out = _timing_summary(timings[1:])
    out["fps"] = 4000.0 / out["total"]
    out["threads"] = threads
    return out


def _save_grid(rows: list[np.ndarray], styles: list[str], path: Path, tile: int = 160) -> None:
    labelled = []
    for row, style in zip(rows, styles, strict=True):
        small = cv2.resize(row, (3 * tile, tile), interpolation=cv2.INTER_AREA)
        cv2.putText(small, style, (4, 14), cv2.FONT_HERSHEY_SIMPLEX, 0.45, (255, 255, 255), 1, cv2.LINE_AA)
        labelled.append(small)
    header = np.full((18, 3 * tile, 3), 255, np.uint8)
    for i, name in enumerate(("input", "teacher", "model")):
        cv2.putText(header, name, (i * tile + 4, 13), cv2.FONT_HERSHEY_SIMPLEX, 0.45, (0, 0, 0), 1, cv2.LINE_AA)
    path.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(path), cv2.cvtColor(np.concatenate([header, *labelled]), cv2.COLOR_RGB2BGR),
                [cv2.IMWRITE_PNG_COMPRESSION, 9])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--out", type=Path, default=Path("runs/embedded_eval"))
    parser.add_argument("--grid", type=Path, default=None, help="write the input|teacher|model grid PNG here")
    parser.add_argument("--clips", type=int, default=None, help="evaluate only the first N held-out clips")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the config's)")
    parser.add_argument("--noise-scale", type=float, default=None, help="V2V noise scale s (default: the config's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the fidelity pass")
    parser.add_argument("--bench-threads", type=int, nargs="*", default=[1, 2])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(args.threads)
    model = EmbeddedModel.load(args.config)
    started = time.time()
    result = evaluate(model, args.clips, args.grid, args.steps, args.noise_scale)
    result["speed"] = [benchmark(model, t) for t in args.bench_threads]
    result["eval_seconds"] = time.time() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "metrics.json").write_text(json.dumps(result, indent=1))
    # Markdown, so the model card can quote the run verbatim.
    print("| style | PSNR (dB) | SSIM | warp error model | warp error teacher | ratio | raw PSNR | raw ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for style, m in result["styles"].items():
        print(f"| {style} | {m['psnr']:.2f} | {m['ssim']:.3f} | {m['warp_model']:.4f} | {m['warp_teacher']:.4f} "
              f"| {m['warp_ratio']:.2f} | {m['psnr_raw']:.2f} | {m['warp_ratio_raw']:.2f} |")
    styles = result["styles"].values()
    print(f"| **mean** | {np.mean([m['psnr'] for m in styles]):.2f} | | | | overall {result['warp_ratio_overall']:.2f} "
          f"| {np.mean([m['psnr_raw'] for m in styles]):.2f} | overall {result['warp_ratio_overall_raw']:.2f} |")
    print()
    print("| threads | encode | DiT | decode | stabilizer | total | FPS |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for s in result["speed"]:
        print(f"| {s['threads']} | {s['encode']:.1f} ms | {s['dit']:.1f} ms | {s['decode']:.1f} ms "
              f"| {s['stabilize']:.1f} ms | {s['total']:.1f} ms | {s['fps']:.1f} |")
    print(f"metrics written to {args.out / 'metrics.json'}")


if __name__ == "__main__":
    main()
