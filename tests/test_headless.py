"""The serving loop without the media stack (engine/streaming/headless.py): the server's engine core, live
policy and step processors, fed by synthetic cameras in real time. What it delivers is compared with a
twin stream that ran the same input chunks alone, undisturbed, through the pipeline's own API."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from engine.pipeline import Pipeline, StreamParams
from engine.serving.device_memory import DeviceMemory
from engine.serving.live import bundled_live_profile, runnable_profile
from engine.streaming.headless import serve_headless

FPS = 6.0  # a slow camera: the 2-core box keeps up with two tiny streams whatever else runs


@pytest.fixture(scope="module")
def pipe() -> Any:
    import torch

    torch.set_num_threads(1)
    return Pipeline.load("tiny-random")


def _profile(pipe: Any) -> Any:
    profile = runnable_profile(bundled_live_profile("tiny-random", pipe.default_size), "cpu", step_wise=True,
                               bf16_units=False)
    return replace(profile, fps=FPS)


def test_streams_get_the_engines_own_output_in_order(pipe: Any) -> None:
    """FIFO at one fixed point, unbatched: every chunk a stream got is what the pipeline makes of the same
    input alone, in the same order (not black, not the input, not a frozen frame: the twin's frames)."""
    report, streams = serve_headless(pipe, _profile(pipe), streams=2, seconds=4.0, fps=FPS, preset="fifo",
                                     max_batch=1, keep=True)
    assert not report.refused and len(report.streams) == 2
    for s in report.streams:
        assert s.frames_out > 0 and s.chunks_on_time + s.chunks_late > 0
    for sid, stream in streams.items():
        assert stream.outputs, f"stream {sid} got nothing"
        twin = pipe.open_stream(StreamParams(prompt="oil painting", seed=sid, size=pipe.default_size))
        point = next(iter(stream.points))
        assert len(stream.points) == 1, "FIFO keeps one point"
        twin.set_fidelity(next(p.config for p in _profile(pipe).points if p.config.label() == point))
        for chunk, got in zip(stream.inputs, stream.outputs, strict=False):
            np.testing.assert_array_equal(got, twin.process(chunk))
        assert not np.array_equal(stream.outputs[-1], stream.inputs[len(stream.outputs) - 1])
        assert len({o.tobytes() for o in stream.outputs}) > 1, "a frozen output"


def test_device_memory_refuses_streams_past_what_fits(pipe: Any) -> None:
    profile = _profile(pipe)
    state = max(p.state_bytes for p in profile.per_stream())
    memory = DeviceMemory(free_bytes=1.2 * state / 0.9, state_bytes=state)
    assert memory.slots == 1
    report, _ = serve_headless(pipe, profile, streams=2, seconds=1.0, fps=FPS, memory=memory)
    # One slot and eviction: both admitted, at most one resident at a time (the policy parks the other).
    assert not report.refused
    none = DeviceMemory(free_bytes=0.5 * state, state_bytes=state)
    report, streams = serve_headless(pipe, profile, streams=1, seconds=0.3, fps=FPS, memory=none)
    assert not streams and report.refused and "device memory is full" in report.refused[0]
