"""Bipartite re-homing planning (SlackServe §4.2, Algorithm 1, appendix C.2; papers: docs/references.md).

Senders: URGENT-heavy workers (at least ``sender_min_urgent`` URGENT streams and at least
``sender_min_streams`` streams, i.e. the URGENT stream is competing with others for the GPU; moving
a lone stream to an identical GPU gains nothing). Receivers: workers with no URGENT or NORMAL streams
(empty or RELAXED-only) that are not draining and have a free state slot. Each sender sends at most
``send_cap`` streams per tick and each receiver takes at most ``recv_cap``; a moved stream is not moved
again within ``cooldown_s``. Receivers on the sender's node are tried first, then the rest, each group
least-loaded first. The moved stream is the lowest-credit URGENT stream on the sender not in cooldown.
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

    def per_worker_counts(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        n = len(self.worker_ids)
        total = np.bincount(self.stream_worker, minlength=n)
        urgent = np.bincount(self.stream_worker[self.tiers == int(Tier.URGENT)], minlength=n)
        normal = np.bincount(self.stream_worker[self.tiers == int(Tier.NORMAL)], minlength=n)
        return total, urgent, normal


def plan_rehomes(
    arrays: ClusterArrays, now: float, cfg: RehomingConfig, transfer: TransferModel
) -> tuple[Rehome, ...]:
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
    eligible = (arrays.tiers == int(Tier.URGENT)) & (now - arrays.last_rehomed_at >= cfg.cooldown_s)
    plan: list[Rehome] = []
    for src in senders.tolist():
        mine = np.nonzero(eligible & (arrays.stream_worker == src))[0]
        if len(mine) == 0:
            continue
        queue = mine[np.argsort(arrays.credits[mine], kind="stable")].tolist()
        node = arrays.worker_node[src]
        open_recv = [r for r in received if received[r] < cfg.recv_cap]
        ordered = sorted(open_recv, key=lambda r: (arrays.worker_node[r] != node, recv_load[r], r))
        sent = 0
        for dst in ordered:
            if sent >= cfg.send_cap or not queue:
                break
            s = queue.pop(0)
            intra = bool(arrays.worker_node[dst] == node)
            link = Link.INTRA_NODE if intra else Link.INTER_NODE
            plan.append(
                Rehome(
                    stream_id=int(arrays.stream_ids[s]),
                    src=int(arrays.worker_ids[src]),
                    dst=int(arrays.worker_ids[dst]),
                    intra_node=intra,
                    residual_s=transfer.residual_s(float(arrays.state_bytes[s]), link),
                )
            )
            received[dst] += 1
            recv_load[dst] += 1
            sent += 1
    return tuple(plan)
