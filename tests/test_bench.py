"""`diffcast bench engine` on random-weight models: the report's contract, the prompt-switch cost, and the
CPU smoke of the full-size 1.3B (the command a GPU session runs with --device cuda)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from app.commands import bench, profile
from engine.devices import has_bf16_units


@pytest.fixture(autouse=True)
def keep_threads() -> Iterator[None]:
    previous = torch.get_num_threads()  # --threads changes torch's global setting
    yield
    torch.set_num_threads(previous)


def run_bench(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    rc = bench.run(parser.parse_args(argv))
    out = capsys.readouterr().out
    return rc, (json.loads(out) if rc == 0 else {})


def test_engine_report_has_rows_and_a_separate_prompt_switch(capsys: pytest.CaptureFixture[str]) -> None:
    rc, report = run_bench(["engine", "--model", "random:tiny", "--steps", "1,2", "--chunks", "2", "--threads", "1",
                            "--json"], capsys)
    assert rc == 0
    assert (report["model"], report["dtype"], report["attention"], report["device"]) == \
        ("random:tiny", "fp32", "sdpa", "cpu")
    switch = report["prompt_switch"]
    assert switch["total_ms"] == pytest.approx(switch["text_encode_ms"] + switch["prompt_kv_ms"], abs=0.02)
    assert switch["prompt_kv_ms"] > 0 and switch["cached_text_ms"] >= 0
    assert [r["steps"] for r in report["results"]] == [1, 2]
    for row in report["results"]:
        assert row["size"] == [64, 64] and row["chunk_ms"] > 0 and row["first_chunk_ms"] > 0
        assert row["park_ms"] >= 0 and row["restore_ms"] >= 0 and row["state_mb"] > 0
        assert "cuda_peak_mb" not in row
    one, two = report["results"]
    assert two["state_mb"] > one["state_mb"]  # a KV cache per step
    # The parts add up to the whole, and the second step's cache is the whole difference.
    for row in (one, two):
        assert sum(row["state_parts_mb"].values()) == pytest.approx(row["state_mb"], abs=0.05)
    assert (one["kv_caches"], two["kv_caches"]) == (1, 2)
    assert two["state_parts_mb"]["kv"] == pytest.approx(2 * one["state_parts_mb"]["kv"], abs=0.011)  # rounded MB
    assert two["state_mb"] - one["state_mb"] == pytest.approx(one["state_parts_mb"]["kv"], abs=0.05)
    assert one["park_gbps"] > 0 and one["warmup_chunks"] >= one["kv_window"]


def test_precisions_side_by_side_show_the_fp8_cache_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    """`--precisions fp32,fp8-kv`: a row per precision, the fp8 cache's KV bytes about a quarter of the
    fp32 cache's (one byte per value and a four-byte scale per token and head); a name that is no precision
    is a usage error."""
    rc, report = run_bench(["engine", "--model", "random:tiny", "--steps", "1", "--chunks", "2", "--threads", "1",
                            "--precisions", "fp32,fp8-kv", "--json"], capsys)
    assert rc == 0
    fp32, fp8 = report["results"]
    assert (fp32["precision"], fp8["precision"]) == ("fp32", "fp8-kv")
    head_dim = 32  # random:tiny: dim 64 over 2 heads (engine/models/wan_dit.py CONFIGS["tiny"])
    assert fp8["state_parts_mb"]["kv"] == pytest.approx(fp32["state_parts_mb"]["kv"] * (head_dim + 4) / (4 * head_dim),
                                                        abs=0.011)
    assert fp8["state_mb"] < fp32["state_mb"] - 0.5 * fp32["state_parts_mb"]["kv"]
    with pytest.raises(SystemExit):
        run_bench(["engine", "--precisions", "fp16"], capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error(capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    rc, _ = run_bench(["engine", "--model", "random:tiny", "--device", "cuda"], capsys)
    assert rc == 2 and "CUDA is not available on this machine" in caplog.text
    parser = argparse.ArgumentParser()
    profile.add_arguments(parser)
    assert profile.run(parser.parse_args(["--model", "random:tiny", "--device", "cuda:1"])) == 2


def test_profile_with_bf16_weights_measures_bf16(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    profile.add_arguments(parser)
    args = parser.parse_args(["--model", "random:tiny", "--dtype", "bf16", "--steps", "1", "--windows", "4",
                              "--scales", "1", "--chunks", "1", "--warmup", "1"])
    assert profile.run(args) == 0
    out = capsys.readouterr().out
    assert "S1/W4/x1/bf16" in out and "fp32" not in out  # bf16 weights have no fp32 compute to measure


@pytest.mark.slow
def test_full_size_1_3b_smoke_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """The real 1.3B architecture at 64x64, 1 step, 1 measured chunk: the command a GPU session runs with
    --device cuda. Where the CPU has bf16 units (AVX512-BF16/AMX) bf16 weights: half fp32's memory (a 4.2
    GB process) and 2.3x faster (docs/performance.md), ~11 s. Without them bf16 is emulated and took over
    600 s on an AVX2-only EPYC, so fp32 runs there: ~60 s and a 7.5 GB process."""
    dtype = "bf16" if has_bf16_units("cpu") else "fp32"
    rc, report = run_bench(["engine", "--model", "random:wan2.1-1.3b", "--sizes", "64x64", "--steps", "1",
                            "--chunks", "1", "--threads", "2", "--dtype", dtype, "--json"], capsys)
    assert rc == 0
    assert report["model"] == "random:wan2.1-1.3b" and report["dtype"] == dtype
    assert report["prompt_switch"]["prompt_kv_ms"] > 0
    (row,) = report["results"]
    assert row["chunk_ms"] > 0 and row["first_chunk_ms"] > 0 and row["dit_ms"] > 0
