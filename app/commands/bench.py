"""`diffcast bench engine`: per-chunk latency and FPS of the engine, per configuration.

Every row is measured in this one run, side by side, so ratios between rows are meaningful on the
machine at hand. Streams x steps x sizes x attention sparsity x {sequential, stream batch}.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from typing import Any

from app.commands.stylize import parse_size

NAME = "bench"
HELP = "Benchmark the engine (per-chunk latency, FPS, stage times)."

log = logging.getLogger(__name__)


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _sparsity_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, got {text!r}") from None
    if not values or any(not 0.0 <= v < 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"attention sparsity values must be in [0, 1), got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", choices=["engine"], help="what to benchmark")
    parser.add_argument("--model", default=None, help="'default' (embedded), 'tiny-random', or a model path")
    parser.add_argument("--sizes", default=None, help="comma-separated WxH list (default: the model's size)")
    parser.add_argument("--steps", type=_int_list, default=[1, 2], help="denoising steps to try, e.g. 1,2")
    parser.add_argument("--streams", type=_int_list, default=[1], help="concurrent streams batched together, e.g. 1,2,4")
    parser.add_argument("--sparsity", type=_sparsity_list, default=[0.0],
                        help="block-sparse attention levels to compare, e.g. 0,0.5,0.75 (default 0 = dense)")
    parser.add_argument("--kv-window", type=int, default=None,
                        help="KV window in latent frames (default: the model's); sparsity skips blocks of it")
    parser.add_argument("--stream-batch", action="store_true", help="also measure the pipelined stream batch")
    parser.add_argument("--chunks", type=int, default=12, help="measured chunks per row (after warm-up)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _clip(frames: int, width: int, height: int, seed: int) -> Any:
    import numpy as np

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=(height, width * 2, 3), dtype=np.uint8)
    # A pan 2 px per frame that wraps around, so any number of frames keeps the full width.
    return [np.ascontiguousarray(np.roll(base, -2 * i, axis=1)[:, :width]) for i in range(frames)]


def _measure(pipe: Any, size: tuple[int, int], steps: int, streams: int, chunks: int, stream_batch: bool,
             sparsity: float = 0.0, kv_window: int | None = None) -> dict[str, Any]:
    from dataclasses import replace

    import numpy as np
    import torch

    from engine.frames import frames_to_tensor
    from engine.pipeline import StreamParams
    from engine.streaming.stream_batch import StreamBatch

    rt = pipe.runtime
    params = StreamParams(prompt="oil painting", steps=steps, size=size, kv_window_frames=kv_window)
    fidelity = replace(pipe.fidelity_for(params), attention_sparsity=sparsity)
    states = [rt.open(f"bench{i}", "oil painting", size, fidelity, seed=i) for i in range(streams)]
    per = pipe.chunk_frames
    total = pipe.first_chunk_frames + per * (chunks + 2 + steps)
    clips = [_clip(total, size[0], size[1], i) for i in range(streams)]

    def chunk(k: int, i: int) -> torch.Tensor:
        lo = 0 if k == 0 else pipe.first_chunk_frames + (k - 1) * per
        hi = pipe.first_chunk_frames if k == 0 else lo + per
        return frames_to_tensor(np.stack(clips[i][lo:hi]))

    latencies, stages = [], []
    warm = 2 + (steps if stream_batch else 0)
    if stream_batch:
        batch = StreamBatch(rt, states)
        for k in range(warm + chunks):
            t = time.perf_counter()
            batch.push([chunk(k, i) for i in range(streams)])
            if k >= warm:
                latencies.append(time.perf_counter() - t)
    else:
        for k in range(warm + chunks):
            t = time.perf_counter()
            rt.step_batch(states, [chunk(k, i) for i in range(streams)])
            if k >= warm:
                latencies.append(time.perf_counter() - t)
                stages.append(rt.last_timings)
    chunk_s = statistics.median(latencies)
    row: dict[str, Any] = {
        "size": list(size),
        "steps": steps,
        "streams": streams,
        "sparsity": sparsity,
        "kv_window": fidelity.kv_window_frames,
        "mode": "stream-batch" if stream_batch else "sequential",
        "chunk_ms": round(chunk_s * 1000, 2),
        "chunk_ms_p90": round(sorted(latencies)[int(0.9 * (len(latencies) - 1))] * 1000, 2),
        "fps_per_stream": round(per / chunk_s, 2),
        "fps_total": round(per * streams / chunk_s, 2),
    }
    if stages:
        row["encode_ms"] = round(statistics.median(s.encode_s for s in stages) * 1000, 2)
        row["dit_ms"] = round(statistics.median(s.dit_s for s in stages) * 1000, 2)
        row["decode_ms"] = round(statistics.median(s.decode_s for s in stages) * 1000, 2)
        row["stabilize_ms"] = round(statistics.median(s.stabilize_s for s in stages) * 1000, 2)
    return row


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from engine.pipeline import ModelNotAvailableError, Pipeline

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        pipe = Pipeline.load(args.model, device=args.device)
    except ModelNotAvailableError as exc:
        log.error("%s", exc)
        return 2
    sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else [pipe.default_size]
    rows = []
    modes = [False, True] if args.stream_batch else [False]
    for size in sizes:
        for steps in args.steps:
            for streams in args.streams:
                for stream_batch in modes:
                    if stream_batch and pipe.runtime.config.cache_mode != "per-step":
                        continue
                    # Sparsity innermost: dense and sparse rows of one setting run back to back.
                    for sparsity in args.sparsity:
                        rows.append(_measure(pipe, size, steps, streams, args.chunks, stream_batch, sparsity,
                                             args.kv_window))
                        log.debug("%s", rows[-1])
    report = {
        "model": pipe.name,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "chunk_frames": pipe.chunk_frames,
        "results": rows,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    table = Table(title=f"diffcast engine bench: {pipe.name} on {args.device} ({report['threads']} threads)")
    for col in ("size", "steps", "streams", "window", "sparsity", "mode", "chunk ms", "p90 ms", "FPS/stream",
                "FPS total", "enc/DiT/dec/stab ms"):
        table.add_column(col)
    for r in rows:
        stage = "/".join(str(r.get(k, "-")) for k in ("encode_ms", "dit_ms", "decode_ms", "stabilize_ms"))
        table.add_row(f"{r['size'][0]}x{r['size'][1]}", str(r["steps"]), str(r["streams"]), str(r["kv_window"]),
                      f"{r['sparsity']:g}", r["mode"], str(r["chunk_ms"]), str(r["chunk_ms_p90"]),
                      str(r["fps_per_stream"]), str(r["fps_total"]), stage)
    Console().print(table)
    return 0
