"""Headline check on SlackServe's Steady workload (1 stream/s, 16 GPUs).

CI runs 200 streams (a few seconds); the committed report (docs/sim/) runs the paper's 946. Both plan with
the profile `diffcast simulate` uses: the bundled one without the points the engine cannot run (fp8).
"""

from __future__ import annotations

import pytest

from engine.serving.policy import BASELINES
from engine.sim.runner import run_suite, simulation_profile
from engine.sim.simulator import SimConfig
from engine.sim.workload import WorkloadSpec


@pytest.fixture(scope="module")
def steady() -> dict[str, object]:
    runs = run_suite([WorkloadSpec("steady", streams=200, rate=1.0, seed=0)], [*BASELINES, "slackserve"],
                     simulation_profile(), SimConfig(workers=16), progress=False)
    return {r.policy: r.summary for r in runs}


def test_slackserve_cpr_beats_target_and_fifo(steady: dict) -> None:
    ours = steady["slackserve"]
    assert ours.rejected == 0  # the comparison is over the same admitted streams
    assert ours.cpr >= 0.93
    assert ours.cpr >= 1.6 * steady["fifo-batch"].cpr


def test_slackserve_ttfc_below_every_baseline(steady: dict) -> None:
    for b in BASELINES:
        assert steady["slackserve"].ttfc_s < steady[b].ttfc_s, b


def test_slackserve_keeps_quality_near_reference(steady: dict) -> None:
    ref = simulation_profile().reference().quality
    assert steady["slackserve"].mean_quality >= ref - 0.5  # BMPR's floor keeps degradation small
