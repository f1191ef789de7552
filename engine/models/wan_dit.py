"""Causal Wan 2.1 text-to-video diffusion transformer (CausVid / Self-Forcing / StreamDiffusionV2 lineage).

One self-contained modeling file. The network is Wan 2.1 T2V exactly (parameter names follow the original
Wan checkpoints, so weights load without renaming); what makes it causal:

* per-frame timesteps ``[B, F]`` -> per-frame modulation (tokens of frame f use frame f's e0);
* block-causal self-attention: chunk-by-chunk generation with a :class:`KVCache` (keys cached after RoPE),
  with a rolling window whose first ``sink_frames`` frames stay pinned;
* :meth:`CausalWanDiT.forward_masked`, one forward over all frames with the equivalent attention mask,
  which is the independent reference the cached path must reproduce;
* temporal RoPE positions decoupled from cache positions (``rope_start``), per sample, so the runtime can
  wrap positions (RoPE reset) and batch streams that sit at different positions;
* cross-attention K/V of the prompt computed once per prompt (:class:`PromptCache`);
* optional block-sparse cached attention (``sparsity``): each query frame attends to the sinks, its chunk
  and only the best-scoring blocks of the other cached keys, gathered into smaller K/V (:class:`SparseLayout`).

Token order is frame, row, column. Shapes: latents ``[B, C, F, H, W]``; attention tensors ``[B, S, heads,
head_dim]`` (flash-attn's layout, so cached buffers feed it without copies).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.models.fp8 import FP8_DTYPE, Fp8Linear, quantize_rows

try:  # flash-attn exists only on GPU machines; SDPA is the portable path.
    from flash_attn import flash_attn_func as _flash_attn_func
except ImportError:  # pragma: no cover - depends on the machine
    _flash_attn_func = None


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WanDiTConfig:
    dim: int = 1536
    ffn_dim: int = 8960
    num_heads: int = 12
    num_layers: int = 30
    in_channels: int = 16
    out_channels: int = 16
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 4096
    text_len: int = 512
    freq_dim: int = 256
    eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_max_positions: int = 1024

    def __post_init__(self) -> None:
        problems = []
        if self.dim % self.num_heads:
            problems.append(f"dim {self.dim} is not divisible by num_heads {self.num_heads}")
        elif self.head_dim % 2 or self.head_dim < 6:
            problems.append(f"head_dim {self.head_dim} must be even and >= 6 for the 3D RoPE split")
        if len(self.patch_size) != 3 or self.patch_size[0] != 1:
            # A temporal patch > 1 would mix frames inside one token, which breaks frame-wise causality.
            problems.append(f"patch_size must be (1, ph, pw), got {self.patch_size}")
        if self.freq_dim % 2:
            problems.append(f"freq_dim {self.freq_dim} must be even ([cos | sin] halves)")
        if problems:
            raise ValueError("invalid WanDiTConfig: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def rope_split(self) -> tuple[int, int, int]:
        """Widths of the (frame, row, column) parts of a head (Wan: 44/42/42 for head_dim 128)."""
        d = self.head_dim
        return d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)

    def frame_tokens(self, height: int, width: int) -> int:
        """Tokens per latent frame for a latent of ``height x width``."""
        return (height // self.patch_size[1]) * (width // self.patch_size[2])


CONFIGS: dict[str, WanDiTConfig] = {
    "wan-1.3b": WanDiTConfig(),
    # Wan2.1-T2V-14B's config.json: dim 5120, ffn 13824, 40 heads of 128, 40 layers.
    "wan-14b": WanDiTConfig(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40),
    # Test/CI model: 2 layers, head_dim 32 (RoPE split 12/10/10), 16 latent channels like the Wan VAE,
    # text_dim 384 so the embedded MiniLM text encoder plugs in directly; 16x16 latents -> 64 tokens/frame.
    "tiny": WanDiTConfig(
        dim=64,
        ffn_dim=128,
        num_heads=2,
        num_layers=2,
        text_dim=384,
        text_len=32,
        freq_dim=64,
    ),
}


# --------------------------------------------------------------------------------------------------
# Caches: plain dataclasses of tensors, movable between devices, serialisable, batchable by rows.
# --------------------------------------------------------------------------------------------------

_C = TypeVar("_C", bound="_LayerKV")


@dataclass
class _LayerKV:
    """Per-block key/value tensors ``[B, S, heads, head_dim]``; row ops shared by both caches."""

    k: list[Tensor]
    v: list[Tensor]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def buffer_lists(self) -> dict[str, list[Tensor]]:
        """Every per-layer tensor list by field name, each tensor ``[B, S, heads, *]`` in token order, so an
        operation along the batch or token axis applies to all of them alike."""
        return {"k": self.k, "v": self.v}

    def map_buffers(self: _C, fn: Callable[[Tensor], Tensor], **changes: Any) -> _C:
        """A copy with every tensor of :meth:`buffer_lists` through ``fn`` (and ``changes`` to other fields)."""
        lists = {name: [fn(t) for t in tensors] for name, tensors in self.buffer_lists().items()}
        return dataclasses.replace(self, **lists, **changes)

    def to(self: _C, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> _C:
        """A copy on ``device`` / in ``dtype`` (e.g. offload to host memory and back)."""
        return self.map_buffers(lambda t: t.to(device=device, dtype=dtype, copy=True))

    def _tensor_items(self) -> dict[str, Tensor]:
        return {f"{name}.{i}": t for name, tensors in self.buffer_lists().items() for i, t in enumerate(tensors)}

    @staticmethod
    def _layer_lists(state: dict[str, Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        n = sum(1 for key in state if key.startswith("k."))
        return [state[f"k.{i}"] for i in range(n)], [state[f"v.{i}"] for i in range(n)]


@dataclass
class PromptCache(_LayerKV):
    """Cross-attention keys/values of one prompt per row, for every block ``[B, text_len, heads, head_dim]``.

    Computed once by :meth:`CausalWanDiT.encode_prompt`; a new prompt is a new PromptCache.
    """

    def state_dict(self) -> dict[str, Tensor]:
        return self._tensor_items()

    @classmethod
    def from_state_dict(cls, state: dict[str, Tensor]) -> PromptCache:
        return cls(*cls._layer_lists(state))

    def select_rows(self, rows: Sequence[int] | Tensor) -> PromptCache:
        idx = _row_index(rows, self.k[0].device)
        return self.map_buffers(lambda t: t.index_select(0, idx))

    @classmethod
    def concat(cls, caches: Sequence[PromptCache]) -> PromptCache:
        if not caches:
            raise ValueError("PromptCache.concat needs at least one cache")
        n = caches[0].num_layers
        return cls(
            [torch.cat([c.k[i] for c in caches]) for i in range(n)],
            [torch.cat([c.v[i] for c in caches]) for i in range(n)],
        )

    def split(self, sizes: Sequence[int] | None = None) -> list[PromptCache]:
        """Split rows into consecutive groups (default: one cache per row)."""
        bounds = _split_bounds(self.batch_size, sizes)
        return [self.select_rows(list(range(a, b))) for a, b in bounds]


@dataclass
class KVCache(_LayerKV):
    """Self-attention key/value cache of a causal generation, per block ``[B, window*frame_tokens, heads, hd]``.

    Bookkeeping is in latent frames. ``global_end[b]`` is the absolute index (one past the last frame) of
    what row b has written; ``local_end`` is the number of buffer frames in use (the same for every row:
    rows of one cache must share a fill level so one forward serves them all). Buffer layout: positions
    ``[0, sink_frames)`` hold absolute frames ``[0, sink_frames)`` once written; positions
    ``[sink_frames, local_end)`` hold the most recent frames before ``global_end``, oldest first. Keys are
    stored after RoPE rotation, so they keep the position they were written with.

    Stored in fp8 (precision fp8-kv), the buffers hold float8 e4m3 values and ``k_scale``/``v_scale`` one
    float32 scale per token and head, ``[B, S, heads, 1]`` (value = fp8 * scale, scale = amax / 448 over
    the head's channels, :func:`engine.models.fp8.quantize_rows`). The scales sit in the buffers' token
    layout and are in :meth:`buffer_lists`, so every operation on tokens or rows (eviction, sink copies,
    row selection and concatenation, window resizes, offloading, parking, shipping blocks between
    pipeline ranks) carries a token's scale with its values. Otherwise the scale lists are empty.
    :meth:`write` quantises, :meth:`attended` dequantises; ``to(dtype=...)`` converts between the two.
    """

    frame_tokens: int
    window_frames: int
    sink_frames: int
    global_end: list[int]
    local_end: int = 0
    k_scale: list[Tensor] = dataclasses.field(default_factory=list)
    v_scale: list[Tensor] = dataclasses.field(default_factory=list)

    def buffer_lists(self) -> dict[str, list[Tensor]]:
        return {"k": self.k, "v": self.v, "k_scale": self.k_scale, "v_scale": self.v_scale}

    @property
    def dtype(self) -> torch.dtype:
        """How the keys and values are stored: ``float8_e4m3fn`` (with scales) or a float dtype."""
        return self.k[0].dtype

    @property
    def fp8(self) -> bool:
        return self.dtype == FP8_DTYPE

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> KVCache:
        """A copy on ``device`` stored in ``dtype``: ``float8_e4m3fn`` quantises (a scale per token and
        head), a float dtype from fp8 dequantises; between float dtypes a cast."""
        moved = self.map_buffers(lambda t: t.to(device=device, copy=True))
        if dtype is None or dtype == self.dtype:
            return moved
        if dtype == FP8_DTYPE:
            pairs = [quantize_rows(t) for t in (*moved.k, *moved.v)]
            n = self.num_layers
            q, scales = [p[0] for p in pairs], [p[1] for p in pairs]
            return dataclasses.replace(moved, k=q[:n], v=q[n:], k_scale=scales[:n], v_scale=scales[n:])
        if self.fp8:
            return dataclasses.replace(moved, k=_dequantized(moved.k, moved.k_scale, dtype),
                                       v=_dequantized(moved.v, moved.v_scale, dtype), k_scale=[], v_scale=[])
        return moved.map_buffers(lambda t: t.to(dtype))

    # -- what a forward reads and writes ---------------------------------------------------------------

    def write(self, layer: int, start: int, end: int, k: Tensor, v: Tensor) -> None:
        """Store block ``layer``'s keys and values ``[B, end - start, heads, hd]`` at buffer tokens
        ``[start, end)`` (quantised, with their scales, in fp8)."""
        for buf, scales, new in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            if self.fp8:
                q, scale = quantize_rows(new)
                buf[layer][:, start:end] = q
                scales[layer][:, start:end] = scale
            else:
                buf[layer][:, start:end] = new.to(buf[layer].dtype)

    def attended(self, layer: int, end: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Block ``layer``'s keys and values of buffer tokens ``[0, end)`` in ``dtype`` (dequantised in fp8)."""
        if self.fp8:
            k = _dequantized([self.k[layer][:, :end]], [self.k_scale[layer][:, :end]], dtype)[0]
            v = _dequantized([self.v[layer][:, :end]], [self.v_scale[layer][:, :end]], dtype)[0]
            return k, v
        return self.k[layer][:, :end].to(dtype), self.v[layer][:, :end].to(dtype)

    # -- write planning --------------------------------------------------------------------------

    def reserve(self, start_frames: Sequence[int], num_frames: int) -> tuple[int, int]:
        """Make room for frames ``[start, start + num_frames)`` per row; returns their buffer token slice.

        Writing at an already written start overwrites the same slots (denoising steps of a chunk, then the
        clean pass). Writing past ``global_end`` appends; when the buffer is full the oldest non-sink frames
        are evicted (rolled out) first. Every block then writes its keys/values into the returned slice and
        attends to buffer tokens ``[0, end)``.
        """
        if len(start_frames) != self.batch_size:
            raise ValueError(f"got {len(start_frames)} start frames for a cache of {self.batch_size} rows")
        offsets = {s - g for s, g in zip(start_frames, self.global_end, strict=True)}
        if len(offsets) != 1:
            raise ValueError(
                "rows of one forward must write at the same offset from their cache end: "
                f"start_frames={list(start_frames)}, global_end={self.global_end}"
            )
        offset = offsets.pop()
        if offset > 0:
            raise ValueError(
                f"start frame leaves a gap: writing at {list(start_frames)} but the cache ends at {self.global_end}"
            )
        if num_frames > self.window_frames - self.sink_frames:
            raise ValueError(
                f"a write of {num_frames} frames does not fit a {self.window_frames}-frame window with "
                f"{self.sink_frames} sink frames"
            )
        for g in self.global_end:
            # Rewritten frames must still be in the buffer, and after eviction only the recent
            # (non-sink) run is contiguous with the end.
            present = self.local_end if g == self.local_end else self.local_end - self.sink_frames
            if -offset > present:
                raise ValueError(
                    f"cannot rewrite from frame {g + offset}: the cache (end {g}) holds only the last "
                    f"{present} contiguous frames"
                )
        new_frames = max(0, offset + num_frames)
        evict = max(0, self.local_end + new_frames - self.window_frames)
        if evict:
            self._evict(evict)
        self.local_end += new_frames
        self.global_end = [g + new_frames for g in self.global_end]
        start_pos = self.local_end - (new_frames - offset)
        return start_pos * self.frame_tokens, (start_pos + num_frames) * self.frame_tokens

    def _evict(self, frames: int) -> None:
        t = self.frame_tokens
        keep_from, keep_to = self.sink_frames + frames, self.local_end
        dst = self.sink_frames * t
        n = (keep_to - keep_from) * t
        for buf in self._buffers():
            # clone: source and destination ranges overlap.
            buf[:, dst : dst + n] = buf[:, keep_from * t : keep_to * t].clone()
        self.local_end -= frames

    def _buffers(self) -> Iterator[Tensor]:
        return (t for tensors in self.buffer_lists().values() for t in tensors)

    # -- per-frame access (adaptive sinks) --------------------------------------------------------

    def copy_frame(self, source: int, target: int) -> None:
        """Copy buffer frame ``source`` over frame ``target`` (e.g. the newest frame over a sink) in every
        block, bit for bit (in fp8 with its scales; keys keep the rotation they were written with)."""
        src, dst = self._frame_slice(source), self._frame_slice(target)
        for buf in self._buffers():
            buf[:, dst] = buf[:, src].clone()

    def frame_means(self) -> tuple[Tensor, Tensor]:
        """Mean key and value of each filled buffer frame: two ``[layers, B, local_end, heads, hd]`` tensors."""
        n, t = self.local_end, self.frame_tokens

        def means(bufs: list[Tensor], scales: list[Tensor]) -> Tensor:
            filled = [b[:, : n * t] for b in bufs]
            if self.fp8:
                filled = _dequantized(filled, [s[:, : n * t] for s in scales], torch.float32)
            return torch.stack([b.unflatten(1, (n, t)).float().mean(2) for b in filled])

        return means(self.k, self.k_scale), means(self.v, self.v_scale)

    def _frame_slice(self, position: int) -> slice:
        if not 0 <= position < self.local_end:
            raise IndexError(f"frame position {position} outside the filled buffer [0, {self.local_end})")
        return slice(position * self.frame_tokens, (position + 1) * self.frame_tokens)

    # -- serialisation and rows --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Tensor]:
        out = self._tensor_items()
        out["meta"] = torch.tensor([self.frame_tokens, self.window_frames, self.sink_frames, self.local_end])
        out["global_end"] = torch.tensor(self.global_end, dtype=torch.long)
        return out

    @classmethod
    def from_state_dict(cls, state: dict[str, Tensor]) -> KVCache:
        frame_tokens, window, sink, local_end = (int(x) for x in state["meta"].tolist())
        k, v = cls._layer_lists(state)
        scales = [[state[f"{name}.{i}"] for i in range(len(k)) if f"{name}.{i}" in state]
                  for name in ("k_scale", "v_scale")]
        return cls(k, v, frame_tokens, window, sink, [int(g) for g in state["global_end"].tolist()], local_end,
                   *scales)

    def select_rows(self, rows: Sequence[int] | Tensor) -> KVCache:
        idx = _row_index(rows, self.k[0].device)
        ends = [self.global_end[i] for i in idx.tolist()]
        return self.map_buffers(lambda t: t.index_select(0, idx), global_end=ends)

    @classmethod
    def concat(cls, caches: Sequence[KVCache]) -> KVCache:
        """Stack caches with the same geometry and fill level into one batch (rows in order)."""
        if not caches:
            raise ValueError("KVCache.concat needs at least one cache")
        first = caches[0]

        def shape(c: KVCache) -> tuple[int, int, int, int, torch.dtype]:
            return c.frame_tokens, c.window_frames, c.sink_frames, c.local_end, c.dtype

        for c in caches[1:]:
            if shape(c) != shape(first):
                raise ValueError(
                    f"KVCache.concat needs equal frame_tokens/window/sink/fill level/storage, got {shape(first)} "
                    f"and {shape(c)}"
                )

        def cat(lists: Sequence[list[Tensor]]) -> list[Tensor]:  # one list per cache -> one per layer
            return [torch.cat(layer) for layer in zip(*lists, strict=True)]

        return dataclasses.replace(first, k=cat([c.k for c in caches]), v=cat([c.v for c in caches]),
                                   k_scale=cat([c.k_scale for c in caches]), v_scale=cat([c.v_scale for c in caches]),
                                   global_end=[g for c in caches for g in c.global_end])

    def split(self, sizes: Sequence[int] | None = None) -> list[KVCache]:
        """Split rows back into consecutive groups (default: one cache per row)."""
        bounds = _split_bounds(self.batch_size, sizes)
        return [self.select_rows(list(range(a, b))) for a, b in bounds]


def _dequantized(values: Sequence[Tensor], scales: Sequence[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """fp8 ``values`` times their ``scales`` in float32 (one rounding to ``dtype`` at the end)."""
    return [(q.float() * s).to(dtype) for q, s in zip(values, scales, strict=True)]


def _row_index(rows: Sequence[int] | Tensor, device: torch.device) -> Tensor:
    return torch.as_tensor(rows, dtype=torch.long).reshape(-1).to(device)


def _split_bounds(total: int, sizes: Sequence[int] | None) -> list[tuple[int, int]]:
    sizes = [1] * total if sizes is None else list(sizes)
    if sum(sizes) != total or min(sizes, default=1) < 1:
        raise ValueError(f"split sizes {sizes} do not partition {total} rows")
    bounds, start = [], 0
    for s in sizes:
        bounds.append((start, start + s))
        start += s
    return bounds


# --------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------


ATTENTION_BACKENDS = ("auto", "flash-attn", "sdpa", "reference")
_attention_choice: ContextVar[str] = ContextVar("attention_backend", default="auto")


@contextlib.contextmanager
def attention_backend(name: str) -> Iterator[None]:
    """Run :func:`attention` with one implementation inside the block (correctness comparisons);
    ``"auto"`` (the default) is the fastest one the inputs allow."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    token = _attention_choice.set(name)
    try:
        yield
    finally:
        _attention_choice.reset(token)


def attention_kernel(q: Tensor, mask: Tensor | None = None) -> str:
    """The implementation :func:`attention` runs for queries like ``q``: flash-attn where it is installed and
    can take the call (CUDA, fp16/bf16, no mask: the KV-cached path), else torch's SDPA, which picks its own
    fused kernel (flash / memory-efficient with a mask on CUDA, a fused CPU kernel or the math one elsewhere).
    SDPA exists in every torch this project supports, so "reference" runs only when asked for."""
    flash_ok = mask is None and _flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    chosen = _attention_choice.get()
    if chosen == "auto":
        return "flash-attn" if flash_ok else "sdpa"
    if chosen == "flash-attn" and not flash_ok:
        raise RuntimeError(
            "flash-attn cannot run this call: it needs the flash_attn package, a CUDA tensor in fp16/bf16 and no "
            f"mask (installed: {_flash_attn_func is not None}, device {q.device}, {q.dtype}, mask: {mask is not None})"
        )
    return chosen


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """Softmax attention on ``[B, S, heads, hd]`` tensors; ``mask`` is bool ``[Sq, Sk]``, True = visible."""
    kernel = attention_kernel(q, mask)
    if kernel == "flash-attn":
        assert _flash_attn_func is not None  # attention_kernel checked it
        return cast(Tensor, _flash_attn_func(q, k, v))
    if kernel == "reference":
        return reference_attention(q, k, v, mask)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


def reference_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """``softmax(q k^T / sqrt(hd)) v`` written out in float32: the check the fused kernels are held to."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.float()).to(q.dtype)


def sinusoidal_embedding(t: Tensor, dim: int) -> Tensor:
    """Wan's timestep sinusoid ``[cos | sin]`` with w_i = 10000^(-i/(dim/2)), in float64 like the original."""
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=t.device) / half)
    angles = torch.outer(t.reshape(-1).to(torch.float64), freqs)
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)


def rope_tables(config: WanDiTConfig, frame_starts: Sequence[int], frames: int, rows: int, cols: int,
                device: torch.device) -> tuple[Tensor, Tensor]:
    """cos/sin ``[B, frames*rows*cols, 1, head_dim/2]`` of Wan's 3D RoPE, one temporal start per sample.

    Angles are computed in float64 (as the reference tables are) and rounded to float32 once; rows and
    columns restart at 0 in every frame, frames count from the sample's temporal start.
    """
    limit = config.rope_max_positions
    if min(frame_starts) < 0 or max(frame_starts) + frames > limit or max(rows, cols) > limit:
        raise ValueError(
            f"RoPE positions out of range [0, {limit}): frame starts {list(frame_starts)} + {frames} frames, "
            f"grid {rows}x{cols}"
        )

    def inv_freq(width: int) -> Tensor:
        return 1.0 / config.rope_theta ** (torch.arange(0, width, 2, dtype=torch.float64, device=device) / width)

    wt, wh, ww = config.rope_split
    starts = torch.tensor(list(frame_starts), dtype=torch.float64, device=device)
    f_pos = starts[:, None] + torch.arange(frames, dtype=torch.float64, device=device)  # [B, F]
    ang_t = f_pos[..., None] * inv_freq(wt)  # [B, F, wt/2]
    ang_h = torch.arange(rows, dtype=torch.float64, device=device)[:, None] * inv_freq(wh)
    ang_w = torch.arange(cols, dtype=torch.float64, device=device)[:, None] * inv_freq(ww)
    b = len(frame_starts)
    angles = torch.cat(
        [
            ang_t[:, :, None, None].expand(b, frames, rows, cols, -1),
            ang_h[None, None, :, None].expand(b, frames, rows, cols, -1),
            ang_w[None, None, None, :].expand(b, frames, rows, cols, -1),
        ],
        dim=-1,
    ).reshape(b, frames * rows * cols, 1, -1)
    return torch.cos(angles).float(), torch.sin(angles).float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate adjacent pairs (x_2j, x_2j+1) by the table's angles (complex multiply), in float32."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return out.type_as(x)


def unapply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Inverse of :func:`apply_rope` with the same tables: each pair rotated back by its angle."""
    return apply_rope(x, cos, -sin)


def grid_rope_tables(config: WanDiTConfig, rows: int, cols: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos/sin ``[rows*cols, 1, head_dim/2]`` of the row and column parts of Wan's 3D RoPE alone.

    Built as :func:`rope_tables` at frame position 0, whose frame angles are 0 (cos 1, sin 0), so these
    tables rotate a key along the grid and leave its temporal rotation untouched: un-rotating cached keys
    with them moves the keys to a new grid without knowing which frame position they were written at.
    """
    cos, sin = rope_tables(config, [0], 1, rows, cols, device)
    return cos[0], sin[0]


class RMSNorm(nn.Module):
    """Wan's RMSNorm (statistics in float32, weight applied in the input dtype)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class LayerNorm(nn.LayerNorm):
    """LayerNorm computed in float32 whatever the weight dtype (Wan's WanLayerNorm)."""

    def forward(self, x: Tensor) -> Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).type_as(x)


class Attention(nn.Module):
    """q/k/v/o projections with RMSNorm over all heads on q and k (Wan's self_attn / cross_attn modules)."""

    def __init__(self, dim: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        # Fp8Linear: a plain linear that runs in fp8 under precision fp8-linear (engine/models/fp8.py).
        self.q = Fp8Linear(dim, dim)
        self.k = Fp8Linear(dim, dim)
        self.v = Fp8Linear(dim, dim)
        self.o = Fp8Linear(dim, dim)
        self.norm_q = RMSNorm(dim, eps)
        self.norm_k = RMSNorm(dim, eps)

    def heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.num_heads, -1))

    def project_kv(self, context: Tensor) -> tuple[Tensor, Tensor]:
        return self.heads(self.norm_k(self.k(context))), self.heads(self.v(context))


def _modulate(x: Tensor, shift: Tensor, scale: Tensor, frames: int, eps: float) -> Tensor:
    """LayerNorm (non-affine, float32) then per-frame ``* (1 + scale) + shift``; shift/scale ``[B, F, dim]``."""
    h = F.layer_norm(x.float(), x.shape[-1:], eps=eps).unflatten(1, (frames, -1))
    return (h * (1 + scale[:, :, None]) + shift[:, :, None]).flatten(1, 2).type_as(x)


def _gated_add(x: Tensor, y: Tensor, gate: Tensor, frames: int) -> Tensor:
    """Residual ``x + y * gate`` with a per-frame gate, accumulated in float32."""
    y = y.float().unflatten(1, (frames, -1)) * gate[:, :, None]
    return (x.float() + y.flatten(1, 2)).type_as(x)


@dataclass
class _SelfAttnContext:
    """What every block's self-attention needs for one forward (shared across blocks)."""

    cos: Tensor
    sin: Tensor
    mask: Tensor | None = None
    cache: KVCache | None = None
    write: tuple[int, int] | None = None  # token slice in the cache buffers reserved for this forward
    sparse: SparseLayout | None = None  # block-sparse cached attention; None = dense


class WanBlock(nn.Module):
    def __init__(self, config: WanDiTConfig) -> None:
        super().__init__()
        dim, eps = config.dim, config.eps
        self.eps = eps
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)
        self.self_attn = Attention(dim, config.num_heads, eps)
        # Wan's naming: norm1/norm2 are the (parameter-free) pre-norms of self-attn/FFN, norm3 the affine
        # pre-norm of cross-attention.
        self.norm3 = LayerNorm(dim, eps=eps, elementwise_affine=True)
        self.cross_attn = Attention(dim, config.num_heads, eps)
        self.ffn = nn.Sequential(
            Fp8Linear(dim, config.ffn_dim), nn.GELU(approximate="tanh"), Fp8Linear(config.ffn_dim, dim)
        )

    def forward(self, x: Tensor, e0: Tensor, prompt_k: Tensor, prompt_v: Tensor, layer: int,
                sa: _SelfAttnContext) -> Tensor:
        frames = e0.shape[1]
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation.float()[None] + e0).unbind(2)

        y = self._self_attention(_modulate(x, shift1, scale1, frames, self.eps), layer, sa)
        x = _gated_add(x, y, gate1, frames)

        ca = self.cross_attn
        q = ca.heads(ca.norm_q(ca.q(self.norm3(x))))
        x = x + ca.o(attention(q, prompt_k, prompt_v).flatten(2))

        y = self.ffn(_modulate(x, shift2, scale2, frames, self.eps))
        return _gated_add(x, y, gate2, frames)

    def _self_attention(self, h: Tensor, layer: int, sa: _SelfAttnContext) -> Tensor:
        at = self.self_attn
        q = apply_rope(at.heads(at.norm_q(at.q(h))), sa.cos, sa.sin)
        k = apply_rope(at.heads(at.norm_k(at.k(h))), sa.cos, sa.sin)
        v = at.heads(at.v(h))
        if sa.cache is not None and sa.write is not None:
            # Write first, then attend to the buffer up to our end: this is [visible cached frames ; own
            # frames], and it excludes slots a rewrite replaces and frames the window has just evicted.
            start, end = sa.write
            sa.cache.write(layer, start, end, k, v)
            k, v = sa.cache.attended(layer, end, q.dtype)
            if sa.sparse is not None:
                return at.o(block_sparse_attention(q, k, v, sa.sparse).flatten(2))
        return at.o(attention(q, k, v, sa.mask).flatten(2))


class WanHead(nn.Module):
    def __init__(self, config: WanDiTConfig) -> None:
        super().__init__()
        self.eps = config.eps
        self.modulation = nn.Parameter(torch.randn(1, 2, config.dim) / config.dim**0.5)
        self.head = nn.Linear(config.dim, config.out_channels * math.prod(config.patch_size))

    def forward(self, x: Tensor, e: Tensor) -> Tensor:
        shift, scale = (self.modulation.float()[None] + e[:, :, None]).unbind(2)
        return self.head(_modulate(x, shift, scale, e.shape[1], self.eps))


# --------------------------------------------------------------------------------------------------
# Block-sparse cached self-attention (portable reference: plain torch, any device)
# --------------------------------------------------------------------------------------------------

# Key block size in tokens. Small enough to follow content inside a frame (a 480p frame is 1,560 tokens),
# large enough that scoring (one mean key per block) costs next to nothing beside the attention itself.
SPARSE_BLOCK_TOKENS = 64


@dataclass(frozen=True)
class SparseLayout:
    """Which cached keys of one forward are always kept and which compete, as token offsets in the buffer.

    A chunk attends to buffer tokens ``[0, end)``: sink frames, recent frames, then its own tokens. Keys
    ``[0, sink)`` (the sinks) and ``[tail, end)`` (the recent tokens that do not fill a whole block, then
    the chunk's own tokens) are always kept. ``[sink, tail)`` is ``blocks`` key blocks of ``block_tokens``
    tokens; each query block (one latent frame of the chunk, ``query_tokens`` tokens) keeps ``keep`` of
    them, per head.
    """

    sink: int
    blocks: int
    block_tokens: int
    keep: int
    query_tokens: int

    @property
    def tail(self) -> int:
        return self.sink + self.blocks * self.block_tokens

    @classmethod
    def plan(cls, sparsity: float, block_tokens: int, sink_tokens: int, own_start: int,
             frame_tokens: int) -> SparseLayout | None:
        """The layout that skips ``floor(sparsity * blocks)`` blocks; None when that is none (then the dense
        path runs, so a sparsity too small to skip a block is exactly sparsity 0)."""
        blocks = max(0, own_start - sink_tokens) // block_tokens
        skip = int(sparsity * blocks + 1e-9)  # 1e-9: 0.57 * 100 is 56.99999999999999 in floats; skip 57
        if skip == 0:
            return None
        return cls(sink_tokens, blocks, block_tokens, blocks - skip, frame_tokens)


def select_key_blocks(q: Tensor, k: Tensor, layout: SparseLayout) -> Tensor:
    """The selectable blocks each query frame keeps, per head: block indices ``[B, heads, frames, keep]``.

    A block's score is the dot product of the frame's mean query with the block's mean key (MoBA-style
    pooling; both after RoPE, as the cache stores keys), computed in float32; the top ``keep`` survive,
    listed in buffer order. Rows never mix: every score uses one row's queries and keys.
    """
    q_mean = q.float().unflatten(1, (-1, layout.query_tokens)).mean(2)  # [B, frames, heads, hd]
    k_mean = k[:, layout.sink : layout.tail].float().unflatten(1, (layout.blocks, layout.block_tokens)).mean(2)
    scores = torch.einsum("bfhd,bkhd->bhfk", q_mean, k_mean)
    return scores.topk(layout.keep, dim=-1).indices.sort(dim=-1).values


def kept_tokens(layout: SparseLayout, blocks: Tensor, end: int) -> Tensor:
    """Buffer token indices each query frame attends to, ``[B, heads, frames, kept]``: the sinks, the
    tokens of the selected ``blocks`` (from :func:`select_key_blocks`), then ``[tail, end)``."""
    device = blocks.device
    inside = torch.arange(layout.block_tokens, device=device)
    chosen = (layout.sink + blocks[..., None] * layout.block_tokens + inside).flatten(-2)
    lead = torch.arange(layout.sink, device=device).expand(*blocks.shape[:-1], -1)
    tail = torch.arange(layout.tail, end, device=device).expand(*blocks.shape[:-1], -1)
    return torch.cat([lead, chosen, tail], dim=-1)


def gathered_attention(q: Tensor, k: Tensor, v: Tensor, layout: SparseLayout, blocks: Tensor) -> Tensor:
    """Attention of each query frame to its kept keys only, ``[B, Sq, heads, hd]``.

    The kept keys/values are gathered into smaller tensors first, so attention costs what is kept (a
    masked dense attention would still pay for every key).
    """
    b, sq, heads, hd = q.shape
    frames = sq // layout.query_tokens
    tokens = kept_tokens(layout, blocks, k.shape[1])  # [B, heads, frames, kept]
    rows = torch.arange(b, device=q.device).view(b, 1, 1, 1)
    head = torch.arange(heads, device=q.device).view(1, heads, 1, 1)
    # Advanced indexing copies whole head_dim vectors; (frame, head) pairs become the batch of one 4-D
    # attention call, the shape fused SDPA kernels take.
    k_kept = k[rows, tokens, head].flatten(1, 2)  # [B, heads*frames, kept, hd]
    v_kept = v[rows, tokens, head].flatten(1, 2)
    q_frames = q.transpose(1, 2).reshape(b, heads * frames, layout.query_tokens, hd)
    out = F.scaled_dot_product_attention(q_frames, k_kept, v_kept)
    return out.reshape(b, heads, sq, hd).transpose(1, 2)


def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, layout: SparseLayout) -> Tensor:
    """Cached self-attention over the sinks, the chunk's own tokens and the best-scoring key blocks."""
    return gathered_attention(q, k, v, layout, select_key_blocks(q, k, layout))


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


class CausalWanDiT(nn.Module):
    """Wan 2.1 T2V DiT with per-frame timesteps, a block-causal KV cache and per-sample RoPE offsets."""

    def __init__(self, config: WanDiTConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.dim
        self.patch_embedding = nn.Conv3d(
            config.in_channels, dim, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.text_embedding = nn.Sequential(
            nn.Linear(config.text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim)
        )
        self.time_embedding = nn.Sequential(nn.Linear(config.freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim * 6))
        self.blocks = nn.ModuleList([WanBlock(config) for _ in range(config.num_layers)])
        self.head = WanHead(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embedding.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.patch_embedding.weight.device

    # -- prompt and cache construction --------------------------------------------------------------

    @torch.no_grad()
    def encode_prompt(self, context: Tensor) -> PromptCache:
        """Text encoder states ``[B, L, text_dim]`` -> cached cross-attention K/V of every block.

        Rows are zero-padded (or truncated) to ``text_len`` like Wan does; all ``text_len`` rows are attended,
        so padding rows contribute MLP(0) exactly as in the original. Pad variable-length prompts with zeros.
        """
        cfg = self.config
        if context.ndim != 3 or context.shape[-1] != cfg.text_dim:
            raise ValueError(f"context must be [B, L, {cfg.text_dim}], got {tuple(context.shape)}")
        return self.prompt_kv(self.embed_text(context), range(len(self.blocks)))

    @torch.no_grad()
    def embed_text(self, context: Tensor) -> Tensor:
        """Text encoder states ``[B, L, text_dim]`` -> padded/truncated text tokens ``[B, text_len, dim]``."""
        cfg = self.config
        context = context[:, : cfg.text_len].to(device=self.device, dtype=self.dtype)
        context = F.pad(context, (0, 0, 0, cfg.text_len - context.shape[1]))
        return cast(Tensor, self.text_embedding(context))

    @torch.no_grad()
    def prompt_kv(self, text_tokens: Tensor, blocks: range) -> PromptCache:
        """Cross-attention K/V of ``blocks`` only (layer j of the result is block ``blocks[j]``)."""
        pairs = (cast(WanBlock, self.blocks[i]).cross_attn.project_kv(text_tokens) for i in blocks)
        ks, vs = zip(*pairs, strict=True)
        return PromptCache(list(ks), list(vs))

    def new_kv_cache(self, batch: int, frame_tokens: int, window_frames: int, sink_frames: int = 0,
                     device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                     layers: int | None = None) -> KVCache:
        """An empty self-attention cache holding ``window_frames`` latent frames per row, stored in ``dtype``
        (default the weights'; ``float8_e4m3fn``: fp8 with scales), of ``layers`` blocks (default all)."""
        if not 0 <= sink_frames < window_frames:
            raise ValueError(f"need 0 <= sink_frames < window_frames, got {sink_frames} and {window_frames}")
        cfg = self.config
        n = cfg.num_layers if layers is None else layers
        shape = (batch, window_frames * frame_tokens, cfg.num_heads, cfg.head_dim)
        device = self.device if device is None else device
        dtype = self.dtype if dtype is None else dtype
        k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n)]
        v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n)]
        cache = KVCache(k, v, frame_tokens, window_frames, sink_frames, [0] * batch)
        if dtype == FP8_DTYPE:
            cache.k_scale = [torch.zeros((*shape[:3], 1), device=device) for _ in range(n)]
            cache.v_scale = [torch.zeros((*shape[:3], 1), device=device) for _ in range(n)]
        return cache

    # -- forward passes -----------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, x: Tensor, timestep: Tensor, prompt: PromptCache, kv_cache: KVCache | None = None,
                start_frame: int | Sequence[int] | Tensor = 0,
                rope_start: int | Sequence[int] | Tensor | None = None, sparsity: float = 0.0,
                sparse_block_tokens: int = SPARSE_BLOCK_TOKENS) -> Tensor:
        """Velocity for latent frames ``x`` ``[B, C, F, H, W]`` at per-frame ``timestep`` ``[B, F]`` (or ``[B]``).

        ``start_frame``: absolute frame index of x's first frame (cache bookkeeping, per row allowed).
        ``rope_start``: temporal RoPE position of x's first frame, per row allowed (default: start_frame).
        With ``kv_cache`` the frames attend to the visible cached frames and themselves, and their K/V are
        written into the cache; without, attention is bidirectional over x's own frames.
        ``sparsity``: fraction of the cached key blocks (``sparse_block_tokens`` tokens each) that each
        query frame skips (see :class:`SparseLayout`); sinks and the chunk's own tokens are always kept,
        so without a cache there is nothing to skip. 0 runs the dense path.
        """
        batch = x.shape[0]
        starts = _per_row(start_frame, batch, "start_frame")
        ropes = starts if rope_start is None else _per_row(rope_start, batch, "rope_start")
        tokens, e, e0, grid = self._embed(x, timestep)
        sa = self._cached_context(grid, starts, ropes, kv_cache, len(self.blocks), tokens.device, sparsity,
                                  sparse_block_tokens)
        return self._run(tokens, e, e0, grid, prompt, sa)

    def _cached_context(self, grid: tuple[int, int, int], starts: list[int], ropes: list[int],
                        kv_cache: KVCache | None, layers: int, device: torch.device, sparsity: float,
                        sparse_block_tokens: int) -> _SelfAttnContext:
        """RoPE tables for the rows' positions and, with a cache, its reserved write slice and sparse layout."""
        if not 0.0 <= sparsity < 1.0:
            raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
        if sparse_block_tokens < 1:
            raise ValueError(f"sparse_block_tokens must be >= 1, got {sparse_block_tokens}")
        cos, sin = rope_tables(self.config, ropes, *grid, device=device)
        sa = _SelfAttnContext(cos, sin)
        if kv_cache is not None:
            frame_tokens = grid[1] * grid[2]
            if frame_tokens != kv_cache.frame_tokens:
                raise ValueError(f"x has {frame_tokens} tokens per frame, the cache {kv_cache.frame_tokens}")
            if kv_cache.num_layers != layers:
                raise ValueError(f"cache has {kv_cache.num_layers} layers, the blocks run {layers}")
            sa.cache, sa.write = kv_cache, kv_cache.reserve(starts, grid[0])
            own_start = sa.write[0]
            # Sink frames sit at the buffer start once written; before that the buffer holds fewer.
            sinks = min(kv_cache.sink_frames * frame_tokens, own_start)
            sa.sparse = SparseLayout.plan(sparsity, sparse_block_tokens, sinks, own_start, frame_tokens)
        return sa

    # -- stage helpers: the same forward in pieces (pipeline parallelism runs block ranges per rank) ----

    @torch.no_grad()
    def embed(self, x: Tensor, timestep: Tensor) -> tuple[Tensor, Tensor, Tensor, tuple[int, int, int]]:
        """First stage: tokens ``[B, N, dim]``, e ``[B, F, dim]``, e0 ``[B, F, 6, dim]`` and the token grid."""
        return self._embed(x, timestep)

    @torch.no_grad()
    def run_blocks(self, tokens: Tensor, e0: Tensor, grid: tuple[int, int, int], prompt: PromptCache,
                   blocks: range, kv_cache: KVCache | None = None, start_frame: int | Sequence[int] = 0,
                   rope_start: int | Sequence[int] | None = None, sparsity: float = 0.0,
                   sparse_block_tokens: int = SPARSE_BLOCK_TOKENS) -> Tensor:
        """Run blocks ``blocks`` (a contiguous range) on tokens; returns the tokens after the last one.

        ``prompt`` and ``kv_cache`` hold exactly those blocks' layers: layer j is block ``blocks[j]``, so a
        pipeline stage keeps caches of its own blocks only. :meth:`embed`, then ``run_blocks`` over
        consecutive ranges covering every block, then :meth:`head_out` computes what :meth:`forward` does
        (``sparsity`` and ``sparse_block_tokens`` as there).
        """
        if blocks.step != 1 or not 0 <= blocks.start < blocks.stop <= len(self.blocks):
            raise ValueError(f"blocks must be a non-empty contiguous range inside [0, {len(self.blocks)}), got {blocks}")
        batch = tokens.shape[0]
        if prompt.num_layers != len(blocks) or prompt.batch_size != batch:
            raise ValueError(
                f"prompt cache has {prompt.num_layers} layers x {prompt.batch_size} rows, expected "
                f"{len(blocks)} x {batch}"
            )
        starts = _per_row(start_frame, batch, "start_frame")
        ropes = starts if rope_start is None else _per_row(rope_start, batch, "rope_start")
        sa = self._cached_context(grid, starts, ropes, kv_cache, len(blocks), tokens.device, sparsity,
                                  sparse_block_tokens)
        for j, i in enumerate(blocks):
            tokens = self.blocks[i](tokens, e0, prompt.k[j], prompt.v[j], j, sa)
        return tokens

    @torch.no_grad()
    def head_out(self, tokens: Tensor, e: Tensor, grid: tuple[int, int, int]) -> Tensor:
        """Last stage: head and unpatchify -> velocity ``[B, C, F, H, W]``."""
        return self._unpatchify(self.head(tokens, e), grid)

    @torch.no_grad()
    def forward_masked(self, x: Tensor, timestep: Tensor, prompt: PromptCache, chunk_frames: int,
                       window_frames: int | None = None, sink_frames: int = 0) -> Tensor:
        """Reference: one forward over all frames with the block-causal mask (RoPE frames start at 0).

        A token sees every token of earlier chunks and of its own chunk. With ``window_frames``, a chunk
        ending at frame e sees only frames ``[0, sink_frames)`` and ``[e - (window - sink), e)``, which is
        what the rolling cache with sinks keeps.
        """
        tokens, e, e0, grid = self._embed(x, timestep)
        frames, frame_tokens = grid[0], grid[1] * grid[2]
        f = torch.arange(frames, device=tokens.device)
        chunk_end = torch.clamp((f // chunk_frames + 1) * chunk_frames, max=frames)  # per query frame
        visible = f[None, :] < chunk_end[:, None]  # [query frame, key frame]
        if window_frames is not None:
            recent = f[None, :] >= (chunk_end - (window_frames - sink_frames))[:, None]
            visible &= recent | (f[None, :] < sink_frames)
        mask = visible.repeat_interleave(frame_tokens, 0).repeat_interleave(frame_tokens, 1)
        cos, sin = rope_tables(self.config, [0] * x.shape[0], *grid, device=tokens.device)
        return self._run(tokens, e, e0, grid, prompt, _SelfAttnContext(cos, sin, mask=mask))

    def _embed(self, x: Tensor, timestep: Tensor) -> tuple[Tensor, Tensor, Tensor, tuple[int, int, int]]:
        """Patch tokens ``[B, N, dim]``, time embedding e ``[B, F, dim]`` and e0 ``[B, F, 6, dim]`` (float32)."""
        cfg = self.config
        if x.ndim != 5 or x.shape[1] != cfg.in_channels:
            raise ValueError(f"x must be [B, {cfg.in_channels}, F, H, W], got {tuple(x.shape)}")
        b, _, frames, height, width = x.shape
        if height % cfg.patch_size[1] or width % cfg.patch_size[2]:
            raise ValueError(f"latent {height}x{width} is not divisible by patch {cfg.patch_size[1:]}")
        if timestep.ndim == 1:
            timestep = timestep[:, None].expand(-1, frames)
        if tuple(timestep.shape) != (b, frames):
            raise ValueError(f"timestep must be [B, F] = [{b}, {frames}] (or [B]), got {tuple(timestep.shape)}")
        tokens = self.patch_embedding(x.to(device=self.device, dtype=self.dtype))
        grid = (tokens.shape[2], tokens.shape[3], tokens.shape[4])
        tokens = tokens.flatten(2).transpose(1, 2).contiguous()
        # The time MLPs run in the weight dtype; modulation arithmetic downstream is float32.
        sinus = sinusoidal_embedding(timestep.to(self.device), cfg.freq_dim).to(self.dtype)
        e = self.time_embedding(sinus)
        e0 = self.time_projection(e).float().unflatten(1, (6, cfg.dim)).unflatten(0, (b, frames))
        return tokens, e.float().unflatten(0, (b, frames)), e0, grid

    def _run(self, tokens: Tensor, e: Tensor, e0: Tensor, grid: tuple[int, int, int], prompt: PromptCache,
             sa: _SelfAttnContext) -> Tensor:
        if prompt.num_layers != len(self.blocks) or prompt.batch_size != tokens.shape[0]:
            raise ValueError(
                f"prompt cache has {prompt.num_layers} layers x {prompt.batch_size} rows, expected "
                f"{len(self.blocks)} x {tokens.shape[0]}"
            )
        for i, block in enumerate(self.blocks):
            tokens = block(tokens, e0, prompt.k[i], prompt.v[i], i, sa)
        return self._unpatchify(self.head(tokens, e), grid)

    def _unpatchify(self, tokens: Tensor, grid: tuple[int, int, int]) -> Tensor:
        """``[B, N, pt*ph*pw*C]`` -> ``[B, C, F, H, W]``; the channel index is fastest within a token."""
        pt, ph, pw = self.config.patch_size
        f, h, w = grid
        out = tokens.float().reshape(tokens.shape[0], f, h, w, pt, ph, pw, -1)
        return out.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(tokens.shape[0], -1, f * pt, h * ph, w * pw)


def _per_row(value: int | Sequence[int] | Tensor, batch: int, name: str) -> list[int]:
    if isinstance(value, int):
        return [value] * batch
    rows = [int(v) for v in (value.reshape(-1).tolist() if isinstance(value, Tensor) else value)]
    if len(rows) != batch:
        raise ValueError(f"{name} has {len(rows)} entries for a batch of {batch}")
    return rows
