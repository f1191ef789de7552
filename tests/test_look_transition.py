"""A look transition (a cue): text conditioning, LoRA strengths and noise strength move together over a
number of chunks, from wherever the stream is, on the tiny model. The looks' own outputs come from
streams that cut to them, an independent computation of where the transition starts and ends."""

from __future__ import annotations

import copy

import pytest
import torch
from _runtime_fixtures import clip, fidelity, tiny_runtime

from engine.streaming.parcel import park, unpark
from engine.streaming.prompts import slerp
from engine.streaming.runtime import StreamRuntime
from engine.streaming.state import StreamState


@pytest.fixture(autouse=True)
def one_thread():  # type: ignore[no-untyped-def]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().mean())


def _streams(n: int, history: list[torch.Tensor]) -> tuple[StreamRuntime, list[StreamState]]:
    """``n`` identical streams on the look "oil painting" at noise 0.5, each having run ``history``."""
    rt = tiny_runtime()
    states = [rt.open(str(i), "oil painting", (32, 32), fidelity(), noise_scale=0.5, seed=1) for i in range(n)]
    for frames in history:
        for state in states:
            rt.run_chunk(state, frames)
    return rt, states


@torch.no_grad()
def test_intermediate_chunks_land_between_the_two_looks() -> None:
    """Each chunk of a 4-chunk transition against the same stream (a copy of it as the chunk begins) cut
    to the old look and to the new one: its output is nearer each look's than they are to each other,
    and moves from the old look's to the new one's."""
    chunks = clip(7)
    rt, (moving,) = _streams(1, chunks[:3])
    rt.set_look(moving, "pencil sketch", noise_scale=0.9, transition_chunks=4)
    to_old, to_new = [], []
    for frames in chunks[3:]:
        old, new = copy.deepcopy(moving), copy.deepcopy(moving)
        rt.set_look(old, "oil painting", noise_scale=0.5)
        rt.set_look(new, "pencil sketch", noise_scale=0.9)
        a, b, t = (rt.run_chunk(s, frames).frames for s in (old, new, moving))
        apart = _distance(a, b)
        to_old.append(_distance(t, a) / apart)
        to_new.append(_distance(t, b) / apart)
    for i in range(3):  # the intermediate chunks
        assert to_old[i] < 1 and to_new[i] < 1, (i, to_old, to_new)
    assert to_old == sorted(to_old) and to_new == sorted(to_new, reverse=True), ("it moves one way", to_old, to_new)
    assert to_old[0] < to_new[0], ("the first chunk is still near the old look", to_old, to_new)
    assert to_new[2] < to_old[2], ("the last intermediate chunk is near the new look", to_old, to_new)
    assert to_new[3] < 1e-6, "the last chunk is the new look"
    assert moving.noise_scale == 0.9 and moving.transition is None


@torch.no_grad()
def test_a_look_fired_mid_transition_starts_from_where_the_stream_is() -> None:
    chunks = clip(7)
    rt, (going, fired, naive) = _streams(3, chunks[:3])
    old = rt.prompts.embed(["oil painting"])
    new, third = rt.prompts.embed(["pencil sketch"]), rt.prompts.embed(["watercolor"])
    for state in (going, fired, naive):
        rt.set_look(state, "pencil sketch", noise_scale=0.9, transition_chunks=4)
        for frames in chunks[3:5]:
            rt.run_chunk(state, frames)
    mid = slerp(old, new, 0.5)
    torch.testing.assert_close(fired.embedding, mid)
    assert fired.noise_scale == pytest.approx(0.7)
    # What a restart from the old look would do: the transition's source put back to the old look.
    naive.embedding, naive.noise_scale = old, 0.5
    for state in (fired, naive):
        rt.set_look(state, "watercolor", noise_scale=0.3, transition_chunks=2)
    g, f, n = (rt.run_chunk(s, chunks[5]).frames for s in (going, fired, naive))
    torch.testing.assert_close(fired.embedding, slerp(mid, third, 0.5))
    assert fired.noise_scale == pytest.approx(0.5)
    assert _distance(f, g) < _distance(n, g), "the fired look starts from the output, not from the old look"


@torch.no_grad()
def test_a_parked_stream_resumes_its_look_transition_bit_identically() -> None:
    chunks = clip(6)
    rt, (state,) = _streams(1, chunks[:3])
    rt.set_look(state, "pencil sketch", noise_scale=0.9, transition_chunks=3)
    rt.run_chunk(state, chunks[3])
    restored = unpark(park(state))
    for frames in chunks[4:]:
        torch.testing.assert_close(rt.run_chunk(restored, frames).frames, rt.run_chunk(state, frames).frames,
                                   rtol=0, atol=0)
    assert restored.noise_scale == state.noise_scale == 0.9


def test_a_bad_look_changes_nothing() -> None:
    rt, (state,) = _streams(1, [])
    before = (state.embedding.clone(), dict(state.loras), state.noise_scale)
    with pytest.raises(ValueError):
        rt.set_look(state, "pencil sketch", noise_scale=float("nan"), transition_chunks=2)
    with pytest.raises(ValueError, match="ink"):
        rt.set_look(state, "pencil sketch", loras={"ink": 0.5}, transition_chunks=2)
    assert state.transition is None
    torch.testing.assert_close(state.embedding, before[0], rtol=0, atol=0)
    assert (dict(state.loras), state.noise_scale) == before[1:]


def test_a_gradual_update_of_the_pipeline_moves_noise_with_the_prompt() -> None:
    """What the server's cues go through: ``Stream.update`` with a transition and a new noise strength
    starts one look transition; without a transition the noise strength changes at once."""
    from engine.pipeline import Pipeline, StreamParams

    pipe = Pipeline.load("tiny-random")
    stream = pipe.open_stream(StreamParams(prompt="oil painting", size=(64, 64), noise_scale=0.5))
    stream.update(prompt="ink wash", noise_scale=0.9, transition_chunks=3)
    tr = stream.state.transition
    assert tr is not None and (tr.noise_source, tr.noise_target, tr.chunks) == (0.5, 0.9, 3)
    assert stream.state.noise_scale == 0.5, "the noise strength moves with the chunks, not at once"
    stream.update(prompt="charcoal", noise_scale=0.7)
    assert stream.state.transition is None and stream.state.noise_scale == 0.7
