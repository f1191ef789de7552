"""Evaluate the embedded model on held-out clips at 256x256: fidelity, temporal stability, speed.

    python -m engine.embedded.evaluate [--config engine/weights/default.json] [--out DIR] [--grid PNG]

* fidelity: PSNR / SSIM of the model's output against the teacher's, per style;
* temporal stability: warp error: output frame t−1 warped to t with DIS optical flow
  estimated on the *input* frames, mean absolute error in [0, 1] units; model vs teacher ratio;
* the codec's share of the flicker: the teachers' frames through the stream VAE alone (no DiT; a
  decoder that reads the input frames reads the clip's, as in the product), the same warp ratio;
* block texture: gradient energy across the 16-px grid (the DiT's 2x2-latent patches x the VAE's 8x)
  over the energy elsewhere (``engine.embedded.block_texture``), on the held-out clips of real
  photographs (``clips.HELDOUT_IMAGES``), beside the input's and the teacher's own;
* speed: per-chunk encode / DiT / decode / stabilizer times of one 256x256 stream (4 pixel frames per chunk).

Every clip streams through the product: ``engine.pipeline.Pipeline`` loaded from the checkpoint, chunked
as a live stream is (1 frame, then 4 at a time), through ``StreamRuntime``'s public stages (motion-aware
noise, VAE encode, DiT, decode, temporal stabilizer). One run yields both the shipped output (the
stabilizer the checkpoint's config enables, as ``serve`` and ``stylize`` show it) and the model's own
decoded frames before it ("raw").

Prints a table and writes ``metrics.json`` (and the picture grid) so the model card can quote them.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from skimage.metrics import structural_similarity
from tqdm import tqdm

from engine.embedded.block_texture import grid_energies
from engine.embedded.clips import HELDOUT_IMAGES, ClipSpec, heldout_specs, render_clip
from engine.embedded.model import DEFAULT_CONFIG, EmbeddedSpec
from engine.embedded.teachers import stylize_clip
from engine.fidelity import FidelityConfig
from engine.frames import frames_as_uint8, frames_to_tensor, tensor_to_frames
from engine.pipeline import Pipeline, StreamParams
from engine.streaming.runtime import fit_frames

# The block-texture measure's grid: one DiT token is 2x2 latent cells, one latent cell 8x8 pixels.
GRID_PX = 16

# A look whose output stays under this PSNR against its teacher on held-out clips is not shipped; the
# same bar is the lowest quality the live policy routes a stream of this model to (profiles measured
# with teacher quality declare it as their floor).
SHIPPING_PSNR_DB = 20.0

log = logging.getLogger(__name__)


Timings = tuple[float, float, float, float]  # encode, DiT, decode, stabilizer (seconds per chunk)


@dataclass(frozen=True)
class StreamedClip:
    """One clip streamed through the product, every frame of it in both versions."""

    shipped: np.ndarray  # uint8 [T, H, W, 3]: after the temporal stabilizer (what a user sees)
    raw: np.ndarray  # uint8 [T, H, W, 3]: the model's own decoded frames, same run
    timings: list[Timings]  # per chunk
    noise_rates: list[float]  # per chunk: the motion-aware controller's V2V noise rate


def chunk_spans(pipe: Pipeline, frames: int) -> list[tuple[int, int]]:
    """A clip's chunks as a live stream has them: ``pipe.first_chunk_frames`` (1) first, then
    ``pipe.chunk_frames`` (4) at a time; a trailing partial chunk is an error."""
    if (frames - pipe.first_chunk_frames) % pipe.chunk_frames:
        raise ValueError(f"clip needs {pipe.first_chunk_frames} + {pipe.chunk_frames}k frames, got {frames}")
    bounds = [0, *range(pipe.first_chunk_frames, frames + 1, pipe.chunk_frames)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def stylize_stream(pipe: Pipeline, frames: np.ndarray, prompt: str, seed: int = 0, steps: int | None = None,
                   noise_scale: float | None = None, fidelity: FidelityConfig | None = None) -> StreamedClip:
    """Stream a clip (uint8 [T, H, W, 3]) chunk by chunk as the product does: ``pipe.first_chunk_frames``
    (1) first, then ``pipe.chunk_frames`` (4) at a time; a trailing partial chunk is an error.

    ``steps`` / ``noise_scale`` default to the model's own (its config's sampler); ``fidelity`` runs the
    stream at one operating point of the engine (its steps, KV window, resolution scale, precision and
    attention sparsity; the stream's size stays the clip's). The stages are those of
    ``StreamRuntime.run_chunk``, called one by one so that the decoded frames can be kept before the
    stabilizer and each stage timed.
    """
    spans = chunk_spans(pipe, frames.shape[0])
    params = StreamParams(prompt=prompt, seed=seed, steps=steps, noise_scale=noise_scale)
    if fidelity is not None:
        # Chunk by chunk, one stream: a step batch or a stream batch is a serving choice, not the clip's.
        params = params.with_(steps=fidelity.steps, fidelity=replace(fidelity, step_batch=False, stream_batch=1, gpus=1))
    stream = pipe.open_stream(params)
    runtime, state = stream.runtime, stream.state
    shipped, raw, timings, rates = [], [], [], []
    for a, b in spans:
        pixels = frames_as_uint8(frames[a:b], stream.expected_frames)  # as Stream.process hands them over
        t0 = time.perf_counter()
        chunk = runtime.enter_chunk(state, pixels)
        t1 = time.perf_counter()
        runtime.run_to_end([chunk])
        t2 = time.perf_counter()
        decoded = runtime.decode_chunk(chunk)
        t3 = time.perf_counter()
        out = runtime.finish_frames(state, chunk.inputs, decoded, chunk.restart)
        timings.append((t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3))
        shipped.append(tensor_to_frames(out.frames))
        raw.append(tensor_to_frames(fit_frames(decoded.frames, state.size)))
        rates.append(decoded.noise_rate)
    return StreamedClip(np.concatenate(shipped), np.concatenate(raw), timings, rates)


@torch.no_grad()
def codec_round_trip(pipe: Pipeline, frames: np.ndarray, inputs: np.ndarray | None = None) -> np.ndarray:
    """A clip (uint8 [T, H, W, 3]) encoded and decoded by the model's stream VAE, chunked as a live
    stream is (``pipe.first_chunk_frames``, then ``pipe.chunk_frames`` at a time): the codec's share of
    the model's flicker, with no DiT in between. A decoder that reads the input frames reads
    ``inputs``, the clip ``frames`` were made from (a teacher's input; by default the frames themselves),
    as it reads the camera's frames in the product."""
    runtime = pipe.runtime
    vae = runtime.vae
    source = frames if inputs is None else inputs
    encoder, decoder = vae.new_encoder_cache(), vae.new_decoder_cache()
    out = []
    for a, b in chunk_spans(pipe, frames.shape[0]):
        pixels = frames_to_tensor(frames[a:b])[None].to(runtime.device, runtime.dit.dtype)
        guide = frames_to_tensor(source[a:b])[None].to(pixels) if vae.reads_input else None
        decoded = vae.decode_chunk(vae.encode_chunk(pixels, encoder), decoder, guide)
        out.append(tensor_to_frames(decoded[0].float().clamp(-1, 1)))
    return np.concatenate(out)


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


def evaluate(pipe: Pipeline, prompts: dict[str, str], clips: int | None = None, grid_path: Path | None = None,
             steps: int | None = None, noise_scale: float | None = None) -> dict[str, Any]:
    """Score every style (``prompts``: style name -> the prompt that asks for it) on the held-out clips."""
    specs = heldout_specs()[:clips]
    styles = list(prompts)
    keys = ("psnr", "ssim", "warp_model", "warp_teacher", "psnr_raw", "warp_raw", "psnr_codec", "warp_codec")
    per: dict[str, dict[str, list[float]]] = {s: {k: [] for k in keys} for s in styles}
    # (on-grid, off-grid) energies per photograph clip, pooled over clips before the ratio is taken.
    grid: dict[str, list[tuple[float, float]]] = {}
    all_timings: list[Timings] = []
    grid_rows = []
    for ci, spec in enumerate(tqdm(specs, desc="eval clips")):
        frames = render_clip(spec)
        flows = input_flows(frames)
        photograph = spec.source in HELDOUT_IMAGES
        if photograph:
            grid.setdefault("input", []).append(grid_energies(frames, GRID_PX))
        for style in styles:
            teacher = stylize_clip(frames, style)
            run = stylize_stream(pipe, frames, prompts[style], seed=ci, steps=steps, noise_scale=noise_scale)
            out = run.shipped
            if photograph:
                for kind, video in (("", out), ("_raw", run.raw), ("_teacher", teacher)):
                    grid.setdefault(style + kind, []).append(grid_energies(video, GRID_PX))
            all_timings += run.timings[1:]  # steady-state chunks (the first is the 1-frame warm-up)
            per[style]["psnr"].append(psnr(out, teacher))
            per[style]["ssim"].append(ssim(out, teacher))
            per[style]["warp_model"].append(warp_error(out, flows))
            per[style]["warp_teacher"].append(warp_error(teacher, flows))
            per[style]["psnr_raw"].append(psnr(run.raw, teacher))
            per[style]["warp_raw"].append(warp_error(run.raw, flows))
            codec = codec_round_trip(pipe, teacher, frames)
            per[style]["psnr_codec"].append(psnr(codec, teacher))
            per[style]["warp_codec"].append(warp_error(codec, flows))
            if ci == 0 and grid_path is not None:
                k = len(frames) // 2
                grid_rows.append(np.concatenate([frames[k], teacher[k], out[k]], axis=1))
    result: dict[str, Any] = {"clips": len(specs), "frames_per_clip": int(specs[0].frames), "styles": {}}
    for style, m in per.items():
        wm, wt, wr, wc = (float(np.mean(m[k])) for k in ("warp_model", "warp_teacher", "warp_raw", "warp_codec"))
        result["styles"][style] = {
            "psnr": float(np.mean(m["psnr"])), "ssim": float(np.mean(m["ssim"])),
            "warp_model": wm, "warp_teacher": wt, "warp_ratio": wm / wt,
            "psnr_raw": float(np.mean(m["psnr_raw"])), "warp_raw": wr, "warp_ratio_raw": wr / wt,
            "psnr_codec": float(np.mean(m["psnr_codec"])), "warp_codec": wc, "warp_ratio_codec": wc / wt,
        }
        if style in grid:
            result["styles"][style].update({f"grid_ratio{kind}": _pooled_ratio(grid[style + kind])
                                            for kind in ("", "_raw", "_teacher")})
    if "input" in grid:
        result["grid_ratio_input"] = _pooled_ratio(grid["input"])
        result["grid_px"] = GRID_PX
    wt_all = float(np.mean([v["warp_teacher"] for v in result["styles"].values()]))
    for key, suffix in (("warp_model", ""), ("warp_raw", "_raw"), ("warp_codec", "_codec")):
        result[f"warp_ratio_overall{suffix}"] = float(np.mean([v[key] for v in result["styles"].values()])) / wt_all
    result["timing_ms_eval_threads"] = _timing_summary(all_timings)
    if grid_path is not None:
        _save_grid(grid_rows, styles, grid_path)
    return result


@dataclass(frozen=True)
class TeacherScore:
    """One operating point's output against the teachers on held-out clips (shipped output)."""

    psnr: float  # dB, mean over looks and clips
    warp_ratio: float  # warp error of the output / the teachers', over all looks and clips


def teacher_scores(pipe: Pipeline, configs: list[FidelityConfig], prompts: dict[str, str],
                   clips: int = 2) -> dict[FidelityConfig, TeacherScore]:
    """Score each operating point as ``evaluate`` scores the model: every look (``prompts``: style name
    -> prompt) on the first ``clips`` held-out clips, PSNR and warp error against the teachers.
    Clips, their flows and the teachers' outputs are computed once and shared by every config."""
    cases = []
    for ci, spec in enumerate(heldout_specs()[:clips]):
        frames = render_clip(spec)
        flows = input_flows(frames)
        for style in prompts:
            teacher = stylize_clip(frames, style)
            cases.append((ci, frames, flows, style, teacher, warp_error(teacher, flows)))
    scores = {}
    for config in tqdm(configs, desc="teacher quality", unit="config"):
        psnrs, warps, teacher_warps = [], [], []
        for ci, frames, flows, style, teacher, teacher_warp in cases:
            out = stylize_stream(pipe, frames, prompts[style], seed=ci, fidelity=config).shipped
            psnrs.append(psnr(out, teacher))
            warps.append(warp_error(out, flows))
            teacher_warps.append(teacher_warp)
        scores[config] = TeacherScore(float(np.mean(psnrs)), float(np.mean(warps)) / float(np.mean(teacher_warps)))
    return scores


def style_prompts(config_path: Path) -> dict[str, str]:
    """The shipped looks of an embedded model's config and the prompt each is asked for by (the first
    phrasing it was trained on)."""
    return {style: phrasings[0] for style, phrasings in EmbeddedSpec.from_json(config_path.read_text()).styles.items()}


def _pooled_ratio(energies: list[tuple[float, float]]) -> float:
    """The grid-energy ratio of several equally sized clips taken together."""
    on, off = np.mean(energies, axis=0)
    return float(on / max(off, 1e-12))


def _timing_summary(timings: list[Timings]) -> dict[str, float]:
    enc, dit, dec, stab = (statistics.median(t[i] for t in timings) * 1000 for i in range(4))
    return {"encode": enc, "dit": dit, "decode": dec, "stabilize": stab, "total": enc + dit + dec + stab}


def benchmark(pipe: Pipeline, prompt: str, threads: int, chunks: int = 30) -> dict[str, float]:
    """Per-chunk times of one 256x256 stream (median over ``chunks`` steady-state chunks)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        spec = heldout_specs()[0]
        frames = render_clip(ClipSpec(spec.source, spec.motion, pipe.first_chunk_frames + pipe.chunk_frames * chunks))
        timings = stylize_stream(pipe, frames, prompt).timings
    finally:
        torch.set_num_threads(prev)
    out = _timing_summary(timings[1:])
    out["fps"] = 1000.0 * pipe.chunk_frames / out["total"]
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
    parser.add_argument("--noise-scale", type=float, default=None,
                        help="V2V noise strength s, the motion-aware controller's ceiling (default: the config's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the fidelity pass")
    parser.add_argument("--bench-threads", type=int, nargs="*", default=[1, 2])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(args.threads)
    pipe = Pipeline.load(args.config.with_suffix(".safetensors"))
    prompts = style_prompts(args.config)
    started = time.time()
    result = evaluate(pipe, prompts, args.clips, args.grid, args.steps, args.noise_scale)
    result["speed"] = [benchmark(pipe, next(iter(prompts.values())), t) for t in args.bench_threads]
    result["eval_seconds"] = time.time() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "metrics.json").write_text(json.dumps(result, indent=1))
    # Markdown, so the model card can quote the run verbatim.
    print("| style | PSNR (dB) | SSIM | warp error model | warp error teacher | ratio | raw PSNR | raw ratio "
          f"| {GRID_PX}-px grid (raw, teacher) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for style, m in result["styles"].items():
        grid = f"{m['grid_ratio']:.2f} ({m['grid_ratio_raw']:.2f}, {m['grid_ratio_teacher']:.2f})" if "grid_ratio" in m else "-"
        print(f"| {style} | {m['psnr']:.2f} | {m['ssim']:.3f} | {m['warp_model']:.4f} | {m['warp_teacher']:.4f} "
              f"| {m['warp_ratio']:.2f} | {m['psnr_raw']:.2f} | {m['warp_ratio_raw']:.2f} | {grid} |")
    styles = result["styles"].values()
    grid_input = f"input {result['grid_ratio_input']:.2f}" if "grid_ratio_input" in result else ""
    print(f"| **mean** | {np.mean([m['psnr'] for m in styles]):.2f} | | | | overall {result['warp_ratio_overall']:.2f} "
          f"| {np.mean([m['psnr_raw'] for m in styles]):.2f} | overall {result['warp_ratio_overall_raw']:.2f} | {grid_input} |")
    print(f"\ncodec alone (the teachers' frames through the stream VAE, no DiT): warp ratio overall "
          f"{result['warp_ratio_overall_codec']:.2f}, mean {np.mean([m['psnr_codec'] for m in styles]):.2f} dB; "
          + ", ".join(f"{style} {m['warp_ratio_codec']:.2f}" for style, m in result["styles"].items()))
    print()
    print("| threads | encode | DiT | decode | stabilizer | total | FPS |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for s in result["speed"]:
        print(f"| {s['threads']} | {s['encode']:.1f} ms | {s['dit']:.1f} ms | {s['decode']:.1f} ms "
              f"| {s['stabilize']:.1f} ms | {s['total']:.1f} ms | {s['fps']:.1f} |")
    print(f"metrics written to {args.out / 'metrics.json'}")


if __name__ == "__main__":
    main()
