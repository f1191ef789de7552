"""Precision fp8-kv: the DiT's self-attention KV cache stored as float8 e4m3 with a scale per token and head.

The quantisation is held to a bound derived from the e4m3 format (3 mantissa bits), computed here in
numpy; every operation on a cache (writes, rolling eviction, sink copies, row selection, window resizes,
resampling, serialisation, parking) is checked on an fp8 cache against an fp32 twin that went through
the same operations, token by token: values of very different size per token make a scale that stayed
behind or moved to another token miss the bound by orders of magnitude. Attention over an fp8 cache is
checked against the masked fp32 forward over the same tokens (an independent code path), and the
runtime and the embedded model against fp32 and bf16: close, yet different.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from _dit_fixtures import dit_single_thread  # noqa: F401  (autouse fixture)
from _runtime_fixtures import clip, tiny_runtime

from engine.fidelity import FidelityConfig, engine_capabilities, required_capabilities, unsupported_reason
from engine.models.wan_dit import CONFIGS, CausalWanDiT, KVCache
from engine.profiler import psnr
from engine.serving.profile import bundled_profile
from engine.streaming.parcel import park, unpark
from engine.streaming.rescale import rescale_kv_cache
from engine.streaming.runtime import StreamRuntime, resize_window
from engine.streaming.state import StreamState, tensors_in

FP8 = torch.float8_e4m3fn
CFG = CONFIGS["tiny"]
H = W = 8
FRAME_TOKENS = CFG.frame_tokens(H, W)  # 16 tokens per frame on a 4x4 grid


def _bound(reference: np.ndarray) -> np.ndarray:
    """The largest error e4m3 round-to-nearest may make on each value of ``reference`` [..., hd] at a
    scale of amax/448 per (token, head): half a step of its 3-bit mantissa (2^-4 of the value) where
    the scaled value is a normal number (>= 2^-6), half the subnormal step 2^-9 (times the scale) below."""
    scale = np.abs(reference).max(axis=-1, keepdims=True) / 448.0
    return np.maximum(np.abs(reference) * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6) + 1e-30


def _assert_within_bound(cache: KVCache, twin: KVCache) -> None:
    """``cache`` (fp8) holds ``twin``'s (fp32) filled tokens up to the e4m3 bound, every layer and row."""
    assert cache.fp8 and not twin.fp8
    assert (cache.local_end, cache.global_end, cache.window_frames) == (twin.local_end, twin.global_end,
                                                                        twin.window_frames)
    end = cache.local_end * cache.frame_tokens
    dense = cache.to(dtype=torch.float32)
    for got, want in zip(dense.k + dense.v, twin.k + twin.v, strict=True):
        ref = want[:, :end].numpy().astype(np.float64)
        worst = float((np.abs(got[:, :end].numpy() - ref) / _bound(ref)).max())
        assert worst <= 1.0, f"an error of {worst:.3g} times the e4m3 bound"


def _tokens(frames: int, seed: int, batch: int = 1) -> torch.Tensor:
    """Keys or values ``[B, frames*16, heads, hd]`` whose size differs by up to 10^5 from token to token
    (and head to head): a scale applied to the wrong token is off by far more than the bound."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, frames * FRAME_TOKENS, CFG.num_heads, CFG.head_dim, generator=g)
    return x * torch.exp(torch.rand(batch, frames * FRAME_TOKENS, CFG.num_heads, 1, generator=g) * 11.5 - 6)


def _twins(dit: CausalWanDiT, batch: int = 1, window: int = 4, sink: int = 1) -> tuple[KVCache, KVCache]:
    return (dit.new_kv_cache(batch, FRAME_TOKENS, window, sink, dtype=FP8),
            dit.new_kv_cache(batch, FRAME_TOKENS, window, sink, dtype=torch.float32))


def _write(caches: tuple[KVCache, ...], start: int, frames: int, seed: int) -> None:
    """The same keys and values into every cache, as a forward's blocks write them."""
    batch = caches[0].batch_size
    for cache in caches:
        a, b = cache.reserve([start] * batch, frames)
        for layer in range(cache.num_layers):
            cache.write(layer, a, b, _tokens(frames, seed + 2 * layer, batch), _tokens(frames, seed + 2 * layer + 1, batch))


@pytest.fixture(scope="module")
def dit() -> CausalWanDiT:
    torch.manual_seed(0)
    return CausalWanDiT(CFG).eval()


def test_scales_are_amax_over_448_per_token_and_head_and_the_round_trip_keeps_the_bound(dit: CausalWanDiT) -> None:
    cache, twin = _twins(dit, batch=2, window=3, sink=0)
    _write((cache, twin), 0, 3, seed=1)
    twin.k[0][1, 5] = 0.0  # one token all zeros: scale 1, values 0
    cache.write(0, 0, 48, twin.k[0], twin.v[0])
    assert cache.k[0].dtype == FP8 and cache.k_scale[0].dtype == torch.float32
    assert cache.k_scale[0].shape == (2, 48, CFG.num_heads, 1)  # the buffers' token layout
    want_scale = np.abs(twin.k[0].numpy()).max(-1, keepdims=True) / np.float32(448.0)
    want_scale[want_scale == 0] = 1.0
    np.testing.assert_allclose(cache.k_scale[0].numpy(), want_scale, rtol=1e-6)
    assert float(cache.k[0].float().abs().max()) == 448.0  # each token's largest value maps to e4m3's max
    _assert_within_bound(cache, twin)
    err = (cache.to(dtype=torch.float32).k[1] - twin.k[1]).abs() / twin.k[1].abs().amax(-1, keepdim=True)
    assert 1e-3 < float(err.mean()) < 2.0**-5  # a real rounding: not zero, not more than e4m3's


def test_the_bytes_are_a_byte_per_value_and_four_per_token_and_head(dit: CausalWanDiT) -> None:
    cache, twin = _twins(dit, window=6)
    values = 2 * CFG.num_layers * 6 * FRAME_TOKENS * CFG.num_heads
    assert sum(t.numel() * t.element_size() for t in tensors_in(cache)) == values * (CFG.head_dim + 4)
    assert sum(t.numel() * t.element_size() for t in tensors_in(twin)) == values * CFG.head_dim * 4


def test_every_cache_operation_carries_the_scales_with_their_tokens(dit: CausalWanDiT) -> None:
    cache, twin = _twins(dit, batch=3, window=4, sink=1)
    _write((cache, twin), 0, 1, seed=10)  # the sink frame
    for start in range(1, 7):  # past the window: the oldest non-sink frames roll out
        _write((cache, twin), start, 1, seed=10 + 7 * start)
    assert cache.local_end == 4 and cache.global_end == [7, 7, 7]
    _assert_within_bound(cache, twin)
    _write((cache, twin), 6, 1, seed=99)  # a rewrite of the newest frame (the clean pass)
    _assert_within_bound(cache, twin)
    for c in (cache, twin):
        c.copy_frame(3, 0)  # adaptive sink refresh: the newest frame over the sink
    _assert_within_bound(cache, twin)
    _assert_within_bound(cache.select_rows([2, 0]), twin.select_rows([2, 0]))
    parts, twin_parts = cache.split([1, 2]), twin.split([1, 2])
    _assert_within_bound(KVCache.concat([parts[1], parts[0]]), KVCache.concat([twin_parts[1], twin_parts[0]]))
    for window in (3, 6):
        _assert_within_bound(resize_window(cache, window), resize_window(twin, window))
    restored = KVCache.from_state_dict(cache.state_dict())
    for a, b in zip(tensors_in(restored), tensors_in(cache), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    with pytest.raises(ValueError, match="storage"):
        KVCache.concat([cache, twin])


def test_a_scale_left_behind_by_an_eviction_is_caught() -> None:
    """The check above can fail: values rolled without their scales miss the bound."""
    torch.manual_seed(0)
    model = CausalWanDiT(CFG).eval()
    cache, twin = _twins(model, window=3, sink=1)
    for start in range(4):
        _write((cache, twin), start, 1, seed=3 * start)
    stale = replace(cache, k_scale=[s.clone() for s in cache.k_scale])
    for s in stale.k_scale:
        s[:, FRAME_TOKENS:] = s[:, FRAME_TOKENS:].roll(FRAME_TOKENS, dims=1)  # scales one frame off
    with pytest.raises(AssertionError):
        _assert_within_bound(stale, twin)


def test_resampling_an_fp8_cache_is_resampling_its_values(dit: CausalWanDiT) -> None:
    cache, twin = _twins(dit, window=4, sink=1)
    for start in range(3):
        _write((cache, twin), start, 1, seed=40 + start)
    got = rescale_kv_cache(cache, CFG, (4, 4), (2, 2))
    want = rescale_kv_cache(cache.to(dtype=torch.float32), CFG, (4, 4), (2, 2))
    assert got.fp8 and got.frame_tokens == 4
    _assert_within_bound(got, want)


def test_cached_attention_over_an_fp8_cache_stays_near_the_masked_fp32_forward(dit: CausalWanDiT) -> None:
    """Chunk-by-chunk generation with a rolling fp8 cache (sinks, evictions) against one masked forward in
    fp32 over the same frames: within a few percent (e4m3 on the keys and values), not equal."""
    g = torch.Generator().manual_seed(5)
    prompt = dit.encode_prompt(torch.randn(1, 7, CFG.text_dim, generator=g))
    clean = torch.randn(1, CFG.in_channels, 6, H, W, generator=g)
    noisy = torch.randn(1, CFG.in_channels, 6, H, W, generator=g)
    caches = {dtype: dit.new_kv_cache(1, FRAME_TOKENS, 4, 1, dtype=dtype) for dtype in (FP8, torch.float32)}
    for start in range(0, 6, 2):
        x = torch.cat([clean[:, :, :start], noisy[:, :, start : start + 2]], dim=2)
        t = torch.zeros(1, start + 2)
        t[:, start:] = 600.0
        want = dit.forward_masked(x, t, prompt, chunk_frames=2, window_frames=4, sink_frames=1)[:, :, start:]
        got = {dtype: dit(noisy[:, :, start : start + 2], t[:, start:], prompt, cache, start)
               for dtype, cache in caches.items()}
        torch.testing.assert_close(got[torch.float32], want, rtol=0, atol=2e-5)  # the fp32 cache is exact
        err = float((got[FP8] - want).norm() / want.norm())
        assert 1e-4 < err < 0.05, err
        for cache in caches.values():
            dit(clean[:, :, start : start + 2], torch.zeros(1, 2), prompt, cache, start)
    assert caches[FP8].global_end == [6] and caches[FP8].local_end == 4  # one eviction happened


def test_fp8_kv_runs_where_torch_has_float8_and_needs_bf16(dit: CausalWanDiT) -> None:
    config = FidelityConfig(precision="fp8-kv")
    assert required_capabilities(config) == {"fp8-kv", "bf16"}
    assert required_capabilities(replace(config, precision="fp8-linear-kv")) == {"fp8-kv", "fp8-linear", "bf16"}
    for device in ("cpu", "cuda"):
        assert "fp8-kv" in engine_capabilities(device) and unsupported_reason(config, device) is None
    assert "float8" in (unsupported_reason(config, "mps") or "")
    # The bundled profiles have no fp8-kv point, so what a planner keeps of them is what it kept before.
    for name in ("default_cpu_256", "tiny-random_cpu_128", "wan2.1-1.3b_h100_480p", "wan2.1-1.3b_h100_512"):
        profile = bundled_profile(name)
        without = engine_capabilities(profile.device_type) - {"fp8-kv"}
        assert profile.engine_runnable().points == profile.runnable(without).points


def _stream_chunks(precisions: list[str], seed: int = 3) -> tuple[list[torch.Tensor], StreamRuntime, StreamState]:
    rt = tiny_runtime()
    state = rt.open("s", "oil painting", (32, 32), FidelityConfig(steps=2, kv_window_frames=6,
                                                                  precision=precisions[0]), seed=seed)
    out = []
    for c, frames in enumerate(clip(len(precisions))):
        rt.set_fidelity(state, replace(state.fidelity, precision=precisions[c]))
        out.append(rt.run_chunk(state, frames).frames)
    return out, rt, state


def test_an_fp8_kv_stream_stays_near_bf16_and_holds_a_quarter_of_the_kv_bytes() -> None:
    fp8, _, fp8_state = _stream_chunks(["fp8-kv"] * 4)
    bf16, _, bf16_state = _stream_chunks(["bf16"] * 4)
    fp32, _, fp32_state = _stream_chunks(["fp32"] * 4)
    assert all(c.fp8 for c in fp8_state.kv) and len(fp8_state.kv) == 2  # per-step caches, both fp8
    for a, b, c in zip(fp8, bf16, fp32, strict=True):
        err, bf16_err = float((a - b).norm() / b.norm()), float((b - c).norm() / c.norm())
        assert 1e-4 < err < 0.05, err  # the cache's rounding shows, within a few percent
        assert bf16_err < 0.05
    parts, bf16_parts = fp8_state.nbytes_by_part(), bf16_state.nbytes_by_part()
    # fp32 weights: bf16 and fp32 streams keep fp32 caches; fp8 ones hd + 4 scale bytes where those hold 4 hd.
    assert bf16_parts["kv"] == fp32_state.nbytes_by_part()["kv"]
    assert parts["kv"] * 4 * CFG.head_dim == bf16_parts["kv"] * (CFG.head_dim + 4)
    assert {k: v for k, v in parts.items() if k != "kv"} == {k: v for k, v in bf16_parts.items() if k != "kv"}


def test_switching_to_and_from_fp8_kv_converts_the_cache_at_the_chunk_boundary() -> None:
    _, rt, state = _stream_chunks(["bf16", "bf16"])
    before = [c.to() for c in state.kv]
    rt.set_fidelity(state, replace(state.fidelity, precision="fp8-kv"))
    assert not state.kv[0].fp8  # nothing changes before the next chunk enters
    rt._fit_caches(state)  # what the next chunk's entry does first
    for cache, twin in zip(state.kv, before, strict=True):
        _assert_within_bound(cache, twin)  # the context is kept, rounded to e4m3
    out = rt.run_chunk(state, clip(3)[2]).frames
    assert torch.isfinite(out).all() and state.kv[0].fp8
    rt.set_fidelity(state, replace(state.fidelity, precision="fp32"))
    rt.run_chunk(state, clip(4)[3])
    assert all(c.dtype == torch.float32 and not c.k_scale for c in state.kv)


def test_a_parked_fp8_kv_stream_comes_back_bit_identical_scales_included() -> None:
    _, rt, state = _stream_chunks(["fp8-kv"] * 3)
    parcel = park(state)
    back = unpark(parcel)
    assert back.kv[0].fp8 and len(back.kv[0].k_scale) == CFG.num_layers
    for a, b in zip(tensors_in(back), tensors_in(state), strict=True):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    frames = clip(4)[3]
    torch.testing.assert_close(rt.run_chunk(back, frames).frames, rt.run_chunk(state, frames).frames, rtol=0, atol=0)


def test_the_embedded_model_at_fp8_kv_is_close_to_fp32_but_not_equal() -> None:
    from engine.pipeline import DEFAULT_MODEL, Pipeline, StreamParams

    if not DEFAULT_MODEL.is_file():
        pytest.skip("the embedded default model is not committed")
    from engine.embedded.clips import heldout_specs, render_clip

    pipe = Pipeline.load()
    frames = render_clip(heldout_specs()[0])[:9]
    outs = {}
    for precision in ("fp32", "bf16", "fp8-kv"):
        params = pipe.with_knobs(StreamParams(prompt="oil painting", steps=1, noise_scale=0.2, seed=0),
                                 precision=precision)
        stream = pipe.open_stream(params)
        outs[precision] = np.concatenate([stream.process(frames[:1]), stream.process(frames[1:5]),
                                          stream.process(frames[5:9])])
    assert 40.0 < psnr(outs["fp8-kv"], outs["fp32"]) < 100.0
    assert not np.array_equal(outs["fp8-kv"], outs["bf16"])  # the KV rounding, not only bf16's
    assert not np.array_equal(outs["fp8-kv"], frames)


def test_two_ranks_at_fp8_kv_ship_the_scales_with_the_blocks_on_a_rebalance() -> None:
    """The ring over two real ranks, a rebalance moving a block's fp8 cache (values and scales) to the other
    rank, equal to the single-process engine at fp8-kv (a scale left behind would change the frames)."""
    from _parallel_fixtures import Scenario, TinyFactory

    from engine.parallel.launch import run_ring
    from engine.parallel.ring import RingOptions

    factory = TinyFactory(layers=4, sink_refresh=False)
    scenario = Scenario(chunks=6, steps=2, switch_at=3, rebalance_at=4, rebalance_to=((0, 1), (1, 4)),
                        precision="fp8-kv")
    expected, _ = scenario.reference(factory())
    got = run_ring(factory, scenario, world=2, options=RingOptions(weights="own"))
    assert got["ranges_after"] == [(0, 1), (1, 4)]
    frames = got["frames"]
    assert isinstance(frames, dict)
    for a, b in zip(expected["s0"], frames["s0"], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
