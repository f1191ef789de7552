"""Numeric faults stay in their stream.

A chunk that turns non-finite (a LoRA with a NaN factor forced past the loader, NaN in one stream's KV
cache) must leave every other row of its cross-user batch bit-identical to the same batch with a clean
stream in its place; the poisoned stream's chunk comes out black with a reason, and after a reset (the
live server resets it itself and tells its owner) its chunks are finite again once the cause is gone.
LoRA files a forward cannot run with are refused when they load (`LoRAError`).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _dit_fixtures import write_random_lora
from safetensors.torch import load_file, save_file
from test_server_executors import FakeClock, Stream, engine_factory, make_loop, settle  # noqa: F401  (fixture)

import engine.lora_files
import engine.models.lora
from engine.frames import frames_to_tensor
from engine.lora_files import load_lora
from engine.models.lora import LoRA, LoRABank, LoRAError, LoRALayer
from engine.models.wan_dit import CONFIGS, CausalWanDiT
from engine.pipeline import Pipeline, StreamParams
from engine.pipeline import Stream as EngineStream
from engine.streaming.runtime import ChunkResult

MODULES = ("self_attn.q", "ffn.0")  # what every test LoRA patches, rank 2 on each block


def _poisoned_lora(path: Path, model: torch.nn.Module) -> None:
    """A LoRA file like the others with one NaN in one factor."""
    write_random_lora(path, model, MODULES, seed=9)
    tensors = load_file(str(path))
    key = next(k for k in sorted(tensors) if k.endswith("lora_down.weight"))
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(path))


@pytest.fixture(scope="module")
def pipe(tmp_path_factory: pytest.TempPathFactory) -> Pipeline:
    """tiny-random with LoRAs "good" and "twin" (clean, the same shapes) and "bad" (a NaN factor),
    "bad" installed past the loader's checks as a file from before them would have been."""
    torch.set_num_threads(1)
    pipe = Pipeline.load("tiny-random")
    directory = tmp_path_factory.mktemp("loras")
    for name, seed in (("good", 1), ("twin", 2)):
        write_random_lora(directory / f"{name}.safetensors", pipe.runtime.dit, MODULES, seed=seed)
        pipe.load_lora(name, directory / f"{name}.safetensors", strength=0.0)
    _poisoned_lora(directory / "bad.safetensors", pipe.runtime.dit)
    with pytest.MonkeyPatch.context() as patch:
        for module in (engine.lora_files, engine.models.lora):
            patch.setattr(module, "layer_problem", lambda *args: None, raising=False)
        pipe.load_lora("bad", directory / "bad.safetensors", strength=0.0)
    return pipe


def _clips(pipe: Pipeline, n: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(4)
    sizes = [pipe.first_chunk_frames] + [pipe.chunk_frames] * (n - 1)
    return [frames_to_tensor(rng.integers(0, 256, (k, 128, 128, 3), dtype=np.uint8), k) for k in sizes]


def _open(pipe: Pipeline, loras: dict[str, float], seed: int) -> EngineStream:
    return pipe.open_stream(StreamParams("oil painting", seed=seed, loras=loras))


def _batch(pipe: Pipeline, streams: list[EngineStream], clip: torch.Tensor) -> list[ChunkResult]:
    return pipe.runtime.run_chunks([s.state for s in streams], [clip] * len(streams))


def _assert_black(result: ChunkResult) -> None:
    assert result.fault is not None and "non-finite" in result.fault
    assert bool((result.frames == -1).all())


def _assert_clean(result: ChunkResult) -> None:
    assert result.fault is None and bool(torch.isfinite(result.frames).all())


def test_a_nan_lora_row_leaves_its_batch_bit_identical(pipe: Pipeline) -> None:
    # Rows: another LoRA, no LoRA (strength 0 for every LoRA: 0 x NaN must never reach it), the poison.
    poisoned = [_open(pipe, {"good": 1.0}, 1), _open(pipe, {}, 2), _open(pipe, {"bad": 1.0}, 3)]
    clean = [_open(pipe, {"good": 1.0}, 1), _open(pipe, {}, 2), _open(pipe, {"twin": 1.0}, 3)]
    for clip in _clips(pipe, 3):
        got, want = _batch(pipe, poisoned, clip), _batch(pipe, clean, clip)
        for row in (0, 1):
            assert torch.equal(got[row].frames, want[row].frames), row
            _assert_clean(got[row])
        _assert_black(got[2])
        _assert_clean(want[2])
    bad = poisoned[2].state
    assert pipe.runtime.take_fault(bad.stream_id) == (3, "chunk 2 came out non-finite (NaN or inf) and was "
                                                         "dropped (black frames)")
    assert pipe.runtime.take_fault(bad.stream_id) is None  # taken
    # The cause gone and the stream reset, its chunks are finite again.
    poisoned[2].update(loras={"bad": 0.0})
    poisoned[2].reset()
    _assert_clean(pipe.runtime.run_chunk(poisoned[2].state, _clips(pipe, 1)[0]))


def test_nan_in_one_streams_kv_cache_is_recovered_alone(pipe: Pipeline) -> None:
    poisoned = [_open(pipe, {}, 4), _open(pipe, {"good": 0.5}, 5), _open(pipe, {}, 6)]
    clean = [_open(pipe, {}, 4), _open(pipe, {"good": 0.5}, 5), _open(pipe, {}, 6)]
    clips = _clips(pipe, 4)
    for clip in clips[:2]:
        _batch(pipe, poisoned, clip)
        _batch(pipe, clean, clip)
    victim = poisoned[2].state
    for cache in victim.kv:
        cache.k[0][:, 0] = float("nan")  # the first cached token of every step's cache, first block
    got, want = _batch(pipe, poisoned, clips[2]), _batch(pipe, clean, clips[2])
    for row in (0, 1):
        assert torch.equal(got[row].frames, want[row].frames), row
    _assert_black(got[2])
    assert pipe.runtime.take_fault(victim.stream_id) == (1, got[2].fault)
    # Reset, it starts over (its first chunk again) while the others go on in their batch, as before.
    poisoned[2].reset()
    _assert_clean(pipe.runtime.run_chunk(poisoned[2].state, clips[0]))
    got, want = _batch(pipe, poisoned[:2], clips[3]), _batch(pipe, clean[:2], clips[3])
    for row in (0, 1):
        assert torch.equal(got[row].frames, want[row].frames), row


# -- the loader --------------------------------------------------------------------------------------------


def _refusal(tensors: dict[str, torch.Tensor], tmp_path: Path, config: dict[str, Any] | None = None) -> str:
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    if config is not None:
        (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoRAError) as info:
        load_lora(tmp_path, LoRABank(CausalWanDiT(CONFIGS["tiny"])), "bad")
    return str(info.value)


@pytest.mark.parametrize("case", ["nan factor", "inf factor", "nan alpha", "huge alpha", "rank 0",
                                  "nan lora_alpha", "huge lora_alpha", "text lora_alpha", "huge factors"])
def test_loras_a_forward_cannot_run_are_refused(case: str, tmp_path: Path) -> None:
    dim = CONFIGS["tiny"].dim
    key = "diffusion_model.blocks.0.self_attn.q"
    down, up = torch.randn(4, dim) * 0.1, torch.randn(dim, 4) * 0.1
    tensors = {f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up}
    config = None
    expected = {"nan factor": "1 non-finite values", "inf factor": "1 non-finite values",
                "nan alpha": "alpha must be a finite number", "huge alpha": "not a finite float32 number",
                "rank 0": "rank 0", "nan lora_alpha": "lora_alpha must be a finite number",
                "huge lora_alpha": "not a finite float32 number", "text lora_alpha": "lora_alpha must be a finite",
                "huge factors": "weight change can reach"}[case]
    if case in ("nan factor", "inf factor"):
        down[1, 2] = float("nan") if case == "nan factor" else float("inf")
    elif case == "nan alpha":
        tensors[f"{key}.alpha"] = torch.tensor(float("nan"))
    elif case == "huge alpha":
        tensors[f"{key}.alpha"] = torch.tensor(1e308, dtype=torch.float64)  # alpha / rank overflows float32
    elif case == "rank 0":
        tensors = {f"{key}.lora_down.weight": torch.zeros(0, dim), f"{key}.lora_up.weight": torch.zeros(dim, 0),
                   f"{key}.alpha": torch.tensor(8.0)}
    elif case == "huge factors":
        tensors = {f"{key}.lora_down.weight": torch.full((4, dim), 1e20), f"{key}.lora_up.weight": torch.full((dim, 4), 1e20)}
    else:
        tensors = {"blocks.0.attn1.to_q.lora_A.weight": down, "blocks.0.attn1.to_q.lora_B.weight": up}
        config = {"r": 4, "lora_alpha": {"nan lora_alpha": float("nan"), "huge lora_alpha": 1e308,
                                         "text lora_alpha": "sixteen"}[case]}
    message = _refusal(tensors, tmp_path, config)
    assert expected in message
    if "lora_alpha" not in case or case == "huge lora_alpha":
        assert "blocks.0.self_attn.q" in message  # names the layer


def test_the_cli_refuses_a_rank_0_lora_like_any_bad_lora_file(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    from app.cli import main
    from engine.video_io import VideoWriter

    writer = VideoWriter(tmp_path / "in.mp4", 16.0, (64, 64))
    writer.write(np.zeros((64, 64, 3), dtype=np.uint8))
    writer.close()
    key, dim = "diffusion_model.blocks.0.ffn.0", CONFIGS["tiny"].dim
    save_file({f"{key}.lora_down.weight": torch.zeros(0, dim), f"{key}.lora_up.weight": torch.zeros(CONFIGS["tiny"].ffn_dim, 0),
               f"{key}.alpha": torch.tensor(4.0)}, str(tmp_path / "empty.safetensors"))
    assert main(["stylize", str(tmp_path / "in.mp4"), str(tmp_path / "out.mp4"), "--prompt", "ink", "--model",
                 "tiny-random", "--size", "64x64", "--lora", f"empty={tmp_path / 'empty.safetensors'}"]) == 2
    assert "blocks.0.ffn.0: rank 0" in caplog.text


def test_factors_the_models_dtype_cannot_hold_are_refused_when_installed() -> None:
    dim = CONFIGS["tiny"].dim
    layer = LoRALayer(torch.full((2, dim), 1e5), torch.full((dim, 2), 1e-3), 1.0)  # finite in fp32, inf in fp16
    with pytest.raises(LoRAError, match=r"blocks.0.self_attn.q: down factor .* non-finite values .* in float16"):
        LoRABank(CausalWanDiT(CONFIGS["tiny"]).half()).add(LoRA("wide", {"blocks.0.self_attn.q": layer}))


# -- the live server ---------------------------------------------------------------------------------------


async def test_the_live_server_tells_the_owner_and_keeps_the_other_stream(engine_factory: Any) -> None:  # noqa: F811
    executor = ThreadPoolExecutor(max_workers=1)
    try:
        clock = FakeClock()
        loop = make_loop(engine_factory, executor, clock, max_batch=2)
        a = Stream(loop, engine_factory, clock, executor, steps=1, seed=5)
        b = Stream(loop, engine_factory, clock, executor, steps=1, seed=6)
        for k in range(5):
            if k == 2:  # between chunks: NaN in b's caches
                for cache in b.processor.stream.state.kv:
                    cache.k[0][:, 0] = float("nan")
            a.push(1 if k == 0 else 4)
            b.push(1 if k in (0, 3) else 4)  # reset after its black chunk, it starts with one frame again
            clock.now += 0.1
            await settle(loop)
            await settle(loop)
        assert len(a.outputs) == len(b.outputs) == 5
        assert loop.stats(a.sid)["chunk_faults"] == 0 and loop.stats(a.sid)["chunk_fault"] is None
        stats = loop.stats(b.sid)
        assert stats["chunk_faults"] == 1 and stats["chunk_fault"] == (
            "chunk 2 came out non-finite (NaN or inf) and was dropped (black frames); the stream was reset")
        assert (b.outputs[2] == 0).all()  # black, then pictures again from a fresh start
        assert [len(out) for out in b.outputs] == [1, 4, 4, 1, 4] and min(out.std() for out in b.outputs[3:]) > 0
        for got, want in zip(a.outputs, a.twin_outputs(engine_factory), strict=True):
            assert np.abs(got.astype(int) - want.astype(int)).max() <= 1  # as test_server_executors allows
        assert a.sid in loop.streams and b.sid in loop.streams
    finally:
        executor.shutdown(wait=True)
