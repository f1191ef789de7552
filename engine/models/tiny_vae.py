"""Tiny streaming video VAE: per-frame latents with causal memory, packed 4 frames to a latent frame.

Every pixel frame gets its own latent (8x spatial compression, ``latent_channels / 4`` channels):
pixel-unshuffle to 1/8 resolution, a small conv stack, and a memory block that mixes in the previous
frame's features (one frame of memory, kept in an explicit cache). The latents of 4 consecutive
frames are then stacked along channels into one latent frame, so the stream layout is Wan's (4 pixel
frames per latent frame, first chunk 1 + 4k frames) and the DiT's tokens each cover a 4-frame tube.
The decoder mirrors it per frame, ending in a pixel shuffle back to full resolution.

Why per-frame latents rather than true temporal compression: a tiny VAE that squeezes 4 frames of
motion into one latent reconstructs each frame differently from its neighbours, which shows up as
flicker (warp error) no model downstream can remove; per-frame latents keep reconstruction errors
attached to the content, and the memory blocks (trained with a temporal-difference loss) keep them
steady from frame to frame. Causality is by construction: frame t's latent depends on frames ≤ t
only, so encoding or decoding chunk by chunk equals doing the whole clip at once.

Stream convention (engine.vae.StreamVAE): the first pixel frame of a stream is encoded alone, as a
group of four copies of itself; decoding the first latent returns that one frame. Latents are
normalised with statistics stored in the module (``latent_mean`` / ``latent_std``), measured on
training data after the autoencoder is trained.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class TinyVAEConfig:
    latent_channels: int = 64  # per latent frame = temporal_compression x channels per pixel frame
    enc_channels: int = 64  # conv width of the encoder (at 1/8 resolution)
    dec_channels: int = 96  # conv width of the decoder (at 1/8 resolution)
    temporal_compression: int = 4

    def __post_init__(self) -> None:
        if self.latent_channels % self.temporal_compression:
            raise ValueError(f"latent_channels {self.latent_channels} must be a multiple of "
                             f"temporal_compression {self.temporal_compression}")

    @property
    def frame_channels(self) -> int:
        return self.latent_channels // self.temporal_compression

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> TinyVAEConfig:
        unknown = set(data) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ValueError(f"unknown TinyVAEConfig fields: {sorted(unknown)}")
        return cls(**data)  # type: ignore[arg-type]


def _conv(cin: int, cout: int, k: int = 3) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, k, padding=k // 2)


class _ResBlock(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = _conv(ch, ch), _conv(ch, ch)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv2(F.relu(self.conv1(x)))


class _Memory(nn.Module):
    """h_t = x_t + conv3(relu(conv1([x_t, x_{t-1}]))): one frame of temporal memory, zeros before the start."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = _conv(2 * ch, ch, k=1), _conv(ch, ch)

    def forward(self, x: Tensor, prev: Tensor) -> Tensor:
        return x + self.conv2(F.relu(self.conv1(torch.cat([x, prev], dim=1))))


def _previous_frames(feats: Tensor, prev: Tensor | None) -> Tensor:
    """[B, T, C, h, w] -> the same frames shifted one step later in time, ``prev`` (or zeros) first."""
    first = torch.zeros_like(feats[:, :1]) if prev is None else prev[:, None]
    return torch.cat([first, feats[:, :-1]], dim=1)


@dataclass
class TinyVAECache:
    """Causal state of one stream: features of the previous pixel frame (None before the first)."""

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
        fc, ce, cd = config.frame_channels, config.enc_channels, config.dec_channels
        patch = 3 * 8 * 8  # one 8x8 RGB patch per latent cell after pixel-unshuffle
        # Every convolution runs at 1/8 resolution (pixel (un)shuffle reaches full resolution), which is
        # what keeps 256x256 streaming at tens of frames per second on two CPU cores.
        self.enc_in = nn.Sequential(nn.PixelUnshuffle(8), _conv(patch, ce), nn.ReLU(), _ResBlock(ce))
        self.enc_memory = _Memory(ce)
        self.enc_out = _conv(ce, fc)
        # Linear paths: one 8x8 patch <-> one latent cell. Initialised by PCA (``init_linear_from_pca``)
        # they give a usable autoencoder from step 0; the conv branches (output convs zero-initialised)
        # learn the nonlinear remainder.
        self.enc_lin = nn.Conv2d(patch, fc, 1)
        self.dec_lin = nn.Conv2d(fc, patch, 1)
        self.dec_in = _conv(fc, cd)
        self.dec_memory = _Memory(cd)
        self.dec_body = nn.Sequential(nn.ReLU(), _ResBlock(cd), _ResBlock(cd), nn.ReLU(), _conv(cd, patch))
        self._init_weights()
        self.register_buffer("latent_mean", torch.zeros(config.latent_channels))
        self.register_buffer("latent_std", torch.ones(config.latent_channels))

    def _init_weights(self) -> None:
        # PyTorch's default conv init shrinks the signal layer after layer in a norm-free ReLU stack,
        # which stalls training for hundreds of steps. He init keeps activations at unit scale;
        # residual branches start as the identity and the nonlinear outputs start at zero.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                nn.init.zeros_(m.bias)  # type: ignore[arg-type]
        for m in self.modules():
            if isinstance(m, _ResBlock | _Memory):
                nn.init.zeros_(m.conv2.weight)
        nn.init.zeros_(self.enc_out.weight)
        dec_out = self.dec_body[-1]
        assert isinstance(dec_out, nn.Conv2d)
        nn.init.zeros_(dec_out.weight)

    @torch.no_grad()
    def init_linear_from_pca(self, frames: Tensor) -> None:
        """Set the linear paths to the top principal components of 8x8 patches of frames [N, 3, H, W]."""
        fc = self.config.frame_channels
        patches = F.pixel_unshuffle(frames, 8)  # [N, 192, H/8, W/8]
        data = patches.permute(0, 2, 3, 1).reshape(-1, patches.shape[1]).double()
        mean = data.mean(dim=0)
        _, _, v = torch.linalg.svd(data[: min(len(data), 20000)] - mean, full_matrices=False)
        comps = v[:fc].float()  # [fc, 192], rows orthonormal
        assert self.enc_lin.bias is not None and self.dec_lin.bias is not None
        self.enc_lin.weight.copy_(comps[:, :, None, None])
        self.enc_lin.bias.copy_(-(comps @ mean.float()))
        self.dec_lin.weight.copy_(comps.t()[:, :, None, None])
        self.dec_lin.bias.copy_(mean.float())

    # -- raw (unnormalised) autoencoder, used by training ---------------------------------------------

    def encode_frames(self, frames: Tensor, prev: Tensor | None) -> tuple[Tensor, Tensor]:
        """Pixel frames [B, 3, T, H, W] -> raw per-frame latents [B, T, fc, H/8, W/8] and the last frame's features."""
        b, _, t, h, w = frames.shape
        if h % 8 or w % 8:
            raise ValueError(f"frame size {h}x{w} must be divisible by 8")
        flat = frames.transpose(1, 2).reshape(b * t, 3, h, w)
        feats = self.enc_in(flat).unflatten(0, (b, t))
        mem = self.enc_memory(feats.flatten(0, 1), _previous_frames(feats, prev).flatten(0, 1))
        lin = self.enc_lin(F.pixel_unshuffle(flat, 8))
        return (lin + self.enc_out(F.relu(mem))).unflatten(0, (b, t)), feats[:, -1]

    def decode_frames(self, latents: Tensor, prev: Tensor | None) -> tuple[Tensor, Tensor]:
        """Raw per-frame latents [B, T, fc, h, w] -> pixels [B, 3, T, 8h, 8w] and the last frame's features."""
        b, t = latents.shape[:2]
        flat = latents.flatten(0, 1)
        feats = self.dec_in(flat).unflatten(0, (b, t))
        mem = self.dec_memory(feats.flatten(0, 1), _previous_frames(feats, prev).flatten(0, 1))
        pixels = F.pixel_shuffle(self.dec_lin(flat) + self.dec_body(mem), 8)
        return pixels.unflatten(0, (b, t)).transpose(1, 2), feats[:, -1]

    def pack(self, per_frame: Tensor) -> Tensor:
        """[B, K*tc, fc, h, w] per-frame latents -> [B, tc*fc, K, h, w] latent frames (frame-major channels)."""
        b, t, fc, h, w = per_frame.shape
        tc = self.temporal_compression
        if t % tc:
            raise ValueError(f"packing needs a multiple of {tc} frames, got {t}")
        return per_frame.reshape(b, t // tc, tc * fc, h, w).transpose(1, 2)

    def unpack(self, latents: Tensor) -> Tensor:
        """[B, tc*fc, K, h, w] latent frames -> [B, K*tc, fc, h, w] per-frame latents."""
        b, _, k, h, w = latents.shape
        return latents.transpose(1, 2).reshape(b, k * self.temporal_compression, self.config.frame_channels, h, w)

    def encode_groups(self, groups: Tensor, prev: Tensor | None) -> tuple[Tensor, Tensor]:
        """Pixel groups [B, 3, K*tc, H, W] -> raw latents [B, C, K, H/8, W/8] and the last frame's features."""
        if groups.shape[2] % self.temporal_compression:
            raise ValueError(f"encode_groups needs a multiple of {self.temporal_compression} frames, got {groups.shape[2]}")
        per_frame, last = self.encode_frames(groups, prev)
        return self.pack(per_frame), last

    def decode_groups(self, latents: Tensor, prev: Tensor | None) -> tuple[Tensor, Tensor]:
        """Raw latents [B, C, K, h, w] -> pixels [B, 3, K*tc, 8h, 8w] and the last frame's features."""
        return self.decode_frames(self.unpack(latents), prev)

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
