"""The Wan 2.1 video VAE (4x time, 8x space, 16 latent channels), driven chunk by chunk.

Same architecture and parameter names as the original ``Wan2.1_VAE.pth`` (``wan/modules/vae.py``);
diffusers' ``AutoencoderKLWan`` is the same network under other names (see ``original_to_diffusers_keys``).

Streaming. All temporal context lives in a ``WanVAECache`` owned by the caller: each causal 3D conv
keeps the last 2 input frames it saw, the temporal downsampler its last input frame, the temporal
upsampler its 2 frames of history. The temporal resamplers treat the first frame of a stream
specially (it is encoded alone, and decodes to a single frame), exactly like the reference, but
here that rule is tied to the stream start rather than to the call. So any split of a stream into
chunks gives the same result: encoding 1, 4, 4, ... frames per call (the reference schedule) or the
whole clip in one call, decoding one latent frame per call or all of them at once.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.vae import check_chunk_frames

log = logging.getLogger(__name__)

LATENTS_MEAN: tuple[float, ...] = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
LATENTS_STD: tuple[float, ...] = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)  # fmt: skip

CACHE_FRAMES = 2  # causal context of every 3x3x3 conv


@dataclass(frozen=True)
class WanVAEConfig:
    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temporal_downsample: tuple[bool, ...] = (False, True, True)
    latents_mean: tuple[float, ...] = LATENTS_MEAN
    latents_std: tuple[float, ...] = LATENTS_STD

    def __post_init__(self) -> None:
        if len(self.temporal_downsample) != len(self.dim_mult) - 1:
            raise ValueError(
                f"temporal_downsample needs {len(self.dim_mult) - 1} entries (one per downsampling stage), "
                f"got {self.temporal_downsample}"
            )
        if len(self.latents_mean) != self.z_dim or len(self.latents_std) != self.z_dim:
            raise ValueError(
                f"latents_mean/std need z_dim={self.z_dim} entries, got {len(self.latents_mean)}/{len(self.latents_std)}"
            )
        if self.base_dim % 2:
            raise ValueError(f"base_dim must be even (upsamplers halve channels), got {self.base_dim}")

    @classmethod
    def tiny(cls) -> WanVAEConfig:
        """A few channels, one res block per stage: the real topology at test speed."""
        return cls(base_dim=4, num_res_blocks=1)

    @property
    def temporal_compression(self) -> int:
        return 2 ** sum(self.temporal_downsample)

    @property
    def spatial_compression(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)


@dataclass
class WanVAECache:
    """Causal state of one stream's encoder or decoder: plain tensors keyed by module name."""

    kind: str  # "encoder" or "decoder"
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    frames_seen: int = 0  # pixel frames encoded / latent frames decoded so far

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> WanVAECache:
        return WanVAECache(
            self.kind, {k: v.to(device=device, dtype=dtype) for k, v in self.tensors.items()}, self.frames_seen
        )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "frames_seen": self.frames_seen, "tensors": dict(self.tensors)}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> WanVAECache:
        missing = {"kind", "frames_seen", "tensors"} - state.keys()
        if missing:
            raise ValueError(f"VAE cache state lacks {sorted(missing)}")
        return cls(str(state["kind"]), dict(state["tensors"]), int(state["frames_seen"]))


Cache = dict[str, torch.Tensor]


class RMSNorm(nn.Module):
    """Channel RMS norm: L2-normalise over channels, times sqrt(C)·gamma (no bias in Wan 2.1)."""

    def __init__(self, dim: int, images: bool) -> None:
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim, 1, 1) if images else torch.ones(dim, 1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 for half types: the squared sum overflows/underflows otherwise.
        normed = F.normalize(x.float() if x.element_size() < 4 else x, dim=1).to(x.dtype)
        return normed * self.scale * self.gamma


class CausalConv3d(nn.Conv3d):
    """Conv3d whose temporal padding is all in front, taken from the stream's cache when it has one."""

    cache_key = ""  # set by WanVAE to the module's name

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        kernel: int | tuple[int, int, int],
        stride: int | tuple[int, int, int] = 1,
        padding: int | tuple[int, int, int] = 0,
    ) -> None:
        pad = (padding,) * 3 if isinstance(padding, int) else padding
        super().__init__(in_dim, out_dim, kernel, stride=stride, padding=(0, pad[1], pad[2]))
        self.context = 2 * pad[0]

    def forward(self, x: torch.Tensor, cache: Cache | None = None) -> torch.Tensor:
        if self.context == 0:
            return super().forward(x)
        if cache is None:
            raise ValueError(f"{self.cache_key or 'causal conv'} needs a cache dict")
        past = cache.get(self.cache_key)
        seq = x if past is None else torch.cat([past.to(x.dtype), x], dim=2)
        cache[self.cache_key] = seq[:, :, -self.context :].clone()
        missing = self.context - (0 if past is None else past.shape[2])
        if missing > 0:
            seq = F.pad(seq, (0, 0, 0, 0, missing, 0))
        return super().forward(seq)


class ResidualBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        # Sequential only for the original parameter names (residual.0/2/3/6).
        self.residual = nn.Sequential(
            RMSNorm(in_dim, images=False),
            nn.SiLU(),
            CausalConv3d(in_dim, out_dim, 3, padding=1),
            RMSNorm(out_dim, images=False),
            nn.SiLU(),
            nn.Dropout(0.0),
            CausalConv3d(out_dim, out_dim, 3, padding=1),
        )
        self.shortcut: nn.Module = CausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else nn.Identity()

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        r = self.residual
        h = r[2](r[1](r[0](x)), cache)
        h = r[6](r[4](r[3](h)), cache)
        return h + self.shortcut(x)


class AttentionBlock(nn.Module):
    """Single-head self-attention over the pixels of each frame (no temporal mixing)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, images=True)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        b, c, t, h, w = x.shape
        y = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        qkv = self.to_qkv(self.norm(y)).reshape(b * t, 1, 3 * c, h * w).permute(0, 1, 3, 2)
        q, k, v = qkv.contiguous().chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v)
        y = self.proj(y.squeeze(1).permute(0, 2, 1).reshape(b * t, c, h, w))
        return x + y.reshape(b, t, c, h, w).permute(0, 2, 1, 3, 4)


class _Upsample(nn.Upsample):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # nearest-exact in float32, as the reference does, then back to the working dtype.
        return super().forward(x.float()).type_as(x)


class Resample(nn.Module):
    """2x spatial up/down-sampling, optionally with 2x temporal up/down-sampling (the *3d modes)."""

    def __init__(self, dim: int, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.time_conv: CausalConv3d | None = None
        if mode in ("upsample2d", "upsample3d"):
            self.resample = nn.Sequential(
                _Upsample(scale_factor=(2.0, 2.0), mode="nearest-exact"), nn.Conv2d(dim, dim // 2, 3, padding=1)
            )
            if mode == "upsample3d":
                self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0))
        elif mode in ("downsample2d", "downsample3d"):
            self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=(2, 2)))
            if mode == "downsample3d":
                self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1))
        else:
            raise ValueError(f"unknown resample mode {mode!r}")

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        if self.mode == "upsample3d":
            x = self._time_upsample(x, cache)
        b, c, t, h, w = x.shape
        y = self.resample(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
        x = y.reshape(b, t, *y.shape[1:]).permute(0, 2, 1, 3, 4)
        if self.mode == "downsample3d":
            x = self._time_downsample(x, cache)
        return x

    def _time_upsample(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        """Stream frame 0 -> 1 frame; frame i >= 1 -> 2 frames from a causal conv over frames 1..i."""
        assert self.time_conv is not None
        key = self.time_conv.cache_key
        head = x[:, :, :0]
        if key not in cache:  # stream start: the first frame bypasses the temporal conv
            head, x = x[:, :, :1], x[:, :, 1:]
            cache[key] = x[:, :, :0].clone()  # started, no history yet (the conv zero-pads)
        if x.shape[2] == 0:
            return head
        b, c, t, h, w = x.shape
        y = self.time_conv(x, cache).reshape(b, 2, c, t, h, w)
        y = torch.stack((y[:, 0], y[:, 1]), dim=3).reshape(b, c, 2 * t, h, w)
        return torch.cat([head, y], dim=2)

    def _time_downsample(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        """Stream frame 0 passes through; then a stride-2 conv over frames (0,1,2), (2,3,4), ..."""
        assert self.time_conv is not None
        key = self.time_conv.cache_key
        past = cache.get(key)
        if past is None:
            if x.shape[2] % 2 != 1:
                raise RuntimeError(f"{key}: a stream must start with an odd number of frames, got {x.shape[2]}")
            head, seq = x[:, :, :1], x
        else:
            if x.shape[2] % 2 != 0:
                raise RuntimeError(f"{key}: later chunks need an even number of frames, got {x.shape[2]}")
            head, seq = x[:, :, :0], torch.cat([past.to(x.dtype), x], dim=2)
        cache[key] = x[:, :, -1:].clone()
        if seq.shape[2] < 3:
            return head
        return torch.cat([head, self.time_conv(seq)], dim=2)


def _run(layers: nn.Sequential, x: torch.Tensor, cache: Cache) -> torch.Tensor:
    for layer in layers:
        x = layer(x, cache)
    return x


class Encoder3d(nn.Module):
    def __init__(self, cfg: WanVAEConfig) -> None:
        super().__init__()
        dims = [cfg.base_dim * m for m in (1, *cfg.dim_mult)]
        self.conv1 = CausalConv3d(3, dims[0], 3, padding=1)
        blocks: list[nn.Module] = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            for _ in range(cfg.num_res_blocks):
                blocks.append(ResidualBlock(in_dim, out_dim))
                in_dim = out_dim
            if i != len(cfg.dim_mult) - 1:
                blocks.append(Resample(out_dim, "downsample3d" if cfg.temporal_downsample[i] else "downsample2d"))
        self.downsamples = nn.Sequential(*blocks)
        self.middle = nn.Sequential(ResidualBlock(dims[-1], dims[-1]), AttentionBlock(dims[-1]), ResidualBlock(dims[-1], dims[-1]))
        self.head = nn.Sequential(
            RMSNorm(dims[-1], images=False), nn.SiLU(), CausalConv3d(dims[-1], 2 * cfg.z_dim, 3, padding=1)
        )

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        x = _run(self.middle, _run(self.downsamples, self.conv1(x, cache), cache), cache)
        return self.head[2](self.head[1](self.head[0](x)), cache)


class Decoder3d(nn.Module):
    def __init__(self, cfg: WanVAEConfig) -> None:
        super().__init__()
        dims = [cfg.base_dim * m for m in (cfg.dim_mult[-1], *reversed(cfg.dim_mult))]
        temporal_upsample = tuple(reversed(cfg.temporal_downsample))
        self.conv1 = CausalConv3d(cfg.z_dim, dims[0], 3, padding=1)
        self.middle = nn.Sequential(ResidualBlock(dims[0], dims[0]), AttentionBlock(dims[0]), ResidualBlock(dims[0], dims[0]))
        blocks: list[nn.Module] = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            if i > 0:
                in_dim //= 2  # the previous stage's upsampler halved the channels
            for _ in range(cfg.num_res_blocks + 1):
                blocks.append(ResidualBlock(in_dim, out_dim))
                in_dim = out_dim
            if i != len(cfg.dim_mult) - 1:
                blocks.append(Resample(out_dim, "upsample3d" if temporal_upsample[i] else "upsample2d"))
        self.upsamples = nn.Sequential(*blocks)
        self.head = nn.Sequential(RMSNorm(dims[-1], images=False), nn.SiLU(), CausalConv3d(dims[-1], 3, 3, padding=1))

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        x = _run(self.upsamples, _run(self.middle, self.conv1(x, cache), cache), cache)
        return self.head[2](self.head[1](self.head[0](x)), cache)


class WanVAE(nn.Module):
    """The Wan 2.1 VAE as a ``engine.vae.StreamVAE``: normalised latents out of encode, into decode."""

    latents_mean: torch.Tensor
    latents_std: torch.Tensor

    def __init__(self, config: WanVAEConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = config or WanVAEConfig()
        self.latent_channels = cfg.z_dim
        self.temporal_compression = cfg.temporal_compression
        self.spatial_compression = cfg.spatial_compression
        self.encoder = Encoder3d(cfg)
        self.conv1 = CausalConv3d(2 * cfg.z_dim, 2 * cfg.z_dim, 1)
        self.conv2 = CausalConv3d(cfg.z_dim, cfg.z_dim, 1)
        self.decoder = Decoder3d(cfg)
        shape = (1, cfg.z_dim, 1, 1, 1)
        # Not persistent: the normalisation is config, not checkpoint content.
        self.register_buffer("latents_mean", torch.tensor(cfg.latents_mean).reshape(shape), persistent=False)
        self.register_buffer("latents_std", torch.tensor(cfg.latents_std).reshape(shape), persistent=False)
        for name, module in self.named_modules():
            if isinstance(module, CausalConv3d):
                module.cache_key = name
        self.memory_format = torch.contiguous_format

    def use_channels_last(self, enabled: bool = True) -> WanVAE:
        """Keep the 3-D convolutions' weights and activations channels-last (NDHWC), the layout cuDNN's
        bf16 3-D convolutions run in: in NCDHW, every convolution of a chunk is wrapped in two layout
        transposes (9 % of an H100 chunk's GPU time, beside the convolutions' 41 %). The same numbers
        either way; the streams' caches keep the layout they were made in."""
        self.memory_format = torch.channels_last_3d if enabled else torch.contiguous_format
        for module in self.modules():
            if isinstance(module, nn.Conv3d):
                module.weight.data = module.weight.data.contiguous(memory_format=self.memory_format)
            elif isinstance(module, nn.Conv2d):
                layout = torch.channels_last if enabled else torch.contiguous_format
                module.weight.data = module.weight.data.contiguous(memory_format=layout)
        return self

    def new_encoder_cache(self) -> WanVAECache:
        return WanVAECache("encoder")

    def new_decoder_cache(self) -> WanVAECache:
        return WanVAECache("decoder")

    @torch.no_grad()
    def encode_chunk(self, frames: torch.Tensor, cache: WanVAECache) -> torch.Tensor:
        """Pixels [B, 3, T, H, W] in [-1, 1] -> normalised latents [B, z, T', H/8, W/8] (posterior mean).

        T = 1 + 4k on a stream's first call (-> 1 + k latents), 4k afterwards (-> k latents).
        """
        self._check_cache(cache, "encoder")
        check_chunk_frames(frames, cache.frames_seen, self.temporal_compression, self.spatial_compression)
        x = frames.to(self._dtype).contiguous(memory_format=self.memory_format)
        mu = self.conv1(self.encoder(x, cache.tensors))[:, : self.latent_channels]
        cache.frames_seen += frames.shape[2]
        return ((mu - self.latents_mean) / self.latents_std).to(frames.dtype).contiguous()

    reads_input = False  # Wan's decoder sees the latents only

    @torch.no_grad()
    def decode_chunk(self, latents: torch.Tensor, cache: WanVAECache, guide: torch.Tensor | None = None) -> torch.Tensor:
        """Normalised latents [B, z, t, h, w] -> pixels [B, 3, T, 8h, 8w] clamped to [-1, 1].

        T = 1 + 4(t - 1) on a stream's first call, 4t afterwards.
        """
        if guide is not None:
            raise ValueError("the Wan VAE's decoder does not read input frames (reads_input is False)")
        self._check_cache(cache, "decoder")
        if latents.ndim != 5 or latents.shape[1] != self.latent_channels or latents.shape[2] == 0:
            raise ValueError(
                f"latents must be [B, {self.latent_channels}, t>0, h, w], got {tuple(latents.shape)}"
            )
        z = latents.to(self._dtype) * self.latents_std + self.latents_mean
        out = self.decoder(self.conv2(z.contiguous(memory_format=self.memory_format)), cache.tensors)
        cache.frames_seen += latents.shape[2]
        return out.clamp(-1.0, 1.0).to(latents.dtype).contiguous()

    def encode(self, frames: torch.Tensor) -> torch.Tensor:
        """Whole clip (1 + 4k frames) in one call."""
        return self.encode_chunk(frames, self.new_encoder_cache())

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Whole clip in one call."""
        return self.decode_chunk(latents, self.new_decoder_cache())

    @property
    def _dtype(self) -> torch.dtype:
        return self.conv1.weight.dtype

    @staticmethod
    def _check_cache(cache: WanVAECache, kind: str) -> None:
        if not isinstance(cache, WanVAECache) or cache.kind != kind:
            got = cache.kind if isinstance(cache, WanVAECache) else type(cache).__name__
            raise ValueError(f"expected a WanVAE {kind} cache (new_{kind}_cache()), got {got}")


# ---- checkpoint names: original Wan <-> diffusers AutoencoderKLWan ----------------------------------

_RESBLOCK_RENAMES = (
    (".residual.0.", ".norm1."),
    (".residual.2.", ".conv1."),
    (".residual.3.", ".norm2."),
    (".residual.6.", ".conv2."),
    (".shortcut.", ".conv_shortcut."),
)
_FIXED_RENAMES = (
    (r"^conv1\.", "quant_conv."),
    (r"^conv2\.", "post_quant_conv."),
    (r"^(encoder|decoder)\.conv1\.", r"\1.conv_in."),
    (r"^(encoder|decoder)\.head\.0\.", r"\1.norm_out."),
    (r"^(encoder|decoder)\.head\.2\.", r"\1.conv_out."),
    (r"^(encoder|decoder)\.middle\.0\.", r"\1.mid_block.resnets.0."),
    (r"^(encoder|decoder)\.middle\.1\.", r"\1.mid_block.attentions.0."),
    (r"^(encoder|decoder)\.middle\.2\.", r"\1.mid_block.resnets.1."),
    (r"^encoder\.downsamples\.", "encoder.down_blocks."),
)


def _decoder_block_names(cfg: WanVAEConfig) -> list[str]:
    """diffusers name of each entry of the original flat ``decoder.upsamples`` list."""
    names = []
    for stage in range(len(cfg.dim_mult)):
        names += [f"up_blocks.{stage}.resnets.{j}" for j in range(cfg.num_res_blocks + 1)]
        if stage != len(cfg.dim_mult) - 1:
            names.append(f"up_blocks.{stage}.upsamplers.0")
    return names


def original_to_diffusers_keys(config: WanVAEConfig | None = None) -> dict[str, str]:
    """Map every original Wan 2.1 VAE parameter name to its diffusers ``AutoencoderKLWan`` name."""
    cfg = config or WanVAEConfig()
    with torch.device("meta"):
        names = list(WanVAE(cfg).state_dict())
    up_names = _decoder_block_names(cfg)
    mapping = {}
    for name in names:
        new = name
        for pattern, repl in _FIXED_RENAMES:
            new = re.sub(pattern, repl, new)
        match = re.match(r"^decoder\.upsamples\.(\d+)\.", new)
        if match:
            new = f"decoder.{up_names[int(match.group(1))]}.{new[match.end():]}"
        for old, repl in _RESBLOCK_RENAMES:
            new = new.replace(old, repl)
        mapping[name] = new
    return mapping


def diffusers_to_original(state_dict: Mapping[str, torch.Tensor], config: WanVAEConfig) -> dict[str, torch.Tensor]:
    inverse = {v: k for k, v in original_to_diffusers_keys(config).items()}
    # Unknown names pass through unchanged so the strict check reports them.
    return {inverse.get(k, k): v for k, v in state_dict.items()}


def original_to_diffusers(state_dict: Mapping[str, torch.Tensor], config: WanVAEConfig) -> dict[str, torch.Tensor]:
    mapping = original_to_diffusers_keys(config)
    return {mapping.get(k, k): v for k, v in state_dict.items()}


# ---- loading ----------------------------------------------------------------------------------------

_DIFFUSERS_WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")


def config_from_diffusers(cfg: Mapping[str, Any]) -> WanVAEConfig:
    """WanVAEConfig from an ``AutoencoderKLWan`` config.json; rejects what Wan 2.1's VAE is not."""
    unsupported = {
        "is_residual": (cfg.get("is_residual", False), False),
        "patch_size": (cfg.get("patch_size"), None),
        "attn_scales": (list(cfg.get("attn_scales") or []), []),
        "in_channels": (cfg.get("in_channels", 3), 3),
        "out_channels": (cfg.get("out_channels", 3), 3),
        "decoder_base_dim": (cfg.get("decoder_base_dim") or cfg.get("base_dim", 96), cfg.get("base_dim", 96)),
    }
    bad = {k: got for k, (got, want) in unsupported.items() if got != want}
    if bad:
        raise ValueError(f"not a Wan 2.1 VAE config (Wan 2.2 or other variant?): {bad}")
    known = {f.name for f in fields(WanVAEConfig)}
    renamed = {"temperal_downsample": "temporal_downsample"}
    kwargs: dict[str, Any] = {}
    for key, value in cfg.items():
        name = renamed.get(key, key)
        if name in known:
            kwargs[name] = tuple(value) if isinstance(value, list) else value
    return WanVAEConfig(**kwargs)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} is not a flat state dict of tensors")
    return state


def check_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], source: Path,
                     what: str = "the Wan 2.1 VAE") -> None:
    """A ValueError naming every missing, unexpected and mis-shaped key of ``state`` for ``model``."""
    expected = model.state_dict()
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    misshaped = sorted(
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in expected.keys() & state.keys()
        if state[k].shape != expected[k].shape
    )
    problems = [
        f"{label} ({len(items)}): {items[:10]}{' ...' if len(items) > 10 else ''}"
        for label, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped))
        if items
    ]
    if problems:
        raise ValueError(f"{source} does not match {what}: " + "; ".join(problems))


def load_wan_vae(
    path: str | Path,
    config: WanVAEConfig | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> WanVAE:
    """Load Wan2.1_VAE.pth / .safetensors (original or diffusers names) or a diffusers VAE directory.

    A diffusers directory's config.json decides the config; for single files pass ``config``
    (default: the real Wan 2.1 VAE). Loading is strict: any missing, unexpected or mis-shaped key
    raises a ValueError listing them.
    """
    path = Path(path)
    if path.is_dir():
        root = path / "vae" if (path / "vae" / "config.json").is_file() else path
        config_file = root / "config.json"
        weights = next((root / n for n in _DIFFUSERS_WEIGHT_FILES if (root / n).is_file()), None)
        if not config_file.is_file() or weights is None:
            raise FileNotFoundError(
                f"{root} is not a diffusers VAE directory: needs config.json and one of {_DIFFUSERS_WEIGHT_FILES}"
            )
        config = config_from_diffusers(json.loads(config_file.read_text()))
    elif path.is_file():
        weights = path
    else:
        raise FileNotFoundError(f"no VAE weights at {path}")
    cfg = config or WanVAEConfig()
    state = read_weights(weights)
    if any(k.startswith(("quant_conv.", "encoder.down_blocks.", "decoder.up_blocks.")) for k in state):
        state = diffusers_to_original(state, cfg)
    with torch.device("meta"):
        model = WanVAE(cfg)
    check_state_dict(model, state, weights)
    model.load_state_dict(state, strict=True, assign=True)
    # Buffers were built on meta; rebuild them from the config.
    shape = (1, cfg.z_dim, 1, 1, 1)
    model.latents_mean = torch.tensor(cfg.latents_mean).reshape(shape)
    model.latents_std = torch.tensor(cfg.latents_std).reshape(shape)
    log.info("loaded Wan 2.1 VAE from %s (%d tensors)", weights, len(state))
    return for_device(model.to(device=device, dtype=dtype).eval())


def for_device(vae: WanVAE) -> WanVAE:
    """The layout and kernels the VAE's device wants: on CUDA channels-last convolutions
    (:meth:`WanVAE.use_channels_last`) and cuDNN's autotuner (it times its algorithms once per new
    convolution shape, on a stream's first chunks at a size, and keeps the fastest); unchanged on a CPU,
    where channels-last measured no faster."""
    if vae.latents_mean.device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        vae.use_channels_last()
    return vae
