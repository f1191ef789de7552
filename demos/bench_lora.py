"""What LoRAs cost a chunk: latency with 0, 1 and 2 LoRAs active, side by side in one run.

Two random LoRAs of ``--rank`` on every attention and FFN linear layer of every block (the layers
trainers target) are written in the original Wan layout and loaded with ``Pipeline.load_lora`` into one
copy of the model; a second copy loads none. Four streams are timed chunk by chunk, interleaved so load
from other processes hits all alike: on the copy without LoRAs, then on the copy with them: no LoRA
active (the hooks installed but returning at once), one LoRA, and two LoRAs mixed. Ratios are to the
first. (Two copies of the model: the measurement needs twice the weights' memory.)

    .venv/bin/python demos/bench_lora.py                                   # tiny-random, CPU
    .venv/bin/python demos/bench_lora.py --model random:wan2.1-1.3b --device cuda --dtype bf16 --rank 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.pipeline import Pipeline, Stream, StreamParams  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TARGETS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.k",
           "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2")


def write_lora(pipe: Pipeline, path: Path, rank: int, seed: int) -> None:
    """A random LoRA of ``rank`` on TARGETS of every block, in the original Wan layout."""
    g = torch.Generator().manual_seed(seed)
    dit = pipe.runtime.dit
    tensors = {}
    for block in range(dit.config.num_layers):
        for target in TARGETS:
            name = f"blocks.{block}.{target}"
            out_f, in_f = dit.get_submodule(name).weight.shape
            tensors[f"diffusion_model.{name}.lora_down.weight"] = torch.randn(rank, in_f, generator=g) * 0.01
            tensors[f"diffusion_model.{name}.lora_up.weight"] = torch.randn(out_f, rank, generator=g) * 0.01
            tensors[f"diffusion_model.{name}.alpha"] = torch.tensor(float(rank))
    save_file(tensors, str(path))


def chunk_seconds(stream: Stream, chunk: np.ndarray, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    stream.process(chunk)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=8, help="timed chunks per stream (after 2 warm-up chunks)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    plain = Pipeline.load(args.model, device=args.device, dtype=DTYPES[args.dtype])
    pipe = Pipeline.load(args.model, device=args.device, dtype=DTYPES[args.dtype])
    device = pipe.runtime.device
    w, h = pipe.default_size
    rng = np.random.default_rng(0)
    first = rng.integers(0, 256, (pipe.first_chunk_frames, h, w, 3), dtype=np.uint8)
    chunk = rng.integers(0, 256, (pipe.chunk_frames, h, w, 3), dtype=np.uint8)

    def opened(on: Pipeline, loras: dict[str, float]) -> Stream:
        stream = on.open_stream(StreamParams("oil painting", steps=args.steps, loras=loras))
        stream.process(first)
        stream.process(chunk)  # warm-up: the first chunks allocate caches
        return stream

    with tempfile.TemporaryDirectory() as tmp:
        for name, seed in (("a", 1), ("b", 2)):
            write_lora(pipe, Path(tmp) / f"{name}.safetensors", args.rank, seed)
            pipe.load_lora(name, Path(tmp) / f"{name}.safetensors", strength=0.0)
    streams = {"none loaded": opened(plain, {}), "0 active": opened(pipe, {}), "1 active": opened(pipe, {"a": 1.0}),
               "2 active": opened(pipe, {"a": 0.7, "b": 0.5})}
    times: dict[str, list[float]] = {label: [] for label in streams}
    for _ in tqdm(range(args.chunks), desc="0/1/2 LoRAs, interleaved"):
        for label, stream in streams.items():
            times[label].append(chunk_seconds(stream, chunk, device))
    medians = {k: statistics.median(v) for k, v in times.items()}
    base = medians["none loaded"]
    rows: list[dict[str, Any]] = [{"loras": label, "chunk_ms": round(s * 1000, 2), "ratio": round(s / base, 3)}
                                  for label, s in medians.items()]
    if args.json:
        print(json.dumps({"model": args.model, "device": str(device), "dtype": args.dtype, "rank": args.rank,
                          "steps": args.steps, "rows": rows}, indent=2))
        return
    print(f"{args.model} on {device} ({args.dtype}), {args.steps} steps, LoRA rank {args.rank} on "
          f"{len(TARGETS)} linear layers per block; median of {args.chunks} chunks")
    print(f"{'LoRAs':<12} {'chunk ms':>10} {'ratio':>7}")
    for row in rows:
        print(f"{row['loras']:<12} {row['chunk_ms']:>10} {row['ratio']:>7}")


if __name__ == "__main__":
    main()
