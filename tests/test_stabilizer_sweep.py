"""The stabilizer sweep scores what the product would show at each setting: it replays the runtime's
stabilizer over a stream's decoded frames."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch

from engine.embedded.clips import render_clip, train_specs
from engine.embedded.evaluate import chunk_spans, stylize_stream
from engine.embedded.stabilizer_sweep import SweepRow, SweepScores, overall, pick, pick_per_look, stabilized
from engine.pipeline import Pipeline
from engine.streaming.stabilizer import StabilizerConfig


def test_the_sweep_replays_the_runtimes_stabilizer_on_the_decoded_frames() -> None:
    torch.set_num_threads(1)
    pipe = Pipeline.load()
    base, looks = pipe.runtime.config.stabilizer, pipe.runtime.config.stabilizer_looks
    assert base is not None and looks is not None, "the default model ships with a stabilizer setting per look"
    # Night vision's own setting: its raw frames flicker most, so it gets a longer history than the rest.
    config = looks.settings[list(pipe.styles.names).index("night_vision")] if pipe.styles else None
    assert config is not None and config.strength > base.strength
    frames = render_clip(train_specs(9)[5])
    run = stylize_stream(pipe, frames, "night vision goggles", seed=2)
    spans = chunk_spans(pipe, frames.shape[0])
    replayed = stabilized(config, frames, run.raw, spans)
    # The runtime filters the decoder's float frames, the replay their 8-bit copy: a level apart at most.
    assert np.abs(replayed.astype(int) - run.shipped.astype(int)).max() <= 2
    assert np.abs(run.raw.astype(int) - run.shipped.astype(int)).mean() > 0.5  # the filter did change them
    # ... and the stream ran its look's setting, not the model-wide one.
    assert np.abs(stabilized(base, frames, run.raw, spans).astype(int) - run.shipped.astype(int)).max() > 2
    # No history weight: the decoded frames pass as they are.
    assert np.array_equal(stabilized(replace(config, strength=0.0), frames, run.raw, spans), run.raw)


def test_the_pick_is_the_best_picture_under_the_flicker_ceiling() -> None:
    def row(strength: float | None, db: float, ratio: float) -> SweepRow:
        return SweepRow(None if strength is None else StabilizerConfig(strength=strength), db, ratio, "cartoon", 20.0)

    rows = [row(None, 27.0, 1.9), row(0.9, 26.0, 0.6), row(0.7, 26.6, 0.78), row(0.5, 26.9, 0.95)]
    best = pick(rows, 0.8)
    assert best is not None and best.config is not None and best.config.strength == 0.7
    assert pick(rows, 0.5) is None


def test_per_look_picks_are_the_best_mean_picture_under_both_ceilings() -> None:
    """Against brute force over every combination of settings."""
    options = (None, StabilizerConfig(strength=0.3), StabilizerConfig(strength=0.6), StabilizerConfig(strength=0.9))
    # Per look, per option: (PSNR, output warp error) on two clips; teachers' warp error per look.
    table = {"tone": [(30.0, 0.004), (30.5, 0.0030), (29.8, 0.0022), (28.0, 0.0016)],
             "grain": [(24.0, 0.012), (24.2, 0.0080), (23.9, 0.0060), (23.0, 0.0050)],
             "cells": [(23.0, 0.016), (23.4, 0.0140), (23.2, 0.0120), (22.5, 0.0100)]}
    teacher = {"tone": 0.002, "grain": 0.005, "cells": 0.03}
    scores = SweepScores(options, tuple(
        {look: [(db + d, warp * (1 + d), teacher[look]) for d in (-0.1, 0.1)] for look, rows in table.items()
         for db, warp in [rows[k]]} for k in range(len(options))))
    looks = list(table)
    for overall_cap, look_cap in [(0.5, 1.2), (0.45, 1.0), (0.9, 2.0)]:
        best = None
        for combo in itertools.product(range(1, len(options)), repeat=len(looks)):
            ratios = [table[look][k][1] / teacher[look] for look, k in zip(looks, combo, strict=True)]
            warp = sum(table[look][k][1] for look, k in zip(looks, combo, strict=True)) / sum(teacher.values())
            db = float(np.mean([table[look][k][0] for look, k in zip(looks, combo, strict=True)]))
            if warp <= overall_cap and max(ratios) <= look_cap and (best is None or db > best[0]):
                best = (db, combo)
        assert best is not None
        picks = pick_per_look(scores, overall_cap, look_cap)
        assert [options.index(picks[look].config) for look in looks] == list(best[1])
        assert overall(scores, picks)[0] == pytest.approx(best[0])
    # No setting keeps the grain look under 0.5x its teacher: it gets its steadiest.
    assert pick_per_look(scores, 9.0, 0.5)["grain"].config == options[3]
