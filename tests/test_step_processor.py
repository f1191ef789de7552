"""The step-wise stream both engines run (engine/streaming/step_processor.py), on the tiny-random model."""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.pipeline import Pipeline, StreamParams
from engine.streaming.step_processor import InProcessProcessor


def _run_chunk(proc: InProcessProcessor, frames: np.ndarray) -> list[np.ndarray]:
    proc.begin_chunk(frames)
    while rows := proc.step_rows():
        proc.denoise_rows([chunk for _, chunk in rows])
    return proc.take_finished()


def _open(pipe: Any) -> InProcessProcessor:
    stream = pipe.open_stream(StreamParams(prompt="oil painting", steps=2, seed=3))
    return InProcessProcessor(stream, int(pipe.first_chunk_frames), int(pipe.chunk_frames))


def test_a_dropped_chunk_gives_its_positions_to_the_next_one() -> None:
    pipe = Pipeline.load("tiny-random")
    width, height = pipe.default_size
    rng = np.random.default_rng(0)

    def frames(n: int) -> np.ndarray:
        return rng.integers(0, 256, (n, height, width, 3), dtype=np.uint8)

    dropped, twin = _open(pipe), _open(pipe)
    first = frames(dropped.first_chunk_frames)
    for proc in (dropped, twin):
        assert len(_run_chunk(proc, first)) == 1
    # The policy abandons a chunk after one of its denoising steps (its prompt switched, say).
    dropped.begin_chunk(frames(dropped.chunk_frames))
    rows = dropped.step_rows()
    dropped.denoise_rows([chunk for _, chunk in rows])
    dropped.drop_chunks()
    assert dropped.step_rows() == []
    # The next chunk continues from where the twin, which never saw the dropped one, continues.
    nxt = frames(dropped.chunk_frames)
    out = _run_chunk(dropped, nxt)
    twin_out = _run_chunk(twin, nxt)
    assert len(out) == 1 and out[0].shape == twin_out[0].shape == (dropped.chunk_frames, height, width, 3)
    state, twin_state = dropped._stream.state, twin._stream.state
    assert (state.frame, state.rope_frame) == (twin_state.frame, twin_state.rope_frame)


def test_a_fresh_stream_and_a_running_one_step_together() -> None:
    """One engine step with a stream's first chunk (one frame, its caches empty) beside another's fourth:
    their encodes and decodes cannot share a VAE call (a first chunk decodes to fewer frames), and each
    comes out as it does alone (the batched-VAE path once ended every stream of such a step)."""
    from engine.streaming.step_processor import StepRow, run_step

    pipe = Pipeline.load("tiny-random")
    width, height = pipe.default_size
    rng = np.random.default_rng(1)

    def frames(n: int) -> np.ndarray:
        return rng.integers(0, 256, (n, height, width, 3), dtype=np.uint8)

    running, fresh, twin_running, twin_fresh = (_open(pipe) for _ in range(4))
    warm = [frames(1), frames(4), frames(4)]
    for proc in (running, twin_running):
        for chunk in warm:
            _run_chunk(proc, chunk)
    nxt, first = frames(4), frames(1)
    config = running.fidelity()
    outs, _ = run_step([StepRow(running, config, nxt), StepRow(fresh, config, first)])
    while not (outs[0] and outs[1]):
        more, _ = run_step([StepRow(running), StepRow(fresh)])
        outs = [outs[0] + more[0], outs[1] + more[1]]
    alone = [_run_chunk(twin_running, nxt), _run_chunk(twin_fresh, first)]
    for got, want in zip(outs, alone, strict=True):
        assert [o.shape[0] for o in got] == [w.shape[0] for w in want]
        for a, b in zip(got, want, strict=True):
            assert np.abs(a.astype(int) - b.astype(int)).max() <= 1
