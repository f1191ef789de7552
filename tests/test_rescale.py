"""A stream's resolution scale changes at a chunk boundary: RoPE-aware KV resampling, VAE cache resampling."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from _runtime_fixtures import clip, fidelity, tiny_runtime

from app.server.serving.engine_bridge import InProcessFactory, InProcessProcessor, StreamSettings
from engine.models.tiny_vae import TinyVAECache
from engine.models.wan_dit import (
    CONFIGS,
    CausalWanDiT,
    KVCache,
    PromptCache,
    apply_rope,
    grid_rope_tables,
    rope_tables,
    unapply_rope,
)
from engine.models.wan_vae import WanVAECache
from engine.pipeline import Pipeline, Stream, StreamParams
from engine.streaming.rescale import resample_grid, rescale_kv_cache, rescale_vae_cache
from engine.streaming.runtime import StreamRuntime
from engine.streaming.state import StreamState

CFG = CONFIGS["tiny"]


@pytest.fixture(scope="module")
def dit() -> CausalWanDiT:
    torch.manual_seed(0)
    return CausalWanDiT(CFG).eval()


@pytest.fixture(scope="module")
def pipe() -> Pipeline:
    return Pipeline.load("tiny-random")


def _prompt(dit: CausalWanDiT) -> PromptCache:
    return dit.encode_prompt(torch.randn(1, 4, CFG.text_dim, generator=torch.Generator().manual_seed(1)))


def _cached(dit: CausalWanDiT, x: torch.Tensor, rope_start: int) -> KVCache:
    """The KV cache after one cached forward of latents ``x`` [1, C, F, h, w] at temporal position ``rope_start``."""
    tokens = dit.config.frame_tokens(x.shape[3], x.shape[4])
    cache = dit.new_kv_cache(1, tokens, window_frames=6, sink_frames=1)
    dit(x, torch.full((1,), 500.0), _prompt(dit), cache, start_frame=0, rope_start=rope_start)
    return cache


# -- RoPE inversion --------------------------------------------------------------------------------


def test_unrotating_then_rotating_is_the_identity() -> None:
    x = torch.randn(2, 3 * 4 * 5, CFG.num_heads, CFG.head_dim, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_tables(CFG, [0, 7], 3, 4, 5, torch.device("cpu"))
    torch.testing.assert_close(unapply_rope(apply_rope(x, cos, sin), cos, sin), x, rtol=0, atol=1e-5)
    torch.testing.assert_close(apply_rope(unapply_rope(x, cos, sin), cos, sin), x, rtol=0, atol=1e-5)
    gcos, gsin = grid_rope_tables(CFG, 4, 5, torch.device("cpu"))
    per_frame = x.unflatten(1, (3, -1))
    torch.testing.assert_close(apply_rope(unapply_rope(per_frame, gcos, gsin), gcos, gsin), per_frame, rtol=0, atol=1e-5)


def test_unrotated_cached_keys_are_the_keys_before_rope(dit: CausalWanDiT) -> None:
    pre: list[torch.Tensor] = []
    attn = dit.blocks[0].self_attn
    hook = attn.norm_k.register_forward_hook(lambda _m, _i, out: pre.append(attn.heads(out)))
    try:
        frames, rows, cols, start = 2, 3, 4, 5
        x = torch.randn(1, CFG.in_channels, frames, 2 * rows, 2 * cols, generator=torch.Generator().manual_seed(2))
        cache = _cached(dit, x, rope_start=start)
    finally:
        hook.remove()
    n = frames * rows * cols
    cached = cache.k[0][:, :n]
    cos, sin = rope_tables(CFG, [start], frames, rows, cols, torch.device("cpu"))
    torch.testing.assert_close(unapply_rope(cached, cos, sin), pre[0], rtol=0, atol=1e-5)
    # Removing only the grid rotation leaves the keys rotated by their frame position alone (a 1x1 grid's
    # tables hold only the frame angles).
    tcos, tsin = rope_tables(CFG, [start], frames, 1, 1, torch.device("cpu"))
    temporal = apply_rope(pre[0].unflatten(1, (frames, -1)), tcos[0, :, None], tsin[0, :, None])
    gcos, gsin = grid_rope_tables(CFG, rows, cols, torch.device("cpu"))
    torch.testing.assert_close(unapply_rope(cached.unflatten(1, (frames, -1)), gcos, gsin), temporal, rtol=0, atol=1e-5)


# -- KV cache resampling ---------------------------------------------------------------------------


def test_resampling_a_kv_cache_to_its_own_grid_is_the_identity(dit: CausalWanDiT) -> None:
    x = torch.randn(1, CFG.in_channels, 2, 6, 8, generator=torch.Generator().manual_seed(3))
    cache = _cached(dit, x, rope_start=4)
    same = rescale_kv_cache(cache, CFG, (3, 4), (3, 4))
    for a, b in zip((*same.k, *same.v), (*cache.k, *cache.v), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (same.frame_tokens, same.local_end, same.global_end) == (12, 2, [2])


@pytest.mark.parametrize("new_grid", [(2, 2), (3, 5)])
def test_constant_input_keeps_its_keys_on_the_new_grid(dit: CausalWanDiT, new_grid: tuple[int, int]) -> None:
    """Layer 0 of a spatially constant input has the same key and value in every token of a frame, so
    the resampled layer-0 cache must equal the one the model writes for that input on the new grid."""
    g = torch.Generator().manual_seed(4)
    level = torch.randn(1, CFG.in_channels, 2, 1, 1, generator=g)

    def constant(grid: tuple[int, int]) -> torch.Tensor:
        return level.expand(-1, -1, -1, 2 * grid[0], 2 * grid[1]).contiguous()

    old = _cached(dit, constant((3, 4)), rope_start=6)
    moved = rescale_kv_cache(old, CFG, (3, 4), new_grid)
    fresh = _cached(dit, constant(new_grid), rope_start=6)
    tokens = new_grid[0] * new_grid[1]
    assert moved.frame_tokens == fresh.frame_tokens == tokens
    assert (moved.window_frames, moved.sink_frames, moved.local_end, moved.global_end) == (6, 1, 2, [2])
    assert moved.k[0].shape == fresh.k[0].shape
    torch.testing.assert_close(moved.k[0], fresh.k[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(moved.v[0], fresh.v[0], rtol=0, atol=1e-4)
    # Without the grid rotation every token of a frame holds that frame's one key.
    gcos, gsin = grid_rope_tables(CFG, *new_grid, torch.device("cpu"))
    plain = unapply_rope(moved.k[0][:, : 2 * tokens].unflatten(1, (2, tokens)), gcos, gsin)
    torch.testing.assert_close(plain, plain[:, :, :1].expand_as(plain), rtol=0, atol=1e-4)
    assert not moved.k[0][:, 2 * tokens :].any()  # frames never written stay empty


def test_resample_grid_averages_down_and_interpolates_up() -> None:
    x = torch.arange(16.0).reshape(1, 1, 4, 4)
    torch.testing.assert_close(resample_grid(x, (2, 2)), torch.tensor([[[[2.5, 4.5], [10.5, 12.5]]]]))
    up = resample_grid(x, (8, 8))
    assert up.shape == (1, 1, 8, 8) and float(up.min()) >= 0.0 and float(up.max()) <= 15.0
    assert resample_grid(torch.zeros(2, 3, 0, 4, 4), (2, 2)).shape == (2, 3, 0, 2, 2)


# -- VAE caches ------------------------------------------------------------------------------------


def _run_stream(rt: StreamRuntime, scales: list[float], size: int = 32) -> tuple[StreamState, list[torch.Tensor]]:
    """One V2V stream whose chunk k runs at ``scales[k]``; returns its state and output chunks."""
    state = rt.open("s", "oil painting", (size, size), fidelity(steps=2), seed=1)
    out = []
    for scale, frames in zip(scales, clip(len(scales), size=size), strict=True):
        rt.set_fidelity(state, dataclasses.replace(state.fidelity, resolution_scale=scale))
        out.append(rt.run_chunk(state, frames).frames)
    return state, out


def _shapes(state: StreamState) -> dict[str, Any]:
    def vae(cache: object) -> Any:
        if isinstance(cache, WanVAECache):
            return {name: tuple(t.shape) for name, t in cache.tensors.items()}
        assert isinstance(cache, TinyVAECache)
        return None if cache.prev is None else tuple(cache.prev.shape)

    return {
        "kv": [(c.frame_tokens, c.local_end, tuple(c.k[0].shape), tuple(c.v[-1].shape)) for c in state.kv],
        "encoder": vae(state.vae_encoder),
        "decoder": vae(state.vae_decoder),
        "last_frame": tuple(state.noise_controller.last_frame.shape),  # type: ignore[union-attr]
    }


def test_wan_vae_stream_changes_scale_mid_stream() -> None:
    """The runtime with the Wan 2.1 VAE topology: 1 -> 0.5 -> 1, caches as a fresh stream's at each scale."""
    rt = tiny_runtime()
    scales = [1.0, 1.0, 0.5, 0.5, 1.0]
    state, out = _run_stream(rt, scales)
    assert all(o.shape[-2:] == (32, 32) and torch.isfinite(o).all() for o in out)
    assert state.engine_size == (32, 32)
    assert _shapes(state) == _shapes(_run_stream(rt, [1.0] * len(scales))[0])
    half, _ = _run_stream(rt, scales[:4])
    assert half.engine_size == (16, 16)
    assert _shapes(half) == _shapes(_run_stream(rt, [0.5] * 4)[0])


def test_vae_cache_of_unknown_type_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match="cannot rescale a VAE cache of type dict"):
        rescale_vae_cache({"prev": torch.zeros(1)}, (32, 32), (16, 16))
    with pytest.raises(ValueError, match="no known layout"):
        rescale_vae_cache(TinyVAECache(extra={"x": torch.zeros(1)}), (32, 32), (16, 16))
    assert rescale_vae_cache(None, (32, 32), (16, 16)) is None


# -- the public API ----------------------------------------------------------------------------------


def _moving(n: int, t: int, seed: int = 0) -> np.ndarray:
    """A 128x128 picture sliding right one pixel a frame, frames t .. t+n-1."""
    base = np.random.default_rng(seed).integers(0, 256, size=(128, 128, 3), dtype=np.uint8)
    return np.stack([np.roll(base, t + i, axis=1) for i in range(n)])


def _feed(stream: Stream, chunks: int, t: int = 0) -> list[np.ndarray]:
    """``chunks`` chunks of the moving picture from frame ``t``; every output is finite."""
    out = []
    for _ in range(chunks):
        n = stream.expected_frames
        out.append(stream.process(_moving(n, t)))
        assert stream.last is not None and torch.isfinite(stream.last.frames).all()
        t += n
    return out


def test_tiny_random_stream_switches_scale_with_update(pipe: Pipeline) -> None:
    stream = pipe.open_stream(StreamParams(prompt="oil painting", size=(128, 128), seed=2))
    out = _feed(stream, 3)
    stream.update(resolution_scale=0.5)
    out += _feed(stream, 2, t=9)
    assert stream.state.engine_size == (64, 64) and stream.state.kv[0].frame_tokens == 16
    assert _shapes(stream.state) == _shapes(_fresh(pipe, 0.5, 5))
    stream.update(resolution_scale=1.0)
    out += _feed(stream, 2, t=17)
    assert stream.state.engine_size == (128, 128) and stream.state.kv[0].frame_tokens == 64
    assert _shapes(stream.state) == _shapes(_fresh(pipe, 1.0, 7))
    assert [o.shape for o in out] == [(1, 128, 128, 3)] + [(4, 128, 128, 3)] * 6
    for a, b in zip(out[1:], out[2:], strict=False):
        assert not np.array_equal(a, b)  # the input moves, so the output does: nothing froze


def _fresh(pipe: Pipeline, scale: float, chunks: int) -> StreamState:
    params = StreamParams(prompt="oil painting", size=(128, 128), seed=2)
    stream = pipe.open_stream(pipe.with_knobs(params, resolution_scale=scale))
    _feed(stream, chunks)
    return stream.state


def test_update_refuses_a_scale_outside_its_range_and_changes_nothing(pipe: Pipeline) -> None:
    stream = pipe.open_stream(StreamParams(prompt="oil painting", size=(32, 32)))
    with pytest.raises(ValueError, match="resolution_scale must be in"):
        stream.update(resolution_scale=1.5)
    with pytest.raises(ValueError, match="too small"):
        stream.update(prompt="neon", resolution_scale=0.25)  # 8 px: below the 16 px the model divides
    assert stream.fidelity.resolution_scale == 1.0 and stream.params.prompt == "oil painting"
    assert stream.state.transition is None


def test_processor_set_fidelity_runs_the_next_chunk_smaller(pipe: Pipeline) -> None:
    factory = InProcessFactory(pipe)
    small, full = factory.open(StreamSettings(seed=1)), factory.open(StreamSettings(seed=1))
    assert isinstance(small, InProcessProcessor) and isinstance(full, InProcessProcessor)
    for proc in (small, full):
        proc.process(_moving(1, 0))
    small.set_fidelity(dataclasses.replace(small.fidelity(), resolution_scale=0.5))
    assert small.fidelity().resolution_scale == 0.5
    for proc in (small, full):
        proc.begin_chunk(_moving(4, 1))
    assert small.step_rows()[0][0] != full.step_rows()[0][0]  # never batched with the full-size stream
    while rows := small.step_rows():
        small.denoise_rows([row for _, row in rows])
    (out,) = small.take_finished()
    assert out.shape == (4, 128, 128, 3)
    state = small._stream.state
    assert state.engine_size == (64, 64) and state.kv[0].frame_tokens == 16
    assert state.vae_encoder.prev.shape[-2:] == (8, 8)


def test_stream_batch_rescales_only_after_a_drain() -> None:
    from engine.streaming.stream_batch import StreamBatch

    rt = tiny_runtime()
    state = rt.open("s", "oil painting", (32, 32), fidelity(steps=2), seed=1)
    chunks = clip(3)
    batch = StreamBatch(rt, [state])
    batch.push([chunks[0]])  # in flight: its second step is still to run
    rt.set_fidelity(state, dataclasses.replace(state.fidelity, resolution_scale=0.5))
    with pytest.raises(ValueError, match="needs drain"):
        batch.push([chunks[1]])
    assert [r.frames.shape[-2:] for r in batch.drain()] == [(32, 32)]
    batch.push([chunks[1]])
    assert state.engine_size == (16, 16) and state.kv[0].frame_tokens == 1
    assert [r.frames.shape[-2:] for r in batch.drain()] == [(32, 32)]
