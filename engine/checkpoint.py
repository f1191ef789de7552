"""Strict loading (and saving) of Wan 2.1 DiT weights into :class:`CausalWanDiT`.

Layouts, detected from file names and tensor names:

* original Wan keys: one safetensors file, or a directory of safetensors shards (Wan's own HF repos name
  them ``diffusion_pytorch_model-*.safetensors`` but keep the original keys);
* CausVid / Self-Forcing / StreamDiffusionV2 torch pickles (``.pt``): weights under ``generator`` /
  ``generator_ema`` / ``state_dict``, keys prefixed ``model.``;
* diffusers: a directory with ``config.json`` + ``diffusion_pytorch_model*.safetensors`` (sharded with an
  index json or not; a pipeline directory's ``transformer/`` works too), or one diffusers safetensors file.

The model is built on the ``meta`` device and every tensor is read from a memory-mapped source, converted
and assigned one at a time, so loading never holds two copies of the weights. Any missing, unexpected or
mis-shaped tensor fails the load with one :class:`CheckpointError` that lists them all.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from engine.models.wan_dit import CONFIGS, CausalWanDiT, WanDiTConfig

log = logging.getLogger(__name__)

__all__ = [
    "CheckpointError",
    "diffusers_to_original",
    "diffusers_to_original_key",
    "load_wan_dit",
    "original_to_diffusers",
    "original_to_diffusers_key",
    "save_wan_dit",
]

CONFIG_METADATA_KEY = "wan_dit_config"  # safetensors metadata written by save_wan_dit
_LIST_LIMIT = 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: unreadable file, unknown layout, or mismatching tensors."""


# --------------------------------------------------------------------------------------------------
# Key mapping original <-> diffusers (a bijection on the Wan 2.1 T2V key set)
# --------------------------------------------------------------------------------------------------

# (original, diffusers) name pairs. Entries ending in "." rename a module prefix; the others a whole name.
_TOP_LEVEL = (
    ("patch_embedding.", "patch_embedding."),
    ("text_embedding.0.", "condition_embedder.text_embedder.linear_1."),
    ("text_embedding.2.", "condition_embedder.text_embedder.linear_2."),
    ("time_embedding.0.", "condition_embedder.time_embedder.linear_1."),
    ("time_embedding.2.", "condition_embedder.time_embedder.linear_2."),
    ("time_projection.1.", "condition_embedder.time_proj."),
    ("head.head.", "proj_out."),
    ("head.modulation", "scale_shift_table"),
)
_IN_BLOCK = (
    ("modulation", "scale_shift_table"),
    *(
        (f"{orig}.{a}.", f"{diff}.{b}.")
        for orig, diff in (("self_attn", "attn1"), ("cross_attn", "attn2"))
        for a, b in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"), ("norm_q", "norm_q"),
                     ("norm_k", "norm_k"))
    ),
    # Wan's norm3 is the affine cross-attention norm; diffusers calls it norm2.
    ("norm3.", "norm2."),
    ("ffn.0.", "ffn.net.0.proj."),
    ("ffn.2.", "ffn.net.2."),
)
_BLOCK_KEY = re.compile(r"(blocks\.\d+\.)(.+)")


def _rename(key: str, to_diffusers: bool) -> str | None:
    block = _BLOCK_KEY.fullmatch(key)
    prefix, rest, table = (block.group(1), block.group(2), _IN_BLOCK) if block else ("", key, _TOP_LEVEL)
    for orig, diff in table:
        src, dst = (orig, diff) if to_diffusers else (diff, orig)
        if src.endswith("."):
            if rest.startswith(src) and rest.count(".") == src.count("."):  # exactly one leaf name after it
                return prefix + dst + rest[len(src) :]
        elif rest == src:
            return prefix + dst
    return None


def original_to_diffusers_key(key: str) -> str | None:
    """Diffusers name of an original Wan tensor name; None when the name is not a Wan 2.1 T2V tensor."""
    return _rename(key, to_diffusers=True)


def diffusers_to_original_key(key: str) -> str | None:
    """Original Wan name of a diffusers tensor name; None when the name is not a Wan 2.1 T2V tensor."""
    return _rename(key, to_diffusers=False)


_V = TypeVar("_V")


def _rename_all(state: Mapping[str, _V], rename: Callable[[str], str | None], what: str) -> dict[str, _V]:
    out, unknown = {}, []
    for key, value in state.items():
        new = rename(key)
        if new is None:
            unknown.append(key)
        else:
            out[new] = value
    if unknown:
        raise CheckpointError(f"not {what} Wan 2.1 tensor names: {_listing(unknown)}")
    return out


def original_to_diffusers(state: Mapping[str, _V]) -> dict[str, _V]:
    return _rename_all(state, original_to_diffusers_key, "original")


def diffusers_to_original(state: Mapping[str, _V]) -> dict[str, _V]:
    return _rename_all(state, diffusers_to_original_key, "diffusers")


def _listing(items: Iterable[str]) -> str:
    items = sorted(items)
    shown = ", ".join(items[:_LIST_LIMIT])
    return shown + (f", ... and {len(items) - _LIST_LIMIT} more" if len(items) > _LIST_LIMIT else "")


# --------------------------------------------------------------------------------------------------
# Sources: tensor names (original layout) -> lazy loaders over memory-mapped files
# --------------------------------------------------------------------------------------------------


@dataclass
class _Source:
    description: str
    loaders: dict[str, Callable[[], torch.Tensor]]  # original-layout name -> tensor
    shapes: dict[str, tuple[int, ...]]
    unknown: list[str]  # names in the file that are not Wan tensors (as written in the file)
    config: WanDiTConfig | None = None


_PREFIXES = ("model.diffusion_model.", "model.", "_orig_mod.", "")


def _normalise_names(names: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """Map file names to original-layout names: strip a wrapper prefix, undo diffusers renames."""
    names = list(names)
    prefix = next(p for p in _PREFIXES if all(n.startswith(p) for n in names))
    stripped = [n[len(prefix) :] for n in names]
    diffusers = any(s.startswith(("condition_embedder.", "proj_out.")) or ".attn1." in s for s in stripped)
    rename = diffusers_to_original_key if diffusers else (lambda s: s if original_to_diffusers_key(s) else None)
    mapping, unknown = {}, []
    for name, s in zip(names, stripped, strict=True):
        new = rename(s)
        if new is None:
            unknown.append(name)
        else:
            mapping[new] = name
    return mapping, unknown


def _safetensors_source(files: list[Path], stack: ExitStack, description: str) -> _Source:
    loaders: dict[str, Callable[[], torch.Tensor]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    unknown: list[str] = []
    config = None
    for file in files:
        try:
            handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            names = list(handle.keys())
            file_shapes = {n: tuple(handle.get_slice(n).get_shape()) for n in names}
            meta = handle.metadata() or {}
        except Exception as exc:  # safetensors raises its own error types for corrupt/truncated files
            raise CheckpointError(f"cannot read safetensors file {file}: {exc}") from exc
        if CONFIG_METADATA_KEY in meta:
            config = _config_from_dict(json.loads(meta[CONFIG_METADATA_KEY]), file)
        mapping, file_unknown = _normalise_names(names)
        unknown += file_unknown
        for new, name in mapping.items():
            loaders[new] = _safetensors_loader(handle, name, file)
            shapes[new] = file_shapes[name]
    return _Source(description, loaders, shapes, unknown, config)


def _safetensors_loader(handle: Any, name: str, file: Path) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        try:
            return handle.get_tensor(name)
        except Exception as exc:
            raise CheckpointError(f"cannot read tensor {name!r} from {file}: {exc}") from exc

    return load


def _torch_source(file: Path, ema: bool | None) -> _Source:
    try:
        obj = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as exc:
        if "mmap" not in str(exc):
            raise CheckpointError(f"cannot read torch checkpoint {file}: {exc}") from exc
        # Legacy (non-zip) pickles cannot be memory-mapped; they load fully, once.
        log.warning("%s is a legacy torch pickle; loading it without mmap", file)
        try:
            obj = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc2:
            raise CheckpointError(f"cannot read torch checkpoint {file}: {exc2}") from exc2
    except Exception as exc:
        raise CheckpointError(f"cannot read torch checkpoint {file}: {exc}") from exc
    state = _pick_state_dict(obj, ema, file)
    mapping, unknown = _normalise_names(state)
    return _Source(
        f"torch checkpoint {file}",
        {new: _constant(state[name]) for new, name in mapping.items()},
        {new: tuple(state[name].shape) for new, name in mapping.items()},
        unknown,
    )


def _constant(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: tensor


def _pick_state_dict(obj: Any, ema: bool | None, file: Path) -> dict[str, torch.Tensor]:
    if not isinstance(obj, dict):
        raise CheckpointError(f"{file} holds a {type(obj).__name__}, not a state dict")
    nested = [k for k in ("generator_ema", "generator", "state_dict") if isinstance(obj.get(k), dict)]
    if ema is not None:
        key = "generator_ema" if ema else "generator"
        if key not in nested:
            raise CheckpointError(f"{file} has no {key!r} entry (top-level entries: {_listing(map(str, obj))})")
    elif nested:
        key = nested[0]
    elif obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    else:
        raise CheckpointError(f"{file}: no weights under generator / generator_ema / state_dict "
                              f"(top-level entries: {_listing(map(str, obj))})")
    log.info("loading %s[%r]", file, key)
    return obj[key]


def _open_source(path: Path, ema: bool | None, stack: ExitStack) -> _Source:
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.is_dir():
        return _directory_source(path, stack)
    if path.suffix == ".safetensors":
        if ema is not None:
            raise CheckpointError(f"ema={ema} only applies to CausVid/Self-Forcing .pt files, not {path}")
        return _safetensors_source([path], stack, f"safetensors file {path}")
    return _torch_source(path, ema)


def _directory_source(path: Path, stack: ExitStack) -> _Source:
    if not (path / "config.json").exists() and (path / "transformer" / "config.json").exists():
        path = path / "transformer"  # a diffusers pipeline directory
    index = sorted(path.glob("*.safetensors.index.json"))
    if index:
        try:
            weight_map = json.loads(index[0].read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"cannot read shard index {index[0]}: {exc}") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"shards listed in {index[0]} are missing: {_listing(missing)}")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors files in directory {path}")
    source = _safetensors_source(files, stack, f"directory {path} ({len(files)} safetensors file(s))")
    source.config = source.config or _json_config_beside(path)
    return source


# --------------------------------------------------------------------------------------------------
# Configuration: config.json (diffusers or original Wan), safetensors metadata, or tensor shapes
# --------------------------------------------------------------------------------------------------


def _json_config_beside(directory: Path) -> WanDiTConfig | None:
    file = directory / "config.json"
    if not file.exists():
        return None
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {file}: {exc}") from exc
    return _config_from_dict(raw, file)


def _config_from_dict(raw: dict[str, Any], file: Path) -> WanDiTConfig:
    """WanDiTConfig from our own metadata, a diffusers WanTransformer3DModel config, or Wan's WanModel config."""
    fields = {f.name for f in dataclasses.fields(WanDiTConfig)}
    try:
        if "num_attention_heads" in raw:  # diffusers
            unsupported = {
                "qk_norm": raw.get("qk_norm", "rms_norm_across_heads") != "rms_norm_across_heads",
                "cross_attn_norm": raw.get("cross_attn_norm", True) is not True,
                "image_dim": raw.get("image_dim") is not None,
                "added_kv_proj_dim": raw.get("added_kv_proj_dim") is not None,
            }
            if any(unsupported.values()):
                bad = {k: raw.get(k) for k, v in unsupported.items() if v}
                raise CheckpointError(f"{file}: only Wan 2.1 T2V models are supported, got {bad}")
            return WanDiTConfig(
                dim=raw["num_attention_heads"] * raw["attention_head_dim"],
                ffn_dim=raw["ffn_dim"],
                num_heads=raw["num_attention_heads"],
                num_layers=raw["num_layers"],
                in_channels=raw["in_channels"],
                out_channels=raw.get("out_channels") or raw["in_channels"],
                patch_size=tuple(raw.get("patch_size", (1, 2, 2))),
                text_dim=raw["text_dim"],
                freq_dim=raw["freq_dim"],
                eps=raw.get("eps", 1e-6),
                rope_max_positions=raw.get("rope_max_seq_len", 1024),
            )
        if "in_dim" in raw:  # Wan's own config.json (WanModel)
            if raw.get("model_type", "t2v") != "t2v":
                raise CheckpointError(f"{file}: only Wan 2.1 T2V models are supported, got {raw['model_type']!r}")
            return WanDiTConfig(
                dim=raw["dim"], ffn_dim=raw["ffn_dim"], num_heads=raw["num_heads"], num_layers=raw["num_layers"],
                in_channels=raw["in_dim"], out_channels=raw["out_dim"],
                patch_size=tuple(raw.get("patch_size", (1, 2, 2))), text_dim=raw.get("text_dim", 4096),
                text_len=raw.get("text_len", 512), freq_dim=raw["freq_dim"], eps=raw.get("eps", 1e-6),
            )
        values = {k: v for k, v in raw.items() if k in fields}
        values["patch_size"] = tuple(values.get("patch_size", (1, 2, 2)))
        return WanDiTConfig(**values)
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{file}: not a usable Wan DiT config ({exc!r})") from exc


def config_to_dict(config: WanDiTConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def infer_config(shapes: Mapping[str, tuple[int, ...]]) -> WanDiTConfig:
    """Config from tensor shapes (original names). Head count is not in the shapes: a named config with the
    same shapes supplies it, else Wan's head_dim of 128 does."""
    try:
        dim, in_channels, *patch = shapes["patch_embedding.weight"]
        num_layers = len({k.split(".")[1] for k in shapes if k.startswith("blocks.")})
        derived: dict[str, Any] = {
            "dim": dim,
            "in_channels": in_channels,
            "patch_size": tuple(patch),
            "ffn_dim": shapes["blocks.0.ffn.0.weight"][0],
            "num_layers": num_layers,
            "out_channels": shapes["head.head.weight"][0] // math.prod(patch),
            "text_dim": shapes["text_embedding.0.weight"][1],
            "freq_dim": shapes["time_embedding.0.weight"][1],
        }
    except (KeyError, ValueError, IndexError) as exc:
        raise CheckpointError(f"cannot infer the model config from the tensor shapes (missing {exc}); "
                              "pass config=") from exc
    for name, named in CONFIGS.items():
        if all(getattr(named, k) == v for k, v in derived.items()):
            log.info("checkpoint shapes match the %r config", name)
            return named
    if dim % 128:
        raise CheckpointError(f"cannot infer the head count for dim {dim} (not a multiple of Wan's head_dim 128); "
                              "pass config=")
    log.info("inferred config from shapes with head_dim 128: %s", derived)
    return WanDiTConfig(num_heads=dim // 128, **derived)


# --------------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------------


def load_wan_dit(path: str | Path, config: WanDiTConfig | str | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, ema: bool | None = None) -> CausalWanDiT:
    """Load a Wan 2.1 T2V DiT (any supported layout) into an eval-mode :class:`CausalWanDiT`.

    ``config``: a WanDiTConfig, a name in CONFIGS, or None to take it from config.json / file metadata /
    tensor shapes. ``ema``: for CausVid/Self-Forcing files, True = ``generator_ema``, False = ``generator``,
    None = ``generator_ema`` when present (the published Self-Forcing sampling default), else ``generator``.
    """
    path = Path(path)
    if isinstance(config, str):
        if config not in CONFIGS:
            raise CheckpointError(f"unknown config {config!r}; known: {', '.join(CONFIGS)}")
        config = CONFIGS[config]
    with ExitStack() as stack:
        source = _open_source(path, ema, stack)
        config = config or source.config or infer_config(source.shapes)
        with torch.device("meta"):
            model = CausalWanDiT(config)
        _check_tensors(model, source)
        state = {}
        for name in tqdm(list(source.loaders), desc=f"loading {path.name}", unit="tensor", leave=False,
                         disable=len(source.loaders) < 100):
            state[name] = source.loaders[name]().to(device=device, dtype=dtype)
        # assign=True puts the loaded tensors in place of the meta parameters: no second copy.
        model.load_state_dict(state, strict=True, assign=True)
    log.info("loaded %s (%d tensors) as %s on %s", source.description, len(state), dtype, device)
    return model.eval()


def _check_tensors(model: CausalWanDiT, source: _Source) -> None:
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = [k for k in expected if k not in source.shapes]
    unexpected = [k for k in source.shapes if k not in expected] + source.unknown
    mismatched = [
        f"{k}: checkpoint {list(source.shapes[k])} vs model {list(shape)}"
        for k, shape in expected.items()
        if k in source.shapes and source.shapes[k] != shape
    ]
    problems = [
        f"{len(items)} {what}: {_listing(items)}"
        for what, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", mismatched))
        if items
    ]
    if problems:
        raise CheckpointError(f"{source.description} does not match the model ({model.config}): "
                              + "; ".join(problems))


def save_wan_dit(model: CausalWanDiT, path: str | Path) -> None:
    """Save weights as one safetensors file in the original Wan key layout, with the config as metadata."""
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    metadata = {"format": "pt", CONFIG_METADATA_KEY: json.dumps(config_to_dict(model.config))}
    save_file(state, str(path), metadata=metadata)
