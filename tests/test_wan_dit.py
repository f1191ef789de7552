"""Causal Wan DiT: cached chunk-by-chunk generation vs. one masked forward, cache semantics, RoPE, meta build.

The reference for every cached result is ``forward_masked`` (one forward over all frames with an explicit
attention mask), an independent code path from the cache bookkeeping. Parity with diffusers' Wan
implementation lives in tests/test_checkpoint.py (it goes through the key mapping).
"""

from __future__ import annotations

import io

import pytest
import torch
from _dit_fixtures import dit_single_thread  # noqa: F401  (autouse fixture)

from engine.models.wan_dit import (
    CONFIGS,
    CausalWanDiT,
    KVCache,
    PromptCache,
    WanDiTConfig,
    attention_backend,
    attention_kernel,
)

CFG = CONFIGS["tiny"]
H = W = 8  # 4x4 patches -> 16 tokens per frame keeps every test fast
FRAME_TOKENS = CFG.frame_tokens(H, W)
ATOL = 2e-5


@pytest.fixture(scope="module")
def model() -> CausalWanDiT:
    torch.manual_seed(0)
    return CausalWanDiT(CFG).eval()


@pytest.fixture(scope="module")
def prompt(model: CausalWanDiT) -> PromptCache:
    torch.manual_seed(1)
    return model.encode_prompt(torch.randn(1, 7, CFG.text_dim))


def latents(frames: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, CFG.in_channels, frames, H, W, generator=g)


def generate_cached(model: CausalWanDiT, prompt: PromptCache, clean: torch.Tensor, noisy: torch.Tensor,
                    chunk: int, window: int, sink: int, steps: tuple[float, ...] = (750.0, 500.0)
                    ) -> tuple[list[torch.Tensor], KVCache]:
    """CausVid/Self-Forcing pattern: per chunk, denoising steps at the chunk start, then a clean pass at t=0.

    Returns the velocity of the last denoising step of every chunk.
    """
    cache = model.new_kv_cache(clean.shape[0], FRAME_TOKENS, window, sink)
    outputs = []
    for start in range(0, clean.shape[2], chunk):
        sl = slice(start, start + chunk)
        n = noisy[:, :, sl].shape[2]
        for i, t in enumerate(steps):
            v = model(noisy[:, :, sl] * (1 + 0.1 * i), torch.full((clean.shape[0], n), t), prompt, cache, start)
            if i == len(steps) - 1:
                outputs.append(v)
        model(clean[:, :, sl], torch.zeros(clean.shape[0], n), prompt, cache, start)
    return outputs, cache


def masked_reference(model: CausalWanDiT, prompt: PromptCache, clean: torch.Tensor, noisy: torch.Tensor,
                     chunk: int, window: int | None, sink: int, t: float, scale: float) -> list[torch.Tensor]:
    """For chunk c: forward_masked over [clean chunks < c ; noisy chunk c] at timesteps [0 ... 0, t]."""
    outputs = []
    for start in range(0, clean.shape[2], chunk):
        end = min(start + chunk, clean.shape[2])
        x = torch.cat([clean[:, :, :start], noisy[:, :, start:end] * scale], dim=2)
        ts = torch.zeros(clean.shape[0], end)
        ts[:, start:] = t
        out = model.forward_masked(x, ts, prompt, chunk, window, sink)
        outputs.append(out[:, :, start:end])
    return outputs


@pytest.mark.parametrize(
    ("chunk", "frames", "window", "sink"),
    [
        (2, 6, 6, 0),  # plain block-causal: the window never fills
        (1, 7, 4, 1),  # rolling window with one sink; eviction from chunk 4 on
        (2, 8, 5, 1),  # chunk does not divide window - sink: uneven eviction
        (1, 6, 3, 0),  # no sinks
        (3, 9, 7, 3),  # CausVid-like 3-frame chunks, first chunk becomes the sinks
    ],
)
def test_cached_generation_equals_masked_forward(model, prompt, chunk, frames, window, sink):
    clean, noisy = latents(frames, seed=1), latents(frames, seed=2)
    cached, _ = generate_cached(model, prompt, clean, noisy, chunk, window, sink)
    reference = masked_reference(model, prompt, clean, noisy, chunk, window, sink, t=500.0, scale=1.1)
    for c, (got, want) in enumerate(zip(cached, reference, strict=True)):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=f"chunk {c}")


def test_masked_reference_is_sensitive_to_the_mask(model, prompt):
    """The comparison above could not pass by accident: window and causal masks change the output."""
    x, t = latents(7, seed=3), torch.full((1, 7), 300.0)
    causal = model.forward_masked(x, t, prompt, chunk_frames=1)
    windowed = model.forward_masked(x, t, prompt, chunk_frames=1, window_frames=4, sink_frames=1)
    bidirectional = model(x, t, prompt)
    assert (causal[:, :, :-1] - bidirectional[:, :, :-1]).abs().max() > 1e-3
    assert (causal[:, :, -1] - windowed[:, :, -1]).abs().max() > 1e-3
    torch.testing.assert_close(causal[:, :, :4], windowed[:, :, :4], atol=ATOL, rtol=0)


def test_rewrite_at_same_start_overwrites(model, prompt):
    clean, noisy = latents(5, seed=4), latents(5, seed=5)
    _, with_steps = generate_cached(model, prompt, clean, noisy, chunk=1, window=3, sink=1)
    _, clean_only = generate_cached(model, prompt, clean, noisy, chunk=1, window=3, sink=1, steps=())
    assert (with_steps.global_end, with_steps.local_end) == (clean_only.global_end, clean_only.local_end) == ([5], 3)
    for a, b in zip(with_steps.k + with_steps.v, clean_only.k + clean_only.v, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_write_errors_are_clear(model, prompt):
    cache = model.new_kv_cache(1, FRAME_TOKENS, window_frames=4, sink_frames=1)
    x = latents(1)
    with pytest.raises(ValueError, match="gap"):
        model(x, torch.zeros(1, 1), prompt, cache, start_frame=2)
    with pytest.raises(ValueError, match="does not fit"):
        model(latents(4), torch.zeros(1, 4), prompt, cache, start_frame=0)
    for f in range(6):
        model(x, torch.zeros(1, 1), prompt, cache, start_frame=f)
    with pytest.raises(ValueError, match="cannot rewrite"):
        model(latents(1), torch.zeros(1, 1), prompt, cache, start_frame=1)
    with pytest.raises(ValueError, match="tokens per frame"):
        model(latents(1)[..., :4], torch.zeros(1, 1), prompt, cache, start_frame=6)


def _run_stream(model, prompt, cache, xs, starts, ropes=None):
    outs = []
    for i, (x, s) in enumerate(zip(xs, starts, strict=True)):
        outs.append(model(x, torch.full((x.shape[0], x.shape[2]), 400.0 + i), prompt, cache, s,
                          None if ropes is None else ropes[i]))
    return outs


def test_batched_rows_equal_separate_rows(model):
    """Two streams with different prompts, ages and RoPE positions share one forward, then split back."""
    torch.manual_seed(6)
    prompts = [model.encode_prompt(torch.randn(1, n, CFG.text_dim)) for n in (5, 11)]
    caches = [model.new_kv_cache(1, FRAME_TOKENS, 4, 1) for _ in range(2)]
    # Stream 0 has written 5 frames, stream 1 has written 7: both buffers are full (same fill level).
    for cache, frames, seed in ((caches[0], 5, 7), (caches[1], 7, 8)):
        x = latents(frames, seed=seed)
        for f in range(frames):
            model(x[:, :, f : f + 1], torch.zeros(1, 1), prompts[0], cache, f)
    assert [c.local_end for c in caches] == [4, 4]

    xs = [latents(1, seed=9), latents(1, seed=10)]
    ts = [torch.tensor([[700.0]]), torch.tensor([[250.0]])]
    ropes = [5, 3]  # stream 1 has had its RoPE position wrapped
    batched_cache = KVCache.concat(caches)
    batched_prompt = PromptCache.concat(prompts)
    out = model(torch.cat(xs), torch.cat(ts), batched_prompt, batched_cache, [5, 7], torch.tensor(ropes))
    separate = [model(xs[i], ts[i], prompts[i], caches[i], [5, 7][i], ropes[i]) for i in range(2)]
    torch.testing.assert_close(out, torch.cat(separate), atol=ATOL, rtol=0)

    for part, cache in zip(batched_cache.split(), caches, strict=True):
        assert (part.global_end, part.local_end) == (cache.global_end, cache.local_end)
        for a, b in zip(part.k + part.v, cache.k + cache.v, strict=True):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="same offset"):
        model(torch.cat(xs), torch.cat(ts), batched_prompt, batched_cache, [6, 6])


def test_concat_rejects_different_fill_levels(model):
    a = model.new_kv_cache(1, FRAME_TOKENS, 4)
    b = model.new_kv_cache(1, FRAME_TOKENS, 4)
    b.local_end = 2
    with pytest.raises(ValueError, match="fill level"):
        KVCache.concat([a, b])


def test_moved_or_serialised_cache_gives_identical_next_output(model, prompt):
    clean, noisy = latents(5, seed=11), latents(5, seed=12)
    _, cache = generate_cached(model, prompt, clean, noisy, chunk=1, window=3, sink=1, steps=(500.0,))
    buffer = io.BytesIO()
    torch.save(cache.state_dict(), buffer)
    buffer.seek(0)
    restored = [
        cache.to("cpu"),
        cache.to(dtype=torch.float64).to(dtype=torch.float32),
        KVCache.from_state_dict(torch.load(buffer, weights_only=True)),
    ]
    prompt_restored = PromptCache.from_state_dict(prompt.to("cpu").state_dict())
    x, t = latents(1, seed=13), torch.full((1, 1), 600.0)
    want = model(x, t, prompt, cache, 5)
    for other in restored:
        assert (other.global_end, other.local_end) == ([5], 3)
        torch.testing.assert_close(model(x, t, prompt_restored, other, 5), want, atol=0, rtol=0)


def test_rope_is_relative_so_a_global_shift_changes_nothing(model, prompt):
    """Independent check of the RoPE tables: shifting every frame's position by the same amount is a no-op."""
    x, t = latents(3, seed=14), torch.full((1, 3), 800.0)
    base = model(x, t, prompt)
    torch.testing.assert_close(model(x, t, prompt, rope_start=17), base, atol=ATOL, rtol=0)
    # ...while a cache written at positions [0, 3) read by a chunk at a shifted position does change.
    cache = model.new_kv_cache(1, FRAME_TOKENS, 6)
    model(x, torch.zeros(1, 3), prompt, cache, 0)
    y = latents(1, seed=15)
    near = model(y, t[:, :1], prompt, cache.to("cpu"), 3)
    far = model(y, t[:, :1], prompt, cache.to("cpu"), 3, rope_start=9)
    assert (near - far).abs().max() > 1e-4


def test_per_sample_rope_start_in_one_batch(model, prompt):
    x, t = latents(2, batch=3, seed=16), torch.full((3, 2), 450.0)
    batched_prompt = PromptCache.concat([prompt] * 3)
    out = model(x, t, batched_prompt, rope_start=[0, 4, 11])
    for i, r in enumerate((0, 4, 11)):
        torch.testing.assert_close(out[i : i + 1], model(x[i : i + 1], t[i : i + 1], prompt, rope_start=r),
                                   atol=ATOL, rtol=0)


def test_per_frame_timesteps_modulate_their_own_frame(model, prompt):
    x = latents(2, seed=17)
    a = model(x, torch.tensor([[100.0, 900.0]]), prompt)
    b = model(x, torch.tensor([[100.0, 100.0]]), prompt)
    # Bidirectional within the chunk, so frame 0 changes too, but differently from a shared timestep.
    assert (a - b).abs().max() > 1e-3
    with pytest.raises(ValueError, match="timestep"):
        model(x, torch.zeros(1, 3), prompt)


def test_sink_frame_access(model, prompt):
    clean = latents(5, seed=18)
    _, cache = generate_cached(model, prompt, clean, clean, chunk=1, window=3, sink=1, steps=())
    k_means, v_means = cache.frame_means()
    assert k_means.shape == (CFG.num_layers, 1, 3, CFG.num_heads, CFG.head_dim)
    t = FRAME_TOKENS
    newest = [k[:, 2 * t : 3 * t].clone() for k in cache.k]  # buffer frame 2: absolute frame 4
    torch.testing.assert_close(k_means[:, :, 2], torch.stack([k.mean(1) for k in newest]))
    cache.copy_frame(2, 0)
    torch.testing.assert_close(cache.frame_means()[1][:, :, 0], v_means[:, :, 2])
    for k, want in zip(cache.k, newest, strict=True):
        assert torch.equal(k[:, :t], want)
    with pytest.raises(IndexError):
        cache.copy_frame(3, 0)


def test_prompt_padding_matches_explicit_zero_rows(model):
    torch.manual_seed(19)
    ctx = torch.randn(2, 5, CFG.text_dim)
    padded = torch.cat([ctx, torch.zeros(2, CFG.text_len - 5, CFG.text_dim)], dim=1)
    a, b = model.encode_prompt(ctx), model.encode_prompt(padded)
    for x, y in zip(a.k + a.v, b.k + b.v, strict=True):
        torch.testing.assert_close(x, y)
    parts = a.split()
    torch.testing.assert_close(parts[1].k[0], a.select_rows([1]).k[0])
    with pytest.raises(ValueError, match="context"):
        model.encode_prompt(torch.randn(1, 5, CFG.text_dim + 1))


def test_patch_size_one_and_bad_configs():
    torch.manual_seed(20)
    cfg = WanDiTConfig(dim=48, ffn_dim=64, num_heads=2, num_layers=1, patch_size=(1, 1, 1), text_dim=16,
                       text_len=4, freq_dim=16)
    m = CausalWanDiT(cfg).eval()
    p = m.encode_prompt(torch.randn(1, 3, 16))
    x = torch.randn(1, 16, 2, 4, 4)
    out = m.forward_masked(x, torch.full((1, 2), 10.0), p, chunk_frames=1)
    cache = m.new_kv_cache(1, cfg.frame_tokens(4, 4), 2)
    cached = torch.cat([m(x[:, :, i : i + 1], torch.full((1, 1), 10.0), p, cache, i) for i in range(2)], dim=2)
    torch.testing.assert_close(cached, out, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="patch_size"):
        WanDiTConfig(patch_size=(2, 2, 2))
    with pytest.raises(ValueError, match="num_heads"):
        WanDiTConfig(dim=100, num_heads=12)


def test_wan_1_3b_builds_on_meta():
    cfg = CONFIGS["wan-1.3b"]
    with torch.device("meta"):
        m = CausalWanDiT(cfg)
    state = m.state_dict()
    assert len(state) == 825
    n = sum(p.numel() for p in m.parameters())
    d, f, L = cfg.dim, cfg.ffn_dim, cfg.num_layers
    per_block = 8 * (d * d + d) + 4 * d + 2 * d + (d * f + f) + (f * d + d) + 6 * d
    expected = (
        per_block * L
        + 16 * 4 * d + d  # patch embedding (Conv3d 16 -> d, kernel 1x2x2)
        + (cfg.text_dim * d + d) + (d * d + d)  # text MLP
        + (cfg.freq_dim * d + d) + (d * d + d)  # time MLP
        + (d * 6 * d + 6 * d)  # time projection
        + 2 * d + (d * 64 + 64)  # head
    )
    assert n == expected
    assert 1.2e9 < n < 1.5e9
    assert cfg.rope_split == (44, 42, 42)
    assert state["blocks.29.self_attn.norm_q.weight"].shape == (1536,)
    assert state["head.head.weight"].shape == (64, 1536)


def test_sdpa_equals_the_reference_attention_on_masked_and_cached_paths(model, prompt):
    """SDPA (what the masked and KV-cached paths run off CUDA) against softmax written out in float32."""
    x, t = latents(5, seed=4), torch.full((1, 5), 400.0)
    fused = model.forward_masked(x, t, prompt, chunk_frames=1, window_frames=4, sink_frames=1)
    with attention_backend("reference"):
        reference = model.forward_masked(x, t, prompt, chunk_frames=1, window_frames=4, sink_frames=1)
    torch.testing.assert_close(fused, reference, atol=ATOL, rtol=0)

    def cached() -> torch.Tensor:
        cache = model.new_kv_cache(1, FRAME_TOKENS, 4, 1)
        return torch.cat([model(x[:, :, i : i + 1], t[:, i : i + 1], prompt, cache, i) for i in range(5)], dim=2)

    fused_cached = cached()
    with attention_backend("reference"):
        reference_cached = cached()
    torch.testing.assert_close(fused_cached, reference_cached, atol=ATOL, rtol=0)
    torch.testing.assert_close(fused_cached, reference, atol=ATOL, rtol=0)


def test_attention_backend_choice():
    q = torch.zeros(1, 4, 2, 8)
    assert attention_kernel(q) == "sdpa"  # no flash-attn on a CPU tensor
    with attention_backend("flash-attn"), pytest.raises(RuntimeError, match="flash-attn cannot run this call"):
        attention_kernel(q)
    with pytest.raises(ValueError, match="attention backend must be one of"):
        with attention_backend("xformers"):
            pass
    assert attention_kernel(q) == "sdpa"  # the choice ends with its block
