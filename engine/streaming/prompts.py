"""Prompt blending and smooth prompt transitions.

A prompt change must not restart the stream (StreamDiffusionV2's demo restarts; we don't): only
the cross-attention K/V change, the self-attention KV cache and the VAE caches carry on. To avoid
a visible jump the new conditioning can be reached over k chunks by interpolating the text
embeddings; several prompts can be mixed with weights, linearly or by spherical interpolation
(slerp keeps the embedding norm, which linear mixing of unrelated prompts shrinks).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

BlendMode = Literal["linear", "slerp"]


def mix_weights(prompts: int, weights: Sequence[float] | None) -> list[float]:
    """The shares (sum 1) of ``prompts`` prompts mixed by ``weights`` (None: equal shares)."""
    if prompts < 1:
        raise ValueError("at least one prompt is needed")
    if weights is None:
        return [1.0 / prompts] * prompts
    if prompts != len(weights):
        raise ValueError(f"{prompts} prompts but {len(weights)} weights")
    if any(w < 0 for w in weights):
        raise ValueError(f"prompt weights must be non-negative, got {list(weights)}")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("prompt weights must not all be zero")
    return [float(w) / total for w in weights]


def _check_weights(embeddings: Sequence[torch.Tensor], weights: Sequence[float]) -> list[float]:
    shares = mix_weights(len(embeddings), weights)
    shape = embeddings[0].shape
    for e in embeddings[1:]:
        if e.shape != shape:
            raise ValueError(f"prompt embeddings differ in shape: {tuple(shape)} vs {tuple(e.shape)}")
    return shares


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


# Words that join two looks in a prompt ("pencil sketch and watercolor", "cartoon x noir", "half oil
# painting half sketch"): dropped at a cut, so each part reads as the look it names.
JOINERS = frozenset({"and", "with", "in", "&", "+", "plus", "meets", "x", "or", "half", "mix", "mixed",
                     "blend", "blended", "into", "vs", "versus", "between", "like", "of", "a", "an", "the", "style",
                     "look"})
# Longer prompts are not cut: a cut costs two text-encoder rows (a 14-word prompt's 13 cuts encode in
# ~40 ms on 2 cores, once: the encoder caches), and a sentence this long describes a scene rather than
# naming looks.
MAX_CUT_WORDS = 16
# A part of a cut names a look when it is at least MENTION_FLOOR near the look's prototype and says it
# more clearly than the whole prompt: as near as the whole prompt is to any look, or MENTION_GAIN nearer
# that look than the whole prompt is. Chosen on the embedded model's prompt lists: of the shipped
# phrasings and paraphrases and of the unrelated prompts none has such a cut (the gain alone at 0.02
# would split "watercolor painting" into watercolor and oil paint); of the prompts naming two looks
# (engine/embedded/prompt_lists/two_looks.txt) the weakest named part is at 0.63 ("thermal + cartoon").
MENTION_FLOOR = 0.6
MENTION_GAIN = 0.05


def prompt_cuts(prompt: str, max_words: int = MAX_CUT_WORDS) -> list[tuple[str, str]]:
    """Every cut of ``prompt`` into two parts at a word boundary, joining words (``JOINERS``) dropped at
    the cut: "a pencil sketch with watercolor" -> ..., ("a pencil sketch", "watercolor"), ...; none for a
    prompt of more than ``max_words`` words."""
    words = re.findall(r"[\w'-]+|[&+]", prompt.lower())
    if len(words) > max_words:
        return []
    cuts = []
    for k in range(1, len(words)):
        left, right = words[:k], words[k:]
        while left and left[-1] in JOINERS:
            left = left[:-1]
        while right and right[0] in JOINERS:
            right = right[1:]
        cut = (" ".join(left), " ".join(right))
        if left and right and cut not in cuts:
            cuts.append(cut)
    return cuts


@dataclass(frozen=True)
class LookAnchors:
    """The looks a pooled-text model was trained on, as prototype embeddings: a prompt is served as a
    blend of looks' prototypes rather than as its raw embedding.

    A small model knows only its looks: a raw paraphrase or a prompt between two looks lands somewhere
    the DiT never saw and comes out as an arbitrary mix. Anchored, a prompt that names two looks
    ("pencil sketch and watercolor": a cut of it into two parts, each saying its own look more clearly
    than the whole prompt does; see ``named``) gets half of each; otherwise a prompt near one look gets that look, a prompt
    between two gets their interpolation (slerp in the embedding the model was trained on), weighted by
    a softmax of its cosine similarities at ``temperature``. Explicit prompt weights then blend the
    anchored prompts.

    A whole prompt's embedding is near the look its words lean to, not the looks it lists: "pencil
    sketch and watercolor" is 0.71 from the pencil sketch and 0.63 from watercolor, a 95/5 blend by
    the softmax; its parts are 0.87 and 1.0 from their looks.
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

    def _similarities(self, embeddings: torch.Tensor) -> torch.Tensor:
        """[..., dim] -> cosine similarities to every look [..., looks]."""
        return torch.nn.functional.normalize(embeddings.float(), dim=-1) @ self.prototypes.float().T

    def named(self, embedding: torch.Tensor, cuts: torch.Tensor | None) -> tuple[str, str] | None:
        """The two looks a prompt names, or None. ``embedding`` [dim] is the whole prompt's, ``cuts``
        [K, 2, dim] its cuts' parts' (``prompt_cuts``; None when it has none). A cut names two looks when
        its parts are nearest to different looks, each at least ``MENTION_FLOOR`` near it, and both say
        their looks more clearly than the whole prompt does: as near as the whole prompt is to its
        nearest look, or ``MENTION_GAIN`` nearer their look than the whole prompt is. Of several such
        cuts the one whose weaker part is nearest wins."""
        if cuts is None or cuts.shape[0] == 0:
            return None
        whole = self._similarities(embedding.reshape(-1))  # [looks]
        best, index = self._similarities(cuts).max(dim=-1)  # [K, 2]
        weaker = best.min(dim=-1).values
        gain = (best - whole[index]).min(dim=-1).values
        apart = index[:, 0] != index[:, 1]
        clearer = (weaker >= whole.max()) | (gain >= MENTION_GAIN)
        ok = apart & (weaker >= MENTION_FLOOR) & clearer
        if not bool(ok.any()):
            return None
        k = int(torch.where(ok, weaker, torch.full_like(weaker, -2.0)).argmax())
        return self.names[int(index[k, 0])], self.names[int(index[k, 1])]

    def weights(self, embedding: torch.Tensor, cuts: torch.Tensor | None = None) -> list[tuple[str, float]]:
        """The two looks one prompt is served as and their blend weights (sum 1): half of each look it
        names (see ``named``), else its two nearest looks by a softmax of its similarities."""
        named = self.named(embedding, cuts)
        if named is not None:
            return [(named[0], 0.5), (named[1], 0.5)]
        top = torch.topk(self._similarities(embedding.reshape(-1)), 2)
        w = torch.softmax(top.values / self.temperature, dim=0)
        return [(self.names[int(i)], float(wi)) for i, wi in zip(top.indices, w, strict=True)]

    def anchor(self, embeddings: torch.Tensor, cuts: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
        """[N, dim] prompt embeddings (and each one's cuts, as ``named`` takes them) -> [N, dim] blends of
        the looks each is served as."""
        index = {n: i for i, n in enumerate(self.names)}
        rows = []
        for i, e in enumerate(embeddings):
            (a, _), (b, wb) = self.weights(e, cuts[i] if cuts is not None else None)
            rows.append(slerp(self.prototypes[index[a]].float(), self.prototypes[index[b]].float(), wb))
        return torch.stack(rows).to(embeddings.dtype)


def seconds_to_chunks(seconds: float, chunk_seconds: float) -> int:
    """The chunks a transition of ``seconds`` takes at ``chunk_seconds`` per chunk (0: a cut). Rounded up,
    so a short transition that is asked for still moves over at least one chunk rather than cutting."""
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"a transition's length must be a finite number of seconds >= 0, got {seconds}")
    if not math.isfinite(chunk_seconds) or chunk_seconds <= 0:
        raise ValueError(f"a chunk's duration must be a positive number of seconds, got {chunk_seconds}")
    # The tolerance keeps a length that is a whole number of chunks (0.75 s at 0.25 s) from rounding up.
    return math.ceil(seconds / chunk_seconds - 1e-9)


@dataclass
class PromptTransition:
    """Moves the conditioning from ``source`` to ``target`` over ``chunks`` chunks, and with it, where
    given, the LoRA strengths (``loras_source`` to ``loras_target``, linearly; a LoRA absent from one
    side is at 0 there) and the noise strength (``noise_source`` to ``noise_target``), so a look's text,
    LoRAs and noise arrive together."""

    source: torch.Tensor
    target: torch.Tensor
    chunks: int
    mode: BlendMode = "slerp"
    done: int = 0
    loras_source: dict[str, float] = field(default_factory=dict)
    loras_target: dict[str, float] | None = None  # None: the transition leaves the LoRA strengths alone
    noise_source: float | None = None
    noise_target: float | None = None  # None: the transition leaves the noise strength alone

    def __post_init__(self) -> None:
        if self.chunks < 1:
            raise ValueError("a transition takes at least one chunk")
        if (self.noise_source is None) != (self.noise_target is None):
            raise ValueError("a noise transition needs both its source and its target")

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

    def loras(self) -> dict[str, float] | None:
        """LoRA strengths of the chunk :meth:`next_embedding` last gave (zeros dropped), or None when the
        transition does not move them; the last chunk uses the target exactly."""
        if self.loras_target is None:
            return None
        if self.finished:
            return dict(self.loras_target)
        t = self.done / self.chunks
        names = sorted(self.loras_source.keys() | self.loras_target.keys())
        mixed = {n: (1 - t) * self.loras_source.get(n, 0.0) + t * self.loras_target.get(n, 0.0) for n in names}
        return {n: s for n, s in mixed.items() if s != 0.0}

    def noise_scale(self, ahead: int = 0) -> float | None:
        """Noise strength of the chunk :meth:`next_embedding` last gave (``ahead`` 1: of the chunk it gives
        next, which the motion-aware controller needs before the chunk begins), or None when the
        transition does not move it."""
        if self.noise_source is None or self.noise_target is None:
            return None
        done = min(self.done + ahead, self.chunks)
        if done >= self.chunks:
            return self.noise_target
        t = done / self.chunks
        return (1 - t) * self.noise_source + t * self.noise_target
