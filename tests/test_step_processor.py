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
