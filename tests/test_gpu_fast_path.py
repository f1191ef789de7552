"""CUDA correctness of the GPU fast path: bf16 against fp32 weights, flash-attn against SDPA against the
float32 reference, the cached path against the masked one, and the engine bench on CUDA.

Skipped without CUDA, so never run in this repository's CI (CPU only): written for the first session
on a GPU machine (docs/performance.md, "GPU fast path (not measured yet)"), which may have to tune the
tolerances below; they are estimates, not measurements.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json

import pytest
import torch

from engine.models.wan_dit import CONFIGS, attention, attention_backend, reference_attention
from engine.random_model import build_dit

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = "cuda"


def _velocity(dit: torch.nn.Module, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    t = torch.full(x.shape[:1] + x.shape[2:3], 500.0, device=CUDA)
    return dit(x, t, dit.encode_prompt(context)).float()  # type: ignore[operator]


@pytest.mark.parametrize("config", ["tiny", "wan-1.3b"])
def test_bf16_weights_track_fp32(config: str) -> None:
    cfg = CONFIGS[config]
    fp32 = build_dit(cfg, CUDA, torch.float32)
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)  # the same weights, rounded
    g = torch.Generator(device=CUDA).manual_seed(0)
    x = torch.randn(1, cfg.in_channels, 1, 8, 8, device=CUDA, generator=g)
    context = 0.1 * torch.randn(1, cfg.text_len, cfg.text_dim, device=CUDA, generator=g)
    a, b = _velocity(fp32, x, context), _velocity(bf16, x, context)
    assert torch.isfinite(b).all()
    assert float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)) > 0.99


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn is not installed")
def test_flash_attn_matches_sdpa_and_the_reference() -> None:
    g = torch.Generator(device=CUDA).manual_seed(0)
    # One 480p frame of queries against a 6-frame window of the 1.3B's cache (12 heads of 128).
    q = torch.randn(1, 1560, 12, 128, device=CUDA, generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 9360, 12, 128, device=CUDA, generator=g, dtype=torch.bfloat16) for _ in range(2))
    ref = reference_attention(q, k, v).float()
    for backend in ("flash-attn", "sdpa"):
        with attention_backend(backend):
            torch.testing.assert_close(attention(q, k, v).float(), ref, atol=2e-2, rtol=2e-2, msg=backend)


def test_cached_generation_equals_masked_forward_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The masked path (SDPA with a mask) against the cached one (flash-attn or SDPA without), fp32."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # the patch conv sees 5 frames vs 1 at a time
    cfg = CONFIGS["tiny"]
    dit = build_dit(cfg, CUDA, torch.float32)
    g = torch.Generator(device=CUDA).manual_seed(1)
    x = torch.randn(1, cfg.in_channels, 5, 8, 8, device=CUDA, generator=g)
    t = torch.full((1, 5), 400.0, device=CUDA)
    prompt = dit.encode_prompt(0.1 * torch.randn(1, 7, cfg.text_dim, device=CUDA, generator=g))
    masked = dit.forward_masked(x, t, prompt, chunk_frames=1, window_frames=4, sink_frames=1)
    cache = dit.new_kv_cache(1, cfg.frame_tokens(8, 8), 4, 1)
    cached = torch.cat([dit(x[:, :, i : i + 1], t[:, i : i + 1], prompt, cache, i) for i in range(5)], dim=2)
    torch.testing.assert_close(cached, masked, atol=1e-3, rtol=1e-3)


def test_bench_engine_on_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    from app.commands import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["engine", "--device", CUDA, "--model", "random:tiny", "--steps", "1,2", "--chunks", "3",
                              "--json"])
    assert bench.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dtype"] == "bf16" and report["device"].startswith("cuda")
    assert all(row["cuda_peak_mb"] > 0 and row["chunk_ms"] > 0 for row in report["results"])
