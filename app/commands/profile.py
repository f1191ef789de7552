"""`diffcast profile`: measure every fidelity configuration of a model and write a fidelity profile."""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from app.commands.arguments import add_compile_arguments, parse_size

NAME = "profile"
HELP = "measure latency and quality of every fidelity configuration and write a profile for the serving policy"

log = logging.getLogger(__name__)


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None,
        help="model: omitted = the embedded default if present, else 'tiny-random'; 'random:wan2.1-1.3b' "
             "(full-size random weights, no download); or a path",
    )
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N; cuda fails clearly without CUDA")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                        help="weight dtype (default auto: bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--size", type=parse_size, default=None, help="frame size WxH (default: the model's size)")
    parser.add_argument("--out", type=Path, default=None, help="profile JSON to write (default: print a summary only)")
    parser.add_argument("--chunks", type=int, default=8, help="timed chunks per config after warm-up (default 8)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed chunks first (default: the largest window)")
    parser.add_argument("--fps", type=float, default=16.0, help="content frame rate the profile refers to (default 16)")
    parser.add_argument("--windows", type=_ints, default=None, help="KV windows, e.g. 4,6 (default: smallest, default)")
    parser.add_argument("--scales", type=_floats, default=None, help="resolution scales (default 1,0.75,0.5)")
    parser.add_argument("--steps", type=_ints, default=None, help="denoising steps (default: 1..the preset's)")
    parser.add_argument("--precisions", default=None,
                        help="compute precisions (default fp32,bf16 with fp32 weights; bf16 with bf16 weights, "
                             "which have no fp32 compute to measure; plus fp8-linear where the GPU runs the fp8 GEMM)")
    parser.add_argument("--sparsity", type=_floats, default=(), metavar="S,...",
                        help="also measure block-sparse attention at these sparsities (default window, fp32)")
    parser.add_argument("--step-batch", action="store_true",
                        help="also measure the step batch (steps of successive chunks in one forward; default window, fp32)")
    parser.add_argument("--quality", choices=["auto", "teachers", "reference"], default="auto",
                        help="quality measure: 'teachers' = PSNR and warp error against the embedded model's teachers "
                             "on held-out clips; 'reference' = PSNR against the most expensive config's output; "
                             "auto (default): teachers for an embedded model (one with shipped looks), else reference")
    parser.add_argument("--teacher-clips", type=int, default=2, help="held-out clips for --quality teachers (default 2)")
    parser.add_argument("--ladder", action="store_true",
                        help="write only the Pareto front, each point at least --min-speedup faster than the one above")
    parser.add_argument("--min-speedup", type=float, default=0.05,
                        help="with --ladder: the least fraction a point must be faster than the one above (default 0.05)")
    parser.add_argument("--anchor-ms", type=float, default=None,
                        help="scale every latency so the reference point's chunk takes this many ms (a quiet "
                             "machine's figure): on a busy machine the side-by-side run still gives the ratios")
    parser.add_argument("--group", type=int, default=None,
                        help="streams alive at once: configs run interleaved in groups of N, each group's states "
                             "freed before the next (default: all on a CPU; on CUDA as many as fit 70%% of the free "
                             "memory)")
    parser.add_argument("--reduced", action="store_true",
                        help="a reduced grid: the runtime's default KV window only (not also the smallest), so a "
                             "full-size model's profile fits a few minutes on one GPU")
    parser.add_argument("--seed", type=int, default=0)
    add_compile_arguments(parser)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")


def _default_window(pipe: object) -> tuple[int, ...]:
    return (int(pipe.runtime.config.kv_window_frames),)  # type: ignore[attr-defined]


def teacher_prompts(model: str, quality: str) -> dict[str, str] | None:
    """The looks and prompts to score against the teachers, or None to score against the reference
    config; ValueError where teachers are asked for a model that has none."""
    from engine.embedded.evaluate import style_prompts
    from engine.pipeline import DEFAULT_MODEL

    if quality == "reference":
        return None
    config = DEFAULT_MODEL.with_suffix(".json") if model == "default" else Path(model).with_suffix(".json")
    embedded = model == "default" or (model.endswith(".safetensors") and config.is_file()
                                      and '"diffcast-embedded' in config.read_text())
    if not embedded:
        if quality == "teachers":
            raise ValueError(f"--quality teachers needs an embedded model (it has teachers); {model!r} is not one")
        return None
    return style_prompts(config)


def _compile(pipe: Any, spec: Any, args: argparse.Namespace) -> Any:
    """The DiT and VAE compiled at every shape the profile's configs run (engine/compiled.py); the report."""
    from engine.compiled import compile_pipeline, config_shapes
    from engine.profiler import candidate_configs

    size = spec.size or pipe.default_size
    shapes = config_shapes(pipe.runtime, size, candidate_configs(pipe, size, spec))
    return compile_pipeline(pipe, shapes, backend=args.compile_backend, cache_dir=args.compile_cache,
                            sites=args.compile_sites)[1]


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.devices import dtype_name, resolve_device, resolve_dtype
    from engine.models.fp8 import fp8_linear_supported
    from engine.pipeline import DEFAULT_MODEL, ModelNotAvailableError, Pipeline
    from engine.profiler import ProfileRun, profile_pipeline
    from engine.serving.bmpr import BMPR

    torch.set_num_threads(max(args.threads, 1))
    model = args.model or ("default" if DEFAULT_MODEL.is_file() else "tiny-random")
    try:
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        precisions = args.precisions or ("fp32,bf16" if dtype == torch.float32 else dtype_name(dtype))
        if args.precisions is None and fp8_linear_supported(device):
            # A serving point only where the fp8 GEMM runs; a CPU's emulation is slower than bf16.
            precisions += ",fp8-linear"
        pipe = Pipeline.load(model, device=str(device), dtype=dtype)
        spec = ProfileRun(size=args.size, chunks=args.chunks, warmup=args.warmup, fps=args.fps, seed=args.seed,
                          windows=args.windows or (_default_window(pipe) if args.reduced else None),
                          scales=args.scales, steps=args.steps, group=args.group,
                          precisions=tuple(p.strip() for p in precisions.split(",") if p.strip()),
                          sparsities=args.sparsity, step_batch=args.step_batch)
        teachers = teacher_prompts(model, args.quality)
        compiled = _compile(pipe, spec, args) if args.compile else None
        result = profile_pipeline(pipe, spec, model_name=model, teachers=teachers, teacher_clips=args.teacher_clips)
        if compiled is not None:
            result = replace(result, compile=compiled.to_json())
            print(f"compiled ({compiled.backend}): cold start {compiled.cold_start_s:.1f} s, {compiled.graphs} graphs")
        if args.anchor_ms is not None:
            result = result.anchored(args.anchor_ms)
    except ModelNotAvailableError as exc:
        log.error("%s", exc)
        return 2
    except ValueError as exc:
        log.error("cannot profile: %s", exc)
        return 2
    profile = result.profile
    router = BMPR(profile.per_stream(), profile.quality_floor)
    frontier = {p.config for p in router.frontier}
    rungs = {p.config for p in result.ladder(args.min_speedup).profile.points}
    print(f"{'config':<34} {'chunk ms':>9} {'first ms':>9} {'PSNR dB':>8} {'SSIM':>6} {'warp':>6}  frontier")
    for p in sorted(profile.points, key=lambda p: p.latency_s):
        mark = ("*" if p.config in frontier else "") + (" ladder" if p.config in rungs else "")
        warp = result.warp_ratio.get(p.config)
        print(f"{p.config.label():<34} {1000 * p.latency_s:9.1f} {1000 * p.first_chunk_latency_s:9.1f} "
              f"{p.quality:8.2f} {result.ssim[p.config]:6.3f} {'' if warp is None else f'{warp:.2f}x':>6}  {mark}")
    print(f"{len(profile.points)} configs, frontier {len(frontier)}, ladder {len(rungs)}, "
          f"quality floor {router.floor:.2f} dB")
    if args.ladder:
        result = result.ladder(args.min_speedup)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result.save(args.out)
        print(f"wrote {args.out}")
    return 0
