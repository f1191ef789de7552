"""The public Pipeline API: its mechanics on the tiny random-weight model (the same code path as the
real models), and what it returns on the shipped default model (which must be a stylisation)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _output_checks import (
    assert_looks_differ,
    assert_stylized,
    assert_undistorted,
    circles_clip,
    held_out_clip,
    run_stream,
)

from engine.frames import frames_to_tensor, tensor_to_frames
from engine.pipeline import ModelNotAvailableError, Pipeline, StreamParams


@pytest.fixture(scope="module")
def pipe() -> Pipeline:
    return Pipeline.load("tiny-random")


def _frames(n: int, h: int = 96, w: int = 80, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, h, w, 3), dtype=np.uint8)


def test_stream_processes_chunks_at_the_stream_size(pipe: Pipeline) -> None:
    stream = pipe.open_stream(StreamParams(prompt="oil painting", size=(64, 64)))
    assert stream.expected_frames == pipe.first_chunk_frames == 1
    first = stream.process(_frames(1))
    assert first.shape == (1, 64, 64, 3) and first.dtype == np.uint8
    assert stream.expected_frames == pipe.chunk_frames == 4
    out = stream.process(_frames(4, seed=1))
    assert out.shape == (4, 64, 64, 3)
    assert stream.stats()["chunks"] == 2


def test_wrong_chunk_length_and_dtype_say_what_is_wrong(pipe: Pipeline) -> None:
    stream = pipe.open_stream(StreamParams(prompt="oil painting", size=(64, 64)))
    with pytest.raises(ValueError, match="needs 1 frames, got 4"):
        stream.process(_frames(4))
    with pytest.raises(ValueError, match="uint8"):
        stream.process(_frames(1).astype(np.float32))
    with pytest.raises(ValueError, match=r"\[T, H, W, 3\]"):
        stream.process(np.zeros((1, 8, 8), dtype=np.uint8))


def test_update_switches_prompt_and_steps_without_restart(pipe: Pipeline) -> None:
    stream = pipe.open_stream(StreamParams(prompt="oil painting", size=(64, 64)))
    stream.process(_frames(1))
    stream.process(_frames(4, seed=1))
    stream.update(prompt=["pencil sketch", "neon"], prompt_weights=[0.7, 0.3], transition_chunks=2, steps=1)
    stream.process(_frames(4, seed=2))
    stats = stream.stats()
    assert stats["chunks"] == 3 and stats["steps"] == 1
    stream.reset()
    assert stream.stats()["chunks"] == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt": ""}, "non-empty"),
        ({"prompt": "x" * 5000}, "limit is"),
        ({"prompt": "a", "noise_scale": 2.0}, "noise_scale"),
        ({"prompt": ("a", "b"), "prompt_weights": (1.0,)}, "2 prompts but 1"),
    ],
)
def test_bad_params_are_rejected_clearly(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StreamParams(**kwargs)  # type: ignore[arg-type]


def test_too_many_steps_is_rejected(pipe: Pipeline) -> None:
    with pytest.raises(ValueError, match="steps must be in 1..4, got 5"):
        pipe.open_stream(StreamParams(prompt="a", steps=5))


def test_unknown_model_path_is_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ModelNotAvailableError, match="cannot load model"):
        Pipeline.load(str(tmp_path / "nope.bin"))


def test_frame_tensor_round_trip() -> None:
    frames = _frames(3)
    np.testing.assert_array_equal(tensor_to_frames(frames_to_tensor(frames)), frames)


def test_text_to_video_stream_runs_on_the_same_runtime(pipe: Pipeline) -> None:
    params = StreamParams(prompt="a red fox in snow", mode="t2v", steps=2, size=(64, 64), seed=5)
    a, b = pipe.open_stream(params), pipe.open_stream(params)
    first = a.generate()
    assert first.shape == (9, 64, 64, 3)  # 3 latent frames: 1 + 4 + 4 pixel frames
    second = a.generate()
    assert second.shape == (12, 64, 64, 3)
    np.testing.assert_array_equal(b.generate(), first)  # seeded: reproducible
    assert a.stats()["frame"] == 6
    with pytest.raises(ValueError, match="generate"):
        a.process(_frames(4))
    v2v = pipe.open_stream(StreamParams(prompt="x", size=(64, 64)))
    with pytest.raises(ValueError, match="mode='t2v'"):
        v2v.generate()


def test_noise_too_low_is_refused_on_update(pipe: Pipeline) -> None:
    stream = pipe.open_stream(StreamParams(prompt="oil painting", size=(64, 64)))
    with pytest.raises(ValueError, match="too low"):
        stream.update(noise_scale=0.15)
    assert stream.params.noise_scale == 0.8


def test_the_default_model_through_the_api_defaults_stylizes_its_input() -> None:
    """No steps or noise given: the model's own operating point. Two looks of a held-out moving clip
    keep its structure and motion, change it, and differ from each other."""
    torch.set_num_threads(1)
    default = Pipeline.load()
    clip = held_out_clip(1)
    outs = [run_stream(default.open_stream(StreamParams(prompt=look, size=(128, 128))), clip)
            for look in ("oil painting", "night vision")]
    for out in outs:
        assert out.shape == (len(clip), 128, 128, 3)
        assert_stylized(out, clip)
    assert_looks_differ(*outs)


def test_a_stream_takes_its_size_from_its_first_chunks_aspect(pipe: Pipeline) -> None:
    """On the tiny model (a 128x128 budget, a 16-px grid: 8-px VAE cells x 2-px patches) a 4:3 camera
    streams at 144x112 and a 16:9 one at 160x96 (engine/aspect.py); the engine runs at that size."""
    assert pipe.size_granularity == 16 and pipe.pixel_budget == 128 * 128
    for (cam_w, cam_h), (w, h) in (((640, 480), (144, 112)), ((1280, 720), (160, 96))):
        stream = pipe.open_stream(StreamParams(prompt="oil painting"))
        assert stream.process(_frames(1, h=cam_h, w=cam_w)).shape == (1, h, w, 3)
        assert stream.size == pipe.stream_size((cam_w, cam_h)) == (w, h) and stream.state.engine_size == (w, h)
        # The camera turns mid-stream: the stream keeps its size and context, the frames are cropped to it.
        assert stream.process(_frames(4, h=cam_w, w=cam_h)).shape == (4, h, w, 3)
        # A lower resolution scale keeps the aspect on the grid; the output keeps the stream's size.
        stream.update(resolution_scale=0.5)
        assert stream.process(_frames(4, h=cam_h, w=cam_w)).shape == (4, h, w, 3)
        ew, eh = stream.state.engine_size
        assert ew % 16 == 0 and eh % 16 == 0 and ew * eh <= w * h / 4 and abs(np.log(ew / eh * h / w)) < 0.2
        assert stream.stats()["chunks"] == 3
        # A reset picks the size again, from the (now portrait) camera.
        stream.reset()
        assert stream.process(_frames(1, h=cam_w, w=cam_h)).shape == (1, w, h, 3)
    # An explicit size wins over the camera's aspect.
    sized = pipe.open_stream(StreamParams(prompt="oil painting", size=(64, 96)))
    assert sized.process(_frames(1, h=480, w=640)).shape == (1, 96, 64, 3)


@pytest.mark.parametrize(("camera", "size"), [((640, 480), (288, 224)), ((640, 360), (336, 192))])
def test_the_default_model_streams_4_3_and_16_9_cameras_undistorted(camera: tuple[int, int],
                                                                     size: tuple[int, int]) -> None:
    """A 4:3 and a 16:9 camera through the Python API at the model's own settings: the output keeps the
    camera's aspect (its circles stay circles) at the model's pixel budget, and is a stylisation."""
    torch.set_num_threads(1)
    default = Pipeline.load()
    clip = circles_clip(camera)
    out = run_stream(default.open_stream(StreamParams(prompt="oil painting")), clip)
    assert out.shape == (len(clip), size[1], size[0], 3)
    assert_undistorted(out, clip)
