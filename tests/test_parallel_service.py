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


def test_processor_over_two_ranks_matches_the_pipeline_api() -> None:
    factory = TinyFactory(layers=4, sink_refresh=True)
    scenario = ServiceScenario(chunks=5, switch_at=3)
    expected = scenario.reference(factory())
    got = run_pipeline(factory, scenario, world=2)
    assert [g.shape for g in got] == [e.shape for e in expected]
    for e, g in zip(expected, got, strict=True):
        # uint8 frames: fp32-rounding differences may flip a rounding step, never more.
        assert int(np.abs(e.astype(np.int16) - g.astype(np.int16)).max()) <= 1
    assert not np.array_equal(expected[-1], expected[-2])
