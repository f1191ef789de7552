"""The Ray worker's methods in-process (StreamWorker is a plain class that Ray wraps)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import engine.streaming.runtime as runtime
from engine.aspect import fit_frame, fit_size, scaled_size
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


def test_a_chunk_from_a_camera_is_resized_once_each_way_on_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk that comes at its rung's engine size with its camera's size: the worker's stream takes its
    size from the camera (as the server did), resizes nothing on the way in and once on the way out.
    Frames sent at the stream's size instead (no camera) are resized twice: in to the rung, out again."""
    resizes: list[tuple[tuple[int, int], tuple[int, int]]] = []  # (from, to) of every chunk fit_frames resized
    fit_frames = runtime.fit_frames

    def counting(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        if (frames.shape[-1], frames.shape[-2]) != tuple(size):
            resizes.append(((frames.shape[-1], frames.shape[-2]), size))
        return fit_frames(frames, size)

    monkeypatch.setattr(runtime, "fit_frames", counting)
    worker = StreamWorker("tiny-random")
    # 3:2 -> 144x96, whose x0.5 rung (64x48) is 4:3: sized from its frames, the stream would be 144x112.
    camera = (300, 200)
    stream = fit_size(camera, worker.pipe.default_size[0] * worker.pipe.default_size[1], worker.pipe.size_granularity)
    rng = np.random.default_rng(1)
    for sid, sent_camera in ((1, camera), (2, None)):
        worker.open(sid, StreamParams(prompt="oil painting", steps=1, seed=sid))
        config = replace(worker._steppers[sid].fidelity(), resolution_scale=0.5)
        engine = scaled_size(stream, 0.5, worker.pipe.size_granularity)
        size = engine if sent_camera else stream  # what the server resized the camera's frames to
        resizes.clear()
        for frames in (worker.pipe.first_chunk_frames, worker.pipe.chunk_frames, worker.pipe.chunk_frames):
            inputs = rng.integers(0, 256, (frames, size[1], size[0], 3), dtype=np.uint8)
            [out] = worker.run_step(StepCall((ChunkOrder(sid, config, inputs, sent_camera),))).finished[sid]
            assert out.shape == (frames, stream[1], stream[0], 3)
            # Stylized: neither black nor the input frames scaled up.
            assert out.std() > 10 and np.abs(out.astype(float) - fit_frame(inputs[-1], stream)).mean() > 10
        if sent_camera:
            assert resizes == [(engine, stream)] * 3, resizes
        else:
            assert resizes == [(stream, engine), (engine, stream)] * 3, resizes
