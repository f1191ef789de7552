"""Run policies over workloads: the glue the CLI, the report and the tests share."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from engine.serving.autoscale import AutoscaleConfig
from engine.serving.bmpr import BMPR
from engine.serving.policy import ABLATION_LADDER, BASELINES, SlackPolicy, policy_presets
from engine.serving.profile import FidelityProfile, bundled_profile, load_profile
from engine.sim.metrics import Summary, summarise
from engine.sim.simulator import SimConfig, SimResult, Simulator
from engine.sim.workload import TraceEvent, WorkloadSpec, generate

log = logging.getLogger(__name__)

ALL_POLICIES: tuple[str, ...] = BASELINES + tuple(p for p in ABLATION_LADDER if p not in BASELINES)


@dataclass(frozen=True)
class Run:
    workload: str
    policy: str
    result: SimResult
    summary: Summary
    wall_s: float


def simulation_profile(path: Path | None = None) -> FidelityProfile:
    """The profile at ``path`` (default: the bundled 1.3B H100 480p one) reduced to the points the engine
    runs on the device it was made for, so a simulation never plans with a knob that does not exist."""
    profile = load_profile(path) if path is not None else bundled_profile()
    runnable = profile.engine_runnable()
    dropped = len(profile.points) - len(runnable.points)
    if dropped:
        log.info("profile %s/%s: %d of %d points need what the engine lacks on %s; simulating without them",
                 profile.model, profile.device, dropped, len(profile.points), profile.device_type)
    return runnable


def advisory_autoscale(profile: FidelityProfile) -> AutoscaleConfig:
    """K = streams one GPU sustains in real time at the fastest floor-quality config (BMPR's floor)."""
    router = BMPR(profile.per_stream(), profile.quality_floor)
    floor_point = router.frontier[router.fastest_ok]
    return AutoscaleConfig(streams_per_worker=profile.chunk_duration_s / floor_point.latency_s)


def make_policy(name: str, profile: FidelityProfile) -> SlackPolicy:
    """Our policies carry the autoscaler in advisory mode: the simulator records the desired worker
    count each tick but keeps the cluster size fixed (the paper's setup)."""
    presets = policy_presets()
    if name not in presets:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(presets)}")
    cfg = presets[name]
    autoscale = advisory_autoscale(profile) if cfg.bmpr else None
    return SlackPolicy(profile, cfg, autoscale=autoscale)


def run_one(
    policy_name: str,
    profile: FidelityProfile,
    events: Sequence[TraceEvent],
    sim: SimConfig,
    workload: str = "trace",
) -> Run:
    policy = make_policy(policy_name, profile)
    t0 = time.perf_counter()
    result = Simulator(policy, profile, list(events), sim).run()
    wall = time.perf_counter() - t0
    return Run(workload, policy_name, result, summarise(result), wall)


def workload_events(spec: WorkloadSpec, profile: FidelityProfile) -> list[TraceEvent]:
    # Switch/pause points sit on the nominal playout timeline, which starts one initial slack after arrival.
    lead = make_policy("slackserve", profile).initial_slack_s
    return generate(replace(spec, nominal_lead_s=lead))


def run_suite(
    workloads: Sequence[WorkloadSpec] | None,
    policies: Sequence[str],
    profile: FidelityProfile,
    sim: SimConfig,
    trace: Sequence[TraceEvent] | None = None,
    progress: bool = True,
) -> list[Run]:
    jobs: list[tuple[str, list[TraceEvent]]] = []
    if trace is not None:
        jobs.append(("trace", list(trace)))
    for spec in workloads or ():
        jobs.append((spec.name, workload_events(spec, profile)))
    runs: list[Run] = []
    bar = tqdm(total=len(jobs) * len(policies), desc="simulate", disable=not progress, unit="run")
    for name, events in jobs:
        for p in policies:
            bar.set_postfix_str(f"{name}/{p}")
            run = run_one(p, profile, events, sim, workload=name)
            log.debug("%s/%s: cpr=%.3f ttfc=%.2f (%.1fs)", name, p, run.summary.cpr, run.summary.ttfc_s, run.wall_s)
            runs.append(run)
            bar.update(1)
    bar.close()
    return runs
