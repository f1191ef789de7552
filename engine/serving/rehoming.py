"""Bipartite re-homing planning (SlackServe §4.2, Algorithm 1, appendix C.2; papers: docs/references.md).

Senders: URGENT-heavy workers (at least ``sender_min_urgent`` URGENT streams and at least
``sender_min_streams`` streams, i.e. the URGENT stream is competing with others for the GPU; moving
a lone stream to an identical GPU gains nothing). Receivers: workers with no URGENT or NORMAL streams
(empty or RELAXED-only) that are not draining and have a free state slot. Each sender sends at most
``send_cap`` streams per tick and each receiver takes at most ``recv_cap``; a moved stream is not moved
again within ``cooldown_s``. Receivers on the sender's node are tried first, then the rest, each group
least-loaded first. The moved stream is the lowest-credit URGENT stream on the sender not in cooldown.

Live (``RehomingConfig.balance_speed``, which the live server turns on): a live V2V stream cannot get
ahead of its camera, so its slack never grows past about one chunk and it is URGENT on every worker,
fast or slow; no worker is ever a receiver by the rule above. There a worker's load is its measured
speed (its steps' wall time over the profile's, ``WorkerView.speed``) times its streams: the engine
time one round of its streams takes, comparable across workers whatever the machine's load. Senders go
from the highest load down; each sends its lowest-credit URGENT streams (not in cooldown) to the
worker whose load after taking one is lowest, while that stays below the sender's load by
``balance_margin``. The caps and the cooldown hold as above; a lone stream moves too when its worker
is that much slower (then the move gains). A worker with no measured speed counts as the median one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from engine.serving.credit import Tier
from engine.serving.snapshot import Rehome
from engine.serving.transfer import Link, TransferModel


@dataclass(frozen=True, slots=True)
class RehomingConfig:
    send_cap: int = 2
    recv_cap: int = 1
    cooldown_s: float = 60.0
    sender_min_urgent: int = 1
    sender_min_streams: int = 2
    # Live: senders and receivers by measured speed x streams (module docstring), not by tiers.
    balance_speed: bool = False
    # A move must cut the round by this share: receiver's load after it x (1 + margin) < sender's load
    # (speeds measured on a busy machine wobble; no stream ping-pongs between equal workers).
    balance_margin: float = 0.5


@dataclass(frozen=True)
class ClusterArrays:
    """Column view of the streams and workers a planner needs (built once per tick)."""

    stream_ids: npt.NDArray[np.int64]
    stream_worker: npt.NDArray[np.int64]  # index into worker arrays
    tiers: npt.NDArray[np.int8]
    credits: npt.NDArray[np.float64]
    last_rehomed_at: npt.NDArray[np.float64]
    state_bytes: npt.NDArray[np.float64]
    worker_ids: npt.NDArray[np.int64]
    worker_node: npt.NDArray[np.int64]
    worker_slots: npt.NDArray[np.int64]
    worker_draining: npt.NDArray[np.bool_]
    # Each worker's measured speed (``WorkerView.speed``; NaN: not measured), for ``balance_speed``.
    worker_speed: npt.NDArray[np.float64] | None = None

    def per_worker_counts(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        n = len(self.worker_ids)
        total = np.bincount(self.stream_worker, minlength=n)
        urgent = np.bincount(self.stream_worker[self.tiers == int(Tier.URGENT)], minlength=n)
        normal = np.bincount(self.stream_worker[self.tiers == int(Tier.NORMAL)], minlength=n)
        return total, urgent, normal


def plan_rehomes(
    arrays: ClusterArrays, now: float, cfg: RehomingConfig, transfer: TransferModel
) -> tuple[Rehome, ...]:
    if cfg.balance_speed:
        return _plan_by_speed(arrays, now, cfg, transfer)
    total, urgent, normal = arrays.per_worker_counts()
    senders = np.nonzero((urgent >= cfg.sender_min_urgent) & (total >= cfg.sender_min_streams))[0]
    receivers = np.nonzero(
        (urgent == 0) & (normal == 0) & ~arrays.worker_draining & (total < arrays.worker_slots)
    )[0]
    if len(senders) == 0 or len(receivers) == 0:
        return ()
    senders = senders[np.argsort(-urgent[senders], kind="stable")]
    recv_load = total.copy()
    received = dict.fromkeys(receivers.tolist(), 0)
    eligible = _eligible(arrays, now, cfg)
    plan: list[Rehome] = []
    for src in senders.tolist():
        queue = _queue(arrays, eligible, src)
        if not queue:
            continue
        node = arrays.worker_node[src]
        open_recv = [r for r in received if received[r] < cfg.recv_cap]
        ordered = sorted(open_recv, key=lambda r: (arrays.worker_node[r] != node, recv_load[r], r))
        sent = 0
        for dst in ordered:
            if sent >= cfg.send_cap or not queue:
                break
            plan.append(_move(arrays, queue.pop(0), src, dst, transfer))
            received[dst] += 1
            recv_load[dst] += 1
            sent += 1
    return tuple(plan)


def _plan_by_speed(
    arrays: ClusterArrays, now: float, cfg: RehomingConfig, transfer: TransferModel
) -> tuple[Rehome, ...]:
    """The live rule (module docstring): from the highest measured load to the lowest."""
    n = len(arrays.worker_ids)
    total = np.bincount(arrays.stream_worker, minlength=n).astype(np.float64)
    speed = np.ones(n) if arrays.worker_speed is None else arrays.worker_speed.copy()
    measured = np.isfinite(speed)
    speed[~measured] = float(np.median(speed[measured])) if measured.any() else 1.0
    eligible = _eligible(arrays, now, cfg)
    received = np.zeros(n, dtype=np.int64)
    plan: list[Rehome] = []
    for src in np.argsort(-speed * total, kind="stable").tolist():
        if received[src]:
            continue  # took a stream this tick: it was among the lightest
        queue = _queue(arrays, eligible, src)
        sent = 0
        while queue and sent < cfg.send_cap:
            after = speed * (total + 1)
            fits = ((after * (1 + cfg.balance_margin) < speed[src] * total[src]) & (received < cfg.recv_cap)
                    & ~arrays.worker_draining & (total < arrays.worker_slots))
            fits[src] = False
            if not fits.any():
                break
            node = arrays.worker_node[src]
            dst = min(np.nonzero(fits)[0].tolist(), key=lambda r: (after[r], arrays.worker_node[r] != node, r))
            plan.append(_move(arrays, queue.pop(0), src, dst, transfer))
            total[src] -= 1
            total[dst] += 1
            received[dst] += 1
            sent += 1
    return tuple(plan)


def _eligible(arrays: ClusterArrays, now: float, cfg: RehomingConfig) -> npt.NDArray[np.bool_]:
    """Streams that may move: URGENT, and not moved within the cooldown."""
    ok: npt.NDArray[np.bool_] = (arrays.tiers == int(Tier.URGENT)) & (now - arrays.last_rehomed_at >= cfg.cooldown_s)
    return ok


def _queue(arrays: ClusterArrays, eligible: npt.NDArray[np.bool_], src: int) -> list[int]:
    """The sender's movable streams (row indices), lowest credit first."""
    mine = np.nonzero(eligible & (arrays.stream_worker == src))[0]
    return mine[np.argsort(arrays.credits[mine], kind="stable")].tolist()


def _move(arrays: ClusterArrays, s: int, src: int, dst: int, transfer: TransferModel) -> Rehome:
    intra = bool(arrays.worker_node[dst] == arrays.worker_node[src])
    link = Link.INTRA_NODE if intra else Link.INTER_NODE
    return Rehome(
        stream_id=int(arrays.stream_ids[s]),
        src=int(arrays.worker_ids[src]),
        dst=int(arrays.worker_ids[dst]),
        intra_node=intra,
        residual_s=transfer.residual_s(float(arrays.state_bytes[s]), link),
    )
