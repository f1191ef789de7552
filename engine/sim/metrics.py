"""Summary metrics of one simulation run (SlackServe §7.1 definitions)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from engine.sim.simulator import SimResult


@dataclass(frozen=True)
class Summary:
    policy: str
    streams: int
    rejected: int
    cpr: float  # mean over admitted streams of (on-time chunks / chunks)
    ttfc_s: float  # mean arrival -> first playable chunk
    ttfc_p95_s: float
    stalls_per_stream: float
    stall_mean_s: float
    stall_p95_s: float
    stall_s_per_stream: float
    mean_quality: float  # chunk-weighted, over delivered chunks
    rehomes: int
    evictions: int
    restores: int
    preemptions: int
    urgent_workers_mean: float
    relaxed_workers_mean: float
    utilisation: float

    def to_json(self) -> dict[str, float | int | str]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def summarise(r: SimResult) -> Summary:
    recs = [s for s in r.streams if s.chunks_on_time + s.chunks_late > 0]
    cpr = [s.chunks_on_time / (s.chunks_on_time + s.chunks_late) for s in recs]
    ttfc = np.array([s.ttfc_s for s in recs if s.ttfc_s is not None], dtype=np.float64)
    stalls = np.array([st.duration_s for s in recs for st in s.stalls], dtype=np.float64)
    q_sum = sum((s.mean_quality or 0.0) * (s.chunks_on_time + s.chunks_late) for s in recs)
    q_n = sum(s.chunks_on_time + s.chunks_late for s in recs)
    tl = r.timeline
    busy = sum(r.worker_busy_s.values())
    span = max(r.end_t, 1e-9) * max(len(r.worker_busy_s), 1)
    n = max(len(recs), 1)
    return Summary(
        policy=r.policy,
        streams=len(r.streams),
        rejected=len(r.rejected),
        cpr=float(np.mean(cpr)) if cpr else 0.0,
        ttfc_s=float(ttfc.mean()) if len(ttfc) else float("nan"),
        ttfc_p95_s=float(np.percentile(ttfc, 95)) if len(ttfc) else float("nan"),
        stalls_per_stream=len(stalls) / n,
        stall_mean_s=float(stalls.mean()) if len(stalls) else 0.0,
        stall_p95_s=float(np.percentile(stalls, 95)) if len(stalls) else 0.0,
        stall_s_per_stream=float(stalls.sum()) / n,
        mean_quality=q_sum / q_n if q_n else float("nan"),
        rehomes=r.rehomes,
        evictions=r.evictions,
        restores=r.restores,
        preemptions=r.preemptions,
        urgent_workers_mean=float(np.mean([row.urgent_workers for row in tl])) if tl else 0.0,
        relaxed_workers_mean=float(np.mean([row.relaxed_workers for row in tl])) if tl else 0.0,
        utilisation=busy / span,
    )
