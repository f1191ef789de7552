"""Measure every fidelity configuration the engine supports and write a fidelity profile.

For one model at one frame size, each candidate ``FidelityConfig`` (denoising steps within the
sampler preset, KV window, resolution scale, compute precision) runs the same synthetic camera
clip with the same seed:

* latency: wall time of one V2V chunk (encode + DiT + decode + the stabilizer where the model enables it, ``Stream.process``;
  with the step batch, one ``StreamBatch.push``: one forward carrying every chunk in flight), the median over
  ``chunks`` chunks after ``warmup`` chunks (enough to fill the largest KV window, so the attention
  cost is the steady-state one); the first-chunk latency is the median of ``first_repeats`` fresh
  first chunks. Configs are run *interleaved* chunk by chunk, so load from other processes on a
  shared machine spreads over all configs instead of biasing whichever ran during a busy spell.
* quality: PSNR (dB) of the config's output clip against the reference config's output (the most
  expensive one: most steps, largest window, full resolution, fp32) — the same clip, seed and
  input, so the only difference is the fidelity knob. Identical output scores ``PSNR_CAP`` (the
  reference against itself). SSIM is stored beside it in each point (``"ssim"``).

PSNR to the full-fidelity output is the proxy because the serving question is "how far does this
knob take the stream from what it would have shown at full fidelity"; absolute scores (VBench) need
models and data this repository does not ship. The embedded default model has its teachers here, so
its quality is measured, not proxied (``teachers``): each config's shipped output against the
teachers on held-out clips, every look, PSNR and warp error (``engine.embedded.evaluate.teacher_scores``,
the evaluation the model card reports). The result is a ``diffcast-fidelity-profile/1`` file whose
frontier and floor BMPR reads (``engine.serving.bmpr.BMPR``); :func:`ladder` keeps only its Pareto
front, each point measurably faster than the one above it.
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
import platform
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from skimage.metrics import structural_similarity
from tqdm import tqdm

from engine.embedded.evaluate import SHIPPING_PSNR_DB, teacher_scores
from engine.fidelity import FidelityConfig, required_capabilities
from engine.frames import frames_as_uint8, tensor_to_frames
from engine.pipeline import Pipeline, StreamParams
from engine.serving.profile import FidelityProfile, ProfilePoint, pareto_frontier
from engine.streaming.stream_batch import StreamBatch

log = logging.getLogger(__name__)

PSNR_CAP = 100.0  # dB for identical clips (MSE 0), so the reference is the finite maximum
DEFAULT_SCALES = (1.0, 0.75, 0.5)
PROFILE_PROMPT = "oil painting"


@dataclass(frozen=True)
class ProfileRun:
    """What to measure. ``windows``/``scales`` None = the engine's defaults (see candidate_configs)."""

    size: tuple[int, int] | None = None  # (width, height); None = the model's default size
    chunks: int = 8
    warmup: int | None = None  # None = the largest window (fills every KV cache before timing)
    first_repeats: int = 3
    seed: int = 0
    fps: float = 16.0  # the content frame rate the profile's chunk durations refer to
    windows: tuple[int, ...] | None = None
    scales: tuple[float, ...] | None = None
    precisions: tuple[str, ...] = ("fp32", "bf16")
    steps: tuple[int, ...] | None = None
    # Variants measured on top of the grid, at the runtime's default window and fp32 for every step
    # count and scale (the grid times these would multiply the run time): block-sparse attention at
    # each of these sparsities, and the step batch (steps >= 2; only where the runtime keeps one KV
    # cache per step).
    sparsities: tuple[float, ...] = ()
    step_batch: bool = False
    # Streams alive at once: configs run interleaved in groups of this many, each group's states freed
    # before the next (a full-size model's state is GBs: all points at once do not fit a GPU). None: all.
    group: int | None = None

    def __post_init__(self) -> None:
        if self.chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {self.chunks}")
        if self.first_repeats < 1:
            raise ValueError(f"first_repeats must be >= 1, got {self.first_repeats}")
        if self.fps <= 0:
            raise ValueError(f"fps must be positive, got {self.fps}")
        if not self.precisions:
            raise ValueError("precisions must name at least one precision")
        if self.group is not None and self.group < 1:
            raise ValueError(f"group must be >= 1, got {self.group}")


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of two uint8 clips, ``PSNR_CAP`` when identical."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    if mse == 0.0:
        return PSNR_CAP
    return min(PSNR_CAP, 10.0 * float(np.log10(255.0**2 / mse)))


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean per-frame SSIM of two uint8 clips [T, H, W, 3]."""
    return float(np.mean([structural_similarity(x, y, channel_axis=2, data_range=255) for x, y in zip(a, b, strict=True)]))


def candidate_configs(pipe: Pipeline, size: tuple[int, int], run: ProfileRun) -> list[FidelityConfig]:
    """Every config the engine accepts at ``size``: steps 1..preset, windows (default: the smallest
    that holds the sinks plus a chunk, and the runtime default), scales that give distinct engine
    sizes, precisions. The first element is the reference (most expensive) config."""
    runtime = pipe.runtime
    cfg = runtime.config
    steps = run.steps or tuple(range(1, len(runtime.preset.steps) + 1))
    windows = run.windows or tuple(sorted({cfg.sink_frames + cfg.chunk_latent_frames, cfg.kv_window_frames}))
    scales: list[float] = []
    seen: set[tuple[int, int]] = set()
    for scale in run.scales or DEFAULT_SCALES:
        engine_size = runtime.engine_size(size, FidelityConfig(resolution_scale=scale))
        if min(engine_size) > 0 and engine_size not in seen:
            seen.add(engine_size)
            scales.append(scale)
    configs = []
    for s, w, scale, precision in itertools.product(steps, windows, scales, run.precisions):
        configs.append(FidelityConfig(steps=s, kv_window_frames=w, resolution_scale=scale, precision=precision))
    # Variants at fp32 where it is measured (bf16 weights have no fp32 compute to offer).
    base = FidelityConfig(kv_window_frames=cfg.kv_window_frames,
                          precision="fp32" if "fp32" in run.precisions else run.precisions[0])
    variants = [replace(base, attention_sparsity=sparsity) for sparsity in run.sparsities if sparsity > 0]
    if run.step_batch and cfg.cache_mode == "per-step":
        variants.append(replace(base, step_batch=True))
    for s, scale, variant in itertools.product(steps, scales, variants):
        if s >= 2 or not variant.step_batch:
            configs.append(replace(variant, steps=s, resolution_scale=scale))
    for config in configs:
        runtime.check_fidelity(config)  # a clear error for a knob value this engine cannot run
    if not configs:
        raise ValueError(f"no fidelity configuration of this engine is valid at size {size}")
    precision_rank = {p: i for i, p in enumerate(("bf16", "fp32"))}
    reference = max(configs, key=lambda c: (c.steps, c.kv_window_frames, c.resolution_scale,
                                            precision_rank.get(c.precision, -1)))
    return [reference] + [c for c in configs if c != reference]


def synthetic_clip(size: tuple[int, int], frames: int, seed: int) -> np.ndarray:
    """Moving camera-like content: a smooth gradient, a drifting blob and mild sensor noise."""
    width, height = size
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    out = np.empty((frames, height, width, 3), np.uint8)
    for t in range(frames):
        cx = width * (0.3 + 0.4 * np.sin(t / 9.0) ** 2)
        cy = height * (0.5 + 0.25 * np.cos(t / 13.0))
        blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * (0.12 * width) ** 2))
        base = np.stack([x / width, y / height, 0.5 + 0.5 * np.sin((x + 3 * t) / 17.0)], axis=-1)
        image = 0.6 * base + 0.4 * blob[..., None] + rng.normal(0, 0.02, (height, width, 3))
        out[t] = np.clip(image * 255, 0, 255).astype(np.uint8)
    return out


class _Measured:
    """One config's stream: ``process`` times one chunk in and returns the frames that came out (with
    the step batch, an older chunk's, or none while it fills; ``drain`` returns the rest)."""

    def __init__(self, pipe: Pipeline, config: FidelityConfig, size: tuple[int, int], seed: int) -> None:
        # The stream runs chunk by chunk; a step batch is the StreamBatch's, a stream batch the profiler's.
        fidelity = replace(config, step_batch=False, stream_batch=1, gpus=1)
        self.stream = pipe.open_stream(StreamParams(prompt=PROFILE_PROMPT, seed=seed, size=size, fidelity=fidelity))
        self.batch = StreamBatch(pipe.runtime, [self.stream.state]) if config.step_batch else None

    def process(self, frames: np.ndarray) -> tuple[float, list[np.ndarray]]:
        t0 = time.perf_counter()
        if self.batch is None:
            out = [self.stream.process(frames)]
        else:
            done = self.batch.push([frames_as_uint8(frames, self.stream.expected_frames)])[0]
            out = [] if done is None else [tensor_to_frames(done.frames)]
        return time.perf_counter() - t0, out

    def drain(self) -> list[np.ndarray]:
        return [tensor_to_frames(r.frames) for r in self.batch.drain()] if self.batch is not None else []


def profile_pipeline(pipe: Pipeline, run: ProfileRun, model_name: str | None = None,
                     configs: Sequence[FidelityConfig] | None = None, teachers: dict[str, str] | None = None,
                     teacher_clips: int = 2) -> ProfileResult:
    """Measure ``configs`` (default: every candidate; the first one is the quality reference).

    ``teachers`` (an embedded model's look -> prompt): quality is PSNR against the teachers on
    ``teacher_clips`` held-out clips, with each point's warp error ratio beside it, instead of PSNR
    against the reference config."""
    size = run.size or pipe.default_size
    configs = list(configs) if configs is not None else candidate_configs(pipe, size, run)
    warmup = run.warmup if run.warmup is not None else max(c.kv_window_frames for c in configs)
    first_n, chunk_n = pipe.first_chunk_frames, pipe.chunk_frames
    clip = synthetic_clip(size, first_n + (warmup + run.chunks) * chunk_n, run.seed)
    first_input, rest = clip[:first_n], clip[first_n:]

    # Untimed warm-up of the whole path (allocator, kernels, text encoder caches).
    probe = _Measured(pipe, configs[0], size, run.seed)
    probe.process(first_input)
    probe.process(rest[:chunk_n])
    group = run.group or len(configs)
    if run.group is None and pipe.runtime.device.type == "cuda":
        group = streams_that_fit(pipe.runtime.device, probe.stream.state.nbytes())
    del probe

    first_times: dict[FidelityConfig, list[float]] = {c: [] for c in configs}
    for _ in range(run.first_repeats):
        for c in configs:
            first_times[c].append(_Measured(pipe, c, size, run.seed).process(first_input)[0])
    release(pipe.runtime.device)

    outputs: dict[FidelityConfig, list[np.ndarray]] = {}
    chunk_times: dict[FidelityConfig, list[float]] = {c: [] for c in configs}
    state_bytes: dict[FidelityConfig, float] = {}
    workspace: dict[FidelityConfig, float] = {}
    total = warmup + run.chunks
    groups = [configs[i : i + group] for i in range(0, len(configs), group)]
    for n, members in enumerate(groups):
        streams = {c: _Measured(pipe, c, size, run.seed) for c in members}
        outputs.update({c: streams[c].process(first_input)[1] for c in members})
        label = f"profiling {len(members)} configs" + (f" (group {n + 1}/{len(groups)})" if len(groups) > 1 else "")
        for k in tqdm(range(total), desc=label, unit="chunk"):
            frames = rest[k * chunk_n : (k + 1) * chunk_n]
            for c in members:  # interleaved: background load hits every config alike
                with _peak_above_resident(pipe.runtime.device, workspace, c, k == total - 1):
                    seconds, out = streams[c].process(frames)
                outputs[c].extend(out)
                if k >= warmup:
                    chunk_times[c].append(seconds)
        for c in members:
            outputs[c].extend(streams[c].drain())
            state_bytes[c] = float(streams[c].stream.state.nbytes())
        del streams
        release(pipe.runtime.device)

    clips = {c: np.concatenate(outputs[c]) for c in configs}
    reference = clips[configs[0]]
    scores = teacher_scores(pipe, list(configs), teachers, teacher_clips) if teachers else {}
    points = []
    for c in configs:
        points.append(ProfilePoint(
            config=c,
            latency_s=statistics.median(chunk_times[c]),
            first_chunk_latency_s=statistics.median(first_times[c]),
            quality=scores[c].psnr if scores else psnr(clips[c], reference),
            state_bytes=state_bytes[c],
            workspace_bytes=workspace.get(c, 0.0),
            source="measured",
            needs=tuple(sorted({pipe.runtime.device.type} | required_capabilities(c))),
        ))
    device = f"{platform.processor() or platform.machine()} cpu x{torch.get_num_threads()} threads"
    if pipe.runtime.device.type != "cpu":
        device = torch.cuda.get_device_name(pipe.runtime.device)
    profile = FidelityProfile(
        model=model_name or pipe.name,
        device=device,
        resolution=(int(size[0]), int(size[1])),
        chunk_latent_frames=pipe.runtime.config.chunk_latent_frames,
        chunk_pixel_frames=chunk_n,
        first_chunk_pixel_frames=first_n,
        fps=run.fps,
        points=tuple(points),
        quality_floor=SHIPPING_PSNR_DB if scores else None,
        source=f"measured: engine/profiler.py, {run.chunks} chunks after {warmup} warm-up, seed {run.seed}",
        notes=(
            (f"quality = mean PSNR (dB) of each config's shipped output against the teachers on {teacher_clips} "
             f"held-out clips x {len(teachers or ())} looks (engine/embedded/evaluate.py); 'warp_ratio' per point is "
             "its warp error over the teachers'; 'ssim' the mean SSIM against the reference config's output"
             if scores else
             f"quality = PSNR (dB, cap {PSNR_CAP:g}) of each config's output against the reference config "
             f"{configs[0].label()} on the same synthetic clip and seed; 'ssim' per point is the mean SSIM"),
            "latency = median wall time of one V2V chunk (encode + DiT + decode + stabilizer where enabled), configs interleaved",
            f"measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        ),
    )
    return ProfileResult(profile, {c: ssim(clips[c], reference) for c in configs},
                         {c: score.warp_ratio for c, score in scores.items()})


@contextmanager
def _peak_above_resident(device: torch.device, into: dict[FidelityConfig, float], config: FidelityConfig,
                         measure: bool) -> Iterator[None]:
    """On CUDA, where ``measure``: the chunk's peak memory above what was allocated before it (weights and
    every live state) into ``into[config]``: the workspace admission keeps free beside the states."""
    if not (measure and device.type == "cuda"):
        yield
        return
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    yield
    torch.cuda.synchronize(device)
    into[config] = float(max(0, torch.cuda.max_memory_allocated(device) - before))


def streams_that_fit(device: torch.device, state_bytes: int, share: float = 0.7) -> int:
    """How many streams of ``state_bytes`` fit ``share`` of the device's free memory, at least one (the
    rest is the chunks' activations and the allocator's slack)."""
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, int(share * free / max(state_bytes, 1)))


def release(device: torch.device) -> None:
    """Give freed memory back: states dropped by the caller are collected and, on CUDA, the caching
    allocator returns their blocks (so the next group, or another process, gets them)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class ProfileResult:
    profile: FidelityProfile
    ssim: dict[FidelityConfig, float]  # mean SSIM against the reference, per config
    warp_ratio: dict[FidelityConfig, float] = field(default_factory=dict)  # against the teachers, where measured
    # How the engine was compiled for the run (engine/compiled.py ``CompileReport.to_json``: the cold start
    # and each shape's warm-up); None: it ran eager.
    compile: dict[str, Any] | None = None

    def save(self, path: str | Path) -> None:
        """The profile file, with each point's SSIM (and warp error ratio) beside its quality and the
        compile's report where the run was compiled (loaders ignore the extra keys)."""
        doc: dict[str, Any] = self.profile.to_json()
        if self.compile is not None:
            doc["compile"] = self.compile
        for raw, point in zip(doc["points"], self.profile.points, strict=True):
            raw["ssim"] = round(self.ssim[point.config], 5)
            if point.config in self.warp_ratio:
                raw["warp_ratio"] = round(self.warp_ratio[point.config], 4)
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")

    def anchored(self, reference_ms: float) -> ProfileResult:
        """Every latency times one factor, so that the reference (highest-quality) point's chunk takes
        ``reference_ms``: a busy machine slows every config alike (they run interleaved), so the run
        gives the ratios and a quiet machine's measurement of the reference gives the scale."""
        if not reference_ms > 0:
            raise ValueError(f"the anchor must be a positive number of milliseconds, got {reference_ms}")
        measured = self.profile.reference().latency_s
        factor = reference_ms / 1000.0 / measured

        def scaled(p: ProfilePoint) -> ProfilePoint:
            return replace(p, latency_s=p.latency_s * factor, first_chunk_latency_s=p.first_chunk_latency_s * factor)

        note = (f"latencies x{factor:.4f}: measured side by side on a busy machine (reference "
                f"{1000 * measured:.1f} ms per chunk), anchored to {reference_ms:g} ms for the reference "
                "measured on a quiet one")
        points = tuple(scaled(p) for p in self.profile.points)
        return replace(self, profile=replace(self.profile, points=points, notes=(*self.profile.notes, note)))

    def ladder(self, min_speedup: float = 0.05) -> ProfileResult:
        """Only the ladders of :func:`ladders` (the Pareto front, each rung measurably faster, for every
        set of capabilities the points need)."""
        kept = ladders(self.profile.per_stream(), min_speedup)
        notes = (*self.profile.notes, f"kept: the Pareto front, each point at least {min_speedup:.0%} faster than "
                                      f"the one above it, for each set of capabilities the points need "
                                      f"({len(kept)} of {len(self.profile.points)} measured)")
        return replace(self, profile=replace(self.profile, points=kept, notes=notes))


def ladders(points: Sequence[ProfilePoint], min_speedup: float = 0.05) -> tuple[ProfilePoint, ...]:
    """The :func:`ladder` of the points each set of requirements runs, merged (fastest first): a device
    without one of the capabilities (say bf16 on a CPU without bf16 units) still finds a whole ladder
    among the points it runs, where the ladder of all points would leave it the few that need nothing."""
    kept: dict[FidelityConfig, ProfilePoint] = {}
    for have in {p.requirements for p in points}:
        for p in ladder([q for q in points if q.requirements <= have], min_speedup):
            kept[p.config] = p
    return tuple(sorted(kept.values(), key=lambda p: p.latency_s))


def ladder(points: Sequence[ProfilePoint], min_speedup: float = 0.05) -> tuple[ProfilePoint, ...]:
    """The Pareto front of ``points`` from the best quality down, keeping a point only where it is at
    least ``min_speedup`` (a fraction) faster than the last one kept: a rung the timing noise of a
    shared machine could reorder is no rung. Sorted by latency, fastest first."""
    kept: list[ProfilePoint] = []
    for point in reversed(pareto_frontier(points)):
        if not kept or point.latency_s <= (1.0 - min_speedup) * kept[-1].latency_s:
            kept.append(point)
    return tuple(reversed(kept))
