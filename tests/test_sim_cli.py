"""`diffcast simulate` end to end on tiny configurations (the module, without the other subcommands)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest

from app.commands import simulate
from engine.fidelity import FidelityConfig
from engine.serving.profile import FidelityProfile, ProfilePoint, bundled_profile
from engine.sim.runner import run_one, simulation_profile, workload_events
from engine.sim.simulator import SimConfig
from engine.sim.workload import WorkloadSpec


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    rc = simulate.run(parser.parse_args(argv))
    return rc, capsys.readouterr().out


def test_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run_cli(["--workload", "steady", "--streams", "20", "--policies", "fifo-batch,slackserve",
                       "--json"], capsys)
    assert rc == 0
    obj = json.loads(out)  # exactly one JSON object on stdout
    assert set(obj["policies"]) == {"fifo-batch", "slackserve"}
    for summary in obj["policies"].values():
        assert {"cpr", "ttfc_s", "stalls_per_stream"} <= set(summary)
        assert 0.0 <= summary["cpr"] <= 1.0


def test_tick_bench_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run_cli(["--tick-bench", "--streams", "64", "--ticks", "5", "--json"], capsys)
    assert rc == 0
    obj = json.loads(out)
    assert obj["streams"] == 64 and obj["tick_ms"] > 0


def test_report_and_trace_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "pause.jsonl"
    assert run_cli(["--workload", "pause", "--streams", "15", "--write-trace", str(trace)], capsys)[0] == 0
    assert trace.read_text().count('"arrive"') == 15
    out_dir = tmp_path / "rep"
    rc, out = run_cli(["--trace", str(trace), "--policies", "credit-only,slackserve", "--out", str(out_dir),
                       "--json"], capsys)
    assert rc == 0
    assert json.loads(out)["workload"] == "trace"
    report = (out_dir / "report.md").read_text()
    assert "## trace" in report and "slackserve" in report
    for png in ("cpr.png", "ttfc.png", "stalls.png", "worker_tiers.png", "ablation_trace.png", "autoscaler.png"):
        assert (out_dir / png).stat().st_size > 1000


def test_bad_policy_name_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    assert simulate.run(parser.parse_args(["--policies", "magic", "--streams", "5"])) == 2
    assert "unknown policies" in capsys.readouterr().err


def _fidelity_counts(profile: FidelityProfile) -> dict[str, int]:
    """Chunks per config label under overload (4 GPUs for 40 streams): BMPR downshifts to fast points."""
    events = workload_events(WorkloadSpec("steady", streams=40, rate=1.0, seed=0), profile)
    return run_one("slackserve", profile, events, SimConfig(workers=4)).result.fidelity_counts


def test_simulation_never_plans_with_fp8_points_on_the_h100_profile() -> None:
    raw = bundled_profile()
    assert any("/fp8/" in label for label in _fidelity_counts(raw)), "the unfiltered profile would use fp8"
    counts = _fidelity_counts(simulation_profile())
    assert counts and not any("/fp8/" in label for label in counts)
    assert any("/sp0.6/" in label for label in counts)  # sparse points remain: the engine runs them


def test_profile_point_needing_a_missing_capability_is_dropped(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    profile = bundled_profile()
    # Faster and better than anything else: every policy would pick it if it were left in.
    magic = ProfilePoint(FidelityConfig(steps=1, kv_window_frames=5), 0.05, 0.05, 99.0, 0.0, source="derived",
                         needs=("cuda", "flux-capacitor"))
    path = tmp_path / "magic.json"
    replace(profile, points=(*profile.points, magic)).save(path)
    loaded = simulation_profile(path)
    assert magic.config not in {p.config for p in loaded.points}
    assert magic.config.label() not in _fidelity_counts(loaded)
    rc, out = run_cli(["--profile", str(path), "--workload", "steady", "--streams", "10",
                       "--policies", "slackserve", "--json"], capsys)
    assert rc == 0 and json.loads(out)["policies"]["slackserve"]["mean_quality"] < 99.0
