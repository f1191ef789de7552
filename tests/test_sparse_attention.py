"""Block-sparse cached self-attention: the gathered computation equals masked dense attention over the
kept blocks, sparsity 0 is the dense path, and the runtime, stream batch and ring (pipeline ranks) run the knob.

The independent reference is ``F.scaled_dot_product_attention`` over *all* cached keys with a boolean mask
built here from the selected block indices and the layout's arithmetic (not from ``kept_tokens``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from _runtime_fixtures import clip, tiny_runtime

from engine.fidelity import FidelityConfig
from engine.models import wan_dit
from engine.models.wan_dit import (
    CONFIGS,
    CausalWanDiT,
    KVCache,
    PromptCache,
    SparseLayout,
    gathered_attention,
    kept_tokens,
    select_key_blocks,
)
from engine.parallel.comm import Channel
from engine.parallel.ring import RingRuntime
from engine.streaming.stream_batch import StreamBatch

CFG = CONFIGS["tiny"]
H = W = 8  # 16 tokens per latent frame
FRAME_TOKENS = CFG.frame_tokens(H, W)
BLOCK = 8  # half a frame per key block
ATOL = 2e-5


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Batched and single-row forwards then round alike; tiny tensors are faster on one thread anyway."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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


def filled_cache(model: CausalWanDiT, prompt: PromptCache, frames: int = 12, window: int = 10, sink: int = 2,
                 seed: int = 0) -> KVCache:
    """A cache past its window (sinks pinned, eviction done), written densely one frame at a time."""
    cache = model.new_kv_cache(1, FRAME_TOKENS, window, sink)
    x = latents(frames, seed=seed)
    for f in range(frames):
        model(x[:, :, f : f + 1], torch.zeros(1, 1), prompt, cache, f)
    return cache


def masked_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SparseLayout,
                     blocks: torch.Tensor) -> torch.Tensor:
    """Dense attention over every key, with the keys of the blocks each (row, head, frame) dropped masked."""
    b, sq, heads, _ = q.shape
    key = torch.arange(k.shape[1])
    in_region = (key >= layout.sink) & (key < layout.tail)
    block_of_key = torch.where(in_region, (key - layout.sink) // layout.block_tokens, -1)
    mask = torch.zeros(b, heads, sq, k.shape[1], dtype=torch.bool)
    for r in range(b):
        for h in range(heads):
            for f in range(sq // layout.query_tokens):
                chosen = torch.isin(block_of_key, blocks[r, h, f])
                mask[r, h, f * layout.query_tokens : (f + 1) * layout.query_tokens] = ~in_region | chosen
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


@pytest.mark.parametrize(
    ("sink", "own_start", "query_frames", "block", "sparsity", "keep"),
    [
        (16, 16 + 5 * 10 + 3, 2, 10, 0.5, 3),  # 5 blocks; a remainder of 3 recent tokens stays with the chunk
        (0, 96, 1, 8, 0.75, 3),  # no sinks, 12 blocks
        (32, 32 + 64, 3, 16, 0.3, 3),  # several query frames, each with its own selection; 4 blocks
        (8, 8 + 100 * 2, 1, 2, 0.57, 43),  # 57 of 100 blocks skipped, not 56 (float rounding)
    ],
)
def test_gathered_attention_equals_masked_dense_over_kept_blocks(sink: int, own_start: int, query_frames: int,
                                                                 block: int, sparsity: float, keep: int) -> None:
    g = torch.Generator().manual_seed(own_start)
    ft, b, heads, hd = 8, 2, 3, 16
    end = own_start + query_frames * ft
    q, k, v = (torch.randn(b, s, heads, hd, generator=g) for s in (query_frames * ft, end, end))
    layout = SparseLayout.plan(sparsity, block, sink, own_start, ft)
    assert layout is not None
    assert layout.keep == keep
    blocks = select_key_blocks(q, k, layout)
    assert blocks.shape == (b, heads, query_frames, layout.keep)
    assert len({tuple(row.tolist()) for row in blocks.flatten(0, 2)}) > 1  # heads/frames choose differently
    got = gathered_attention(q, k, v, layout, blocks)
    torch.testing.assert_close(got, masked_reference(q, k, v, layout, blocks), atol=1e-6, rtol=0)


def test_sparsity_zero_is_the_dense_path_bit_for_bit(model: CausalWanDiT, prompt: PromptCache,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cache = filled_cache(model, prompt)
    x, t = latents(1, seed=5), torch.full((1, 1), 600.0)
    dense = model(x, t, prompt, cache.to("cpu"), 12)

    def refuse(*args: object) -> torch.Tensor:
        raise AssertionError("sparsity 0 must not reach the sparse path")

    monkeypatch.setattr(wan_dit, "block_sparse_attention", refuse)
    torch.testing.assert_close(model(x, t, prompt, cache.to("cpu"), 12, sparsity=0.0, sparse_block_tokens=BLOCK),
                               dense, atol=0, rtol=0)
    # 14 selectable blocks: 0.05 skips none, so it is exactly dense too.
    torch.testing.assert_close(model(x, t, prompt, cache.to("cpu"), 12, sparsity=0.05, sparse_block_tokens=BLOCK),
                               dense, atol=0, rtol=0)
    with pytest.raises(ValueError, match="sparsity"):
        model(x, t, prompt, cache.to("cpu"), 12, sparsity=1.0)


def test_model_sparse_forward_equals_masked_dense_with_the_same_selection(
        model: CausalWanDiT, prompt: PromptCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through every block of the model: swap the gather for the masked reference (same selection)."""
    cache = filled_cache(model, prompt)
    x, t = latents(2, seed=6), torch.full((1, 2), 500.0)
    sparse = model(x, t, prompt, cache.to("cpu"), 12, sparsity=0.6, sparse_block_tokens=BLOCK)
    layouts: list[SparseLayout] = []

    def masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SparseLayout,
               blocks: torch.Tensor) -> torch.Tensor:
        layouts.append(layout)
        return masked_reference(q, k, v, layout, blocks)

    monkeypatch.setattr(wan_dit, "gathered_attention", masked)
    reference = model(x, t, prompt, cache.to("cpu"), 12, sparsity=0.6, sparse_block_tokens=BLOCK)
    assert len(layouts) == CFG.num_layers
    # 10-frame window, 2 sinks, a 2-frame chunk: 6 recent frames = 12 blocks of 8 tokens, 60 % skipped.
    assert layouts[0] == SparseLayout(sink=2 * FRAME_TOKENS, blocks=12, block_tokens=BLOCK, keep=5,
                                      query_tokens=FRAME_TOKENS)
    torch.testing.assert_close(sparse, reference, atol=ATOL, rtol=0)


def test_high_sparsity_changes_the_output_but_keeps_sinks_and_own_chunk(model: CausalWanDiT,
                                                                         prompt: PromptCache) -> None:
    cache = filled_cache(model, prompt)
    x, t = latents(1, seed=7), torch.full((1, 1), 600.0)
    dense = model(x, t, prompt, cache.to("cpu"), 12)
    sparse = model(x, t, prompt, cache.to("cpu"), 12, sparsity=0.9, sparse_block_tokens=BLOCK)
    assert torch.isfinite(sparse).all()
    assert (sparse - dense).abs().max() > 1e-3

    g = torch.Generator().manual_seed(8)
    ft, own_start = 8, 8 * 9
    end = own_start + ft
    q, k, v = (torch.randn(1, s, 2, 16, generator=g) for s in (ft, end, end))
    # Make the sink keys the worst match for every query: they are kept all the same.
    k[:, :16] = -10 * q.mean(1, keepdim=True)
    layout = SparseLayout.plan(0.9, 8, 16, own_start, ft)
    assert layout is not None and layout.keep == 1
    blocks = select_key_blocks(q, k, layout)
    kept = kept_tokens(layout, blocks, end)
    for row in kept.flatten(0, 2).tolist():
        assert set(range(16)) <= set(row) and set(range(own_start, end)) <= set(row)
        assert len(row) == 16 + 8 + ft  # sinks, one block, own chunk
    changed_sink = v.clone()
    changed_sink[:, 0] += 5.0
    assert (gathered_attention(q, k, changed_sink, layout, blocks) - gathered_attention(q, k, v, layout, blocks)
            ).abs().max() > 1e-3


def test_batched_rows_choose_their_blocks_independently(model: CausalWanDiT, prompt: PromptCache) -> None:
    caches = [filled_cache(model, prompt, seed=s) for s in (9, 10)]
    xs = [latents(1, seed=11), latents(1, seed=12)]
    t = torch.full((1, 1), 400.0)
    separate = [model(xs[i], t, prompt, caches[i].to("cpu"), 12, sparsity=0.5, sparse_block_tokens=BLOCK)
                for i in range(2)]
    batched = model(torch.cat(xs), t.expand(2, 1), PromptCache.concat([prompt, prompt]),
                    KVCache.concat(caches), 12, sparsity=0.5, sparse_block_tokens=BLOCK)
    torch.testing.assert_close(batched, torch.cat(separate), atol=ATOL, rtol=0)


# -- the runtime ------------------------------------------------------------------------------------

SIZE = (32, 32)  # 4 tokens per frame; window 8 with 3 sinks leaves 4 recent frames = 8 blocks of 2


def sparse_fidelity(sparsity: float, steps: int = 2) -> FidelityConfig:
    return FidelityConfig(steps=steps, kv_window_frames=8, precision="fp32", attention_sparsity=sparsity)


def test_runtime_runs_sparse_streams_and_batches_them_exactly() -> None:
    rt = tiny_runtime(sparse_block_tokens=2)
    chunks = [clip(7, seed=i) for i in range(2)]
    singles = [rt.open(f"s{i}", p, SIZE, sparse_fidelity(0.5), seed=i)
               for i, p in enumerate(("oil painting", "neon"))]
    batched = [rt.open(f"b{i}", p, SIZE, sparse_fidelity(0.5), seed=i)
               for i, p in enumerate(("oil painting", "neon"))]
    dense = rt.open("d", "oil painting", SIZE, sparse_fidelity(0.0), seed=0)
    differs = False
    for c in range(7):
        expected = [rt.run_chunk(s, frames[c]).frames for s, frames in zip(singles, chunks, strict=True)]
        got = [r.frames for r in rt.run_chunks(batched, [frames[c] for frames in chunks])]
        for a, b in zip(got, expected, strict=True):
            assert a.shape == (3, chunks[0][c].shape[1], *SIZE[::-1]) and torch.isfinite(a).all()
            # The batch's VAE calls are batched too: a larger convolution may round a few 1e-5 apart.
            torch.testing.assert_close(a, b, rtol=0, atol=5e-5)
        differs |= not torch.allclose(rt.run_chunk(dense, chunks[0][c]).frames, expected[0], atol=1e-4)
    assert differs, "sparsity 0.5 must change the output once the window holds more than sinks and chunk"
    mixed = [rt.open(f"m{i}", "neon", SIZE, sparse_fidelity(sp)) for i, sp in enumerate((0.5, 0.0))]
    with pytest.raises(ValueError, match="share attention_sparsity"):
        rt.run_chunks(mixed, [chunks[0][0], chunks[0][0]])


def test_stream_batch_with_sparse_attention_equals_sequential() -> None:
    rt = tiny_runtime(sparse_block_tokens=2)
    chunks = clip(7)
    seq = rt.open("s", "watercolor", SIZE, sparse_fidelity(0.5), seed=3)
    expected = [rt.run_chunk(seq, c).frames for c in chunks]
    state = rt.open("b", "watercolor", SIZE, sparse_fidelity(0.5), seed=3)
    batch = StreamBatch(rt, [state])
    got = [r[0].frames for r in (batch.push([c]) for c in chunks) if r[0] is not None]
    got += [r.frames for r in batch.drain()]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_ring_groups_rows_by_sparsity_and_matches_the_runtime() -> None:
    """One rank in-process: two streams at different sparsity in one micro-step run as two groups."""
    rt = tiny_runtime(sparse_block_tokens=2)
    chunks = clip(6)
    levels = (0.0, 0.75)
    expected = []
    for i, sp in enumerate(levels):
        state = rt.open(f"r{i}", "oil painting", SIZE, sparse_fidelity(sp), seed=4)
        expected.append([rt.run_chunk(state, c).frames for c in chunks])
    ring = RingRuntime(rt, Channel(torch.device("cpu")), 1, [range(CFG.num_layers)])
    states = [ring.open(f"p{i}", "oil painting", SIZE, sparse_fidelity(sp), seed=4) for i, sp in enumerate(levels)]
    got: dict[str, list[torch.Tensor]] = {s.stream_id: [] for s in states}
    for c in chunks:
        for state, result in ring.push(states, [c, c]):
            got[state.stream_id].append(result.frames)
    for state, result in ring.drain():
        got[state.stream_id].append(result.frames)
    for i, state in enumerate(states):
        for a, b in zip(got[state.stream_id], expected[i], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert not torch.allclose(expected[0][-1], expected[1][-1], atol=1e-4)


def test_runtime_refuses_fp8_in_plain_words() -> None:
    rt = tiny_runtime()
    with pytest.raises(ValueError, match="fp8 attention needs a kernel"):
        rt.check_fidelity(FidelityConfig(precision="fp8"))
    rt.check_fidelity(sparse_fidelity(0.9))
