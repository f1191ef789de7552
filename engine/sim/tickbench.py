"""Control-tick latency benchmark: the policy's ``tick`` on a synthetic cluster snapshot.

The snapshot mixes tiers the way a loaded cluster does (half the workers URGENT-heavy, a quarter
RELAXED-only, a quarter empty) so re-homing planning does real work; the time is the median over many
ticks, after warm-up, measured with ``time.perf_counter``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from engine.serving.policy import PolicyConfig, SlackPolicy
from engine.serving.profile import FidelityProfile
from engine.serving.snapshot import Snapshot, StreamView, WorkerView


@dataclass(frozen=True)
class TickBench:
    streams: int
    workers: int
    ticks: int
    tick_ms: float
    tick_p95_ms: float
    rehomes_per_tick: float


def synthetic_snapshot(streams: int, workers: int, seed: int = 0, now: float = 1000.0) -> Snapshot:
    rng = np.random.default_rng(seed)
    busy = max(1, (3 * workers) // 4)
    views = []
    for i in range(streams):
        w = i % busy
        urgent_heavy = w < workers // 2
        slack = float(rng.uniform(0.0, 1.5) if urgent_heavy else rng.uniform(6.0, 12.0))
        views.append(StreamView(
            stream_id=i,
            worker_id=w,
            slack_s=slack,
            arrival_t=float(rng.uniform(0, now)),
            inflight_remaining_s=float(rng.uniform(0.0, 0.4)) if rng.random() < 0.2 else 0.0,
            first_chunk=bool(rng.random() < 0.02),
            last_rehomed_at=float(now - rng.uniform(0, 120)),
            state_bytes=6e9,
        ))
    ws = [WorkerView(w, w // 8, state_slots=streams) for w in range(workers)]
    return Snapshot(now, views, ws)


def run_tick_bench(profile: FidelityProfile, streams: int = 1024, workers: int = 16, ticks: int = 300,
                   warmup: int = 20) -> TickBench:
    policy = SlackPolicy(profile, PolicyConfig())
    snap = synthetic_snapshot(streams, workers)
    for _ in range(warmup):
        policy.tick(snap)
    times = []
    rehomes = 0
    for _ in range(ticks):
        t0 = time.perf_counter()
        plan = policy.tick(snap)
        times.append(time.perf_counter() - t0)
        rehomes += len(plan.rehomes)
    times.sort()
    return TickBench(
        streams=streams,
        workers=workers,
        ticks=ticks,
        tick_ms=statistics.median(times) * 1e3,
        tick_p95_ms=times[int(0.95 * (len(times) - 1))] * 1e3,
        rehomes_per_tick=rehomes / ticks,
    )
