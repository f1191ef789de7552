"""Simulator: no starvation under generated arrival patterns, accounting invariants, mechanics."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.serving.policy import SlackPolicy, policy_presets
from engine.serving.profile import FidelityProfile, bundled_profile
from engine.sim.simulator import SimConfig, Simulator
from engine.sim.workload import LENGTHS_FRAMES, EventKind, TraceEvent


@pytest.fixture(scope="module")
def profile() -> FidelityProfile:
    return bundled_profile()


def test_policy_and_simulator_do_not_import_torch() -> None:
    code = (
        "import sys, importlib, pkgutil, engine.serving, engine.sim\n"
        "for pkg in (engine.serving, engine.sim):\n"
        "    for m in pkgutil.iter_modules(pkg.__path__):\n"
        "        importlib.import_module(pkg.__name__ + '.' + m.name)\n"
        "import app.commands.simulate\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def arrivals(pattern: list[tuple[float, int]]) -> list[TraceEvent]:
    return [TraceEvent(t, EventKind.ARRIVE, i, frames) for i, (t, frames) in enumerate(sorted(pattern))]


CREDIT_POLICIES = {"slackserve", "credit-only", "+bmpr", "+rehoming", "ts-chunk-lsf"}
POLICIES = sorted(CREDIT_POLICIES) + ["ts-deadline", "fifo-batch"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pattern=st.lists(st.tuples(st.floats(0.0, 15.0), st.sampled_from(LENGTHS_FRAMES)), min_size=1, max_size=12),
    gpus=st.sampled_from([1, 2, 4]),
    slots=st.integers(1, 3),
    policy=st.sampled_from(POLICIES),
    seed=st.integers(0, 3),
)
def test_no_admitted_stream_starves(profile: FidelityProfile, pattern: list[tuple[float, int]], gpus: int,
                                    slots: int, policy: str, seed: int) -> None:
    pol = SlackPolicy(profile, policy_presets()[policy])
    gpus = max(gpus, pol.config.gpus_per_worker)
    sim = Simulator(pol, profile, arrivals(pattern), SimConfig(workers=gpus, nodes=1, state_slots=slots, seed=seed))
    res = sim.run()
    n = len(pattern)
    t_max = max(p.latency_s for p in profile.points) * 1.2  # jitter is clipped well inside this
    transfer = 1.0
    total_chunks = sum(math.ceil(f / 12) + 1 for _, f in pattern)
    for s in sim.streams.values():
        tr = s.tracker
        assert tr.done_generating, f"stream {s.sid} ({policy}) never finished"
        chunks = [t for kind, t, _ in tr.log if kind == "chunk"]
        assert len(chunks) == tr.chunks_on_time + tr.chunks_late
        if policy in CREDIT_POLICIES:
            # Credit ordering: between services a stream waits at most its own slack (never above content
            # + initial slack) plus one chunk of every other stream in the system, twice over.
            bound = tr.content_s + tr.initial_slack_s + 2 * n * t_max + transfer
        else:
            # Stream-deadline / FIFO orders can park a stream behind whole other streams; they are still
            # work-conserving, so the wait is bounded by all the work in the system.
            bound = max(pattern)[0] + total_chunks * t_max * 4 + transfer
        gaps = [chunks[0] - s.arrival_t] + [b - a for a, b in zip(chunks, chunks[1:], strict=False)]
        assert max(gaps) <= bound, (policy, max(gaps), bound)
    assert len(res.streams) + len(res.rejected) == n


def test_chunk_outcomes_match_deadline_recomputation(profile: FidelityProfile) -> None:
    """Without pauses or switches, chunk i is due at arrival + S0 + (content before i) + (stall time
    before i); a late chunk extends the stall time by how late it was. Recompute from the event log."""
    pol = SlackPolicy(profile, policy_presets()["slackserve"])
    pattern = [(0.3 * i, LENGTHS_FRAMES[i % 4]) for i in range(30)]
    sim = Simulator(pol, profile, arrivals(pattern), SimConfig(workers=4, nodes=2, state_slots=2))
    res = sim.run()
    for s in sim.streams.values():
        tr = s.tracker
        due_content, stalled, on_time, late, stall_total = 0.0, 0.0, 0, 0, 0.0
        for kind, t, dur in tr.log:
            assert kind == "chunk"
            deadline = s.arrival_t + tr.initial_slack_s + due_content + stalled
            if t <= deadline + 1e-9:
                on_time += 1
            else:
                late += 1
                stalled += t - deadline
                stall_total += t - deadline
            due_content = min(tr.content_s, due_content + dur)
        assert (tr.chunks_on_time, tr.chunks_late) == (on_time, late)
        assert sum(x.duration_s for x in tr.stalls) == pytest.approx(stall_total)
        rec = next(r for r in res.streams if r.sid == s.sid)
        assert rec.ttfc_s == pytest.approx(tr.log[0][1] - s.arrival_t)
    assert res.evictions > 0 and res.restores > 0  # 30 streams on 4 GPUs x 2 slots must offload


def test_overload_triggers_rehoming_and_tiers_are_tracked(profile: FidelityProfile) -> None:
    pol = SlackPolicy(profile, policy_presets()["slackserve"])
    # Eight long streams at once on 8 GPUs plus a later wave: placement by fewest streams then imbalance.
    pattern = [(0.0, 241)] * 8 + [(2.0 + 0.1 * i, 241) for i in range(8)] + [(20.0, 81)] * 2
    sim = Simulator(pol, profile, arrivals(pattern), SimConfig(workers=8, nodes=2, state_slots=4))
    res = sim.run()
    assert res.timeline and all(
        row.urgent_workers + row.normal_workers + row.relaxed_workers + row.idle_workers == 8 for row in res.timeline
    )
    assert all(not math.isnan(r.mean_quality or 0.0) for r in res.streams)


def test_prompt_switch_after_generation_finished_revives_stream(profile: FidelityProfile) -> None:
    pol = SlackPolicy(profile, policy_presets()["slackserve"])
    events = [TraceEvent(0.0, EventKind.ARRIVE, 0, 81), TraceEvent(6.0, EventKind.PROMPT_SWITCH, 0)]
    sim = Simulator(pol, profile, events, SimConfig(workers=1, nodes=1))
    sim.run()
    tr = sim.streams[0].tracker
    assert tr.epoch == 1 and tr.done_generating
    kinds = [k for k, _, _ in tr.log]
    assert kinds.index("switch") < len(kinds) - 1  # chunks were generated again after the switch


def test_prompt_switch_mid_chunk_abandons_the_stale_chunk_at_a_step_boundary(profile: FidelityProfile) -> None:
    pol = SlackPolicy(profile, policy_presets()["credit-only"])  # static 4-step chunks
    ref = pol.reference
    step = ref.first_chunk_latency_s / ref.config.steps
    events = [TraceEvent(0.0, EventKind.ARRIVE, 0, 81), TraceEvent(1.5 * step, EventKind.PROMPT_SWITCH, 0)]
    sim = Simulator(pol, profile, events, SimConfig(workers=1, nodes=1, jitter_cv=0.0))
    sim.run()
    tr = sim.streams[0].tracker
    # The stale chunk stops after its 2nd step; the new prompt's first chunk follows immediately.
    assert tr.first_chunk_t == pytest.approx(2 * step + ref.latency_s)
