"""The product path (engine.pipeline) on the SHIPPED default model: the look each prompt asks for."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.pipeline import DEFAULT_MODEL, Pipeline, StreamParams

pytestmark = pytest.mark.skipif(not DEFAULT_MODEL.is_file(), reason="the embedded default model is not committed")


@pytest.fixture(scope="module")
def pipe() -> Pipeline:
    torch.set_num_threads(1)
    return Pipeline.load()


def test_each_style_prompt_through_the_pipeline_is_closest_to_its_teacher(pipe: Pipeline) -> None:
    from engine.embedded.clips import heldout_specs, render_clip
    from engine.embedded.teachers import TEACHERS, stylize_clip

    frames = render_clip(heldout_specs()[4])[:9]  # held out: 1 + 4 + 4 frames
    teachers = {s: stylize_clip(frames, s).astype(np.float32) for s in TEACHERS}
    assert pipe.styles is not None
    wrong = []
    for style in pipe.styles.names:
        stream = pipe.open_stream(StreamParams(prompt=style.replace("_", " "), steps=1, noise_scale=0.2, seed=0))
        out = np.concatenate([stream.process(frames[:1]), stream.process(frames[1:5]), stream.process(frames[5:9])])
        dist = {s: float(np.mean((out.astype(np.float32) - t) ** 2)) for s, t in teachers.items()}
        nearest = min(dist, key=dist.__getitem__)
        if nearest != style:
            wrong.append(f"{style} -> nearest {nearest} (MSE {dist[nearest]:.0f}), own {dist[style]:.0f}")
        assert stream.notice is None
    assert not wrong, "; ".join(wrong)


def test_a_prompt_far_from_every_style_gets_a_notice_naming_the_nearest(pipe: Pipeline) -> None:
    stream = pipe.open_stream(StreamParams(prompt="quarterly tax report spreadsheet", noise_scale=0.2))
    assert stream.notice is not None and "nearest" in stream.notice
    assert stream.stats()["notice"] == stream.notice
    stream.update(prompt="a charcoal pencil drawing")
    assert stream.notice is None
