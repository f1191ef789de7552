"""Precision fp8-linear (engine/models/fp8.py): the DiT blocks' linears with float8 e4m3 operands.

The rounding is checked against an independent nearest-value search over every finite e4m3 number, the
product against float64 numpy on those values, and the model and runtime paths against bf16: close, yet
different (a path that ignored fp8 would give bf16's numbers exactly and fail).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _runtime_fixtures import clip, tiny_runtime

from engine.fidelity import FidelityConfig, engine_capabilities, required_capabilities, unsupported_reason
from engine.models import fp8
from engine.models.bf16_weights import keep_bf16_weights
from engine.models.wan_dit import CONFIGS, CausalWanDiT


def _e4m3_grid() -> np.ndarray:
    """Every finite float8 e4m3fn value, sorted (the 256 bit patterns, NaNs dropped)."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    return np.unique(values[np.isfinite(values)])


def _quantize_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row scales amax/448 and each value's nearest e4m3 number, by search: the fp8 values as floats."""
    amax = np.abs(x).max(axis=1, keepdims=True)
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    grid = _e4m3_grid()
    scaled = (x / scale).astype(np.float32)
    nearest = grid[np.abs(scaled[..., None] - grid).argmin(-1)]
    return nearest, scale


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_rows_round_to_the_nearest_e4m3_value_with_amax_scales() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 48, generator=g) * torch.logspace(-3, 2, 7)[:, None]
    x[3] = 0.0  # an all-zero row: scale 1, values 0
    q, scale = fp8.quantize_rows(x)
    want_q, want_scale = _quantize_reference(x.numpy())
    assert q.dtype == torch.float8_e4m3fn
    np.testing.assert_allclose(scale.numpy(), want_scale, rtol=1e-6)
    # Ties (a value exactly halfway between two e4m3 numbers) are measure-zero for random inputs.
    np.testing.assert_array_equal(q.float().numpy(), want_q)
    assert float(q.float().abs().max()) == 448.0  # each non-zero row's largest value maps to e4m3's max


def test_the_emulated_linear_is_the_product_of_the_quantised_operands() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 32, generator=g)
    w = torch.randn(24, 32, generator=g) * 0.1
    b = torch.randn(24, generator=g)
    got = fp8.fp8_linear(x, w, b)
    qx, sx = _quantize_reference(x.reshape(-1, 32).numpy().astype(np.float64))
    qw, sw = _quantize_reference(w.numpy().astype(np.float64))
    want = (qx * sx) @ (qw * sw).T + b.numpy()
    np.testing.assert_allclose(got.reshape(-1, 24).numpy(), want, rtol=1e-5, atol=1e-5)
    exact = x @ w.T + b
    assert 1e-3 < _rel(got, exact) < 0.06  # e4m3's 3 mantissa bits: a few percent, not zero


def _tiny_dit() -> tuple[CausalWanDiT, torch.Tensor, torch.Tensor, object]:
    torch.manual_seed(0)
    dit = CausalWanDiT(CONFIGS["tiny"]).eval()
    keep_bf16_weights(dit)  # as the runtime does: the plain path is the bf16-cached one
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 16, 3, 16, 16, generator=g)
    prompt = dit.encode_prompt(torch.randn(1, 4, CONFIGS["tiny"].text_dim, generator=g))
    return dit, x, torch.full((1,), 500.0), prompt


def test_the_dit_in_fp8_stays_near_bf16_switches_without_reload_and_quantises_once() -> None:
    dit, x, t, prompt = _tiny_dit()
    modules = fp8.fp8_linear_modules(dit)
    # Every block's attention q/k/v/o (self and cross) and both FFN linears; not the embeddings or head.
    assert len(modules) == CONFIGS["tiny"].num_layers * 10
    assert all(name.startswith("blocks.") for name in modules)
    exact = dit(x, t, prompt)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = dit(x, t, prompt)
        with fp8.fp8_linears():
            first = dit(x, t, prompt)
            again = dit(x, t, prompt)
        bf16_after = dit(x, t, prompt)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    torch.testing.assert_close(bf16_after, bf16, rtol=0, atol=0)  # the plain path is untouched
    # Made at first use, then kept; the prompt's cross-attention K/V were computed before (encode_prompt,
    # once per prompt), so those two linears never ran in fp8 and hold no fp8 copy.
    made = {name: m.fp8_weights.made for name, m in modules.items()}
    assert made == {name: 0 if name.endswith(("cross_attn.k", "cross_attn.v")) else 1 for name in modules}
    err = _rel(first, bf16)
    # Close to bf16 (fp8 adds an error of bf16's own order against fp32), yet not bf16's numbers.
    assert 1e-3 < err < 0.05, err
    assert _rel(first, exact) < 0.05
    fp8.drop_emulation_copies(dit)
    assert all(m.fp8_weights.dequantized is None and m.fp8_weights.q is not None
               for name, m in modules.items() if made[name])
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8.fp8_linears():
        torch.testing.assert_close(dit(x, t, prompt), first, rtol=0, atol=0)  # made again from the fp8 copy


def test_a_changed_weight_is_quantised_again() -> None:
    dit, x, t, prompt = _tiny_dit()
    linear = fp8.fp8_linear_modules(dit)["blocks.0.ffn.0"]
    with fp8.fp8_linears():
        before = dit(x, t, prompt)
        with torch.no_grad():
            linear.weight.mul_(2.0)  # in place: the version changes, the tensor does not
        after = dit(x, t, prompt)
    assert linear.fp8_weights.made == 2
    assert _rel(after, before) > 1e-3


def test_fp8_linear_is_a_cuda_capability_only_where_the_gemm_runs() -> None:
    config = FidelityConfig(precision="fp8-linear")
    assert required_capabilities(config) == {"fp8-linear", "bf16"}
    assert "fp8-linear" in engine_capabilities("cuda", fp8_units=True)
    assert "fp8-linear" not in engine_capabilities("cuda")
    assert "fp8-linear" not in engine_capabilities("cpu", fp8_units=True)  # emulated: tests only
    assert unsupported_reason(config, "cuda", fp8_units=True) is None
    for device in ("cpu", "cuda", "mps"):
        reason = unsupported_reason(config, device)
        assert reason is not None and "fp8 linears need" in reason
    assert not fp8.fp8_linear_supported("cpu")


def test_the_runtime_refuses_fp8_linear_on_a_cpu() -> None:
    rt = tiny_runtime()
    with pytest.raises(ValueError, match="fp8 linears need torch's fp8 GEMM"):
        rt.open("s", "oil painting", (32, 32), FidelityConfig(steps=1, kv_window_frames=6, precision="fp8-linear"))


def test_an_fp8_linear_chunk_stays_near_the_bf16_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime's fp8-linear chunk (admitted here as if the CPU had the GEMM; it runs the emulation)
    against the same stream in bf16: decoded frames within a few 1/255 steps, latents close, not equal."""
    import engine.streaming.runtime as runtime

    # Admit it as a GPU with the GEMM would; inside the chunk fp8.fp8_linear_supported(cpu) is still False,
    # so the linears run the emulation.
    monkeypatch.setattr(runtime, "unsupported_reason", lambda config, device, fp8_units=False: None)
    rt = tiny_runtime()
    out: dict[str, list[torch.Tensor]] = {}
    for precision in ("bf16", "fp8-linear"):
        state = rt.open(f"s-{precision}", "oil painting", (32, 32), FidelityConfig(steps=2, kv_window_frames=6,
                                                                      precision=precision), seed=3)
        out[precision] = [rt.run_chunk(state, frames).frames for frames in clip(3)]
    for f8, f16 in zip(out["fp8-linear"], out["bf16"], strict=True):
        mse = float(((f8 - f16) * 127.5).pow(2).mean())
        psnr = 10 * np.log10(255.0**2 / max(mse, 1e-12))
        assert 30.0 < psnr < 100.0, psnr  # near bf16; identical frames would mean fp8 was skipped
