"""`diffcast bench engine`: per-chunk latency and FPS of the engine, per configuration.
`diffcast bench memory`: weight and per-stream state bytes of a model, and streams per GPU (arithmetic).

Every engine row is measured in this one run, side by side, so ratios between rows are meaningful on
the machine at hand. Streams x steps x sizes x attention sparsity x {sequential, stream batch}. The
prompt switch (text encoder, then the prompt's cross-attention K/V) happens once per prompt, not per
chunk, so it is measured once, apart from the rows. On a CPU each chunk runs as one engine lane's step,
on the threads the engine's thread budget allows as in the server (engine/streaming/thread_budget.py;
``--fixed-threads`` keeps ``--threads``). ``--busy N`` measures every row again beside N busy
processes (app/busy_neighbours.py): the quiet rows, then the loaded ones.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from collections import Counter
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from app.busy_neighbours import BusyNeighbours
from app.commands.arguments import add_compile_arguments, add_vae_argument, parse_size

NAME = "bench"
HELP = "Benchmark the engine (per-chunk latency, FPS, stage times) or work out its memory per stream."

if TYPE_CHECKING:
    from engine.streaming.lanes import EngineLanes

log = logging.getLogger(__name__)

DEFAULT_STEPS = {"engine": [1, 2], "memory": [1, 2, 3, 4]}
MEMORY_MODEL = "random:wan2.1-1.3b"


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


def _precision_list(text: str) -> list[str]:
    from engine.fidelity import PRECISIONS

    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in PRECISIONS for v in values):
        raise argparse.ArgumentTypeError(f"precisions are comma-separated names among {', '.join(PRECISIONS)}, "
                                         f"got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", choices=["engine", "memory"],
                        help="engine: measure chunks; memory: weight/state bytes and streams per GPU (arithmetic)")
    parser.add_argument("--model", default=None,
                        help="'default' (embedded), 'tiny-random', 'random:wan2.1-1.3b' / 'random:wan2.1-14b' "
                             f"(full-size random weights, no download), or a model path; memory: a random: model "
                             f"(default {MEMORY_MODEL})")
    add_vae_argument(parser)
    parser.add_argument("--sizes", default=None, help="comma-separated WxH list (default: the model's size)")
    parser.add_argument("--steps", type=_int_list, default=None,
                        help="denoising steps to try, e.g. 1,2 (default 1,2; memory: 1,2,3,4)")
    parser.add_argument("--streams", type=_int_list, default=[1], help="concurrent streams batched together, e.g. 1,2,4")
    parser.add_argument("--sparsity", type=_sparsity_list, default=[0.0],
                        help="block-sparse attention levels to compare, e.g. 0,0.5,0.75 (default 0 = dense)")
    parser.add_argument("--precisions", type=_precision_list, default=None, metavar="P,...",
                        help="chunk precisions to compare side by side, e.g. fp32,bf16,fp8-kv (default: the model's "
                             "own); each row gives its precision and its state's parts (state_parts_mb: the KV "
                             "cache's bytes, scales included)")
    parser.add_argument("--kv-window", type=int, default=None,
                        help="KV window in latent frames (default: the model's); sparsity skips blocks of it")
    parser.add_argument("--stream-batch", action="store_true", help="also measure the pipelined stream batch")
    parser.add_argument("--chunks", type=int, default=12, help="measured chunks per row (after warm-up)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice); on a CPU the most a step takes: fewer "
                             "while other programs keep cores busy, as in the server")
    parser.add_argument("--fixed-threads", action="store_true",
                        help="every step on --threads, whatever else runs (no thread budget)")
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="measure every row again beside N busy processes (CPU spinners): quiet rows, "
                             "then loaded ones")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N; cuda fails clearly without CUDA")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                        help="weight dtype (default auto: bf16 on cuda, fp32 on cpu; memory: bf16)")
    parser.add_argument("--gpu-memory-gib", type=float, default=141.0,
                        help="memory: GPU memory the streams share (default 141, an H200)")
    parser.add_argument("--workspace-gib", type=float, default=None,
                        help="memory: kept free for activations, CUDA context and allocator slack (default 10%% of the GPU)")
    add_compile_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    if args.steps is None:
        args.steps = DEFAULT_STEPS[args.target]
    if args.target == "memory":
        if args.compile:
            log.error("--compile is for `bench engine`: the memory arithmetic runs no model")
            return 2
        if args.vae is not None:
            log.error("--vae is for `bench engine`: the memory arithmetic counts the Wan 2.1 VAE")
            return 2
        return _run_memory(args)
    return _run_engine(args)


# -- engine ---------------------------------------------------------------------------------------------


def _clip(frames: int, width: int, height: int, seed: int) -> Any:
    import numpy as np

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=(height, width * 2, 3), dtype=np.uint8)
    # A pan 2 px per frame that wraps around, so any number of frames keeps the full width.
    return [np.ascontiguousarray(np.roll(base, -2 * i, axis=1)[:, :width]) for i in range(frames)]


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def measure_row(pipe: Any, size: tuple[int, int], steps: int, streams: int, chunks: int, stream_batch: bool,
                sparsity: float = 0.0, kv_window: int | None = None, lanes: EngineLanes | None = None,
                precision: str | None = None) -> dict[str, Any]:
    """One row of `diffcast bench engine`: ``streams`` streams batched at ``size`` and ``steps``, a full KV
    window of warm-up chunks, then ``chunks`` timed ones (the median is the row's chunk time); stage
    times, the first chunk of fresh streams, park/restore of one state, its bytes and the CUDA peak."""
    import numpy as np
    import torch

    from engine.frames import frames_to_tensor
    from engine.pipeline import StreamParams
    from engine.profiler import release
    from engine.streaming.parcel import park, unpark
    from engine.streaming.stream_batch import StreamBatch

    rt = pipe.runtime
    cuda = rt.device.type == "cuda"
    if cuda:  # untested here: no GPU in this repository's CI
        torch.cuda.reset_peak_memory_stats(rt.device)
    params = StreamParams(prompt="oil painting", steps=steps, size=size)
    fidelity = pipe.fidelity_for(params, attention_sparsity=sparsity,
                                 **({} if kv_window is None else {"kv_window_frames": kv_window}),
                                 **({} if precision is None else {"precision": precision}))

    states = [rt.open(f"bench{i}", "oil painting", size, fidelity, seed=i) for i in range(streams)]
    unstarted = park(states)  # fresh copies for the first-chunk timing, without encoding the prompt again
    per = pipe.chunk_frames
    # Steady state: the KV window full (its sinks written, every later chunk rolls it) before timing.
    warm = warmup_chunks(fidelity.kv_window_frames, rt.config.chunk_latent_frames) + (steps if stream_batch else 0)
    total = pipe.first_chunk_frames + per * (chunks + warm)
    clips = [_clip(total, size[0], size[1], i) for i in range(streams)]

    def chunk(k: int, i: int) -> torch.Tensor:
        lo = 0 if k == 0 else pipe.first_chunk_frames + (k - 1) * per
        hi = pipe.first_chunk_frames if k == 0 else lo + per
        return frames_to_tensor(np.stack(clips[i][lo:hi]))

    # With ``lanes`` every chunk runs as one lane's step, on the threads the server would give it; the
    # row counts its timed chunks at each thread count.
    latencies, stages, threads = [], [], Counter[int]()
    batch = StreamBatch(rt, states) if stream_batch else None
    for k in range(warm + chunks):
        t = rt.clock()
        with lanes.step() if lanes is not None else nullcontext():
            if batch is not None:
                batch.push([chunk(k, i) for i in range(streams)])
            else:
                rt.run_chunks(states, [chunk(k, i) for i in range(streams)])
        if k >= warm:
            latencies.append(rt.clock() - t)
            if batch is None:
                stages.append(rt.last_timings)
            if lanes is not None and 0 in lanes.last_threads:
                threads[lanes.last_threads[0]] += 1
    chunk_s = statistics.median(latencies)
    row: dict[str, Any] = {
        "size": list(size),
        "steps": steps,
        "streams": streams,
        "sparsity": sparsity,
        "kv_window": fidelity.kv_window_frames,
        "precision": fidelity.precision,
        "mode": "stream-batch" if stream_batch else "sequential",
        "warmup_chunks": warm,
        "chunk_ms": _ms(chunk_s),
        "chunk_ms_p90": _ms(sorted(latencies)[int(0.9 * (len(latencies) - 1))]),
        "fps_per_stream": round(per / chunk_s, 2),
        "fps_total": round(per * streams / chunk_s, 2),
    }
    if threads:
        row["step_threads"] = {str(n): threads[n] for n in sorted(threads)}  # thread count -> timed chunks
    if stages:
        row["encode_ms"] = _ms(statistics.median(s.encode_s for s in stages))
        row["dit_ms"] = _ms(statistics.median(s.dit_s for s in stages))
        row["decode_ms"] = _ms(statistics.median(s.decode_s for s in stages))
        row["deblock_ms"] = _ms(statistics.median(s.deblock_s for s in stages))
        row["stabilize_ms"] = _ms(statistics.median(s.stabilize_s for s in stages))
        # Time to the first frame of fresh streams (one input frame in, one out), everything warm.
        fresh = unpark(unstarted, rt.device)
        t = rt.clock()
        rt.run_chunks(fresh, [chunk(0, i) for i in range(streams)])
        row["first_chunk_ms"] = _ms(rt.clock() - t)
        del fresh
        row.update(_park_restore(rt, states[0]))
    row["state_mb"] = round(states[0].nbytes() / 2**20, 2)
    # Which part of a stream's state takes what (KV caches: one per step in per-step mode).
    row["state_parts_mb"] = {k: round(v / 2**20, 2) for k, v in states[0].nbytes_by_part().items()}
    row["kv_caches"] = len(states[0].kv)
    if cuda:
        row["cuda_peak_mb"] = round(torch.cuda.max_memory_allocated(rt.device) / 2**20, 1)
    del states, unstarted
    release(rt.device)  # the next row starts from what the model alone holds
    return row


def warmup_chunks(kv_window_frames: int, chunk_latent_frames: int) -> int:
    """Chunks before timing: the first, then enough to fill the KV window, then one that rolls it."""
    return 1 + -(-kv_window_frames // chunk_latent_frames) + 1


def _park_restore(rt: Any, state: Any, repeats: int = 2) -> dict[str, float]:
    """What parking a stream in host memory and bringing it back costs (the serving policy's eviction,
    a migration's copy): the best of ``repeats`` round trips (the first also allocates the pinned
    buffers). GB/s are the state's bytes over each direction's wall time."""
    from engine.streaming.parcel import park, unpark

    park_s, restore_s, nbytes = [], [], 0
    for _ in range(repeats):
        t0 = rt.clock()
        parcel = park(state)
        parcel.wait()
        t1 = rt.clock()
        back = unpark(parcel, rt.device)
        t2 = rt.clock()
        park_s.append(t1 - t0)
        restore_s.append(t2 - t1)
        nbytes = parcel.nbytes
        del parcel, back
    park_best, restore_best = min(park_s), min(restore_s)
    return {"park_ms": _ms(park_best), "restore_ms": _ms(restore_best),
            "park_gbps": round(nbytes / park_best / 1e9, 2), "restore_gbps": round(nbytes / restore_best / 1e9, 2)}


def _prompt_switch(pipe: Any, repeats: int = 3) -> dict[str, Any]:
    """A prompt switch's cost: the text encoder on a prompt it has not seen (its cache missed), then the
    prompt's cross-attention K/V for every block; and a switch back to a cached prompt (K/V only)."""
    rt = pipe.runtime
    rt.dit.encode_prompt(rt.prompts.embed(["oil painting"]))  # untimed: warms both up; cached from here on
    text_s, kv_s, cached_s = [], [], []
    for i in range(repeats):
        t0 = rt.clock()
        embedding = rt.prompts.embed([f"prompt switch {i}: a watercolour lighthouse at dusk"])
        t1 = rt.clock()
        rt.dit.encode_prompt(embedding)
        t2 = rt.clock()
        rt.prompts.embed(["oil painting"])  # opened by every row: a cache hit
        cached_s.append(rt.clock() - t2)
        text_s.append(t1 - t0)
        kv_s.append(t2 - t1)
    text, kv = statistics.median(text_s), statistics.median(kv_s)
    return {"text_encode_ms": _ms(text), "prompt_kv_ms": _ms(kv), "total_ms": _ms(text + kv),
            "cached_text_ms": _ms(statistics.median(cached_s)), "repeats": repeats}


def _run_engine(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from engine.devices import dtype_name, resolve_device, resolve_dtype
    from engine.models.wan_dit import attention_kernel
    from engine.pipeline import ModelNotAvailableError, Pipeline
    from engine.streaming.lanes import EngineLanes
    from engine.streaming.thread_budget import openmp_spins, serial_opencv, thread_budget

    if args.busy < 0:
        log.error("--busy must be 0 or more, got %d", args.busy)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    try:
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        pipe = Pipeline.load(args.model, device=str(device), dtype=dtype, vae=args.vae)
    except (ModelNotAvailableError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else [pipe.default_size]
    # One lane, as a server with one stream runs it: on a CPU its threads follow the thread budget.
    budget = thread_budget(threads) if device.type == "cpu" and not args.fixed_threads else None
    if device.type == "cpu":
        serial_opencv()  # as serve's CPU engine
    lanes = EngineLanes(1, threads, budget)

    def measure_rows(busy: int) -> list[dict[str, Any]]:
        rows = []
        modes = [False, True] if args.stream_batch else [False]
        for size in sizes:
            for steps in args.steps:
                for streams in args.streams:
                    for stream_batch in modes:
                        if stream_batch and pipe.runtime.config.cache_mode != "per-step":
                            continue
                        # Sparsity and precision innermost: rows of one setting run back to back.
                        for sparsity in args.sparsity:
                            for precision in args.precisions or [None]:
                                row = measure_row(pipe, size, steps, streams, args.chunks, stream_batch, sparsity,
                                                  args.kv_window, lanes, precision)
                                rows.append({**row, "busy": busy})
                            log.debug("%s", rows[-1])
        return rows

    compiled = None
    if args.compile:
        try:
            # Every thread count a step may run on: the budget moves a lane between one thread and all.
            counts = list(range(1, threads + 1)) if budget is not None else [threads]
            compiled, compile_report = _compile(pipe, args, sizes, counts)
        except ValueError as exc:  # a call site that does not exist
            log.error("%s", exc)
            return 2
    prompt_switch = _prompt_switch(pipe)
    rows = measure_rows(0)
    loaded_switch = None
    if args.busy:
        with BusyNeighbours(args.busy):
            loaded_switch = _prompt_switch(pipe)
            rows += measure_rows(args.busy)
    report = {
        "model": pipe.name,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": dtype_name(dtype),
        "attention": attention_kernel(torch.empty(0, device=device, dtype=dtype)),
        "threads": threads,
        "thread_budget": budget is not None,
        "openmp_spins": openmp_spins(),  # where OpenMP's threads sleep at a barrier the budget keeps them all
        "busy": args.busy,
        "chunk_frames": pipe.chunk_frames,
        "prompt_switch": prompt_switch,
        "results": rows,
    }
    if loaded_switch is not None:
        report["prompt_switch_busy"] = loaded_switch
    if compiled is not None:
        # The calls each call site ran compiled and eager over the whole run: the timed rows' steady chunks
        # should all be compiled (a row's warm-up and first chunks run eager).
        report["compile"] = {**compile_report.to_json(), "calls": compiled.stats()}
    if args.json:
        print(json.dumps(report))
        return 0
    table = Table(title=f"diffcast engine bench: {pipe.name} ({report['dtype']}, {report['attention']}) on "
                        f"{report['device_name']} ({report['threads']} threads)")
    for col in ("busy", "size", "steps", "streams", "window", "sparsity", "precision", "mode", "threads", "chunk ms",
                "p90 ms", "first ms", "FPS/stream", "FPS total", "enc/DiT/dec/deblock/stab ms", "state MB (KV)",
                "park/restore GB/s"):
        table.add_column(col)
    for r in rows:
        stage = "/".join(str(r.get(k, "-")) for k in ("encode_ms", "dit_ms", "decode_ms", "deblock_ms", "stabilize_ms"))
        # The timed chunks at each thread count, e.g. "2x3 1x9".
        step_threads = " ".join(f"{n}x{c}" for n, c in sorted(r.get("step_threads", {}).items(), reverse=True))
        table.add_row(str(r["busy"]), f"{r['size'][0]}x{r['size'][1]}", str(r["steps"]), str(r["streams"]),
                      str(r["kv_window"]), f"{r['sparsity']:g}", r["precision"], r["mode"], step_threads or "-",
                      str(r["chunk_ms"]), str(r["chunk_ms_p90"]), str(r.get("first_chunk_ms", "-")),
                      str(r["fps_per_stream"]), str(r["fps_total"]), stage,
                      f"{r['state_mb']} ({r.get('state_parts_mb', {}).get('kv', '-')})",
                      f"{r.get('park_gbps', '-')}/{r.get('restore_gbps', '-')}")
    console = Console()
    console.print(table)
    if compiled is not None:
        console.print(f"compiled ({compile_report.backend}): cold start {compile_report.cold_start_s:.1f} s, "
                      f"{compile_report.graphs} graphs, cache {compile_report.cache_dir}")
    for label, ps in (("", prompt_switch), (f" beside {args.busy} busy", loaded_switch)):
        if ps is not None:
            console.print(f"prompt switch{label} (once per prompt, not per chunk): {ps['total_ms']} ms = text encoder "
                          f"{ps['text_encode_ms']} ms + prompt K/V {ps['prompt_kv_ms']} ms; "
                          f"a cached prompt's text: {ps['cached_text_ms']} ms")
    return 0


def _compile(pipe: Any, args: argparse.Namespace, sizes: list[tuple[int, int]], threads: list[int]) -> tuple[Any, Any]:
    """The DiT and VAE compiled at the rows' shapes (every size x streams x sparsity at the model's precision
    and --kv-window; steps share a shape) and every thread count the rows' steps may take, warmed up
    before any row is timed."""
    from engine.compiled import CompileShape, compile_pipeline
    from engine.fidelity import FidelityConfig

    rt = pipe.runtime
    shapes = [CompileShape(rt.engine_size(size, FidelityConfig()), 1, streams, FidelityConfig().precision,
                           args.kv_window, sparsity)
              for size in sizes for streams in args.streams for sparsity in args.sparsity]
    return compile_pipeline(pipe, shapes, backend=args.compile_backend, cache_dir=args.compile_cache,
                            sites=args.compile_sites, threads=threads)


# -- memory ---------------------------------------------------------------------------------------------


def _size_text(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _run_memory(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from engine.devices import resolve_dtype
    from engine.memory import memory_report
    from engine.random_model import random_model

    try:
        model = random_model(args.model or MEMORY_MODEL)
        # The arithmetic is about a GPU: "auto" means what a GPU runs (bf16), whatever this machine has.
        dtype = resolve_dtype(args.dtype, torch.device("cuda"))
        sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else [model.size]
        reports = [memory_report(model, size, tuple(args.steps), args.kv_window, dtype, args.gpu_memory_gib,
                                 args.workspace_gib) for size in sizes]
    except (KeyError, ValueError) as exc:
        log.error("%s", exc.args[0] if exc.args else exc)
        return 2
    if args.json:
        print(json.dumps({"reports": [r.to_json() for r in reports]}))
        return 0
    console = Console()
    for r in reports:
        w = r.weight_bytes
        console.print(
            f"[bold]{r.model} at {r.size[0]}x{r.size[1]}, {r.dtype}: arithmetic, not measured[/bold]\n"
            f"weights: DiT {r.dit_parameters / 1e9:.3f}B + VAE {r.vae_parameters / 1e6:.1f}M parameters = "
            f"fp32 {_size_text(w['fp32'])}, bf16 {_size_text(w['bf16'])}; umT5-XXL encoder "
            f"{r.umt5_parameters / 1e9:.2f}B = {_size_text(r.umt5_parameters * dtype.itemsize)} "
            f"in {r.dtype} (only where it runs on the GPU)\n"
            f"GPU {_size_text(r.gpu_memory_bytes)} - {r.dtype} weights - workspace {_size_text(r.workspace_bytes)}; "
            f"KV window {r.window} latent frames x {r.frame_tokens} tokens"
        )
        table = Table()
        for col in ("steps", "KV caches", "prompt K/V", "text emb", "VAE enc", "VAE dec", "per stream on GPU",
                    "streams", "streams, umT5 on GPU"):
            table.add_column(col)
        for row in r.rows:
            s = row.state
            table.add_row(str(row.steps), _size_text(s.kv_caches), _size_text(s.prompt_kv),
                          _size_text(s.text_embedding), _size_text(s.vae_encoder), _size_text(s.vae_decoder),
                          _size_text(s.device), str(row.streams), str(row.streams_with_umt5))
        console.print(table)
    return 0
