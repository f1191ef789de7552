"""Prompt blending and smooth prompt transitions.

A prompt change must not restart the stream (StreamDiffusionV2's demo restarts; we don't): only
the cross-attention K/V change, the self-attention KV cache and the VAE caches carry on. To avoid
a visible jump the new conditioning can be reached over k chunks by interpolating the text
embeddings; several prompts can be mixed with weights, linearly or by spherical interpolation
(slerp keeps the embedding norm, which linear mixing of unrelated prompts shrinks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

BlendMode = Literal["linear", "slerp"]


def _check_weights(embeddings: Sequence[torch.Tensor], weights: Sequence[float]) -> list[float]:
    if not embeddings:
        raise ValueError("at least one prompt embedding is needed")
    if len(embeddings) != len(weights):
        raise ValueError(f"{len(embeddings)} prompts but {len(weights)} weights")
    if any(w < 0 for w in weights):
        raise ValueError(f"prompt weights must be non-negative, got {list(weights)}")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("prompt weights must not all be zero")
    shape = embeddings[0].shape
    for e in embeddings[1:]:
        if e.shape != shape:
            raise ValueError(f"prompt embeddings differ in shape: {tuple(shape)} vs {tuple(e.shape)}")
    return [float(w) / total for w in weights]


def slerp(a: torch.Tensor, b: torch.Tensor, t: float) -> torch.Tensor:
    """Spherical interpolation between two embeddings (over the flattened tensor), norm interpolated."""
    a64, b64 = a.double().flatten(), b.double().flatten()
    na, nb = a64.norm(), b64.norm()
    if na < 1e-12 or nb < 1e-12:
        return torch.lerp(a.double(), b.double(), t).to(a.dtype)
    ua, ub = a64 / na, b64 / nb
    cos = torch.clamp(torch.dot(ua, ub), -1.0, 1.0)
    omega = torch.arccos(cos)
    if omega.item() < 1e-6:
        direction = torch.lerp(ua, ub, t)
    else:
        so = torch.sin(omega)
        direction = (torch.sin((1 - t) * omega) / so) * ua + (torch.sin(t * omega) / so) * ub
    norm = (1 - t) * na + t * nb
    return (direction * norm).reshape(a.shape).to(a.dtype)


def blend(embeddings: Sequence[torch.Tensor], weights: Sequence[float], mode: BlendMode = "linear") -> torch.Tensor:
    """Weighted mix of prompt embeddings. Slerp of several prompts folds them in one at a time."""
    w = _check_weights(embeddings, weights)
    if mode == "linear":
        out = torch.zeros_like(embeddings[0], dtype=torch.float64)
        for e, wi in zip(embeddings, w, strict=True):
            out += wi * e.double()
        return out.to(embeddings[0].dtype)
    if mode != "slerp":
        raise ValueError(f"unknown blend mode {mode!r}; use 'linear' or 'slerp'")
    acc, acc_w = embeddings[0], w[0]
    for e, wi in zip(embeddings[1:], w[1:], strict=True):
        if wi == 0:
            continue
        acc_w += wi
        acc = slerp(acc, e, wi / acc_w)
    return acc


@dataclass(frozen=True)
class LookAnchors:
    """The looks a pooled-text model was trained on, as prototype embeddings: a prompt is served as a
    blend of its two nearest looks' prototypes rather than as its raw embedding.

    A small model knows only its looks: a raw paraphrase or a prompt between two looks lands somewhere
    the DiT never saw and comes out as an arbitrary mix. Anchored, a prompt near one look gets that look,
    a prompt between two gets their interpolation (slerp in the embedding the model was trained on),
    weighted by a softmax of its cosine similarities at ``temperature``; explicit prompt weights then
    blend the anchored prompts.
    """

    names: tuple[str, ...]
    prototypes: torch.Tensor  # [looks, dim], L2-normalised
    temperature: float

    def __post_init__(self) -> None:
        if self.prototypes.shape[0] != len(self.names) or len(self.names) < 2:
            raise ValueError(f"need at least 2 looks with one prototype each, got {len(self.names)} names for "
                             f"{self.prototypes.shape[0]} prototypes")
        if not self.temperature > 0:
            raise ValueError(f"look temperature must be positive, got {self.temperature}")

    def weights(self, embedding: torch.Tensor) -> list[tuple[str, float]]:
        """The two nearest looks of one normalised embedding [dim] and their blend weights (sum 1)."""
        sims = self.prototypes.float() @ torch.nn.functional.normalize(embedding.float().reshape(-1), dim=0)
        top = torch.topk(sims, 2)
        w = torch.softmax(top.values / self.temperature, dim=0)
        return [(self.names[int(i)], float(wi)) for i, wi in zip(top.indices, w, strict=True)]

    def anchor(self, embeddings: torch.Tensor) -> torch.Tensor:
        """[N, dim] prompt embeddings -> [N, dim] blends of each one's two nearest prototypes."""
        index = {n: i for i, n in enumerate(self.names)}
        rows = []
        for e in embeddings:
            (a, _), (b, wb) = self.weights(e)
            rows.append(slerp(self.prototypes[index[a]].float(), self.prototypes[index[b]].float(), wb))
        return torch.stack(rows).to(embeddings.dtype)


@dataclass
class PromptTransition:
    """Moves the conditioning from ``source`` to ``target`` over ``chunks`` chunks."""

    source: torch.Tensor
    target: torch.Tensor
    chunks: int
    mode: BlendMode = "slerp"
    done: int = 0

    def __post_init__(self) -> None:
        if self.chunks < 1:
            raise ValueError("a transition takes at least one chunk")

    @property
    def finished(self) -> bool:
        return self.done >= self.chunks

    def next_embedding(self) -> torch.Tensor:
        """Embedding for the next chunk; the last chunk of the transition uses the target exactly."""
        self.done = min(self.done + 1, self.chunks)
        t = self.done / self.chunks
        if t >= 1.0:
            return self.target
        if self.mode == "slerp":
            return slerp(self.source, self.target, t)
        return torch.lerp(self.source.double(), self.target.double(), t).to(self.source.dtype)

