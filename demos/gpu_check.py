#!/usr/bin/env python3
"""One-shot GPU check: every serving path of the engine on one GPU, in at most five minutes, into one JSON file.

It needs Python, torch, numpy and opencv (and the engine's light dependencies: tqdm, safetensors,
scikit-image, all on the GPU machines' image) and imports nothing of the media or web stack (aiortc,
av, the server), which those machines do not have. Phases, each written to the JSON as it ends (a run
cut short keeps what it measured; a phase that fails records its error and the next one runs):

  env        torch, CUDA and the GPU
  bench      `diffcast bench engine` rows (app/commands/bench.py ``measure_row``, the same code): 832x480 and
             512x512 at 1-4 steps, one stream, a full KV window of warm-up then ``--chunks`` measured, with
             the park and restore GB/s of one stream's state
  batched    1/2/4/8 streams in one batch at 832x480, 1 step
  profile    a reduced CUDA profile (engine/profiler.py: the runtime's default KV window, steps 1-4 at
             scales 1 and 0.5, the weights' precision), written beside the JSON
  serving    the serving loop without media (engine/streaming/headless.py: the server's engine core, live
             slack policy and step processors, device-memory admission from the GPU's free memory) with N
             synthetic 16 fps cameras for N = 1, 2, 4, 8, planning with the profile just measured: each
             stream's on-time chunk ratio, so streams per GPU is measured
  dit_blocks each DiT block's time in a steady-state chunk (832x480, 1 step), the work only the first
             and only the last pipeline rank do, the activation bytes a rank hands on, and from them the
             2- and 4-GPU pipeline-parallel FPS (engine/parallel/partition.py ``predict_pipeline``)
  vae_layout the Wan VAE's convolutions contiguous against channels-last (CUDA's default here), one
             stream at 832x480, 1 step: encode and decode ms side by side
  fp8_linear precision fp8-linear (engine/models/fp8.py): whether the fp8 GEMM runs here, one DiT forward
             of a 1-latent-frame chunk at 832x480 in fp8 against bf16 (relative error, the kernel's and
             the emulation's) and both forwards' median ms
  fp8_kv     precision fp8-kv (the KV cache in float8 e4m3 with a scale per token and head) beside bf16,
             and fp8-linear-kv beside fp8-linear where the fp8 GEMM runs: one stream each at 832x480,
             1 step, interleaved chunk by chunk after a full KV window of warm-up: median chunk and DiT
             ms, the KV caches' MiB (scales included), PSNR of the decoded frames against bf16's
  stage_timer the stage timer (engine/streaming/stage_timer.py): device-wide syncs per chunk and chunk ms
             with CUDA events at the stage boundaries against a sync at each (the runtime before it),
             alternated, one stream at 832x480, 1 step
  compile    torch.compile (engine/compiled.py) at 832x480, 1 step, one stream: chunk and stage ms eager
             against compiled, and the cold start (the warm-up with its compiles, an empty compile cache)
  fast_path  tests/test_gpu_fast_path.py under pytest (last: it passed on the first H100 run)

``--quick`` runs the same phases on the CPU with the tiny random model at its tiny size (CI runs it; its
compile phase traces with the ``eager`` backend, which generates no code). ``--phases a,b`` runs only
those phases (env always), e.g. ``--phases stage_timer,compile`` on a loan for those two.

    python demos/gpu_check.py --out docs/gpu/h100-check.json     # on one GPU
    python demos/gpu_check.py --quick --out /tmp/check.json      # anywhere, seconds
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from app.commands.bench import measure_row  # noqa: E402
from engine.devices import dtype_name, has_bf16_units, resolve_device, resolve_dtype, stream_memory  # noqa: E402
from engine.pipeline import Pipeline  # noqa: E402
from engine.profiler import ProfileRun, profile_pipeline, release  # noqa: E402
from engine.serving.device_memory import DeviceMemory  # noqa: E402
from engine.serving.live import runnable_profile  # noqa: E402
from engine.streaming.headless import serve_headless  # noqa: E402

log = logging.getLogger("gpu_check")

# What the media and web stack is: importing any of it here would fail on the GPU machines.
MEDIA_STACK = ("aiortc", "av", "aiohttp", "uvicorn", "fastapi", "starlette", "gradio", "app.server")


class Plan:
    """The phases' sizes: the full run on a GPU, or ``--quick`` on a CPU."""

    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.model = "tiny-random" if quick else "random:wan2.1-1.3b"
        self.device = "cpu" if quick else "cuda"
        self.sizes = [(128, 128), (96, 96)] if quick else [(832, 480), (512, 512)]
        self.steps = [1, 2] if quick else [1, 2, 3, 4]
        self.chunks = 2 if quick else 20
        self.batched = [1, 2] if quick else [1, 2, 4, 8]
        self.batched_chunks = 2 if quick else 6
        self.profile_steps = (1, 2) if quick else (1, 2, 3, 4)
        self.profile_scales = (1.0, 0.5)
        self.profile_chunks = 2 if quick else 6
        self.serving = [1, 2] if quick else [1, 2, 4, 8]
        self.serving_s = 3.0 if quick else 12.0
        self.fps = 6.0 if quick else 16.0
        self.timer_chunks = 3 if quick else 20
        self.compile_backend = "eager" if quick else "inductor"


class Check:
    """The JSON being built: every phase's result or error, written after each phase."""

    def __init__(self, out: Path, budget_s: float, phases: set[str] | None = None) -> None:
        self.out = out
        self.phases = phases  # None: every phase
        self.start = time.monotonic()
        self.deadline = self.start + budget_s
        self.doc: dict[str, Any] = {"format": "diffcast-gpu-check/1", "started": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                                 time.gmtime())}

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def phase(self, name: str, need_s: float, run: Callable[[], Any]) -> None:
        if self.phases is not None and name not in self.phases | {"env", "done"}:
            return
        if self.left_s() < need_s:
            self.doc[name] = {"skipped": f"{self.left_s():.0f} s of the budget left, the phase needs ~{need_s:.0f} s"}
        else:
            t0 = time.monotonic()
            try:
                self.doc[name] = {"result": run()}
            except Exception as exc:  # one phase's failure is a finding; the others still run
                log.exception("phase %s failed", name)
                self.doc[name] = {"error": f"{type(exc).__name__}: {exc}",
                                  "traceback": traceback.format_exc(limit=8)}
            self.doc[name]["seconds"] = round(time.monotonic() - t0, 1)
        self.doc["elapsed_s"] = round(time.monotonic() - self.start, 1)
        self.doc["media_stack_imported"] = sorted(m for m, module in sys.modules.items() if module is not None
                                                  and (m.split(".")[0] in MEDIA_STACK or m.startswith("app.server")))
        self.out.write_text(json.dumps(self.doc, indent=1) + "\n")
        log.info("%s: %s (%.0f s elapsed)", name, "error" if "error" in self.doc[name] else "done",
                 self.doc["elapsed_s"])


def env(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                    memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count,
                    capability=f"{props.major}.{props.minor}", cudnn=torch.backends.cudnn.version())
    else:
        info.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return info


def fast_path_tests(timeout_s: float) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu_fast_path.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return {"returncode": proc.returncode, "summary": lines[-1] if lines else "", "tail": lines[-15:]}


def bench_rows(pipe: Pipeline, plan: Plan) -> list[dict[str, Any]]:
    rows = []
    for size in plan.sizes:
        for steps in plan.steps:
            rows.append(measure_row(pipe, size, steps, 1, plan.chunks, stream_batch=False))
            log.info("bench %s", rows[-1])
    return rows


def batched_rows(pipe: Pipeline, plan: Plan) -> list[dict[str, Any]]:
    rows = []
    for streams in plan.batched:
        rows.append(measure_row(pipe, plan.sizes[0], 1, streams, plan.batched_chunks, stream_batch=False))
        log.info("batched %s", rows[-1])
    one = rows[0]["fps_total"]
    for row in rows:
        row["throughput_vs_one"] = round(row["fps_total"] / one, 2) if one else None
    return rows


def vae_layouts(pipe: Pipeline, plan: Plan) -> list[dict[str, Any]]:
    vae = pipe.runtime.vae
    if not hasattr(vae, "use_channels_last"):
        return [{"skipped": f"{type(vae).__name__} has one layout"}]
    default = vae.memory_format
    rows = []
    for channels_last in (False, True, False, True):  # alternated: drift hits both alike
        vae.use_channels_last(channels_last)
        row = measure_row(pipe, plan.sizes[0], 1, 1, plan.batched_chunks, stream_batch=False)
        rows.append({"channels_last": channels_last, **{k: row[k] for k in ("chunk_ms", "encode_ms", "decode_ms")}})
    vae.use_channels_last(default == torch.channels_last_3d)
    return rows


# Links a rank hands its activations over: H100 SXM's NVLink (450 GB/s each way) and PCIe 5.0 x16.
LINKS = {"nvlink": 450e9, "pcie5": 50e9}


def dit_blocks(pipe: Pipeline, plan: Plan) -> dict[str, Any]:
    from dataclasses import replace as replaced

    from app.commands.bench import warmup_chunks
    from engine.frames import frames_to_tensor
    from engine.parallel.partition import predict_pipeline
    from engine.pipeline import StreamParams
    from engine.profiler import synthetic_clip

    rt = pipe.runtime
    size = plan.sizes[0]
    fidelity = replaced(pipe.fidelity_for(StreamParams(prompt="oil painting", steps=1, size=size)))
    state = rt.open("blocks", "oil painting", size, fidelity, seed=0)
    clip = synthetic_clip(size, 64, seed=1)
    cuda = rt.device.type == "cuda"
    marks: list[tuple[int, str, Any]] = []
    boundary: list[int] = []

    def mark(i: int, kind: str) -> Any:
        def hook(module: Any, args: Any, out: Any = None) -> None:
            if kind == "in":
                boundary.append(args[0].numel() * args[0].element_size())
            if cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                marks.append((i, kind, event))
            else:
                marks.append((i, kind, time.perf_counter()))
        return hook

    handles = []
    for i, block in enumerate(rt.dit.blocks):
        handles.append(block.register_forward_pre_hook(mark(i, "in")))
        handles.append(block.register_forward_hook(mark(i, "out")))
    per_block: list[list[float]] = [[] for _ in rt.dit.blocks]
    stages = []
    try:
        frame = 0
        for k in range(warmup_chunks(fidelity.kv_window_frames, rt.config.chunk_latent_frames) + plan.batched_chunks):
            n = pipe.first_chunk_frames if k == 0 else pipe.chunk_frames
            marks.clear()
            rt.run_chunks([state], [frames_to_tensor(clip[np.arange(frame, frame + n) % len(clip)])])
            frame += n
            if k < warmup_chunks(fidelity.kv_window_frames, rt.config.chunk_latent_frames):
                continue
            stages.append(rt.last_timings)
            starts = {i: t for i, kind, t in marks if kind == "in"}
            for i, kind, t in marks:
                if kind == "out":
                    s = starts[i]
                    per_block[i].append(s.elapsed_time(t) / 1000.0 if cuda else t - s)
    finally:
        for h in handles:
            h.remove()
    costs = [float(np.median(b)) for b in per_block]
    encode = float(np.median([s.encode_s for s in stages]))
    dit = float(np.median([s.dit_s for s in stages]))
    decode = float(np.median([s.decode_s + s.deblock_s + s.stabilize_s for s in stages]))
    rest = max(0.0, dit - sum(costs)) / 2  # embeddings before the blocks, head and x̂₀ after: half each
    bytes_out = boundary[-1] if boundary else 0
    predictions = {}
    for link, rate in LINKS.items():
        for ranks in (r for r in (1, 2, 4) if r <= len(costs)):  # the tiny model has two blocks
            p = predict_pipeline(costs, encode + rest, decode + rest, ranks, bytes_out, rate, pipe.chunk_frames)
            predictions[f"{ranks}gpu_{link}"] = {"fps": round(p.fps, 2), "chunk_ms": round(1000 * p.chunk_s, 2),
                                                 "blocks": [len(r) for r in p.ranges],
                                                 "transfer_ms": round(1000 * p.transfer_s, 3)}
    return {"size": list(size), "steps": 1, "block_ms": [round(1000 * c, 3) for c in costs],
            "blocks_ms": round(1000 * sum(costs), 2), "encode_ms": round(1000 * encode, 2),
            "dit_ms": round(1000 * dit, 2), "decode_ms": round(1000 * decode, 2),
            "boundary_bytes": bytes_out, "predicted": predictions}


def fp8_linear(pipe: Pipeline, plan: Plan) -> dict[str, Any]:
    from engine.models.fp8 import drop_emulation_copies, fp8_linear_supported, fp8_linears

    dit = pipe.runtime.dit
    cfg = dit.config
    width, height = plan.sizes[0]
    g = torch.Generator().manual_seed(0)
    # One latent frame at the size's latent grid (the VAEs' spatial compression is 8), as a chunk of the
    # manifest's 1-latent-frame recipe; no KV cache: the linears' cost and error are what is measured.
    x = torch.randn(1, cfg.in_channels, 1, height // 8, width // 8, generator=g).to(dit.device)
    t = torch.full((1,), 500.0, device=dit.device)
    prompt = dit.encode_prompt(torch.randn(1, 8, cfg.text_dim, generator=g).to(dit.device))
    supported = fp8_linear_supported(dit.device)
    autocast = dit.dtype == torch.float32  # fp32 weights: bf16 autocast, as the runtime's precision does

    def forward(mode: str) -> torch.Tensor:
        with torch.autocast(dit.device.type, dtype=torch.bfloat16, enabled=autocast):
            if mode == "bf16":
                return dit(x, t, prompt)
            with fp8_linears(emulate=mode == "emulated"):
                return dit(x, t, prompt)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return round(float((a.float() - b.float()).norm() / b.float().norm()), 5)

    def median_ms(mode: str) -> float:
        times = []
        for _ in range(5):
            if dit.device.type == "cuda":
                torch.cuda.synchronize(dit.device)
            t0 = time.perf_counter()
            forward(mode)
            if dit.device.type == "cuda":
                torch.cuda.synchronize(dit.device)
            times.append(time.perf_counter() - t0)
        return round(1000 * float(np.median(times)), 2)

    modes = ["bf16", "emulated"] + (["kernel"] if supported else [])
    out = {mode: forward(mode) for mode in modes}  # also the warm-up of each path
    result: dict[str, Any] = {"supported": supported, "size": [width, height], "latent_frames": 1,
                              "rel_error_vs_bf16": {m: rel(out[m], out["bf16"]) for m in modes if m != "bf16"},
                              "forward_ms": {m: median_ms(m) for m in modes}}
    if supported:
        result["kernel_vs_emulated"] = rel(out["kernel"], out["emulated"])
    drop_emulation_copies(dit)  # the emulation's fp32 weights: GBs the phases after this one may want
    return result


def fp8_kv(pipe: Pipeline, plan: Plan) -> dict[str, Any]:
    from app.commands.bench import warmup_chunks
    from engine.frames import frames_to_tensor, tensor_to_frames
    from engine.models.fp8 import fp8_linear_supported
    from engine.pipeline import StreamParams
    from engine.profiler import psnr, synthetic_clip

    rt = pipe.runtime
    size = plan.sizes[0]
    base = pipe.fidelity_for(StreamParams(prompt="oil painting", steps=1, size=size))
    precisions = ["bf16", "fp8-kv"] + (["fp8-linear", "fp8-linear-kv"] if fp8_linear_supported(rt.device) else [])
    states = {p: rt.open(f"kv-{p}", "oil painting", size, replace(base, precision=p), seed=0) for p in precisions}
    clip = synthetic_clip(size, 64, seed=1)
    warm = warmup_chunks(base.kv_window_frames, rt.config.chunk_latent_frames)
    out: dict[str, list[np.ndarray]] = {p: [] for p in precisions}
    chunk_s: dict[str, list[float]] = {p: [] for p in precisions}
    dit_s: dict[str, list[float]] = {p: [] for p in precisions}
    frame = 0
    for k in range(warm + plan.batched_chunks):
        n = pipe.first_chunk_frames if k == 0 else pipe.chunk_frames
        chunk = frames_to_tensor(clip[np.arange(frame, frame + n) % len(clip)])
        frame += n
        for p in precisions:  # interleaved: drift hits every precision alike
            t0 = rt.clock()
            result = rt.run_chunks([states[p]], [chunk])[0]
            seconds = rt.clock() - t0
            out[p].append(tensor_to_frames(result.frames))
            if k >= warm:
                chunk_s[p].append(seconds)
                dit_s[p].append(rt.last_timings.dit_s)
    rows = []
    for p in precisions:
        parts = states[p].nbytes_by_part()
        reference = "fp8-linear" if p == "fp8-linear-kv" else "bf16"
        row = {"precision": p, "chunk_ms": round(1000 * float(np.median(chunk_s[p])), 2),
               "dit_ms": round(1000 * float(np.median(dit_s[p])), 2),
               "kv_mb": round(parts["kv"] / 2**20, 2), "state_mb": round(states[p].nbytes() / 2**20, 2)}
        if p.endswith("-kv"):
            row[f"psnr_db_vs_{reference}"] = round(psnr(np.concatenate(out[p]), np.concatenate(out[reference])), 2)
        rows.append(row)
    del states
    release(rt.device)
    return {"size": list(size), "steps": 1, "kv_window": base.kv_window_frames, "warmup_chunks": warm, "rows": rows}


def stage_timer(pipe: Pipeline, plan: Plan) -> dict[str, Any]:
    """Stage times from CUDA events (the runtime's timer) against a device-wide sync at each boundary, as
    the runtime did before: the device-wide syncs inside each chunk (``torch.cuda.synchronize`` calls,
    counted) and the chunk's wall time (one sync at its end), alternated chunk by chunk."""
    from app.commands.bench import warmup_chunks
    from engine.frames import frames_to_tensor
    from engine.pipeline import StreamParams
    from engine.profiler import synthetic_clip
    from engine.streaming.stage_timer import StageTimer, WallMark

    rt = pipe.runtime
    size = plan.sizes[0]
    fidelity = pipe.fidelity_for(StreamParams(prompt="oil painting", steps=1, size=size))
    state = rt.open("timer", "oil painting", size, fidelity, seed=0)
    clip = synthetic_clip(size, 64, seed=1)
    real_sync = torch.cuda.synchronize
    syncs = [0]

    def counted_sync(*args: Any, **kwargs: Any) -> None:
        syncs[0] += 1
        if rt.device.type == "cuda":
            real_sync(*args, **kwargs)

    def synced_now() -> float:  # the clock the runtime used: a device-wide sync, then perf_counter
        torch.cuda.synchronize(rt.device)
        return time.perf_counter()

    timers = {"events": StageTimer(rt.device), "synced": StageTimer(rt.device, lambda: WallMark(synced_now))}
    own = rt.timer
    runs: dict[str, dict[str, list[float]]] = {m: {"chunk": [], "stages": [], "syncs": [], "read": []} for m in timers}
    warm = warmup_chunks(fidelity.kv_window_frames, rt.config.chunk_latent_frames)
    frame = 0
    torch.cuda.synchronize = counted_sync  # type: ignore[assignment]
    try:
        for k in range(warm + 2 * plan.timer_chunks):
            mode = "events" if k % 2 else "synced"
            rt.timer = timers[mode]
            n = pipe.first_chunk_frames if k == 0 else pipe.chunk_frames
            frames = frames_to_tensor(clip[np.arange(frame, frame + n) % len(clip)])
            frame += n
            t0 = rt.clock()
            syncs[0] = 0
            rt.run_chunks([state], [frames])
            inside = syncs[0]
            t1 = rt.clock()
            timings = rt.last_timings
            t2 = time.perf_counter()
            if k >= warm:
                run = runs[mode]
                run["chunk"].append(t1 - t0)
                run["stages"].append(timings.total_s)
                run["syncs"].append(inside)
                run["read"].append(t2 - t1)
    finally:
        torch.cuda.synchronize = real_sync  # type: ignore[assignment]
        rt.timer = own

    def median_ms(values: list[float]) -> float:
        return round(1000 * float(np.median(values)), 3)

    return {"size": list(size), "steps": 1, "chunks_each": plan.timer_chunks,
            **{mode: {"syncs_per_chunk": float(np.mean(r["syncs"])), "chunk_ms": median_ms(r["chunk"]),
                      "stages_ms": median_ms(r["stages"]), "read_ms": median_ms(r["read"])}
               for mode, r in runs.items()}}


def compile_speedup(pipe: Pipeline, plan: Plan) -> dict[str, Any]:
    """One stream at the first size, 1 step: ``measure_row`` eager, then compiled at that shape
    (engine/compiled.py, an empty cache: the cold start is the full compile), then the same row again."""
    from engine.compiled import CompileShape, compile_pipeline
    from engine.fidelity import FidelityConfig

    size = plan.sizes[0]
    keys = ("chunk_ms", "encode_ms", "dit_ms", "decode_ms", "first_chunk_ms")
    eager = measure_row(pipe, size, 1, 1, plan.batched_chunks, stream_batch=False)
    rt = pipe.runtime
    shape = CompileShape(rt.engine_size(size, FidelityConfig()), 1, 1, FidelityConfig().precision)
    # An empty compile cache (not under $OUT: the compiled code would travel back with the JSON).
    with tempfile.TemporaryDirectory() as cache_dir:
        compiled, report = compile_pipeline(pipe, [shape], backend=plan.compile_backend, cache_dir=Path(cache_dir))
    try:
        row = measure_row(pipe, size, 1, 1, plan.batched_chunks, stream_batch=False)
        calls = compiled.stats()
    finally:
        compiled.remove()
    return {"size": list(size), "steps": 1, "eager": {k: eager[k] for k in keys},
            "compiled": {k: row[k] for k in keys}, "speedup": round(eager["chunk_ms"] / row["chunk_ms"], 3),
            "compile": report.to_json(), "calls": calls}


def reduced_profile(pipe: Pipeline, plan: Plan, path: Path) -> Any:
    precision = dtype_name(pipe.runtime.dit.dtype) if pipe.runtime.device.type == "cuda" else "fp32"
    run = ProfileRun(size=plan.sizes[0], chunks=plan.profile_chunks, first_repeats=1,
                     windows=(pipe.runtime.config.kv_window_frames,), scales=plan.profile_scales,
                     steps=plan.profile_steps, precisions=(precision,))
    result = profile_pipeline(pipe, run, model_name=plan.model)
    result.save(path)
    release(pipe.runtime.device)
    return result.profile


def serving(pipe: Pipeline, plan: Plan, profile: Any, check: Check) -> list[dict[str, Any]]:
    device = pipe.runtime.device
    runnable = replace(runnable_profile(profile, device.type, step_wise=True, bf16_units=has_bf16_units(device)),
                       fps=plan.fps)
    runs = []
    for n in plan.serving:
        if check.left_s() < plan.serving_s + 10:
            runs.append({"streams": n, "skipped": "out of budget"})
            continue
        free, _ = stream_memory(pipe.runtime)
        memory = DeviceMemory.for_profile(free, runnable) if free is not None else None
        report, _ = serve_headless(pipe, runnable, n, plan.serving_s, fps=plan.fps, memory=memory)
        release(device)
        runs.append({"streams": n, "fps": plan.fps, "state_slots": memory.slots if memory else None,
                     **report.to_json()})
        log.info("serving %d streams: late %.3f (steady %.3f), min on-time %.3f", n, report.late_share,
                 report.steady_late_share, report.min_on_time_ratio)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model on the CPU at tiny sizes (CI)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "gpu_check.json",
                        help="the JSON file (default $OUT/gpu_check.json, else ./gpu_check.json)")
    parser.add_argument("--budget-s", type=float, default=290.0,
                        help="phases that would not finish inside this many seconds are skipped (default 290)")
    parser.add_argument("--phases", default=None,
                        help="comma-separated phases to run (default: all; env always runs)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    plan = Plan(args.quick)
    if plan.quick:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    check = Check(args.out, args.budget_s, set(args.phases.split(",")) if args.phases else None)
    device = resolve_device(plan.device)
    check.phase("env", 0, lambda: env(device))
    t0 = time.monotonic()
    pipe = Pipeline.load(plan.model, device=str(device), dtype=resolve_dtype("auto", device))
    check.doc["model"] = {"name": plan.model, "dtype": dtype_name(pipe.runtime.dit.dtype),
                          "load_s": round(time.monotonic() - t0, 1)}
    check.phase("stage_timer", 15, lambda: stage_timer(pipe, plan))
    check.phase("bench", 30, lambda: bench_rows(pipe, plan))
    check.phase("batched", 30, lambda: batched_rows(pipe, plan))
    profile_path = args.out.with_name(args.out.stem + "_profile.json")
    made: dict[str, Any] = {}

    def profile_phase() -> dict[str, Any]:
        made["profile"] = reduced_profile(pipe, plan, profile_path)
        return {"path": profile_path.name, "points": [
            {"config": p.config.label(), "chunk_ms": round(1000 * p.latency_s, 1), "quality": round(p.quality, 2),
             "state_mb": round(p.state_bytes / 2**20, 1), "workspace_mb": round(p.workspace_bytes / 2**20, 1)}
            for p in made["profile"].points]}

    check.phase("profile", 30, profile_phase)
    if "profile" in made:
        check.phase("serving", plan.serving_s + 10, lambda: serving(pipe, plan, made["profile"], check))
    elif check.phases is None or "serving" in check.phases:
        check.doc["serving"] = {"skipped": "no profile was measured"}
    # The smaller measurements and the correctness tests (they passed on the first H100 run) come last:
    # a run cut short by its budget keeps the figures the issues ask for first.
    check.phase("dit_blocks", 15, lambda: dit_blocks(pipe, plan))
    check.phase("vae_layout", 20, lambda: vae_layouts(pipe, plan))
    check.phase("fp8_linear", 15, lambda: fp8_linear(pipe, plan))
    check.phase("fp8_kv", 20, lambda: fp8_kv(pipe, plan))
    # The compile comes after every eager measurement: its graphs stay in the process's caches.
    check.phase("compile", 120, lambda: compile_speedup(pipe, plan))
    check.phase("fast_path", 20, lambda: fast_path_tests(max(10.0, min(90.0, check.left_s() - 5))))
    check.phase("done", 0, lambda: {"ok": not any("error" in v for v in check.doc.values() if isinstance(v, dict))})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
