"""How many stream states one worker's device holds: the admission side of GPU memory.

A stream's state (KV caches, prompt K/V, VAE caches) lives on the worker's device while it is resident;
each chunk also takes a workspace (activations) for as long as it runs. The first H100 run held 57 GB of
80 with four streams at 2 steps, and nothing counted it: a fifth or sixth stream would have met a CUDA
out-of-memory error mid-stream. Here the free memory after the model loaded, less the largest workspace
the profile measured, divided by the largest state any point the policy may pick keeps, is the number
of state slots: the policy parks states beyond them in host memory (eviction), and refuses a stream at
admission where no state could be resident or, on an engine that cannot park, where all are taken.

Pure arithmetic (no torch): the executor measures the free bytes, the profile gives the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.serving.profile import FidelityProfile

GIB = 1024**3
# Of the free bytes, what states and workspace may take: the rest absorbs allocator fragmentation and
# the few tensors a chunk makes that no profile point measured (a prompt switch's K/V, a rescale).
USABLE_SHARE = 0.9


@dataclass(frozen=True)
class DeviceMemory:
    """One worker's device: bytes free for streams once the model is loaded, and what one stream's state
    and one chunk's workspace take there (the profile's largest, over the points it may route to)."""

    free_bytes: float
    state_bytes: float
    workspace_bytes: float = 0.0

    def __post_init__(self) -> None:
        if not (self.free_bytes >= 0 and self.state_bytes >= 0 and self.workspace_bytes >= 0):
            raise ValueError(f"memory figures must be non-negative numbers, got {self}")

    @classmethod
    def for_profile(cls, free_bytes: float, profile: FidelityProfile) -> DeviceMemory:
        points = profile.per_stream()
        return cls(free_bytes, max((p.state_bytes for p in points), default=0.0),
                   max((p.workspace_bytes for p in points), default=0.0))

    @property
    def slots(self) -> int | None:
        """Stream states that fit at once; None where the profile does not say how big a state is."""
        if self.state_bytes <= 0:
            return None
        room = USABLE_SHARE * self.free_bytes - self.workspace_bytes
        return max(0, int(room // self.state_bytes))

    def describe(self) -> str:
        return (f"{self.slots} stream states of {self.state_bytes / GIB:.2f} GiB in {self.free_bytes / GIB:.1f} GiB "
                f"free (less {self.workspace_bytes / GIB:.2f} GiB for a chunk's work)")
