"""Tiny streaming video VAE (TAEHV-style): 2D convs per frame, 4x temporal and 8x spatial compression.

Encoder: each pixel frame goes through a small 2D conv stack to 1/8 resolution; every 4 consecutive
frames are fused (channel concat + 1x1 conv) into one latent frame; a memory block mixes in the
previous latent frame's features (one latent frame of memory, kept in an explicit cache). The decoder
mirrors it: memory block over the previous latent's features, 1x1 conv expands one latent frame into
4 per-frame feature maps, then a 2D upsampling stack per frame. Causality is by construction: latent
frame k depends on pixel frames [4k-3, 4k] and, through memory, only on earlier ones; so encoding or
decoding chunk by chunk equals doing the whole clip at once.

Stream convention (engine.vae.StreamVAE): the first pixel frame of a stream is encoded alone, as a
group of four copies of itself (Wan's 1 + 4k layout); decoding the first latent returns that one
frame. Latents are normalised per channel with statistics stored in the module (``latent_mean`` /
``latent_std``, measured on training data after the autoencoder is trained).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class TinyVAEConfig:
    latent_channels: int = 32
    enc_channels: tuple[int, int] = (64, 96)  # at 1/4 and 1/8 resolution
    dec_channels: tuple[int, int] = (96, 64)  # at 1/8 and 1/4 resolution
    temporal_compression: int = 4

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> TinyVAEConfig:
        unknown = set(data) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ValueError(f"unknown TinyVAEConfig fields: {sorted(unknown)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})  # type: ignore[arg-type]


def _conv(cin: int, cout: int, stride: int = 1, k: int = 3) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2)


class _ResBlock(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = _conv(ch, ch), _conv(ch, ch)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv2(F.relu(self.conv1(x)))


class _Memory(nn.Module):
    """h_k = x_k + conv(relu(conv([x_k, x_{k-1}]))): one step of temporal memory, zeros before the start."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = _conv(2 * ch, ch), _conv(ch, ch)

    def forward(self, x: Tensor, prev: Tensor) -> Tensor:
        return x + self.conv2(F.relu(self.conv1(torch.cat([x, prev], dim=1))))


@dataclass
class TinyVAECache:
    """Causal state of one stream: features of the previous latent frame (None before the first)."""

    prev: Tensor | None = None
    frames_seen: int = 0
    extra: dict[str, Tensor] = field(default_factory=dict)


class TinyVAE(nn.Module):
    spatial_compression = 8
    latent_mean: Tensor
    latent_std: Tensor

    def __init__(self, config: TinyVAEConfig) -> None:
        super().__init__()
        self.config = config
        self.latent_channels = config.latent_channels
        self.temporal_compression = config.temporal_compression
        e2, e3 = config.enc_channels
        d3, d2 = config.dec_channels
        tc = config.temporal_compression
        # Full and half resolution are reached by pixel (un)shuffle only: convolutions start at 1/4
        # resolution, which is what keeps training and 256x256 streaming cheap on a CPU.
        self.enc_frame = nn.Sequential(
            nn.PixelUnshuffle(4), _conv(48, e2), nn.ReLU(),
            _conv(e2, e3, stride=2), nn.ReLU(),
            _ResBlock(e3),
        )
        # Linear paths: a group of tc frames (channels stacked) <-> latent, one 8x8 patch per latent cell.
        # Initialised by PCA (``init_linear_from_pca``) they give a usable autoencoder from step 0; the
        # convolutional branches (output convs zero-initialised) learn the nonlinear remainder.
        self.enc_lin = nn.Conv2d(3 * tc, config.latent_channels, 8, stride=8)
        self.dec_lin = nn.ConvTranspose2d(config.latent_channels, 3 * tc, 8, stride=8)
        self.enc_fuse = nn.Conv2d(tc * e3, e3, 1)
        self.enc_memory = _Memory(e3)
        self.enc_out = _conv(e3, config.latent_channels)
        self.dec_in = _conv(config.latent_channels, d3)
        self.dec_memory = _Memory(d3)
        self.dec_split = nn.Conv2d(d3, tc * d3, 1)
        self.dec_frame = nn.Sequential(
            nn.ReLU(), _ResBlock(d3),
            nn.Upsample(scale_factor=2, mode="nearest"), _conv(d3, d2), nn.ReLU(),
            _ResBlock(d2), nn.ReLU(),
            _conv(d2, 48), nn.PixelShuffle(4),
        )
        self._init_weights()
        self.register_buffer("latent_mean", torch.zeros(config.latent_channels))
        self.register_buffer("latent_std", torch.ones(config.latent_channels))

    def _init_weights(self) -> None:
        # PyTorch's default conv init shrinks the signal layer after layer in a norm-free ReLU stack
        # (the untrained decoder outputs ~0.03 std), which stalls training for hundreds of steps.
        # He init keeps activations at unit scale; residual branches start as the identity.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                nn.init.zeros_(m.bias)  # type: ignore[arg-type]
        for m in self.modules():
            if isinstance(m, _ResBlock | _Memory):
                nn.init.zeros_(m.conv2.weight)
        nn.init.zeros_(self.enc_out.weight)
        dec_out = self.dec_frame[-2]
        assert isinstance(dec_out, nn.Conv2d)
        nn.init.zeros_(dec_out.weight)

    @torch.no_grad()
    def init_linear_from_pca(self, groups: Tensor) -> None:
        """Set the linear paths to the top principal components of 8x8 patches of pixel groups [N, 3, tc, H, W]."""
        tc, c = self.temporal_compression, self.latent_channels
        stacked = groups.flatten(1, 2)  # [N, 3*tc, H, W], channel index = colour*tc + frame
        mean = stacked.mean(dim=(0, 2, 3))
        patches = F.unfold(stacked - mean.view(1, -1, 1, 1), 8, stride=8)  # [N, 3*tc*64, L]
        data = patches.transpose(1, 2).reshape(-1, patches.shape[1]).double()
        _, _, v = torch.linalg.svd(data[: min(len(data), 20000)], full_matrices=False)
        comps = v[:c].float()  # [C, 3*tc*64], rows orthonormal
        weight = comps.reshape(c, 3 * tc, 8, 8)
        assert self.enc_lin.bias is not None and self.dec_lin.bias is not None
        self.enc_lin.weight.copy_(weight)
        self.enc_lin.bias.copy_(-(weight.sum(dim=(2, 3)) * mean.view(1, -1)).sum(dim=1))
        self.dec_lin.weight.copy_(weight)
        self.dec_lin.bias.copy_(mean)

    # -- raw (unnormalised) group-wise autoencoder, used by training ---------------------------------

    def encode_groups(self, groups: Tensor, prev: Tensor | None) -> tuple[Tensor, Tensor]:
        """Pixel groups [B, 3, K*tc, H, W] -> raw latents [B, C, K, H/8, W/8] and the last group's features."""
        b, _, t, h, w = groups.shape
        tc = self.temporal_compression
        if t % tc:
            raise ValueError(f"encode_groups needs a multiple of {tc} frames, got {t}")
        if h % 8 or w % 8:
            raise ValueError(f"frame size {h}x{w} must be divisible by 8")
        k = t // tc
        lin = self.enc_lin(groups.reshape(b, 3, k, tc, h, w).transpose(1, 2).reshape(b * k, 3 * tc, h, w))
        lin = lin.unflatten(0, (b, k))
        feats = self.enc_frame(groups.transpose(1, 2).reshape(b * t, 3, h, w))
        feats = feats.reshape(b, k, tc * feats.shape[1], h // 8, w // 8)
        fused = self.enc_fuse(feats.flatten(0, 1)).unflatten(0, (b, k))
        out = []
        for i in range(k):
            cur = fused[:, i]
            mem = self.enc_memory(cur, torch.zeros_like(cur) if prev is None else prev)
            out.append(lin[:, i] + self.enc_out(F.relu(mem)))
            prev = cur
        assert prev is not None
        return torch.stack(out, dim=2), prev

    def decode_groups(self, latents: Tensor, prev: Tensor | None) -> tuple[Tensor, Tensor]:
        """Raw latents [B, C, K, h, w] -> pixels [B, 3, K*tc, 8h, 8w] and the last latent's features."""
        b, _, k, h, w = latents.shape
        tc = self.temporal_compression
        frames = []
        for i in range(k):
            cur = self.dec_in(latents[:, :, i])
            mem = self.dec_memory(cur, torch.zeros_like(cur) if prev is None else prev)
            prev = cur
            split = self.dec_split(F.relu(mem)).unflatten(1, (tc, -1)).flatten(0, 1)
            lin = self.dec_lin(latents[:, :, i]).unflatten(1, (3, tc)).transpose(1, 2)  # [B, tc, 3, H, W]
            frames.append(lin + self.dec_frame(split).unflatten(0, (b, tc)))
        assert prev is not None
        return torch.cat(frames, dim=1).transpose(1, 2), prev

    # -- StreamVAE protocol ---------------------------------------------------------------------------

    def new_encoder_cache(self) -> TinyVAECache:
        return TinyVAECache()

    def new_decoder_cache(self) -> TinyVAECache:
        return TinyVAECache()

    def normalize(self, raw: Tensor) -> Tensor:
        return (raw - self.latent_mean.view(1, -1, 1, 1, 1)) / self.latent_std.view(1, -1, 1, 1, 1)

    def denormalize(self, z: Tensor) -> Tensor:
        return z * self.latent_std.view(1, -1, 1, 1, 1) + self.latent_mean.view(1, -1, 1, 1, 1)

    def encode_chunk(self, frames: Tensor, cache: TinyVAECache) -> Tensor:
        """Pixel frames [B, 3, T, H, W] in [-1, 1] -> normalised latents; T = 1 + 4k first, then 4k."""
        if frames.ndim != 5 or frames.shape[1] != 3:
            raise ValueError(f"frames must be [B, 3, T, H, W], got {tuple(frames.shape)}")
        tc = self.temporal_compression
        t = frames.shape[2]
        if cache.frames_seen == 0:
            if t % tc != 1:
                raise ValueError(f"the first chunk of a stream needs 1 + {tc}k frames, got {t}")
            first = frames[:, :, :1].expand(-1, -1, tc, -1, -1)
            frames = torch.cat([first, frames[:, :, 1:]], dim=2)
        elif t % tc:
            raise ValueError(f"after the first chunk, chunks need a multiple of {tc} frames, got {t}")
        raw, cache.prev = self.encode_groups(frames, cache.prev)
        cache.frames_seen += t
        return self.normalize(raw)

    def decode_chunk(self, latents: Tensor, cache: TinyVAECache) -> Tensor:
        """Normalised latents [B, C, K, h, w] -> pixel frames in [-1, 1] (the first latent gives 1 frame)."""
        if latents.ndim != 5 or latents.shape[1] != self.latent_channels:
            raise ValueError(f"latents must be [B, {self.latent_channels}, K, h, w], got {tuple(latents.shape)}")
        pixels, cache.prev = self.decode_groups(self.denormalize(latents), cache.prev)
        if cache.frames_seen == 0:
            # The first group encoded four copies of frame 0; its last decoded frame stands for it.
            pixels = pixels[:, :, self.temporal_compression - 1 :]
        cache.frames_seen += pixels.shape[2]
        return pixels.clamp(-1.0, 1.0)
