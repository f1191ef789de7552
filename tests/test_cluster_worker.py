"""The Ray worker's methods in-process (StreamWorker is a plain class that Ray wraps)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from engine.cluster.worker import ChunkOrder, StepCall, StreamWorker
from engine.pipeline import StreamParams


def test_a_stream_moved_with_a_step_batch_chunk_in_flight_goes_on_at_the_destination() -> None:
    src, dst = StreamWorker("tiny-random"), StreamWorker("tiny-random")
    params = StreamParams(prompt="oil painting", steps=2, seed=5)
    src.open(1, params)
    config = replace(src._steppers[1].fidelity(), steps=2, step_batch=True)
    width, height = src.pipe.default_size
    rng = np.random.default_rng(0)

    def chunk(n: int) -> ChunkOrder:
        return ChunkOrder(1, config, rng.integers(0, 256, (n, height, width, 3), dtype=np.uint8))

    first, size = src.pipe.first_chunk_frames, src.pipe.chunk_frames
    src.run_step(StepCall((chunk(first),)))
    assert src.run_step(StepCall((ChunkOrder(1),))).finished[1]  # the first chunk is out
    src.run_step(StepCall((chunk(size),)))  # chunk 1: one step of two
    # Chunk 2 joins the step batch: chunk 1 finishes, chunk 2 stays half-denoised in the engine
    # (the engine core's chunk boundary: it counts chunk 2 as coming out with a later one).
    assert len(src.run_step(StepCall((chunk(size),))).finished[1]) == 1
    assert len(src._steppers[1].step_rows()) == 1

    _, handoff = src.export_stream(1)
    dst.prepare(params)
    dst.import_stream(handoff)
    # The destination's next chunk runs to its end (it would fail writing past a step cache's end if
    # the state had moved with chunk 2's position) and takes the position chunk 2 had.
    dst.run_step(StepCall((chunk(size),)))
    out = dst.run_step(StepCall((ChunkOrder(1),))).finished[1]
    assert len(out) == 1 and out[0].shape == (size, height, width, 3)
    assert dst._streams[1].state.frame == 3  # latent frames: the first chunk, chunk 1, this one
