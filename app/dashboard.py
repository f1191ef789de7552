"""The operator dashboard: /dashboard (web/dashboard.html) and the JSON it polls, /api/dashboard.

The snapshot is built from the same live session data as /metrics (each session's stats and
playout buffer), plus what an operator needs at a glance and /metrics does not say: each
stream's service credit and urgency tier (SlackServe's C = P - (R + T), engine/serving/credit.py)
and every engine worker's streams, tiers and load, and the policy's recent actions. The page keeps the history (slack, fidelity, tiers over time) itself.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse, JSONResponse

from app.server.config import ServerConfig
from app.server.edge.workers import worker_rows
from app.server.serving.session import Session, SessionManager
from engine.serving.credit import Tier, classify, service_credit

WEB_DIR = Path(__file__).resolve().parents[1] / "web"
WARMING = "WARMING"  # no chunk finished yet: no chunk time, no credit


class ChunkRate:
    """Chunks per second per stream, from the runners' chunk counters between two snapshots."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, int]] = {}

    def update(self, sessions: list[Session], now: float) -> dict[str, float]:
        rates: dict[str, float] = {}
        seen: dict[str, tuple[float, int]] = {}
        for session in sessions:
            chunks = session.runner.chunks
            before = self._last.get(session.id)
            if before is not None and now > before[0]:
                rates[session.id] = (chunks - before[1]) / (now - before[0])
            seen[session.id] = (now, chunks)
        self._last = seen  # forget closed streams
        return rates


def stream_row(session: Session, chunk_rate: float) -> dict[str, Any]:
    """One stream: its /metrics-facing stats plus tier, credit, fidelity and its engine load.

    The stats carry the engine core's own tier, credit and per-chunk fidelity (every policy preset),
    and those are shown. Before the core's first control tick has classified a stream, the same
    SlackServe credit is computed here for display: C = P - (R + T) with P the playout slack and T the
    last chunk's measured time; R (the rest of the chunk in flight) is not tracked, so taken as 0.
    """
    stats = session.stats()
    chunk_s = float(session.runner.chunk_seconds)
    if stats.get("tier", "-") not in ("-", None):
        tier = str(stats["tier"]).upper()
        credit = float(stats["credit_s"])
    elif chunk_s > 0:
        credit = service_credit(float(session.playout.slack_s), 0.0, chunk_s)
        tier = classify(credit, chunk_s).name
    else:
        credit, tier = 0.0, WARMING
    steps = stats.get("fidelity_steps") or stats["steps"]
    fidelity = stats.get("fidelity") or f"{steps} steps"
    return {
        **stats,
        "credit_s": round(credit, 3),
        "tier": tier,
        "fidelity": f"{fidelity} · noise {stats['noise_scale']:.2f}",
        "fidelity_steps": steps,
        # Seconds of engine time per wall-clock second this stream costs right now.
        "engine_load": round(chunk_s * chunk_rate, 3),
        "age_s": round(time.monotonic() - session.created, 1),
    }


def snapshot(manager: SessionManager, config: ServerConfig, rate: ChunkRate) -> dict[str, Any]:
    sessions = list(manager.sessions.values())
    rates = rate.update(sessions, time.monotonic())
    streams = [stream_row(s, rates.get(s.id, 0.0)) for s in sessions]
    tier_names = (*(t.name for t in Tier), WARMING)
    tiers = {name: sum(1 for s in streams if s["tier"] == name) for name in tier_names}
    by_id = {s["stream_id"]: s for s in streams}
    workers = []
    # Every worker the policy places streams on: the in-process engine, or each Ray worker actor.
    for row in worker_rows(manager):
        mine = [by_id[sid] for sid in row["streams"] if sid in by_id]
        for stream in mine:
            stream["worker"] = row["id"]
        workers.append({
            "id": f"engine-{row['id']}",
            "device": row["device"],
            "model": config.model or "default",
            "policy": config.policy,
            "streams": len(mine),
            "stream_ids": row["streams"],
            "max_streams": config.max_streams,
            "load": row["load"],
            "draining": row["draining"],
            "threads": row.get("threads"),
            "tiers": {name: sum(1 for s in mine if s["tier"] == name) for name in tier_names},
        })
    return {
        "time": time.time(),
        "workers": workers,
        "streams": streams,
        "actions": recent_actions(manager),
        "totals": {
            "streams": len(streams),
            "max_streams": config.max_streams,
            "viewers": sum(s["viewers"] for s in streams),
            "output_fps": round(sum(s["fps"] for s in streams), 2),
            "tiers": tiers,
        },
    }


def recent_actions(manager: SessionManager) -> list[dict[str, Any]]:
    """The policy's recent actions, newest first, with the sessions' stream ids."""
    loop = manager.serving
    if loop is None:
        return []
    sessions = {policy_id: stream_id for stream_id, policy_id in manager.policy_ids().items()}
    return [{**a, "stream": sessions.get(a["stream"]) if a["stream"] is not None else None}
            for a in reversed(loop.executor.actions)]


def dashboard_router(manager: SessionManager, config: ServerConfig) -> APIRouter:
    router = APIRouter()
    rate = ChunkRate()

    @router.get("/dashboard", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(WEB_DIR / "dashboard.html")

    @router.get("/api/dashboard")
    async def data() -> JSONResponse:
        # It lists every stream id (what WHEP needs), so app/server/edge/security.py lets only admins
        # (--api-token / --token as Bearer; the page passes ?token=) or, with no token set, loopback in.
        return JSONResponse(snapshot(manager, config, rate))

    return router
