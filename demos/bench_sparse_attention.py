"""Block-sparse vs. dense cached self-attention: one attention call, timed side by side.

The shapes are one Wan 2.1 1.3B self-attention call of a streaming chunk: ``--chunk-frames`` latent frames
of queries against a full KV window (``--window`` frames, ``--sinks`` of them sinks, the chunk's own frames
last), 12 heads of 128. For each tokens-per-frame count it times the dense call (``attention``, what the
engine runs at sparsity 0) and the gathered block-sparse call (``block_sparse_attention``: block scoring,
gather, attention over the kept keys) at each ``--sparsity``, and prints the speed ratio dense / sparse
and the fraction of keys kept (sinks and the own chunk are always kept, so it exceeds 1 - sparsity).

    .venv/bin/python demos/bench_sparse_attention.py                     # 256, 1024, 1560 tokens/frame, CPU
    .venv/bin/python demos/bench_sparse_attention.py --device cuda --dtype bf16 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.models.wan_dit import (  # noqa: E402
    SPARSE_BLOCK_TOKENS,
    SparseLayout,
    attention,
    block_sparse_attention,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def timed(calls: list[Callable[[], torch.Tensor]], repeats: int, device: torch.device) -> list[float]:
    """Median seconds per call of each of ``calls``, after one untimed warm-up each. The calls run
    interleaved, so load from other processes on a shared machine hits dense and sparse alike."""
    times: list[list[float]] = [[] for _ in calls]
    for fn in calls:
        fn()
    for _ in range(repeats):
        for fn, into in zip(calls, times, strict=True):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            into.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def bench(frame_tokens: int, args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    dtype = DTYPES[args.dtype]
    g = torch.Generator(device=device).manual_seed(frame_tokens)
    keys = args.window * frame_tokens
    own_start = keys - args.chunk_frames * frame_tokens
    shape = (1, keys, args.heads, args.head_dim)
    k = torch.randn(shape, generator=g, device=device, dtype=dtype)
    v = torch.randn(shape, generator=g, device=device, dtype=dtype)
    q = torch.randn((1, keys - own_start, args.heads, args.head_dim), generator=g, device=device, dtype=dtype)
    layouts = [(sparsity, SparseLayout.plan(sparsity, args.block_tokens, args.sinks * frame_tokens, own_start,
                                            frame_tokens)) for sparsity in args.sparsity]
    sparse = [(sparsity, layout) for sparsity, layout in layouts if layout is not None]
    calls: list[Callable[[], torch.Tensor]] = [lambda: attention(q, k, v)]
    calls += [lambda lay=layout: block_sparse_attention(q, k, v, lay) for _, layout in sparse]
    dense_s, *sparse_s = timed(calls, args.repeats, device)
    rows = [{"frame_tokens": frame_tokens, "keys": keys, "sparsity": 0.0, "kept": 1.0, "ms": dense_s * 1000,
             "speedup": 1.0}]
    for (sparsity, layout), seconds in zip(sparse, sparse_s, strict=True):
        kept = (keys - (layout.blocks - layout.keep) * layout.block_tokens) / keys
        rows.append({"frame_tokens": frame_tokens, "keys": keys, "sparsity": sparsity, "kept": kept,
                     "ms": seconds * 1000, "speedup": dense_s / seconds})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frame-tokens", type=int, nargs="+", default=[256, 1024, 1560],
                        help="tokens per latent frame (480p Wan: 1560)")
    parser.add_argument("--window", type=int, default=21, help="KV window in latent frames, sinks included")
    parser.add_argument("--sinks", type=int, default=3)
    parser.add_argument("--chunk-frames", type=int, default=1, help="latent frames per chunk (the queries)")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.75])
    parser.add_argument("--block-tokens", type=int, default=SPARSE_BLOCK_TOKENS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    with torch.no_grad():
        rows = [row for ft in args.frame_tokens for row in bench(ft, args, device)]
    setup = {"device": str(device), "dtype": args.dtype, "threads": torch.get_num_threads(), "window": args.window,
             "sinks": args.sinks, "chunk_frames": args.chunk_frames, "heads": args.heads,
             "head_dim": args.head_dim, "block_tokens": args.block_tokens}
    if args.json:
        print(json.dumps({"setup": setup, "results": rows}, indent=2))
        return 0
    print(f"setup: {setup}")
    print(f"{'tokens/frame':>12} {'keys':>7} {'sparsity':>8} {'kept':>6} {'ms':>9} {'dense/sparse':>12}")
    for r in rows:
        print(f"{r['frame_tokens']:>12} {r['keys']:>7} {r['sparsity']:>8g} {r['kept']:>6.2f} {r['ms']:>9.1f} "
              f"{r['speedup']:>12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
