"""Everything one live stream owns, as one object that can be moved, offloaded and serialised.

Moving a stream between workers, suspending it to host memory, or checkpointing it all go through
this object; the next chunks after a round trip are bit-identical because every piece of state
(caches, RNG, controller memory, counters) travels with it.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.fidelity import FidelityConfig
from engine.models.wan_dit import KVCache, PromptCache
from engine.sampling import NoiseSource
from engine.streaming.noise import NoiseControllerState
from engine.streaming.prompts import PromptTransition
from engine.streaming.stabilizer import StabilizerState


@dataclass
class StreamState:
    stream_id: str
    fidelity: FidelityConfig
    size: tuple[int, int]  # (width, height) of the stream's frames (outputs come out at it)
    embedding: torch.Tensor  # current text conditioning [1, L, text_dim]
    prompt: PromptCache  # cross-attention K/V of ``embedding``
    noise: NoiseSource  # lives on CPU so a stream's noise is the same on every worker
    vae_encoder: Any
    vae_decoder: Any
    kv: list[KVCache] = field(default_factory=list)  # clean mode: one; per-step mode: one per step
    transition: PromptTransition | None = None
    noise_controller: NoiseControllerState = field(default_factory=NoiseControllerState)
    noise_scale: float = 0.8  # the user's noise strength (s_max of the motion-aware controller)
    force_sink_refresh: bool = False  # set by a prompt switch: re-anchor one sink on the next chunk
    frame: int = 0  # absolute latent frame index of the next chunk
    rope_frame: int = 0  # temporal RoPE position of the next chunk (wraps with RoPE refresh)
    chunks: int = 0
    sink_refreshes: int = 0
    rope_resets: int = 0
    last_noise_rate: float = 0.0
    last_first_timestep: float = 0.0
    last_sink_refresh: bool = False
    stabilize: bool = True  # the user's switch; the runtime stabilises only if its config has a stabilizer
    stabilizer: StabilizerState = field(default_factory=StabilizerState)
    restart_stabilizer: bool = False  # set by a hard prompt switch: the next chunk starts a fresh history
    # (width, height) the model runs at that the caches hold (KV, VAE, noise controller's last frame);
    # None until the first chunk fixes it. A fidelity with another engine size rescales them (rescale.py).
    engine_size: tuple[int, int] | None = None
    loras: dict[str, float] = field(default_factory=dict)  # strength of each loaded LoRA it uses (others 0)
    # The size follows the first chunk's aspect at ``size``'s pixel budget (StreamRuntime.adopt_input_size);
    # cleared once the first chunk fixed it.
    fit_input: bool = False

    def take_stabilizer_restart(self) -> bool:
        """Whether the chunk entering now starts a fresh stabilizer history (a hard prompt switch before it)."""
        restart, self.restart_stabilizer = self.restart_stabilizer, False
        return restart

    def to(self, device: torch.device | str) -> StreamState:
        """A copy with every tensor on ``device`` (e.g. "cpu" to offload to host memory)."""
        copy: StreamState = map_tensors(self, lambda t: t.to(device, copy=True))
        return copy

    def nbytes(self) -> int:
        sizes: list[int] = []

        def count(t: torch.Tensor) -> torch.Tensor:
            sizes.append(t.numel() * t.element_size())
            return t

        map_tensors(self, count)
        return sum(sizes)

    def to_bytes(self) -> bytes:
        """Serialise (tensors on CPU). Only for our own workers: the format is a torch pickle."""
        return pack(self)

    @staticmethod
    def from_bytes(data: bytes, device: torch.device | str = "cpu") -> StreamState:
        state = unpack(data, device)
        if not isinstance(state, StreamState):
            raise ValueError(f"serialised data holds a {type(state).__name__}, not a StreamState")
        return state

    def __getstate__(self) -> dict[str, Any]:
        # torch.Generator does not pickle; its state does.
        fields = dict(self.__dict__)
        fields["noise"] = self.noise.state_dict()
        return fields

    def __setstate__(self, fields: dict[str, Any]) -> None:
        fields = dict(fields)
        fields["noise"] = NoiseSource.from_state_dict(fields["noise"])
        self.__dict__.update(fields)


def pack(obj: Any) -> bytes:
    """A stream's state, or a tuple holding it and a chunk in flight, as bytes in host memory (the
    tensors copied to the CPU). Objects that share the state keep sharing it after :func:`unpack`."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def unpack(data: bytes, device: torch.device | str = "cpu") -> Any:
    """The inverse of :func:`pack`, with every tensor on ``device``; bit-identical."""
    obj = torch.load(io.BytesIO(data), weights_only=False, map_location=device)
    return obj


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor inside dataclasses, lists, tuples and dicts (rebuilding them)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, NoiseSource):
        # A copy, never a shared generator; it stays on CPU so the noise is the same on every worker.
        return NoiseSource.from_state_dict(obj.state_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, list):
        return [map_tensors(x, fn) for x in obj]
    if isinstance(obj, tuple):
        return tuple(map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj
