"""LoRA at run time: a low-rank side path in the DiT's linear layers, with a strength per batch row.

A loaded :class:`LoRA` never touches the base weights. Each targeted ``nn.Linear`` gets a forward hook
that adds ``sum_i s_i[row] * scale_i * B_i (A_i x)`` to its output, where ``s_i[row]`` is the strength
of LoRA i for the batch row (the stream) the token belongs to. So streams with different LoRAs, or the
same LoRA at different strengths, still share one DiT forward, and a strength change is a new number
for the next forward, not a reload.

The strengths of a forward are set with :meth:`LoRABank.rows` (a context variable, like the attention
backend): outside it, or with every strength 0, the hooks return at once and the model runs its base
weights only. Rows are grouped by the LoRAs they use; a group's factors are concatenated along the rank,
so any number of LoRAs costs one pair of thin matmuls per linear layer and group. The side path only
reads and writes the rows of its group: a row never multiplies another stream's factors by 0, so a
non-finite value in one stream's side path (0 x NaN is NaN) cannot reach a row that does not use it.
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
# the same bound in its schema (app/server/control/messages.py, which does not import torch).
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


def layer_problem(layer: LoRALayer, dtype: torch.dtype = torch.float32) -> str | None:
    """Why ``layer`` cannot run in ``dtype`` (None when it can). A non-finite factor or scale, or a weight
    change past the dtype's range, makes every token of the rows using it non-finite (black frames), so
    such a LoRA is refused when it loads rather than found out per chunk. The bound on the change,
    ``|scale| * rank * max|up| * max|down|``, is what one element of ``scale * up @ down`` can reach."""
    if layer.rank == 0:
        return "rank 0: its factors are empty"
    limit, kind = torch.finfo(dtype).max, str(dtype).removeprefix("torch.")
    if not math.isfinite(layer.scale) or abs(layer.scale) > limit:
        return f"scale alpha / rank = {layer.scale:g} is not a finite {kind} number"
    for half, factor in (("down", layer.down), ("up", layer.up)):
        bad = int(factor.numel() - torch.isfinite(factor).sum())
        if bad:
            return f"{half} factor {list(factor.shape)} holds {bad} non-finite values (NaN or inf) in {kind}"
    bound = abs(layer.scale) * layer.rank * float(layer.up.abs().max()) * float(layer.down.abs().max())
    if bound > limit:
        return f"its weight change can reach {bound:.3g}, past {kind}'s largest number {limit:.3g}"
    return None


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
class _RowGroup:
    """Rows of a forward that use the same LoRAs (each at a non-zero strength)."""

    loras: tuple[int, ...]  # indices of the LoRAs (host-side: no device sync in the hooks)
    rows: Tensor  # [g] row indices on the model's device
    values: Tensor  # [g, loras] float32 strengths of those rows on the model's device
    every_row: bool  # the group is the whole batch: no row selection needed


@dataclass(frozen=True)
class _RowStrengths:
    rows: int
    groups: tuple[_RowGroup, ...]


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
        # module name -> a row group's LoRA indices -> (A cat [R, in], B cat [out, R], owner [R], scale [R])
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
        installed = {
            target: LoRALayer(layer.down.to(weight.device, weight.dtype), layer.up.to(weight.device, weight.dtype),
                              layer.scale)
            for target, layer in lora.layers.items()
        }
        # Checked as the model will run them: a factor finite in the file may overflow the model's dtype.
        problems = [f"{target}: {problem}" for target, layer in sorted(installed.items())
                    if (problem := layer_problem(layer, weight.dtype))]
        if problems:
            raise LoRAError(f"LoRA {lora.name!r} cannot run: " + "; ".join(problems))
        self.loras.append(LoRA(lora.name, installed))
        for target in lora.layers:
            if target not in self._hooks:
                self._hooks[target] = _linear(self.model, target).register_forward_hook(partial(self._side_path, target))
        self._stacks.clear()

    def strengths(self, rows: Sequence[Mapping[str, float]]) -> _RowStrengths | None:
        """The strength table of a forward whose row r uses ``rows[r]`` (name -> strength; absent = 0),
        its rows grouped by the LoRAs they use; None when no row uses any LoRA (the hooks then cost nothing)."""
        names = self.names
        table = [[0.0] * len(names) for _ in rows]
        for r, row in enumerate(rows):
            for name, strength in row.items():
                if name not in names:
                    raise LoRAError(f"no LoRA named {name!r} is loaded (loaded: {', '.join(names) or 'none'})")
                table[r][names.index(name)] = float(strength)
        members: dict[tuple[int, ...], list[int]] = {}
        for r, values_of_row in enumerate(table):
            used = tuple(i for i, strength in enumerate(values_of_row) if strength != 0.0)
            if used:
                members.setdefault(used, []).append(r)
        if not members:
            return None
        device = next(self.model.parameters()).device
        values = torch.tensor(table, dtype=torch.float32, device=device)
        groups = []
        for loras, group_rows in members.items():
            index = torch.tensor(group_rows, device=device)
            groups.append(_RowGroup(loras, index, values.index_select(0, index), len(group_rows) == len(rows)))
        return _RowStrengths(len(rows), tuple(groups))

    @contextlib.contextmanager
    def rows(self, rows: Sequence[Mapping[str, float]]) -> Iterator[None]:
        """Forwards inside the block apply the LoRAs with row r's strengths ``rows[r]``."""
        table = self.strengths(rows) if self.loras else None
        token = _rows.set((self, table) if table is not None else None)
        try:
            yield
        finally:
            _rows.reset(token)

    def _stack(self, target: str, loras: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        cache = self._stacks.setdefault(target, {})
        if loras not in cache:
            parts = [(i, self.loras[i].layers[target]) for i in loras if target in self.loras[i].layers]
            if not parts:
                cache[loras] = (torch.empty(0), torch.empty(0), torch.empty(0, dtype=torch.long), torch.empty(0))
            else:
                device = parts[0][1].down.device
                cache[loras] = (
                    torch.cat([p.down for _, p in parts]),
                    torch.cat([p.up for _, p in parts], dim=1),
                    torch.tensor([i for i, p in parts for _ in range(p.rank)], device=device),
                    torch.tensor([p.scale for _, p in parts for _ in range(p.rank)], device=device),
                )
        return cache[loras]

    def _side_path(self, target: str, module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor | None:
        current = _rows.get()
        if current is None or current[0] is not self:
            return None
        table = current[1]
        x = inputs[0]
        # Time embeddings run on [rows * frames, dim]: each row's frames are consecutive.
        frames = x.shape[0] // table.rows
        changed = None
        for group in table.groups:
            down, up, owner, scale = self._stack(target, group.loras)
            if owner.numel() == 0:
                continue
            per_rank = group.values[:, owner] * scale  # [g, R]: every strength non-zero
            if frames > 1:
                per_rank = per_rank.repeat_interleave(frames, dim=0)
            if group.every_row:
                picked, xs = None, x
            else:
                picked = group.rows if frames == 1 else \
                    (group.rows[:, None] * frames + torch.arange(frames, device=x.device)).flatten()
                xs = x.index_select(0, picked)
            h = nn.functional.linear(xs, down.to(x.dtype))
            h = h * per_rank.view(per_rank.shape[0], *([1] * (h.ndim - 2)), -1).to(h.dtype)
            delta = nn.functional.linear(h, up.to(h.dtype)).to(output.dtype)
            base = output if changed is None else changed
            changed = base + delta if picked is None else base.index_add(0, picked, delta)
        return changed


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
