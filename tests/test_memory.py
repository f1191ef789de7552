"""Memory arithmetic (engine/memory.py) against the tensors a real stream holds, and `diffcast bench memory`."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch
from _dit_fixtures import dit_single_thread  # noqa: F401  (autouse fixture)

from app.commands import bench
from engine.memory import memory_report, stream_state_bytes, umt5_xxl_parameter_count
from engine.pipeline import Pipeline, StreamParams
from engine.random_model import RANDOM_MODELS, random_model


def _nbytes(tensors: object) -> int:
    items = tensors.values() if isinstance(tensors, dict) else tensors
    return sum(t.numel() * t.element_size() for t in items)  # type: ignore[union-attr]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_arithmetic_equals_a_real_streams_tensors(dtype: torch.dtype) -> None:
    """random:tiny is the Wan topology (DiT blocks, Wan VAE, umT5-shaped text) at test size: its stream,
    once its VAE caches are full (third chunk on), holds exactly the bytes the arithmetic says, part by part."""
    pipe = Pipeline.load("random:tiny", dtype=dtype)
    size, steps = (96, 64), 2  # not square: width and height must not swap anywhere
    stream = pipe.open_stream(StreamParams(prompt="oil painting", steps=steps, size=size))
    rng = np.random.default_rng(0)
    for _ in range(4):
        stream.process(rng.integers(0, 256, size=(stream.expected_frames, 64, 96, 3), dtype=np.uint8))
    state = stream.state
    model = RANDOM_MODELS["tiny"]
    want = stream_state_bytes(model.dit, model.vae, size, steps, pipe.runtime.config.kv_window_frames, dtype)
    assert want.kv_caches == sum(_nbytes(c.k) + _nbytes(c.v) for c in state.kv)
    assert len(state.kv) == steps
    assert want.prompt_kv == _nbytes(state.prompt.k) + _nbytes(state.prompt.v)
    assert want.text_embedding == _nbytes([state.embedding])
    assert want.vae_encoder == state.vae_encoder.nbytes
    assert want.vae_decoder == state.vae_decoder.nbytes
    assert state.noise_controller.last_frame is not None
    assert want.host == _nbytes([state.noise_controller.last_frame])
    assert want.total == state.nbytes()  # nothing else in the state holds a tensor


def test_streams_per_gpu_fill_what_weights_and_workspace_leave() -> None:
    model = random_model("random:wan2.1-1.3b")
    report = memory_report(model, (832, 480), (1, 4), dtype=torch.bfloat16, gpu_memory_gib=141, workspace_gib=10)
    assert report.frame_tokens == 1560 and report.window == 6  # 832x480 -> 104x60 latents -> 52x30 patches
    gpu, fixed = report.gpu_memory_bytes, report.weight_bytes["bf16"] + report.workspace_bytes
    for row in report.rows:
        assert fixed + row.streams * row.state.device <= gpu < fixed + (row.streams + 1) * row.state.device
        assert row.streams_with_umt5 <= row.streams
    one, four = report.rows
    assert four.state.kv_caches == 4 * one.state.kv_caches  # one KV cache per step (per-step cache mode)
    # KV of one step cache by hand: 30 blocks x (K, V) x 6 frames x 1560 tokens x 1536 x 2 bytes.
    assert one.state.kv_caches == 30 * 2 * 6 * 1560 * 1536 * 2
    assert 5.6e9 < umt5_xxl_parameter_count() < 5.8e9  # "umT5-XXL encoder, 5.7B"
    with pytest.raises(ValueError, match="cannot hold 3 sinks plus a chunk"):
        memory_report(model, window=3)


def test_bench_memory_json(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    rc = bench.run(parser.parse_args(["memory", "--model", "random:wan2.1-14b", "--steps", "1,2", "--json"]))
    assert rc == 0
    (report,) = json.loads(capsys.readouterr().out)["reports"]
    assert report["kind"] == "arithmetic, not measured" and report["dtype"] == "bf16"
    assert report["size"] == [832, 480] and report["gpu_memory_bytes"] == 141 * 2**30
    assert report["weight_bytes"]["fp32"] == 2 * report["weight_bytes"]["bf16"]
    assert [r["steps"] for r in report["rows"]] == [1, 2]
    assert report["rows"][0]["streams"] >= report["rows"][1]["streams"] > 0
    rc = bench.run(parser.parse_args(["memory", "--model", "tiny-random"]))
    assert rc == 2  # the arithmetic knows the random: models only
