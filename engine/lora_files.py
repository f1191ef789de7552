"""Strict loading of LoRA safetensors for the Wan 2.1 DiT, in the layouts trainers write.

Key layouts, detected per tensor name (the run-time side path is engine/models/lora.py):

* diffusers / PEFT: ``<module>.lora_A.weight`` (down, ``[rank, in]``) and ``<module>.lora_B.weight``
  (up, ``[out, rank]``), module names in diffusers (``blocks.0.attn1.to_q``) or original Wan names,
  prefixed ``transformer.`` (diffusers' ``save_lora_weights``), ``base_model.model.`` (PEFT) or not at all;
  a ``<module>.alpha`` scalar where the file has one, else ``lora_alpha``/``r`` from PEFT's
  ``adapter_config.json`` beside the file (or in the directory given);
* original Wan / Self-Forcing / kohya: ``<module>.lora_down.weight``, ``<module>.lora_up.weight`` and
  ``<module>.alpha``, module names original (``blocks.0.self_attn.q``) or diffusers, prefixed
  ``diffusion_model.`` / ``model.diffusion_model.`` / ``model.``, or kohya's flattened
  ``lora_unet_blocks_0_self_attn_q`` (musubi-tuner, ComfyUI).

A layer's scale is ``alpha / rank`` (PEFT's ``use_rslora``: ``alpha / sqrt(rank)``), 1 without alpha.
Anything that is not one of these tensors, names a layer the model lacks, or does not fit its shape
fails the load with one :class:`LoRAError` naming the offending keys and shapes; so do numbers a
forward cannot run with (rank 0, a non-finite factor or alpha, a scale or weight change past float32).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.checkpoint import original_to_diffusers_key
from engine.models.lora import LoRA, LoRABank, LoRAError, LoRALayer, layer_problem, linear_layers

log = logging.getLogger(__name__)

__all__ = ["LoRAError", "load_lora", "lora_from_state_dict"]

_LIST_LIMIT = 10
PEFT_FILE = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"

_PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "transformer.", "model.",
             "lora_unet_", "lora_transformer_")
_PART = re.compile(r"(?P<module>.+?)\.(?P<kind>lora_A|lora_B|lora_down|lora_up)(?:\.default)?\.weight|"
                   r"(?P<amodule>.+?)\.alpha")
_DOWN = {"lora_A": "down", "lora_down": "down", "lora_B": "up", "lora_up": "up"}


def load_lora(path: str | Path, bank: LoRABank, name: str) -> LoRA:
    """Read a LoRA file (or a PEFT adapter directory), check it against ``bank``'s model and install it."""
    path = Path(path)
    file = path / PEFT_FILE if path.is_dir() else path
    if not file.is_file():
        raise LoRAError(f"LoRA {name!r}: file not found: {file}")
    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            state = {key: handle.get_tensor(key) for key in handle.keys()}
    except Exception as exc:  # safetensors raises its own error types for corrupt/truncated files
        raise LoRAError(f"LoRA {name!r}: cannot read safetensors file {file}: {exc}") from exc
    lora = lora_from_state_dict(state, bank.model, name, _peft_config(file.parent / PEFT_CONFIG), str(file))
    bank.add(lora)
    log.info("loaded LoRA %r from %s: rank %d on %d layers", name, file, lora.rank, len(lora.layers))
    return lora


def _peft_config(file: Path) -> dict[str, Any] | None:
    if not file.is_file():
        return None
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"cannot read PEFT adapter config {file}: {exc}") from exc
    if not isinstance(config, dict):
        raise LoRAError(f"{file} is not a PEFT adapter config")
    if config.get("use_dora"):
        raise LoRAError(f"{file}: DoRA adapters (use_dora) are not supported, only plain LoRA")
    alpha = config.get("lora_alpha", 1)
    # json reads NaN and Infinity; a string or a bool is no alpha either.
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise LoRAError(f"{file}: lora_alpha must be a finite number, got {alpha!r}")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoRAError(f"{file}: per-layer rank_pattern/alpha_pattern is not supported; give each layer's "
                        "alpha as a '<module>.alpha' tensor instead")
    return config


def lora_from_state_dict(state: Mapping[str, torch.Tensor], model: torch.nn.Module, name: str,
                         peft_config: Mapping[str, Any] | None = None, source: str = "state dict") -> LoRA:
    """Map the tensors of a LoRA file onto ``model``'s linear layers (original Wan module names)."""
    targets = linear_layers(model)
    lookup = _module_lookup(targets)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    unknown, foreign = [], []
    for key, tensor in state.items():
        match = _PART.fullmatch(_strip_prefix(key))
        if match is None:
            foreign.append(key)
            continue
        module = match.group("module") or match.group("amodule")
        kind = _DOWN[match.group("kind")] if match.group("kind") else "alpha"
        target = lookup.get(module)
        if target is None:
            unknown.append(f"{key} (module {module})")
            continue
        if kind in parts.setdefault(target, {}):
            raise LoRAError(f"LoRA {name!r} ({source}): two tensors give the {kind} of {target} (one is {key})")
        parts[target][kind] = tensor
    problems = []
    if foreign:
        problems.append(f"{len(foreign)} tensors that are not LoRA factors (lora_A/lora_B, lora_down/lora_up or "
                        f"alpha): {_listing(foreign)}")
    if unknown:
        problems.append(f"{len(unknown)} tensors for layers this model lacks or a LoRA cannot patch: "
                        f"{_listing(unknown)}")
    layers: dict[str, LoRALayer] = {}
    for target, found in sorted(parts.items()):
        problem = _layer_problem(target, found, targets[target])
        if problem:
            problems.append(problem)
            continue
        down, up = found["down"].float(), found["up"].float()
        layer = LoRALayer(down, up, _scale(found.get("alpha"), down.shape[0], peft_config))
        problem = layer_problem(layer)
        if problem:
            problems.append(f"{target}: {problem}")
            continue
        layers[target] = layer
    if problems:
        raise LoRAError(f"LoRA {name!r} ({source}) does not fit the model: " + "; ".join(problems))
    if not layers:
        raise LoRAError(f"LoRA {name!r} ({source}) holds no LoRA tensors (expected keys like "
                        "'blocks.0.attn1.to_q.lora_A.weight' or 'diffusion_model.blocks.0.self_attn.q.lora_down.weight')")
    return LoRA(name, layers)


def _layer_problem(target: str, found: Mapping[str, torch.Tensor], linear: torch.nn.Linear) -> str | None:
    missing = [k for k in ("down", "up") if k not in found]
    if missing:
        return f"{target} has no {' and no '.join(missing)} factor"
    down, up = found["down"], found["up"]
    if down.ndim != 2 or up.ndim != 2:
        return f"{target}: factors must be matrices, got down {list(down.shape)} and up {list(up.shape)}"
    if down.shape[0] != up.shape[1]:
        return f"{target}: rank mismatch, down {list(down.shape)} has rank {down.shape[0]}, up {list(up.shape)} " \
               f"has rank {up.shape[1]}"
    if down.shape[1] != linear.in_features or up.shape[0] != linear.out_features:
        return (f"{target}: down {list(down.shape)} and up {list(up.shape)} do not fit the layer's "
                f"{linear.in_features} -> {linear.out_features} (expected down [r, {linear.in_features}], "
                f"up [{linear.out_features}, r])")
    if down.shape[0] == 0:
        return f"{target}: rank 0, down {list(down.shape)} and up {list(up.shape)} are empty"
    alpha = found.get("alpha")
    if alpha is not None and alpha.numel() != 1:
        return f"{target}: alpha must be one number, got a tensor of shape {list(alpha.shape)}"
    if alpha is not None and not math.isfinite(float(alpha)):
        return f"{target}: alpha must be a finite number, got {float(alpha)}"
    return None


def _scale(alpha: torch.Tensor | None, rank: int, peft_config: Mapping[str, Any] | None) -> float:
    if alpha is not None:
        return float(alpha) / rank
    if peft_config is None or "lora_alpha" not in peft_config:
        return 1.0
    denominator = math.sqrt(rank) if peft_config.get("use_rslora") else rank
    return float(peft_config["lora_alpha"]) / denominator  # checked a finite number by _peft_config


def _strip_prefix(key: str) -> str:
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def _module_lookup(targets: Mapping[str, torch.nn.Linear]) -> dict[str, str]:
    """File module name (original, diffusers, or either flattened kohya-style) -> original module name."""
    lookup = {}
    for original in targets:
        names = [original]
        diffusers = original_to_diffusers_key(original + ".weight")
        if diffusers is not None:
            names.append(diffusers.removesuffix(".weight"))
        for n in names:
            lookup[n] = original
            lookup[n.replace(".", "_")] = original
    return lookup


def _listing(items: list[str]) -> str:
    shown = ", ".join(sorted(items)[:_LIST_LIMIT])
    return shown + (f", ... and {len(items) - _LIST_LIMIT} more" if len(items) > _LIST_LIMIT else "")
