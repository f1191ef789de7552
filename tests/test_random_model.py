"""Full-size random-weight models (engine/random_model.py): meta builds, refusal where they do not fit,
the random:tiny recipe end to end, dtypes, initialisation scale."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _dit_fixtures import dit_single_thread  # noqa: F401  (autouse fixture)

from engine.models.wan_dit import CONFIGS, WanDiTConfig
from engine.pipeline import ModelNotAvailableError, Pipeline, StreamParams
from engine.random_model import (
    RANDOM_MODELS,
    build_dit,
    dit_parameter_count,
    materialise_problem,
    random_model,
    weight_bytes,
)


def independent_parameter_count(cfg: WanDiTConfig) -> int:
    """Wan 2.1's DiT parameters summed by hand from the config fields (not from any module)."""
    d, f = cfg.dim, cfg.ffn_dim
    attention = 4 * (d * d + d) + 2 * d  # q, k, v, o with biases; RMSNorm on q and k
    per_block = 2 * attention + 2 * d + (d * f + f) + (f * d + d) + 6 * d  # self, cross, norm3, FFN, modulation
    patch = cfg.in_channels * math.prod(cfg.patch_size) * d + d
    text = (cfg.text_dim * d + d) + (d * d + d)
    time = (cfg.freq_dim * d + d) + (d * d + d) + (d * 6 * d + 6 * d)  # time MLP, time projection
    head = 2 * d + d * cfg.out_channels * math.prod(cfg.patch_size) + cfg.out_channels * math.prod(cfg.patch_size)
    return cfg.num_layers * per_block + patch + text + time + head


def test_14b_builds_on_meta_with_the_real_parameter_count() -> None:
    pipe = Pipeline.load("random:wan2.1-14b", device="meta", dtype=torch.bfloat16)
    dit = pipe.runtime.dit
    assert all(p.device.type == "meta" for p in dit.parameters())  # shapes only: nothing allocated
    assert dit.dtype == torch.bfloat16
    n = sum(p.numel() for p in dit.parameters())
    assert n == independent_parameter_count(CONFIGS["wan-14b"]) == dit_parameter_count(CONFIGS["wan-14b"])
    assert 14.0e9 < n < 14.5e9  # Wan2.1-T2V-14B
    assert pipe.default_size == (832, 480) and pipe.runtime.dit.config.text_dim == 4096
    # The 1.3B by the same formula (tests/test_wan_dit.py checks it against a hand count too).
    assert dit_parameter_count(CONFIGS["wan-1.3b"]) == independent_parameter_count(CONFIGS["wan-1.3b"])


def test_a_model_that_does_not_fit_is_refused_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.devices

    monkeypatch.setattr(engine.devices, "available_memory_bytes", lambda device: 20 * 10**9)
    with pytest.raises(ModelNotAvailableError, match=r"needs 28\.8 GB .* bfloat16 .* cpu has 20\.0 GB free"):
        Pipeline.load("random:wan2.1-14b", device="cpu", dtype=torch.bfloat16)
    model = random_model("random:wan2.1-1.3b")
    assert materialise_problem(model, torch.float32, 20 * 10**9, "cpu") is None
    assert weight_bytes(model, torch.float32) == 2 * weight_bytes(model, torch.bfloat16)


def test_unknown_random_model_names_the_known_ones() -> None:
    with pytest.raises(ModelNotAvailableError, match="random:wan2.1-1.3b, random:wan2.1-14b, random:tiny"):
        Pipeline.load("random:wan2.2-5b")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_without_cuda_is_refused_clearly() -> None:
    with pytest.raises(ModelNotAvailableError, match="CUDA is not available on this machine"):
        Pipeline.load("random:tiny", device="cuda")


def test_random_tiny_streams_deterministically_on_the_wan_vae() -> None:
    frames = np.random.default_rng(0).integers(0, 256, size=(5, 64, 64, 3), dtype=np.uint8)
    outputs = []
    for _ in range(2):
        pipe = Pipeline.load("random:tiny")
        stream = pipe.open_stream(StreamParams(prompt="oil painting", steps=2))
        outputs.append(np.concatenate([stream.process(frames[:1]), stream.process(frames[1:])]))
    assert outputs[0].shape == (5, 64, 64, 3)
    np.testing.assert_array_equal(outputs[0], outputs[1])  # seeded weights, seeded noise
    assert type(pipe.runtime.vae).__name__ == "WanVAE" and pipe.chunk_frames == 4


def test_bf16_weights_run_a_chunk() -> None:
    pipe = Pipeline.load("random:tiny", dtype=torch.bfloat16)
    assert {p.dtype for p in pipe.runtime.dit.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in pipe.runtime.vae.parameters()} == {torch.bfloat16}  # type: ignore[attr-defined]
    stream = pipe.open_stream(StreamParams(prompt="oil painting", steps=1))
    out = stream.process(np.full((1, 64, 64, 3), 128, dtype=np.uint8))
    assert out.shape == (1, 64, 64, 3)
    assert stream.state.kv[0].k[0].dtype == torch.bfloat16


def test_weights_are_filled_at_the_initialisation_scale() -> None:
    cfg = RANDOM_MODELS["tiny"].dit
    dit = build_dit(cfg, "cpu", torch.float32)
    ffn = dit.blocks[0].ffn[0].weight  # type: ignore[index]
    xavier = math.sqrt(2.0 / (cfg.dim + cfg.ffn_dim))
    assert abs(float(ffn.std()) / xavier - 1) < 0.1
    assert float(dit.text_embedding[0].weight.std()) == pytest.approx(0.02, rel=0.1)  # type: ignore[index]
    assert float(dit.blocks[0].self_attn.q.bias.abs().max()) == 0.0  # type: ignore[union-attr]
    assert float(dit.blocks[0].norm3.weight.min()) == 1.0  # type: ignore[union-attr]
    assert float(dit.head.head.weight.abs().max()) > 0  # unlike Wan's zero head: outputs depend on inputs
