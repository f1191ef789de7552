"""The stabilizer sweep scores what the product would show at each setting: it replays the runtime's
stabilizer over a stream's decoded frames."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from engine.embedded.clips import render_clip, train_specs
from engine.embedded.evaluate import chunk_spans, stylize_stream
from engine.embedded.stabilizer_sweep import SweepRow, pick, stabilized
from engine.pipeline import Pipeline
from engine.streaming.stabilizer import StabilizerConfig


def test_the_sweep_replays_the_runtimes_stabilizer_on_the_decoded_frames() -> None:
    torch.set_num_threads(1)
    pipe = Pipeline.load()
    config = pipe.runtime.config.stabilizer
    assert config is not None, "the default model ships with the stabilizer on"
    frames = render_clip(train_specs(9)[5])
    run = stylize_stream(pipe, frames, "watercolor", seed=2)
    spans = chunk_spans(pipe, frames.shape[0])
    replayed = stabilized(config, frames, run.raw, spans)
    # The runtime filters the decoder's float frames, the replay their 8-bit copy: a level apart at most.
    assert np.abs(replayed.astype(int) - run.shipped.astype(int)).max() <= 2
    assert np.abs(run.raw.astype(int) - run.shipped.astype(int)).mean() > 0.5  # the filter did change them
    # No history weight: the decoded frames pass as they are.
    assert np.array_equal(stabilized(replace(config, strength=0.0), frames, run.raw, spans), run.raw)


def test_the_pick_is_the_best_picture_under_the_flicker_ceiling() -> None:
    def row(strength: float | None, db: float, ratio: float) -> SweepRow:
        return SweepRow(None if strength is None else StabilizerConfig(strength=strength), db, ratio, "cartoon", 20.0)

    rows = [row(None, 27.0, 1.9), row(0.9, 26.0, 0.6), row(0.7, 26.6, 0.78), row(0.5, 26.9, 0.95)]
    best = pick(rows, 0.8)
    assert best is not None and best.config is not None and best.config.strength == 0.7
    assert pick(rows, 0.5) is None
