"""The profiler measures real configs of the tiny model and writes a profile BMPR can route with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.cli import main
from engine.pipeline import StreamParams
from engine.profiler import PSNR_CAP, ProfileRun, candidate_configs, profile_pipeline, synthetic_clip
from engine.serving.bmpr import BMPR
from engine.serving.fidelity import FidelityConfig, load_profile

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
        stream = pipe.open_stream(StreamParams(prompt="oil painting", steps=c.steps, seed=0, size=size,
                                               kv_window_frames=c.kv_window_frames, precision=c.precision))
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
