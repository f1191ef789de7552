"""Modelled cost of moving one stream's state (KV cache, sinks, VAE cache, noise state).

SlackServe's State Plane streams transfers layer by layer and reinserts the stream once its first
layer is ready, so only a fraction of a transfer sits on the critical path (their appendix D: 4.4 ms
residual of 31.8 ms mean, 13.8 %). ``residual_s`` is that critical-path part; ``total_s`` the full copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Link(Enum):
    HOST = "host"  # offload / restore over PCIe
    INTRA_NODE = "intra-node"  # NVLink P2P
    INTER_NODE = "inter-node"  # InfiniBand RDMA


@dataclass(frozen=True, slots=True)
class TransferModel:
    host_bytes_per_s: float = 25e9
    intra_node_bytes_per_s: float = 150e9
    inter_node_bytes_per_s: float = 40e9
    fixed_s: float = 0.002
    residual_fraction: float = 0.14

    def __post_init__(self) -> None:
        if min(self.host_bytes_per_s, self.intra_node_bytes_per_s, self.inter_node_bytes_per_s) <= 0:
            raise ValueError("transfer bandwidths must be positive")
        if not 0.0 <= self.residual_fraction <= 1.0:
            raise ValueError(f"residual_fraction must be in [0, 1], got {self.residual_fraction}")

    def total_s(self, state_bytes: float, link: Link) -> float:
        bw = {
            Link.HOST: self.host_bytes_per_s,
            Link.INTRA_NODE: self.intra_node_bytes_per_s,
            Link.INTER_NODE: self.inter_node_bytes_per_s,
        }[link]
        return self.fixed_s + state_bytes / bw

    def residual_s(self, state_bytes: float, link: Link) -> float:
        return self.fixed_s + self.residual_fraction * (self.total_s(state_bytes, link) - self.fixed_s)
