"""fp8 linears' and the fp8 KV cache's error against bf16: the DiT's output and the decoded frames of a stream.

For fp8 linears (precision fp8-linear), both against the same computation in bf16 (precision bf16):

* ``dit_rel_error``: ||v_fp8 - v_bf16|| / ||v_bf16|| of one DiT forward (velocity of one random 3-frame
  latent chunk at t = 500, the model's own size), beside bf16's own error against fp32 for scale;
* ``psnr_db``: PSNR of the decoded frames of a stream run at precision fp8-linear against the same
  stream (same seed, same synthetic clip, engine.profiler.synthetic_clip) at bf16, per chunk, and
  bf16 against fp32 for scale.

For the fp8 KV cache (precision fp8-kv: bf16 with the cache in e4m3, a scale per token and head):

* ``kv_dit_rel_error``: the same velocity, the chunk attending to 3 cached frames of context and to
  itself through an fp8 cache, against a bf16 cache (both under bf16 autocast);
* ``kv_psnr_db`` / ``kv_psnr_db_vs_fp32``: the stream at fp8-kv against bf16 and against fp32;
* ``kv_mb``: the stream's KV caches' MiB at each precision (``StreamState.nbytes_by_part``, scales
  included), what ``bench engine``'s ``state_parts_mb`` reports as ``kv``.

On a GPU whose torch runs the fp8 GEMM the fp8 path is the kernel (``--emulate``: the CPU emulation
there too); elsewhere it is the emulation (engine/models/fp8.py), admitted here although the engine
refuses fp8-linear off such a GPU, because its numbers are the kernel's up to fp32 rounding.

    .venv/bin/python demos/fp8_error.py                               # the embedded model, then tiny-random
    .venv/bin/python demos/fp8_error.py --model random:wan2.1-1.3b --device cuda --dtype bf16 --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import engine.streaming.runtime as runtime_module  # noqa: E402
from engine.devices import DTYPES  # noqa: E402
from engine.fidelity import FidelityConfig  # noqa: E402
from engine.models.fp8 import fp8_emulation, fp8_linear_supported, fp8_linears  # noqa: E402
from engine.pipeline import DEFAULT_MODEL, Pipeline, StreamParams  # noqa: E402
from engine.profiler import psnr, synthetic_clip  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def dit_errors(pipe: Pipeline, emulate: bool, seed: int) -> dict[str, float]:
    dit = pipe.runtime.dit
    cfg = dit.config
    width, height = pipe.default_size
    g = torch.Generator().manual_seed(seed)
    # The VAE's spatial compression is 8 for both the Wan and the embedded VAE.
    x = torch.randn(1, cfg.in_channels, 3, height // 8, width // 8, generator=g).to(dit.device)
    t = torch.full((1,), 500.0, device=dit.device)
    prompt = dit.encode_prompt(torch.randn(1, 8, cfg.text_dim, generator=g).to(dit.device))
    device = dit.device.type
    fp32 = dit(x, t, prompt) if dit.dtype == torch.float32 else None
    with torch.autocast(device, dtype=torch.bfloat16, enabled=dit.dtype == torch.float32):
        bf16 = dit(x, t, prompt)
        with fp8_linears(emulate=emulate):
            fp8 = dit(x, t, prompt)
    out = {"dit_rel_error": _rel(fp8, bf16)}
    if fp32 is not None:
        out["dit_rel_error_bf16_vs_fp32"] = _rel(bf16, fp32)
    context = torch.randn(x.shape, generator=g).to(dit.device)
    cached = {}
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        cache = dit.new_kv_cache(1, cfg.frame_tokens(*x.shape[-2:]), 6, dtype=dtype)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=dit.dtype == torch.float32):
            dit(context, torch.zeros(1), prompt, cache, 0)  # the clean pass that caches the context
            cached[dtype] = dit(x, t, prompt, cache, 3)
    out["kv_dit_rel_error"] = _rel(cached[torch.float8_e4m3fn], cached[torch.bfloat16])
    return out


def stream_frames(pipe: Pipeline, precision: str, chunks: int, seed: int, emulate: bool,
                  kv_mb: dict[str, float]) -> list[np.ndarray]:
    """The stream's decoded chunks at ``precision``; its KV caches' MiB go into ``kv_mb[precision]``."""
    size = pipe.default_size
    clip = synthetic_clip(size, pipe.first_chunk_frames + chunks * pipe.chunk_frames, seed)
    fidelity = replace(FidelityConfig(), kv_window_frames=pipe.runtime.config.kv_window_frames, precision=precision,
                       steps=len(pipe.runtime.preset.steps))
    stream = pipe.open_stream(StreamParams(prompt="oil painting", seed=seed, size=size, fidelity=fidelity))
    rest = clip[pipe.first_chunk_frames :]
    with fp8_emulation() if emulate else contextlib.nullcontext():
        out = [stream.process(clip[: pipe.first_chunk_frames])]
        for k in range(chunks):
            out.append(stream.process(rest[k * pipe.chunk_frames : (k + 1) * pipe.chunk_frames]))
    kv_mb[precision] = round(stream.state.nbytes_by_part()["kv"] / 2**20, 3)
    return out


def measure(model: str, device: str, dtype: str, chunks: int, seed: int, emulate: bool) -> dict[str, Any]:
    torch.manual_seed(seed)
    pipe = Pipeline.load(model, device=device, dtype=DTYPES[dtype])
    kernel = fp8_linear_supported(pipe.runtime.device) and not emulate
    if not kernel:
        # The engine admits fp8-linear only where the GEMM runs; the emulation computes the same numbers.
        original = runtime_module.unsupported_reason
        runtime_module.unsupported_reason = (
            lambda config, device_type, fp8_units=False: None if config.precision == "fp8-linear"
            else original(config, device_type, fp8_units))
    result: dict[str, Any] = {"model": model, "device": device, "dtype": dtype, "size": list(pipe.default_size),
                              "fp8_path": "torch._scaled_mm" if kernel else "emulated", "chunks": chunks,
                              "steps": len(pipe.runtime.preset.steps)}
    result.update(dit_errors(pipe, emulate=not kernel, seed=seed))
    precisions = ["bf16", "fp8-linear", "fp8-kv"] + (["fp32"] if dtype == "fp32" else [])
    kv_mb: dict[str, float] = {}
    frames = {p: stream_frames(pipe, p, chunks, seed, not kernel, kv_mb) for p in precisions}
    clips = {p: np.concatenate(f) for p, f in frames.items()}
    per_chunk = [psnr(a, b) for a, b in zip(frames["fp8-linear"], frames["bf16"], strict=True)]
    result["psnr_db_per_chunk"] = [round(v, 2) for v in per_chunk]
    result["psnr_db"] = round(psnr(clips["fp8-linear"], clips["bf16"]), 2)
    result["kv_psnr_db"] = round(psnr(clips["fp8-kv"], clips["bf16"]), 2)
    if "fp32" in frames:
        result["psnr_db_bf16_vs_fp32"] = round(psnr(clips["bf16"], clips["fp32"]), 2)
        result["kv_psnr_db_vs_fp32"] = round(psnr(clips["fp8-kv"], clips["fp32"]), 2)
    result["kv_mb"] = kv_mb
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append", default=None,
                        help="models to measure (repeatable; default: the embedded model if present, and tiny-random)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--chunks", type=int, default=6, help="chunks after the first (default 6)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--emulate", action="store_true", help="the emulation even where the fp8 GEMM runs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    models = args.model or (["default"] if DEFAULT_MODEL.is_file() else []) + ["tiny-random"]
    for model in models:
        result = measure(model, args.device, args.dtype, args.chunks, args.seed, args.emulate)
        if args.json:
            print(json.dumps(result))
        else:
            print(", ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
