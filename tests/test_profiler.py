"""The profiler measures real configs of the tiny model and writes a profile BMPR can route with."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.cli import main
from engine.fidelity import FidelityConfig
from engine.pipeline import StreamParams
from engine.profiler import (
    PSNR_CAP,
    ProfileRun,
    candidate_configs,
    ladder,
    ladders,
    profile_pipeline,
    synthetic_clip,
)
from engine.serving.bmpr import BMPR
from engine.serving.profile import ProfilePoint, load_profile

REFERENCE = FidelityConfig(steps=2, kv_window_frames=6, precision="fp32")
CHEAP = FidelityConfig(steps=1, kv_window_frames=4, precision="fp32")


def test_two_configs_make_a_valid_profile(engine_factory: Any, tmp_path: Path) -> None:
    pipe = engine_factory.pipeline
    run = ProfileRun(chunks=2, warmup=1, first_repeats=1)
    result = profile_pipeline(pipe, run, configs=[REFERENCE, CHEAP])
    path = tmp_path / "p.json"
    result.save(path)
    profile = load_profile(path)  # validates the file format
    assert profile.resolution == pipe.default_size and profile.chunk_pixel_frames == pipe.chunk_frames
    ref, cheap = profile.find(REFERENCE), profile.find(CHEAP)
    assert ref.quality == PSNR_CAP == max(p.quality for p in profile.points)
    assert result.ssim[REFERENCE] == pytest.approx(1.0)
    assert all(p.latency_s > 0 and p.source == "measured" for p in profile.points)
    router = BMPR(profile.per_stream())
    assert {p.config for p in router.frontier} <= {REFERENCE, CHEAP}
    assert router.route(1e9).point.config == REFERENCE  # unlimited budget: best quality

    # Independent: run the cheap config alone, outside the profiler, and compute PSNR by hand.
    size = pipe.default_size
    clip = synthetic_clip(size, 1 + 3 * pipe.chunk_frames, seed=0)

    def outputs(c: FidelityConfig) -> np.ndarray:
        params = StreamParams(prompt="oil painting", steps=c.steps, seed=0, size=size)
        stream = pipe.open_stream(pipe.with_knobs(params, kv_window_frames=c.kv_window_frames, precision=c.precision))
        chunks = [stream.process(clip[:1])]
        chunks += [stream.process(clip[1 + k * 4 : 5 + k * 4]) for k in range(3)]
        return np.concatenate(chunks).astype(np.float64)

    mse = np.mean((outputs(CHEAP) - outputs(REFERENCE)) ** 2)
    assert cheap.quality == pytest.approx(10 * np.log10(255**2 / mse), abs=1e-3)


def test_candidates_cover_the_engine_knobs(engine_factory: Any) -> None:
    pipe = engine_factory.pipeline
    configs = candidate_configs(pipe, pipe.default_size, ProfileRun())
    preset_steps = len(pipe.runtime.preset.steps)
    assert configs[0] == FidelityConfig(steps=preset_steps, kv_window_frames=pipe.runtime.config.kv_window_frames,
                                        resolution_scale=1.0, precision="fp32")
    assert {c.steps for c in configs} == set(range(1, preset_steps + 1))
    assert {c.precision for c in configs} == {"fp32", "bf16"}
    assert len({c.resolution_scale for c in configs}) == 3 and len(set(configs)) == len(configs)


def test_cli_rejects_a_bad_size() -> None:
    with pytest.raises(SystemExit):
        main(["profile", "--size", "128by128"])


def test_step_batch_and_sparse_variants_are_measured_through_their_engine_paths(engine_factory: Any) -> None:
    pipe = engine_factory.pipeline
    batched = FidelityConfig(steps=2, kv_window_frames=6, precision="fp32", step_batch=True)
    sparse = FidelityConfig(steps=2, kv_window_frames=6, precision="fp32", attention_sparsity=0.5)
    result = profile_pipeline(pipe, ProfileRun(chunks=2, warmup=1, first_repeats=1), configs=[REFERENCE, batched, sparse])
    profile = result.profile
    # The step batch computes what sequential chunks compute (the frames only come out later).
    assert profile.find(batched).quality > 45
    assert "sparse-attention" in profile.find(sparse).needs
    configs = candidate_configs(pipe, pipe.default_size, ProfileRun(sparsities=(0.5,), step_batch=True))
    assert any(c.step_batch for c in configs) and all(c.steps >= 2 for c in configs if c.step_batch)
    assert any(c.attention_sparsity == 0.5 for c in configs)


def _point(latency_ms: float, quality: float, scale: float) -> ProfilePoint:
    return ProfilePoint(config=FidelityConfig(steps=1, kv_window_frames=2, resolution_scale=scale, precision="fp32"),
                        latency_s=latency_ms / 1000, first_chunk_latency_s=latency_ms / 1000, quality=quality,
                        state_bytes=1.0, source="measured", needs=("cpu",))


def test_the_ladder_is_the_pareto_front_with_measurable_steps() -> None:
    points = [_point(100, 24.0, 1.0), _point(98, 23.9, 0.95), _point(80, 23.0, 0.9), _point(85, 22.0, 0.85),
              _point(60, 22.5, 0.8), _point(30, 20.0, 0.5)]
    rungs = ladder(points, min_speedup=0.05)
    # 98 ms is within 5 % of 100 ms (no rung); 85 ms / 22.0 dB is dominated by 80 ms / 23.0 dB.
    assert [p.latency_s * 1000 for p in rungs] == pytest.approx([30, 60, 80, 100])
    assert [p.quality for p in rungs] == [20.0, 22.5, 23.0, 24.0]


def test_each_capability_set_keeps_a_whole_ladder() -> None:
    def bf16(latency_ms: float, quality: float, scale: float) -> ProfilePoint:
        p = _point(latency_ms, quality, scale)
        return replace(p, config=replace(p.config, precision="bf16"))

    fp32 = [_point(100, 24.0, 1.0), _point(60, 22.5, 0.75), _point(30, 20.0, 0.5)]
    fast = [bf16(80, 24.0, 1.0), bf16(48, 22.5, 0.75), bf16(24, 20.0, 0.5)]
    kept = ladders(fp32 + fast)
    # The ladder of all points is the bf16 one; a device without bf16 still gets the fp32 ladder.
    assert ladder(fp32 + fast) == tuple(fast[::-1])
    assert set(kept) == set(fp32 + fast)
    assert [p.latency_s for p in kept] == sorted(p.latency_s for p in kept)


def test_anchoring_keeps_the_ratios_and_sets_the_reference() -> None:
    from engine.profiler import ProfileResult
    from engine.serving.profile import FidelityProfile

    points = (_point(2000, 23.5, 1.0), _point(800, 20.0, 0.5))
    profile = FidelityProfile(model="m", device="cpu", resolution=(256, 256), chunk_latent_frames=1,
                              chunk_pixel_frames=4, first_chunk_pixel_frames=1, fps=16.0, points=points,
                              source="measured")
    anchored = ProfileResult(profile, {p.config: 1.0 for p in points}).anchored(100.0).profile
    assert [p.latency_s for p in anchored.points] == pytest.approx([0.1, 0.04])
    assert [p.quality for p in anchored.points] == [23.5, 20.0]
    assert "anchored to 100 ms" in anchored.notes[-1]


def test_teacher_quality_is_psnr_against_the_teachers_on_held_out_clips() -> None:
    from engine.embedded.clips import heldout_specs, render_clip
    from engine.embedded.evaluate import style_prompts
    from engine.embedded.teachers import stylize_clip
    from engine.pipeline import DEFAULT_MODEL, Pipeline

    pipe = Pipeline.load()
    prompts = dict(list(style_prompts(DEFAULT_MODEL.with_suffix(".json")).items())[:2])
    full = FidelityConfig(steps=1, kv_window_frames=2, precision="fp32")
    half = FidelityConfig(steps=1, kv_window_frames=2, resolution_scale=0.5, precision="fp32")
    result = profile_pipeline(pipe, ProfileRun(chunks=1, warmup=1, first_repeats=1), configs=[full, half],
                              teachers=prompts, teacher_clips=1)
    # Independent: the Python API at the half scale, PSNR against the teachers by hand.
    frames = render_clip(heldout_specs()[0])
    psnrs = []
    for style, prompt in prompts.items():
        stream = pipe.open_stream(pipe.with_knobs(StreamParams(prompt=prompt, seed=0), resolution_scale=0.5))
        out = np.concatenate([stream.process(frames[:1])] + [stream.process(frames[a : a + 4])
                                                             for a in range(1, len(frames), 4)])
        mse = np.mean((out.astype(np.float64) - stylize_clip(frames, style).astype(np.float64)) ** 2)
        psnrs.append(10 * np.log10(255**2 / mse))
    assert result.profile.find(half).quality == pytest.approx(np.mean(psnrs), abs=1e-3)
    assert 10 < result.profile.find(half).quality < result.profile.find(full).quality < PSNR_CAP
    assert all(0.2 < result.warp_ratio[c] < 5 for c in (full, half))


@pytest.mark.parametrize("bf16_units", [True, False], ids=["bf16-cpu", "fp32-only-cpu"])
def test_the_bundled_default_ladder_is_what_the_live_policy_routes_on(bf16_units: bool) -> None:
    from engine.pipeline import Pipeline
    from engine.serving.live import bundled_live_profile, runnable_profile

    # The server's own filter, on a CPU with bf16 units and on one without (bf16 emulated, slower).
    pipe = Pipeline.load()
    bundled = bundled_live_profile(None, pipe.default_size)
    assert bundled.model == "default" and bundled.source.startswith("measured")
    assert any("against the teachers" in note for note in bundled.notes)
    profile = runnable_profile(bundled, "cpu", step_wise=True, bf16_units=bf16_units)
    assert {p.config.precision for p in profile.points} == ({"bf16", "fp32"} if bf16_units else {"fp32"})
    rungs = BMPR(profile.per_stream()).frontier  # what the policy routes on
    assert len(rungs) >= 5
    for faster, slower in zip(rungs[:-1], rungs[1:], strict=True):
        assert faster.latency_s <= 0.95 * slower.latency_s and faster.quality < slower.quality
    # Every point is one the engine runs: a stream switches to it mid-stream and keeps stylizing.
    points = sorted(profile.points, key=lambda p: p.latency_s)
    frames = synthetic_clip(pipe.default_size, 1 + 4 * len(points), seed=1)
    stream = pipe.open_stream(StreamParams(prompt="oil painting"))
    stream.process(frames[:1])
    for k, point in enumerate(points):
        stream.set_fidelity(point.config)
        out = stream.process(frames[1 + 4 * k : 5 + 4 * k])
        assert out.shape == (4, pipe.default_size[1], pipe.default_size[0], 3) and out.std() > 4
        assert stream.state.fidelity == point.config


def test_grouped_points_free_their_states_and_measure_the_same_outputs(engine_factory: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``group`` 2, at most two measured streams live at once whatever the number of points (the
    CUDA run kept every point's state until the end and ran out of memory), and each point's output is
    the one the all-at-once run gives (the same clip, seed and config: grouping changes only timing)."""
    import weakref

    import engine.profiler as profiler

    pipe = engine_factory.pipeline
    configs = [REFERENCE, CHEAP, replace(CHEAP, steps=2), replace(REFERENCE, steps=1)]
    alive: set[int] = set()
    most = 0
    made = profiler._Measured.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        nonlocal most
        made(self, *args, **kwargs)
        key = id(self.stream.state)
        alive.add(key)
        weakref.finalize(self.stream.state, alive.discard, key)
        most = max(most, len(alive))

    run = ProfileRun(chunks=2, warmup=1, first_repeats=1)
    together = profile_pipeline(pipe, run, configs=configs)
    monkeypatch.setattr(profiler._Measured, "__init__", counting)
    grouped = profile_pipeline(pipe, replace(run, group=2), configs=configs)
    assert most <= 2 + 1, f"{most} measured streams were alive at once"  # + the first-chunk probe's
    for c in configs:
        assert grouped.profile.find(c).quality == together.profile.find(c).quality
        assert grouped.profile.find(c).state_bytes == together.profile.find(c).state_bytes > 0
    with pytest.raises(ValueError, match="group"):
        ProfileRun(group=0)
