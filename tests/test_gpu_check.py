"""demos/gpu_check.py in its --quick CPU mode: every phase runs, the JSON holds what the GPU run will
report, and nothing of the media or web stack is imported (the GPU machines have none of it: here those
packages are made unimportable for the run, so an import of one fails the phase that made it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine.serving.profile import load_profile

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("aiortc", "av", "aiohttp", "uvicorn", "fastapi", "starlette", "gradio", "ray")


def test_quick_gpu_check_runs_every_phase_without_the_media_stack(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    code = ("import runpy, sys\n"
            f"for name in {BLOCKED!r}: sys.modules[name] = None\n"
            f"sys.argv = ['gpu_check.py', '--quick', '--out', {str(out)!r}]\n"
            "runpy.run_path('demos/gpu_check.py', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    phases = ("env", "fast_path", "stage_timer", "bench", "batched", "vae_layout", "dit_blocks", "fp8_linear", "fp8_kv",
              "profile", "serving", "compile", "done")
    assert {p: "result" in doc[p] for p in phases} == dict.fromkeys(phases, True), {p: doc[p] for p in phases}
    assert doc["done"]["result"]["ok"] and doc["media_stack_imported"] == []
    bench = doc["bench"]["result"]
    assert {(r["size"][0], r["steps"]) for r in bench} == {(128, 1), (128, 2), (96, 1), (96, 2)}
    for row in bench:
        assert row["warmup_chunks"] >= row["kv_window"] and row["park_gbps"] > 0 and row["restore_gbps"] > 0
    assert [r["streams"] for r in doc["batched"]["result"]] == [1, 2]
    timer = doc["stage_timer"]["result"]  # the runtime's marks against a sync at each of its 5 boundaries
    assert timer["events"]["syncs_per_chunk"] == 0 and timer["synced"]["syncs_per_chunk"] == 5
    assert timer["events"]["stages_ms"] > 0
    compiled = doc["compile"]["result"]  # traced with the eager backend on a CPU
    assert compiled["compile"]["graphs"] >= 3 and compiled["calls"]["dit"]["compiled_calls"] > 0
    assert compiled["eager"]["chunk_ms"] > 0 and compiled["compiled"]["chunk_ms"] > 0
    fp8 = doc["fp8_linear"]["result"]  # a CPU: no fp8 GEMM, the emulation's error only
    assert fp8["supported"] is False and set(fp8["forward_ms"]) == {"bf16", "emulated"}
    assert 1e-3 < fp8["rel_error_vs_bf16"]["emulated"] < 0.05
    kv = {row["precision"]: row for row in doc["fp8_kv"]["result"]["rows"]}  # no fp8 GEMM: no fp8-linear-kv
    assert set(kv) == {"bf16", "fp8-kv"} and 20 < kv["fp8-kv"]["psnr_db_vs_bf16"] < 100
    assert kv["fp8-kv"]["kv_mb"] < 0.6 * kv["bf16"]["kv_mb"]  # fp32 weights here: a bf16 stream's cache is fp32
    profile = load_profile(out.with_name("check_profile.json"))
    assert {p.config.steps for p in profile.points} == {1, 2} and all(p.state_bytes > 0 for p in profile.points)
    runs = doc["serving"]["result"]
    assert [len(r["streams"]) for r in runs] == [1, 2]
    for run in runs:
        for stream in run["streams"]:
            assert stream["frames_out"] > 0 and 0.0 <= stream["on_time_ratio"] <= 1.0
