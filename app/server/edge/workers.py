"""``GET /api/workers``: every engine worker as the serving policy sees it (the in-process engine is one
worker; ``--ray`` has one per worker actor): its streams, their urgency tiers, its load.

It lists stream ids (what WHEP needs), so app/server/edge/security.py lets only admins (``--api-token`` /
``--token`` as Bearer) or, with no token set, a local client (loopback peer and Host) in.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from app.server.edge.openapi import errors
from app.server.serving.session import SessionManager


class WorkerTiers(BaseModel):
    urgent: int = Field(ge=0)
    normal: int = Field(ge=0)
    relaxed: int = Field(ge=0)


class WorkerRow(BaseModel):
    id: int = Field(description="The worker's id (Ray workers keep theirs for life; ids are never reused)")
    device: str = Field(description="The torch device its engine runs on")
    streams: list[str] = Field(description="Ids of the streams homed on it")
    tiers: WorkerTiers = Field(description="Its streams per urgency tier (the policy's last control tick)")
    load: float = Field(ge=0, le=1, description="Share of the last 5 s its engine was busy")
    draining: bool = Field(description="The autoscaler is moving its streams away before removing it")
    threads: int | None = Field(None, ge=1, description="Intra-op threads of its last step (an in-process engine "
                                                        "lane: fewer beside busy programs); null elsewhere")


def worker_rows(manager: SessionManager) -> list[dict[str, Any]]:
    """The serving loop's workers with the policy's stream ids replaced by the sessions' ids."""
    loop = manager.serving
    if loop is None:
        return []
    sessions = {policy_id: stream_id for stream_id, policy_id in manager.policy_ids().items()}
    return [{**row, "streams": [sessions[sid] for sid in row["streams"] if sid in sessions]} for row in loop.workers()]


def workers_router(manager: SessionManager) -> APIRouter:
    router = APIRouter()

    @router.get("/api/workers", response_model=list[WorkerRow], responses=errors("/api/workers", 401))
    async def workers() -> list[dict[str, Any]]:
        return worker_rows(manager)

    return router
