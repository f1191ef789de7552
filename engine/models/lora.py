"""LoRA at run time: a low-rank side path in the DiT's linear layers, with a strength per batch row.

A loaded :class:`LoRA` never touches the base weights. Each targeted ``nn.Linear`` gets a forward hook
that adds ``sum_i s_i[row] * scale_i * B_i (A_i x)`` to its output, where ``s_i[row]`` is the strength
of LoRA i for the batch row (the stream) the token belongs to. So streams with different LoRAs, or the
same LoRA at different strengths, still share one DiT forward, and a strength change is a new number
for the next forward, not a reload.

The strengths of a forward are set with :meth:`LoRABank.rows` (a context variable, like the attention
backend): outside it, or with every strength 0, the hooks return at once and the model runs its base
weights only. The factors of the LoRAs active in a forward are concatenated along the rank, so any
number of them costs one pair of thin matmuls per linear layer.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

# Strengths a stream may ask for (negative ones push away from the LoRA's look). The HTTP edge states
# the same bound in its schema (app/server/control.py, which does not import torch).
MAX_LORA_STRENGTH = 4.0


class LoRAError(ValueError):
    """A LoRA that does not fit the model, or a strength that cannot be applied; the text says which."""


@dataclass(frozen=True)
class LoRALayer:
    """The factors of one linear layer: ``W x + scale * up @ down @ x``."""

    down: Tensor  # A: [rank, in_features]
    up: Tensor  # B: [out_features, rank]
    scale: float  # alpha / rank (1 where the file gives no alpha)

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])


@dataclass(frozen=True)
class LoRA:
    """One LoRA: its factors keyed by the DiT module they patch (original Wan names, ``blocks.3.ffn.0``)."""

    name: str
    layers: Mapping[str, LoRALayer]

    @property
    def rank(self) -> int:
        return max(layer.rank for layer in self.layers.values())

    @property
    def targets(self) -> list[str]:
        """The patched module kinds, block index folded: ``["blocks.*.cross_attn.k", ...]``."""
        return sorted({_fold_block(name) for name in self.layers})

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "rank": self.rank, "layers": len(self.layers), "targets": self.targets}


def _fold_block(name: str) -> str:
    parts = name.split(".")
    if len(parts) > 1 and parts[0] == "blocks":
        parts[1] = "*"
    return ".".join(parts)


def check_strengths(strengths: Mapping[str, float]) -> dict[str, float]:
    """A plain dict of finite strengths within +-MAX_LORA_STRENGTH; LoRAError naming the bad one."""
    out = {}
    for name, value in strengths.items():
        if not isinstance(name, str) or not name:
            raise LoRAError(f"LoRA names are non-empty strings, got {name!r}")
        strength = float(value)
        if not math.isfinite(strength) or abs(strength) > MAX_LORA_STRENGTH:
            raise LoRAError(f"strength of LoRA {name!r} must be a finite number in [-{MAX_LORA_STRENGTH}, "
                            f"{MAX_LORA_STRENGTH}], got {value}")
        out[name] = strength
    return out


@dataclass(frozen=True)
class _RowStrengths:
    values: Tensor  # [rows, loras] float32 on the model's device
    active: tuple[int, ...]  # indices of the LoRAs some row uses (host-side: no device sync in the hooks)


_rows: ContextVar[tuple[LoRABank, _RowStrengths] | None] = ContextVar("lora_rows", default=None)


class LoRABank:
    """The LoRAs loaded on one model, and the hooks that run their side path.

    One bank per model (:meth:`of`): every runtime, pipeline and pipeline stage over the same weights
    sees the same LoRAs.
    """

    @classmethod
    def of(cls, model: nn.Module) -> LoRABank:
        """The model's bank, made empty on first use (no hooks until a LoRA is added)."""
        bank = model.__dict__.get("_lora_bank")
        if not isinstance(bank, LoRABank):
            bank = cls(model)
            model.__dict__["_lora_bank"] = bank  # a plain attribute: not a submodule, not in the state dict
        return bank

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.loras: list[LoRA] = []
        self._hooks: dict[str, RemovableHandle] = {}
        # module name -> active LoRA indices -> (A cat [R, in], B cat [out, R], owner [R], scale [R])
        self._stacks: dict[str, dict[tuple[int, ...], tuple[Tensor, Tensor, Tensor, Tensor]]] = {}

    @property
    def names(self) -> list[str]:
        return [lora.name for lora in self.loras]

    def info(self) -> list[dict[str, Any]]:
        return [lora.info() for lora in self.loras]

    def add(self, lora: LoRA) -> None:
        """Install ``lora`` (strength 0 for every row until a forward asks for it)."""
        if lora.name in self.names:
            raise LoRAError(f"a LoRA named {lora.name!r} is already loaded")
        if not lora.layers:
            raise LoRAError(f"LoRA {lora.name!r} patches no layer")
        weight = next(self.model.parameters())
        for target, layer in lora.layers.items():
            linear = _linear(self.model, target)
            expected = (tuple(linear.weight.shape[1:]), tuple(linear.weight.shape[:1]))
            if (tuple(layer.down.shape[1:]), tuple(layer.up.shape[:1])) != expected or \
                    layer.up.shape[1] != layer.down.shape[0]:
                raise LoRAError(
                    f"LoRA {lora.name!r} does not fit {target}: factors down {list(layer.down.shape)} and up "
                    f"{list(layer.up.shape)}, the layer maps {linear.in_features} -> {linear.out_features}")
        self.loras.append(LoRA(lora.name, {
            target: LoRALayer(layer.down.to(weight.device, weight.dtype), layer.up.to(weight.device, weight.dtype),
                              layer.scale)
            for target, layer in lora.layers.items()
        }))
        for target in lora.layers:
            if target not in self._hooks:
                self._hooks[target] = _linear(self.model, target).register_forward_hook(partial(self._side_path, target))
        self._stacks.clear()

    def strengths(self, rows: Sequence[Mapping[str, float]]) -> _RowStrengths | None:
        """The strength table of a forward whose row r uses ``rows[r]`` (name -> strength; absent = 0);
        None when no row uses any LoRA (the hooks then cost nothing)."""
        names = self.names
        table = [[0.0] * len(names) for _ in rows]
        for r, row in enumerate(rows):
            for name, strength in row.items():
                if name not in names:
                    raise LoRAError(f"no LoRA named {name!r} is loaded (loaded: {', '.join(names) or 'none'})")
                table[r][names.index(name)] = float(strength)
        active = tuple(i for i in range(len(names)) if any(row[i] != 0.0 for row in table))
        if not active:
            return None
        device = next(self.model.parameters()).device
        return _RowStrengths(torch.tensor(table, dtype=torch.float32, device=device), active)

    @contextlib.contextmanager
    def rows(self, rows: Sequence[Mapping[str, float]]) -> Iterator[None]:
        """Forwards inside the block apply the LoRAs with row r's strengths ``rows[r]``."""
        table = self.strengths(rows) if self.loras else None
        token = _rows.set((self, table) if table is not None else None)
        try:
            yield
        finally:
            _rows.reset(token)

    def _stack(self, target: str, active: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        cache = self._stacks.setdefault(target, {})
        if active not in cache:
            parts = [(i, self.loras[i].layers[target]) for i in active if target in self.loras[i].layers]
            if not parts:
                cache[active] = (torch.empty(0), torch.empty(0), torch.empty(0, dtype=torch.long), torch.empty(0))
            else:
                device = parts[0][1].down.device
                cache[active] = (
                    torch.cat([p.down for _, p in parts]),
                    torch.cat([p.up for _, p in parts], dim=1),
                    torch.tensor([i for i, p in parts for _ in range(p.rank)], device=device),
                    torch.tensor([p.scale for _, p in parts for _ in range(p.rank)], device=device),
                )
        return cache[active]

    def _side_path(self, target: str, module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor | None:
        current = _rows.get()
        if current is None or current[0] is not self:
            return None
        table = current[1]
        down, up, owner, scale = self._stack(target, table.active)
        if owner.numel() == 0:
            return None
        x = inputs[0]
        per_rank = table.values[:, owner] * scale  # [rows, R]
        if x.shape[0] != per_rank.shape[0]:
            # Time embeddings run on [rows * frames, dim]: each row's frames are consecutive.
            per_rank = per_rank.repeat_interleave(x.shape[0] // per_rank.shape[0], dim=0)
        h = nn.functional.linear(x, down.to(x.dtype))
        h = h * per_rank.view(per_rank.shape[0], *([1] * (h.ndim - 2)), -1).to(h.dtype)
        return output + nn.functional.linear(h, up.to(h.dtype)).to(output.dtype)


def _linear(model: nn.Module, target: str) -> nn.Linear:
    try:
        module = model.get_submodule(target)
    except AttributeError:
        raise LoRAError(f"the model has no layer {target}") from None
    if not isinstance(module, nn.Linear):
        raise LoRAError(f"{target} is a {type(module).__name__}, not a linear layer a LoRA can patch")
    return module


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """Every layer of ``model`` a LoRA may target, by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
