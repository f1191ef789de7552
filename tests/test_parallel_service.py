"""`diffcast serve --gpus N`'s engine seam: the server's StreamProcessor over pipeline ranks.

Reference: the public Pipeline API (Stream.process) on the same tiny model in this process.
"""

from __future__ import annotations

import numpy as np
from _parallel_fixtures import (
    ServiceScenario,
    TinyFactory,
    one_thread,  # noqa: F401  (autouse fixture)
)

from engine.parallel.launch import run_pipeline
from engine.parallel.pipeline import PipelineOptions


def test_processor_over_two_ranks_matches_the_pipeline_api() -> None:
    """Also lets the block scheduler rebalance on its own after every micro-step it sees a gain in
    (min_gain 0): whatever it moves, the frames must not change."""
    factory = TinyFactory(layers=4, sink_refresh=True)
    scenario = ServiceScenario(chunks=5, switch_at=3)
    expected = scenario.reference(factory())
    result = run_pipeline(factory, scenario, world=2, options=PipelineOptions(rebalance_every=1, min_gain=0.0))
    got = result["frames"]
    assert result["rebalances"] >= 1  # VAE decode makes the last stage slower: blocks moved (7 in a trial run)
    assert [g.shape for g in got] == [e.shape for e in expected]
    for e, g in zip(expected, got, strict=True):
        # uint8 frames: fp32-rounding differences may flip a rounding step, never more.
        assert int(np.abs(e.astype(np.int16) - g.astype(np.int16)).max()) <= 1
    assert not np.array_equal(expected[-1], expected[-2])
