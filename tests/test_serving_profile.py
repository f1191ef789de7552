"""Fidelity configs, the profile file format, Pareto extraction, the bundled derived profiles."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.fidelity import (
    FidelityConfig,
    engine_capabilities,
    missing_capabilities,
    required_capabilities,
    unsupported_reason,
)
from engine.serving.derived_profiles import SDV2_FPS, derived_h100_profile
from engine.serving.profile import (
    FidelityProfile,
    ProfilePoint,
    bundled_profile,
    load_profile,
    pareto_frontier,
    profile_device_type,
    quality_floor,
)


def point(lat: float, q: float, steps: int = 4) -> ProfilePoint:
    return ProfilePoint(FidelityConfig(steps=steps), lat, lat, q, 0.0)


def test_config_validation_names_the_knob() -> None:
    with pytest.raises(ValueError, match="steps"):
        FidelityConfig(steps=5)
    with pytest.raises(ValueError, match="precision"):
        FidelityConfig(precision="int4")
    with pytest.raises(ValueError, match="resolution_scale"):
        FidelityConfig(resolution_scale=0.0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0.1, 2.0), st.floats(70, 90)), min_size=1, max_size=25))
def test_pareto_frontier_matches_bruteforce_dominance(pairs: list[tuple[float, float]]) -> None:
    pts = [point(lat, q) for lat, q in pairs]

    def dominated(i: int) -> bool:
        a = pts[i]
        return any(
            b.latency_s <= a.latency_s and b.quality >= a.quality
            and (b.latency_s < a.latency_s or b.quality > a.quality)
            for b in pts
        )

    expected = {(p.latency_s, p.quality) for i, p in enumerate(pts) if not dominated(i)}
    frontier = pareto_frontier(pts)
    assert {(p.latency_s, p.quality) for p in frontier} == expected
    lats = [p.latency_s for p in frontier]
    assert lats == sorted(lats)


def test_quality_floor_is_median_of_all_configs() -> None:
    pts = [point(0.1, 70), point(0.5, 90), point(0.6, 80), point(0.9, 85)]  # (0.6, 80) is dominated
    assert quality_floor(pts) == pytest.approx(statistics.median([70, 90, 80, 85]))


def test_profile_round_trips_and_loader_errors_are_specific(tmp_path: Path) -> None:
    prof = derived_h100_profile()
    path = tmp_path / "p.json"
    prof.save(path)
    again = load_profile(path)
    assert again.points[7].config == prof.points[7].config
    assert again.points[7].latency_s == pytest.approx(prof.points[7].latency_s, rel=1e-5)
    data = json.loads(path.read_text())
    del data["points"][3]["quality"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"points\[3\].*quality"):
        load_profile(path)
    data["points"][3]["quality"] = 80.0
    data["points"][2]["config"]["turbo"] = True
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"points\[2\].*turbo"):
        load_profile(path)
    data["format"] = "something-else"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unsupported format"):
        load_profile(path)


def test_bundled_profile_is_the_derived_one() -> None:
    bundled = bundled_profile()
    fresh = derived_h100_profile()
    assert len(bundled.points) == len(fresh.points)
    assert all(p.source == "derived" for p in bundled.points)
    with pytest.raises(FileNotFoundError, match="available"):
        bundled_profile("nope")


@pytest.mark.parametrize("res", sorted(SDV2_FPS))
def test_derived_latency_reproduces_published_fps(res: tuple[int, int]) -> None:
    """Reference window/bf16/dense points at 1..4 steps must give back StreamDiffusionV2's FPS (fit error)."""
    prof = derived_h100_profile(res)
    for steps, fps in enumerate(SDV2_FPS[res], start=1):
        p = prof.find(FidelityConfig(steps=steps, precision="bf16"))
        assert 12 / p.latency_s == pytest.approx(fps, rel=0.03)


def test_profile_reference_is_best_quality_single_stream() -> None:
    prof: FidelityProfile = derived_h100_profile()
    ref = prof.reference()
    assert ref.config == FidelityConfig(precision="bf16")
    qs = np.array([p.quality for p in prof.per_stream()])
    assert ref.quality == qs.max()
    assert all(p.config.stream_batch == 1 and p.config.gpus == 1 for p in prof.per_stream())


def test_filtered_profile_keeps_only_supported_configs() -> None:
    prof = derived_h100_profile()
    dense_bf16 = prof.filtered(lambda c: c.precision == "bf16" and c.attention_sparsity == 0.0)
    assert dense_bf16.points and all(p.config.precision == "bf16" for p in dense_bf16.points)
    assert dense_bf16.reference() == prof.reference()
    with pytest.raises(ValueError, match="passes the filter"):
        prof.filtered(lambda c: False)


def test_engine_capabilities_say_what_runs_where() -> None:
    assert engine_capabilities("cpu") == {"cpu", "bf16", "sparse-attention", "fp8-kv"}
    assert engine_capabilities("cuda") == {"cuda", "bf16", "sparse-attention", "fp8-kv"}
    assert engine_capabilities("mps") == {"mps", "sparse-attention"}  # sparse attention is plain torch: every device
    fp8 = FidelityConfig(precision="fp8", attention_sparsity=0.6)
    assert required_capabilities(fp8) == {"fp8-attention", "sparse-attention"}
    assert required_capabilities(FidelityConfig(precision="fp32")) == frozenset()
    for device in ("cpu", "cuda"):
        assert missing_capabilities(fp8, device) == {"fp8-attention"}
        reason = unsupported_reason(fp8, device)
        assert reason is not None and "fp8 attention needs a kernel" in reason
        assert unsupported_reason(FidelityConfig(attention_sparsity=0.9), device) is None
    assert unsupported_reason(FidelityConfig(precision="bf16"), "mps") == "bf16 is not available on mps; use fp32"


@pytest.mark.parametrize(("device", "kind"), [
    ("H100-80GB", "cuda"), ("NVIDIA H100 80GB HBM3", "cuda"), ("NVIDIA GeForce RTX 4090", "cuda"),
    ("Tesla T4", "cuda"), ("NVIDIA L40S", "cuda"), ("x86_64 cpu x2 threads", "cpu"), ("arm cpu x8 threads", "cpu"),
])
def test_profile_device_type_maps_profile_device_strings(device: str, kind: str) -> None:
    assert profile_device_type(device) == kind


def test_profile_device_type_refuses_unknown_devices() -> None:
    with pytest.raises(ValueError, match="cannot tell which device type"):
        profile_device_type("TPU v5e")


def test_needs_round_trip_and_files_without_needs_still_load(tmp_path: Path) -> None:
    prof = derived_h100_profile()
    path = tmp_path / "p.json"
    prof.save(path)
    assert [p.needs for p in load_profile(path).points] == [p.needs for p in prof.points]
    data = json.loads(path.read_text())
    for raw in data["points"]:
        del raw["needs"]
    path.write_text(json.dumps(data))
    old = load_profile(path)
    assert all(p.needs == () for p in old.points)
    # Without a listed need, an fp8 point still requires fp8 attention (its knob says so).
    fp8 = next(p for p in old.points if p.config.precision == "fp8")
    assert "fp8-attention" in fp8.requirements
    data["points"][1]["needs"] = "cuda"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"points\[1\].*needs"):
        load_profile(path)


def test_runnable_keeps_only_points_the_capabilities_cover() -> None:
    prof = derived_h100_profile()
    dense = prof.runnable({"cuda", "bf16"})
    assert dense.points and all(p.config.precision == "bf16" and p.config.attention_sparsity == 0.0
                                for p in dense.points)
    here = prof.engine_runnable()
    assert len(here.points) == len(prof.points) - sum(p.config.precision == "fp8" for p in prof.points)
    assert any(p.config.attention_sparsity > 0 for p in here.points)
    with pytest.raises(ValueError, match="no single-stream configuration.*cuda"):
        prof.runnable(engine_capabilities("cpu"))
    exotic = ProfilePoint(FidelityConfig(steps=1), 0.1, 0.1, 90.0, 0.0, needs=("cuda", "flux-capacitor"))
    widened = replace(prof, points=(*prof.points, exotic))
    assert exotic not in widened.engine_runnable().points


@pytest.mark.parametrize("name", ["wan2.1-1.3b_h100_480p", "wan2.1-1.3b_h100_512"])
def test_bundled_h100_profiles_say_what_each_point_needs(name: str) -> None:
    bundled = bundled_profile(name)
    assert bundled.device_type == "cuda"
    assert bundled.to_json() == derived_h100_profile(bundled.resolution).to_json()  # regenerated, not hand-edited
    for p in bundled.points:
        assert "cuda" in p.needs
        assert ("fp8-attention" in p.needs) == (p.config.precision == "fp8")
        assert ("sparse-attention" in p.needs) == (p.config.attention_sparsity > 0)
    assert any("fp8" in note and "not have yet" in note for note in bundled.notes)
