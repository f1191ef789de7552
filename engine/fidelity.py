"""The per-chunk fidelity knobs the engine runs: one setting of every speed/quality knob for one chunk.

The engine owns this type (the runtime changes a stream's fidelity at a chunk boundary); the serving
policy (engine/serving) reads profiles of these configurations and picks one per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = ("fp32", "bf16", "fp8")


@dataclass(frozen=True, slots=True)
class FidelityConfig:
    """Every per-chunk knob the engine exposes; all can change at a chunk boundary.

    ``kv_window_frames`` counts latent frames kept in the rolling KV cache (sink frames included);
    ``precision`` is the attention compute precision (fp8 = SageAttention-style online quantisation,
    weights stay bf16 so switching needs no reload); ``attention_sparsity`` is the fraction of
    attention blocks skipped; ``stream_batch`` is how many streams share one forward.
    """

    steps: int = 4
    kv_window_frames: int = 21
    resolution_scale: float = 1.0
    precision: str = "bf16"
    attention_sparsity: float = 0.0
    stream_batch: int = 1
    gpus: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.steps <= 4:
            raise ValueError(f"steps must be in 1..4, got {self.steps}")
        if self.kv_window_frames < 1:
            raise ValueError(f"kv_window_frames must be >= 1, got {self.kv_window_frames}")
        if not 0.0 < self.resolution_scale <= 1.0:
            raise ValueError(f"resolution_scale must be in (0, 1], got {self.resolution_scale}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if not 0.0 <= self.attention_sparsity < 1.0:
            raise ValueError(f"attention_sparsity must be in [0, 1), got {self.attention_sparsity}")
        if self.stream_batch < 1:
            raise ValueError(f"stream_batch must be >= 1, got {self.stream_batch}")
        if self.gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {self.gpus}")

    def label(self) -> str:
        return (
            f"S{self.steps}/W{self.kv_window_frames}/x{self.resolution_scale:g}/{self.precision}"
            f"/sp{self.attention_sparsity:g}/b{self.stream_batch}" + (f"/g{self.gpus}" if self.gpus > 1 else "")
        )
