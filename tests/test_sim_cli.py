"""`diffcast simulate` end to end on tiny configurations (the module, without the other subcommands)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from app.commands import simulate


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
