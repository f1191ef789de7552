"""Everything one live stream owns, as one object that can be moved, offloaded and serialised.

Moving a stream between workers or parking it in host memory go through this object (as a `Parcel`,
engine/streaming/parcel.py); the next chunks after a round trip are bit-identical because every piece
of state (caches, RNG, controller memory, counters) travels with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
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

    def nbytes(self) -> int:
        """Bytes of every tensor the state holds (what parking it copies; views counted whole)."""
        return sum(t.numel() * t.element_size() for t in tensors_in(self))

    def nbytes_by_part(self) -> dict[str, int]:
        """:meth:`nbytes` split by what holds it: ``kv`` (every KV cache: one per denoising step in
        per-step mode), ``prompt`` (cross-attention K/V), ``embedding``, ``vae_encoder``, ``vae_decoder``,
        and ``other`` (stabilizer history, motion controller, prompt transition)."""
        parts = {"kv": self.kv, "prompt": self.prompt, "embedding": self.embedding,
                 "vae_encoder": self.vae_encoder, "vae_decoder": self.vae_decoder}
        out = {name: sum(t.numel() * t.element_size() for t in tensors_in(part)) for name, part in parts.items()}
        out["other"] = self.nbytes() - sum(out.values())
        return out


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside dataclasses, lists, tuples and dicts."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, f.name))
    elif isinstance(obj, list | tuple):
        for x in obj:
            yield from tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tensors_in(x)
