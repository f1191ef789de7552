"""What an executor tells the policy (snapshot) and what the policy tells it back (plan).

The policy is pure: it reads these frozen dataclasses plus an injected ``now`` and returns a plan. The
executor (live server or simulator) owns all mutable state: playout trackers, residency, cooldown
timestamps, worker membership. See docs/simulation.md, "How to drive the policy from an executor".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from engine.serving.credit import Tier
from engine.serving.profile import ProfilePoint


@dataclass(frozen=True, slots=True)
class StreamView:
    """One admitted stream as the executor sees it at ``now``.

    ``slack_s`` is P (generated-but-unplayed seconds, from the playout tracker); ``inflight_remaining_s``
    is R: the profiled time left of a started chunk (running, or preempted mid-chunk at a step
    boundary), 0 otherwise. ``inflight_point`` is the config that started chunk must finish with.
    """

    stream_id: int
    worker_id: int
    slack_s: float
    arrival_t: float = 0.0
    remaining_content_s: float = math.inf
    inflight_remaining_s: float = 0.0
    inflight_point: ProfilePoint | None = None
    running: bool = False
    resident: bool = True
    runnable: bool = True
    first_chunk: bool = False
    paused: bool = False
    last_rehomed_at: float = -math.inf
    last_run_at: float = -math.inf
    state_bytes: float = 0.0
    max_steps: int | None = None  # the user's step count: the policy never routes above it


@dataclass(frozen=True, slots=True)
class WorkerView:
    worker_id: int
    node_id: int = 0
    state_slots: int = 4
    draining: bool = False
    # Streams it can host at all, None: no bound. Set where states cannot be parked (then every stream's
    # state stays on the device: engine/serving/device_memory.py).
    max_streams: int | None = None
    # Its steps' measured time over the profile's (live calibration, ``EngineCore.worker_speed``): what
    # live re-homing compares across workers. None: not measured (the simulator's workers).
    speed: float | None = None


@dataclass(frozen=True)
class Snapshot:
    now: float
    streams: Sequence[StreamView]
    workers: Sequence[WorkerView]


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    stream_id: int
    now: float
    content_s: float
    max_steps: int | None = None  # the user's step count, the ceiling of the stream's fidelity


@dataclass(frozen=True, slots=True)
class Admission:
    stream_id: int
    accepted: bool
    worker_id: int | None
    initial_slack_s: float
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Dispatch:
    """What one worker does at a step or chunk boundary.

    ``stream_ids`` run next as one forward (several only for stream batching) with ``point``; if a
    different stream was running mid-chunk, it is preempted (its partial chunk is kept). ``evict`` are
    resident streams to offload to host first; ``restore`` are chosen streams whose state must come back.
    """

    worker_id: int
    stream_ids: tuple[int, ...]
    point: ProfilePoint | None
    preempt: bool = False
    evict: tuple[int, ...] = ()
    restore: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Rehome:
    stream_id: int
    src: int
    dst: int
    intra_node: bool
    residual_s: float


@dataclass(frozen=True)
class TickPlan:
    """The control tick's output. Arrays are aligned with ``stream_ids``."""

    now: float
    stream_ids: npt.NDArray[np.int64]
    fidelity: Sequence[ProfilePoint]
    credits: npt.NDArray[np.float64]
    tiers: npt.NDArray[np.int8]
    queues: Mapping[int, tuple[int, ...]]
    worker_tiers: Mapping[int, Tier | None]
    rehomes: tuple[Rehome, ...] = ()
    desired_workers: int | None = None
    drain: tuple[int, ...] = field(default_factory=tuple)

    def tier_counts(self) -> dict[str, int]:
        return {t.name: int(np.count_nonzero(self.tiers == int(t))) for t in Tier}
