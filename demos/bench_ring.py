"""Pipeline-parallel benchmark: one stream through 1, 2 and 4 ranks, side by side.

Each rank is a process with one torch thread; ranks talk over gloo on 127.0.0.1 (CPU) or NCCL
(``--device cuda``, one GPU per rank). For each rank count the stream runs ``--warmup`` chunks
(filling the ring) and then ``--chunks`` timed chunks; reported: output FPS (pixel frames per
second), ms per chunk, the DiT forwards, and the per-rank compute each rank measured on its last
micro-step. The single-process engine (``StreamRuntime.run_chunk``, one thread) is the baseline row.

On a CPU machine the ranks share the cores, so more ranks cannot compute more: what this measures
there is the pipeline's overhead (serialisation, gloo transfers, process contention), not speed-up.

    .venv/bin/python demos/bench_ring.py                 # 1 -> 2 -> 4 ranks, CPU
    .venv/bin/python demos/bench_ring.py --ranks 1 2 --chunks 16 --json

``--streams N`` measures what `diffcast serve --gpus` does instead: N streams of ``--model`` (default
tiny-random) through the server's seam (`RankFactory.run_chunks`), the same ring and streams in
alternating rounds: one stream's chunk per call (each chunk drains the ring before the next enters)
vs all N chunks in one call (a cross-user batch, dealt over the ranks' micro-steps so they
overlap), plus all N in a single micro-step (batched forwards, no overlap) to split the two gains.

    .venv/bin/python demos/bench_ring.py --streams 4 --ranks 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.fidelity import FidelityConfig  # noqa: E402
from engine.models.wan_dit import CONFIGS, CausalWanDiT  # noqa: E402
from engine.models.wan_vae import WanVAE, WanVAEConfig  # noqa: E402
from engine.parallel.launch import run_ring  # noqa: E402
from engine.parallel.partition import stage_times  # noqa: E402
from engine.parallel.ring import RingOptions, RingRuntime  # noqa: E402
from engine.sampling import STREAMDIFFUSION_V2  # noqa: E402
from engine.streaming.config import RuntimeConfig  # noqa: E402
from engine.streaming.runtime import PromptEncoder, StreamRuntime  # noqa: E402


class SeededTextEncoder:
    """Prompt -> fixed pseudo-random embedding (the benchmark's cost does not depend on meaning)."""

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def encode(self, prompts: list[str]) -> torch.Tensor:
        rows = []
        for p in prompts:
            g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(p.encode()).digest()[:4], "little"))
            rows.append(torch.randn(1, 8, self.dim, generator=g))
        return torch.cat(rows)


@dataclass(frozen=True)
class BenchModel:
    """Random weights, Wan topology: ``layers`` blocks of width ``dim`` (the tiny config otherwise)."""

    layers: int = 8
    dim: int = 256
    sink_refresh: bool = False

    def __call__(self, device: torch.device | str = "cpu") -> StreamRuntime:
        torch.manual_seed(0)
        config = replace(CONFIGS["tiny"], num_layers=self.layers, dim=self.dim, ffn_dim=4 * self.dim, num_heads=self.dim // 32)
        dit = CausalWanDiT(config).to(device).eval()
        vae = WanVAE(WanVAEConfig.tiny()).to(device).eval()
        runtime = RuntimeConfig(sink_refresh=self.sink_refresh)
        return StreamRuntime(dit, vae, PromptEncoder(SeededTextEncoder(config.text_dim)), STREAMDIFFUSION_V2, runtime)


def clip(chunks: int, size: int) -> list[torch.Tensor]:
    """A moving random texture: 1 frame, then 4-frame chunks, pixels in [-1, 1]."""
    base = torch.rand(3, size, size, generator=torch.Generator().manual_seed(0)) * 2 - 1
    out, t = [], 0
    for c in range(chunks):
        n = 1 if c == 0 else 4
        out.append(torch.stack([torch.roll(base, shifts=t + i, dims=2) for i in range(n)], dim=1))
        t += n
    return out


@dataclass(frozen=True)
class BenchProgram:
    """Runs on rank 0: warm the ring up, then time ``chunks`` chunks in and out."""

    warmup: int
    chunks: int
    size: int
    steps: int

    def __call__(self, ring: RingRuntime) -> dict[str, Any]:
        state = ring.open("bench", "oil painting", (self.size, self.size),
                          FidelityConfig(steps=self.steps, kv_window_frames=6, precision="fp32"))
        inputs = clip(self.warmup + self.chunks, self.size)
        for frames in inputs[: self.warmup]:
            ring.push([state], [frames])
        forwards = ring.forwards
        out_frames = 0
        t0 = time.perf_counter()
        for frames in inputs[self.warmup :]:
            out_frames += sum(r.frames.shape[1] for _, r in ring.push([state], [frames]))
        elapsed = time.perf_counter() - t0
        sched = ring.scheduler
        stages = stage_times(ring.ranges, sched.block_costs or [], sched.fixed_costs or []) if sched.block_costs else []
        return {
            "ranks": ring.world,
            "depth": ring.depth,
            "rebalances": ring.rebalances,
            "fps": out_frames / elapsed,
            "ms_per_chunk": 1000 * elapsed / self.chunks,
            "forwards": ring.forwards - forwards,
            "ranges": [(r.start, r.stop) for r in ring.ranges],
            "stage_ms": [round(1000 * t, 1) for t in stages],  # the scheduler's smoothed estimates
        }


def baseline(model: BenchModel, program: BenchProgram) -> dict[str, Any]:
    """The single-process engine on the same inputs: StreamRuntime.run_chunk chunk after chunk."""
    rt = model()
    state = rt.open("bench", "oil painting", (program.size, program.size),
                    FidelityConfig(steps=program.steps, kv_window_frames=6, precision="fp32"))
    inputs = clip(program.warmup + program.chunks, program.size)
    for frames in inputs[: program.warmup]:
        rt.run_chunk(state, frames)
    t0 = time.perf_counter()
    out_frames = sum(rt.run_chunk(state, frames).frames.shape[1] for frames in inputs[program.warmup :])
    elapsed = time.perf_counter() - t0
    return {"ranks": "single-process", "depth": 1, "rebalances": 0, "fps": out_frames / elapsed,
            "ms_per_chunk": 1000 * elapsed / program.chunks, "forwards": program.chunks * program.steps,
            "ranges": [(0, model.layers)], "stage_ms": []}


@dataclass(frozen=True)
class ServingProgram:
    """Runs on rank 0: ``streams`` streams on a `RankFactory`; each round runs every stream's next chunk
    one way, the modes taking turns round by round so machine load hits them alike."""

    model: str | None
    streams: int
    rounds: int
    warmup: int
    steps: int

    def __call__(self, ring: RingRuntime) -> dict[str, Any]:
        import numpy as np

        from app.server.serving.engine_bridge import RankFactory, StreamSettings
        from engine.frames import frames_to_tensor
        from engine.parallel.launch import loaded_pipeline

        factory = RankFactory(ring, loaded_pipeline(self.model, ring.rt.device))
        procs = [factory.open(StreamSettings(prompt="oil painting", steps=self.steps, seed=i))
                 for i in range(self.streams)]
        width, height = factory.size
        rng = np.random.default_rng(0)

        def chunks() -> list[Any]:
            return [rng.integers(0, 255, (p.expected_frames, height, width, 3), dtype=np.uint8) for p in procs]

        def one_at_a_time() -> None:
            for p, frames in zip(procs, chunks(), strict=True):
                factory.run_chunks([(p, frames, None)])

        def batched() -> None:
            factory.run_chunks([(p, frames, None) for p, frames in zip(procs, chunks(), strict=True)])

        def one_micro_step() -> None:
            inputs = [frames_to_tensor(f, p.expected_frames) for p, f in zip(procs, chunks(), strict=True)]
            ring.push([p.state for p in procs], inputs)
            ring.drain()

        modes = {"one at a time": one_at_a_time, "batched (run_chunks)": batched,
                 "batched, one micro-step": one_micro_step}
        for _ in range(self.warmup):
            batched()
        seconds = dict.fromkeys(modes, 0.0)
        for _ in range(self.rounds):
            for name, run in modes.items():
                t0 = time.perf_counter()
                run()
                seconds[name] += time.perf_counter() - t0
        per_chunk = {name: 1000 * s / (self.rounds * self.streams) for name, s in seconds.items()}
        return {"ranks": ring.world, "streams": self.streams, "ms_per_stream_chunk": per_chunk,
                "batched_speedup": per_chunk["one at a time"] / per_chunk["batched (run_chunks)"]}


def serving(args: argparse.Namespace) -> int:
    from engine.parallel.launch import LoadedModel

    rows = []
    for world in tqdm(args.ranks, desc="rank counts", disable=args.json):
        program = ServingProgram(args.model, args.streams, args.chunks, 2, args.steps)
        rows.append(run_ring(LoadedModel(args.model), program, world, device=args.device))
    setup = {"device": args.device, "model": args.model, "streams": args.streams, "steps": args.steps,
             "rounds": args.chunks, "threads_per_rank": 1}
    if args.json:
        print(json.dumps({"setup": setup, "results": rows}, indent=2))
        return 0
    print(f"setup: {setup}")
    for r in rows:
        cells = ", ".join(f"{name} {ms:.1f}" for name, ms in r["ms_per_stream_chunk"].items())
        print(f"{r['ranks']} ranks, ms per stream-chunk: {cells}; batched/one-at-a-time speed-up "
              f"{r['batched_speedup']:.2f}x")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="rank counts to compare")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--size", type=int, default=64, help="frame size in pixels (square)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=12, help="timed chunks per rank count")
    parser.add_argument("--sink-refresh", action="store_true",
                        help="adaptive sink refresh on (exact across ranks, but one micro-step in flight)")
    parser.add_argument("--rebalance-every", type=int, default=0, metavar="N",
                        help="let the block scheduler rebalance every N micro-steps (0 = keep the even split)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--streams", type=int, default=0, metavar="N",
                        help="the serving comparison: N streams one at a time vs batched (see above)")
    parser.add_argument("--model", default="tiny-random", help="model of the --streams comparison")
    args = parser.parse_args()
    if args.streams:
        logging.basicConfig(level=logging.WARNING)
        torch.set_num_threads(1)
        return serving(args)
    if max(args.ranks) > args.layers:
        parser.error(f"--layers {args.layers} cannot be split over {max(args.ranks)} ranks")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    model = BenchModel(args.layers, args.dim, args.sink_refresh)
    rows = []
    for world in tqdm([0, *args.ranks], desc="rank counts", disable=args.json):
        depth = 1 if args.sink_refresh else max(world, 1)
        program = BenchProgram(warmup=args.steps * depth + 1, chunks=args.chunks, size=args.size, steps=args.steps)
        if world == 0:
            rows.append(baseline(model, program))
        else:
            options = RingOptions(rebalance_every=args.rebalance_every)
            rows.append(run_ring(model, program, world, device=args.device, options=options))
    setup = {"device": args.device, "layers": args.layers, "dim": args.dim, "size": args.size, "steps": args.steps,
             "chunks": args.chunks, "sink_refresh": args.sink_refresh, "rebalance_every": args.rebalance_every, "threads_per_rank": 1}
    if args.json:
        print(json.dumps({"setup": setup, "results": rows}, indent=2))
        return 0
    print(f"setup: {setup}")
    print(f"{'ranks':>15} {'depth':>5} {'fps':>8} {'ms/chunk':>9} {'forwards':>8} {'moves':>5}  ranges / per-stage ms")
    for r in rows:
        print(f"{r['ranks']!s:>15} {r['depth']:>5} {r['fps']:8.2f} {r['ms_per_chunk']:9.1f} {r['forwards']:>8} "
              f"{r['rebalances']:>5}  {r['ranges']} {r['stage_ms']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
