"""The garbage checks of tests/_output_checks.py fail on garbage and pass on the model's real output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _output_checks import assert_looks_differ, assert_stylized, held_out_clip, run_stream

from engine.pipeline import Pipeline, StreamParams


@pytest.fixture(scope="module")
def clip() -> np.ndarray:
    return held_out_clip(2)


@pytest.fixture(scope="module")
def outputs(clip: np.ndarray) -> dict[str, np.ndarray]:
    torch.set_num_threads(1)
    pipe, tiny = Pipeline.load(), Pipeline.load("tiny-random")
    looks = {look: run_stream(pipe.open_stream(StreamParams(prompt=look, size=(128, 128))), clip)
             for look in ("oil painting", "thermal camera")}
    return {**looks, "noise": run_stream(tiny.open_stream(StreamParams(prompt="oil painting", size=(64, 64))), clip)}


def test_real_output_passes(clip: np.ndarray, outputs: dict[str, np.ndarray]) -> None:
    assert_stylized(outputs["oil painting"], clip)
    assert_stylized(outputs["thermal camera"], clip)
    assert_looks_differ(outputs["oil painting"], outputs["thermal camera"])


@pytest.mark.parametrize(("garbage", "reason"), [
    ("black", "black or flat"), ("grey", "black or flat"), ("input", "unchanged"), ("frozen", "follow the motion"),
    ("noise", "structure is lost"),
])
def test_garbage_fails(clip: np.ndarray, outputs: dict[str, np.ndarray], garbage: str, reason: str) -> None:
    real = outputs["oil painting"]
    video = {
        "black": np.zeros_like(real), "grey": np.full_like(real, 128), "input": clip.copy(),
        "frozen": np.repeat(real[:1], len(real), axis=0), "noise": outputs["noise"],
    }[garbage]
    with pytest.raises(AssertionError, match=reason):
        assert_stylized(video, clip)


def test_the_same_look_twice_is_not_two_looks(outputs: dict[str, np.ndarray]) -> None:
    with pytest.raises(AssertionError, match="same picture"):
        assert_looks_differ(outputs["oil painting"], outputs["oil painting"].copy())
