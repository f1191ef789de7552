"""Pipeline-parallel DiT over gloo CPU ranks: outputs equal the single-process engine's.

The reference is :meth:`StreamRuntime.run_chunk` chunk after chunk in this process (same tiny random
model, seeds and inputs); the ring spawns real ranks (torch.multiprocessing, 127.0.0.1, a free
port) that split the blocks, pass activations with isend/recv and move blocks on a rebalance.
Batched rows vs. single-row forwards differ by fp32 rounding only, hence atol 1e-5.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _parallel_fixtures import (
    Scenario,
    TinyFactory,
    one_thread,  # noqa: F401  (autouse fixture)
)
from _runtime_fixtures import clip, fidelity

from engine.models.wan_dit import CONFIGS, CausalWanDiT
from engine.parallel.launch import run_ring
from engine.parallel.ring import RingOptions


def assert_same_streams(expected: dict[str, list[torch.Tensor]], got: dict[str, list[torch.Tensor]]) -> None:
    assert got.keys() == expected.keys()
    for sid, frames in expected.items():
        assert len(got[sid]) == len(frames)
        for a, b in zip(frames, got[sid], strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
        assert not torch.allclose(frames[-1], frames[-2])  # the stream is not trivially constant


def test_stage_helpers_compose_to_forward() -> None:
    """embed -> run_blocks over split ranges (caches holding only those blocks) -> head_out == forward."""
    torch.manual_seed(0)
    dit = CausalWanDiT(replace(CONFIGS["tiny"], num_layers=5)).eval()
    prompt_ctx = torch.randn(2, 3, dit.config.text_dim)
    prompt = dit.encode_prompt(prompt_ctx)
    text = dit.embed_text(prompt_ctx)
    whole = dit.new_kv_cache(2, 16, window_frames=4, sink_frames=1)
    parts = [range(0, 2), range(2, 3), range(3, 5)]
    split = [dit.new_kv_cache(2, 16, 4, 1) for _ in parts]
    for p, blocks in zip(split, parts, strict=True):
        p.k, p.v = p.k[: len(blocks)], p.v[: len(blocks)]
    for chunk in range(5):  # past the window: exercises eviction on every piece
        x = torch.randn(2, 16, 1, 8, 8)
        t = torch.tensor([[700.0], [500.0]])
        expected = dit(x, t, prompt, whole, start_frame=chunk, rope_start=[chunk, chunk + 3])
        tokens, e, e0, grid = dit.embed(x, t)
        for cache, blocks in zip(split, parts, strict=True):
            tokens = dit.run_blocks(tokens, e0, grid, dit.prompt_kv(text, blocks), blocks, cache,
                                    start_frame=chunk, rope_start=[chunk, chunk + 3])
        torch.testing.assert_close(dit.head_out(tokens, e, grid), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="contiguous range"):
        dit.run_blocks(tokens, e0, grid, prompt, range(3, 7))


def test_two_ranks_match_single_process_with_switch_and_rebalance() -> None:
    """Adaptive sink refresh on (decisions combine both ranks' blocks), prompt switch, forced rebalance
    after chunk 5, ranks holding only their own blocks' weights (weights move with the blocks), the
    temporal stabilizer on the finished chunks."""
    factory = TinyFactory(layers=4, sink_refresh=True, sink_tau=0.5, stabilize=True)
    scenario = Scenario(chunks=9, steps=2, switch_at=4, rebalance_at=6, rebalance_to=((0, 1), (1, 4)))
    expected, refreshes = scenario.reference(factory())
    assert refreshes["s0"] > 0  # the sink decisions matter in this run
    got = run_ring(factory, scenario, world=2, options=RingOptions(weights="own"))
    assert got["ranges_before"] == [(0, 2), (2, 4)] and got["ranges_after"] == [(0, 1), (1, 4)]
    assert got["sink_refreshes"] == refreshes
    assert_same_streams(expected, got["frames"])


def test_the_last_rank_decodes_with_the_input_frames_a_guided_decoder_reads() -> None:
    """A decoder that reads the input frames (``TinyVAE`` guided): the last rank decodes, so each
    chunk's input frames travel with its last step; the ranks' frames equal the single process's, which
    differ from the same latents decoded without the input (so a dropped guide would fail here)."""
    factory = TinyFactory(layers=4, sink_refresh=False, guided_vae=True)
    scenario = Scenario(chunks=5, steps=2, switch_at=99)
    runtime = factory()
    expected, _ = scenario.reference(runtime)
    vae = runtime.vae
    z = vae.encode_chunk(clip(1)[0][None], vae.new_encoder_cache())
    with torch.no_grad():
        unguided = vae.decode_chunk(z, vae.new_decoder_cache())
        guided = vae.decode_chunk(z, vae.new_decoder_cache(), clip(1)[0][None])
    assert (guided - unguided).abs().mean() > 0.01
    got = run_ring(factory, scenario, world=2)
    assert_same_streams(expected, got["frames"])


@pytest.mark.slow
def test_four_ranks_overlap_and_match_single_process() -> None:
    """No adaptive refresh: 4 micro-steps in flight, two streams batched in each. Stream s0's prompt switch
    forces a sink refresh (barrier micro-steps); the rebalance moves blocks between non-adjacent ranks."""
    factory = TinyFactory(layers=6, sink_refresh=False)
    scenario = Scenario(chunks=9, steps=2, streams=2, switch_at=4, refresh_on_switch=True, rebalance_at=5,
                        rebalance_to=((0, 1), (1, 2), (2, 3), (3, 6)))
    expected, refreshes = scenario.reference(factory())
    assert refreshes == {"s0": 1, "s1": 0}
    got = run_ring(factory, scenario, world=4)
    assert got["depth"] == 4
    assert got["ranges_before"] == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert got["sink_refreshes"] == refreshes
    assert_same_streams(expected, got["frames"])
    # 9 chunks, 2 steps, 4 in flight: chunk c runs step 1 in micro-step c + 4, so 13 forwards in all.
    assert got["forwards"] == 9 + 4


def test_ring_rejects_bad_ranges() -> None:
    rt = TinyFactory(layers=4)()
    from engine.parallel.comm import Channel
    from engine.parallel.ring import RingRuntime

    with pytest.raises(ValueError, match="rank 1 has range\\(3, 4\\)"):
        RingRuntime(rt, Channel(torch.device("cpu")), 2, [range(0, 2), range(3, 4)])
    ring = RingRuntime(rt, Channel(torch.device("cpu")), 1, [range(0, 4)])
    state = ring.open("s", "oil painting", (32, 32), fidelity(steps=2))
    ring.push([state], [clip(1)[0]])
    ring.set_fidelity(state, fidelity(steps=1))
    with pytest.raises(ValueError, match="changed its step count or engine size while a chunk of it is in flight"):
        ring.push([state], [clip(2)[1]])
    ring.set_fidelity(state, fidelity(steps=2))
    ring.push([state], [clip(2)[1]])  # one of its two steps still to run
    with pytest.raises(ValueError, match="needs an empty ring"):
        ring.run([state], [clip(3)[2]])


def test_step_count_and_resolution_changes_between_chunks_match_single_process() -> None:
    """Steps 2 -> 1 -> 3 -> 2 and resolution 1 -> 1/2 -> 1 with a sink refresh on: every rank fits the
    per-step caches the way the single-process engine does (rescales them, drops the extra ones,
    starts an added step from the deepest)."""
    from engine.parallel.comm import Channel
    from engine.parallel.ring import RingRuntime

    schedule = ((2, 1.0), (2, 0.5), (1, 0.5), (1, 1.0), (3, 1.0), (3, 0.5), (2, 1.0))
    factory = TinyFactory(layers=4, sink_refresh=True, sink_tau=0.5)
    rt = factory()
    state = rt.open("s", "oil painting", (32, 32), fidelity(steps=2), seed=3)
    expected = []
    for (steps, scale), frames in zip(schedule, clip(len(schedule)), strict=True):
        rt.set_fidelity(state, replace(fidelity(steps=steps), resolution_scale=scale))
        expected.append(rt.run_chunk(state, frames).frames)
    ring = RingRuntime(factory(), Channel(torch.device("cpu")), 1, [range(0, 4)])
    ring_state = ring.open("s", "oil painting", (32, 32), fidelity(steps=2), seed=3)
    got = []
    for (steps, scale), frames in zip(schedule, clip(len(schedule)), strict=True):
        ring.set_fidelity(ring_state, replace(fidelity(steps=steps), resolution_scale=scale))
        got += [r.frames for _, r in ring.run([ring_state], [frames])]
    assert ring_state.sink_refreshes == state.sink_refreshes > 0
    assert_same_streams({"s": expected}, {"s": got})


def test_a_closed_stream_leaves_no_sink_decision_behind() -> None:
    """A stream whose last chunk decided a sink refresh closes: the decision must not reach the ranks
    with the next stream's micro-step (its caches are gone there)."""
    from engine.parallel.comm import Channel
    from engine.parallel.ring import RingRuntime

    ring = RingRuntime(TinyFactory(layers=4, sink_refresh=True, sink_tau=0.99)(), Channel(torch.device("cpu")), 1,
                       [range(0, 4)])
    a = ring.open("a", "oil painting", (32, 32), fidelity(steps=2), seed=3)
    for frames in clip(12):
        ring.run([a], [frames])
        if ring._refresh:
            break
    assert ring._refresh  # a decision is waiting for a's next chunk
    ring.close_stream(a)
    b = ring.open("b", "oil painting", (32, 32), fidelity(steps=2), seed=4)
    assert [state.stream_id for state, _ in ring.run([b], [clip(1)[0]])] == ["b"]


def test_a_failed_run_leaves_the_ring_serving() -> None:
    """A forward that fails mid-run (say, out of memory): the run's chunks are dropped, its streams can
    be closed, and the next run of another stream gives the frames it gives on a fresh ring."""
    from engine.parallel.comm import Channel
    from engine.parallel.ring import RingRuntime

    factory = TinyFactory(layers=4, sink_refresh=True)
    fresh = RingRuntime(factory(), Channel(torch.device("cpu")), 1, [range(0, 4)])
    want = fresh.run([fresh.open("c", "watercolor", (32, 32), fidelity(steps=2), seed=5)], [clip(1)[0]])
    ring = RingRuntime(factory(), Channel(torch.device("cpu")), 1, [range(0, 4)])
    a = ring.open("a", "oil painting", (32, 32), fidelity(steps=2), seed=3)
    ring.run([a], [clip(1)[0]])
    compute = ring.stage.compute
    calls = []

    def failing(msg: object) -> object:
        calls.append(msg)
        if len(calls) == 2:  # the second micro-step: a's chunk is half done
            raise RuntimeError("CUDA out of memory (injected)")
        return compute(msg)

    ring.stage.compute = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="out of memory"):
        ring.run([a], [clip(2)[1]])
    ring.stage.compute = compute  # type: ignore[method-assign]
    ring.close_stream(a)  # nothing of it is left in flight
    c = ring.open("c", "watercolor", (32, 32), fidelity(steps=2), seed=5)
    got = ring.run([c], [clip(1)[0]])
    torch.testing.assert_close(got[0][1].frames, want[0][1].frames, rtol=0, atol=0)
