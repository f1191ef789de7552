"""The product path (engine.pipeline) on the SHIPPED default model: the look each prompt asks for."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _output_checks import assert_stylized

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
        assert_stylized(out, frames)
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


def test_the_default_model_stabilizes_and_a_stream_can_switch_it_off(pipe: Pipeline) -> None:
    from engine.embedded.clips import heldout_specs, render_clip
    from engine.embedded.evaluate import input_flows, warp_error

    assert pipe.runtime.stabilizer is not None, "default.json enables the temporal stabilizer"
    frames = render_clip(heldout_specs()[1])
    outs = {}
    for stabilize in (True, False):
        stream = pipe.open_stream(StreamParams(prompt="thermal camera", steps=1, noise_scale=0.2, seed=2,
                                               stabilize=stabilize))
        assert stream.stats()["stabilizer"] is stabilize
        chunks = [frames[:1]] + [frames[a : a + 4] for a in range(1, len(frames) - 3, 4)]
        outs[stabilize] = np.concatenate([stream.process(c) for c in chunks])
    flows = input_flows(frames)
    # Flicker measured independently (warp error, DIS flow at a finer preset than the filter's).
    assert warp_error(outs[True], flows) < 0.6 * warp_error(outs[False], flows)
    stream.update(stabilize=True)
    assert stream.stats()["stabilizer"] is True and stream.state.stabilize
