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

A guided decoder (``TinyVAEConfig.guided``) also reads the chunk's input frames, as an image-to-image
model reads its source: each input frame's 8x8 patches join the decoder's features at 1/8 resolution,
and the decoder's features set, per latent cell, a local affine map of a few full-resolution features
of the input frame (its RGB, ``guide_basis`` learned 3x3 filters and optionally box-blurred copies,
``guide_blurs``), interpolated bilinearly between cells (HDRNet's guided slicing, without the
luminance axis). Why: the latent is 8x smaller than the
frame and the DiT's prediction of it wobbles from frame to frame; fine structure drawn from the input
frame itself moves exactly with the content, so the decoded video flickers less and keeps edges a
latent cell cannot place. The guide paths start at zero, so a guided decoder fine-tuned from a plain
one starts as that decoder.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class TinyVAEConfig:
    latent_channels: int = 64  # per latent frame = temporal_compression x channels per pixel frame
    enc_channels: int = 64  # conv width of the encoder (at 1/8 resolution)
    dec_channels: int = 96  # conv width of the decoder (at 1/8 resolution)
    temporal_compression: int = 4
    guided: bool = False  # the decoder also reads the chunk's input frames (``decode_chunk(..., guide=)``)
    guide_basis: int = 6  # learned full-resolution 3x3 filters of the input the guided decoder maps locally
    # Box-blurred copies of the input (block sizes in pixels, bilinear back to full size) the guided
    # decoder also maps: the smoothing a painted look does, from the input itself.
    guide_blurs: tuple[int, ...] = ()
    # One affine map per latent frame (the mean of its pixel frames' features) instead of one per pixel
    # frame: the DiT's four per-frame codes of a latent frame wobble against each other, the input does not.
    guide_per_group: bool = False

    def __post_init__(self) -> None:
        if self.guide_basis < 0:
            raise ValueError(f"guide_basis must be 0 or more, got {self.guide_basis}")
        if any(b < 2 for b in self.guide_blurs):
            raise ValueError(f"guide_blurs must be block sizes of 2 pixels or more, got {self.guide_blurs}")
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
        if "guide_blurs" in data:
            data = {**data, "guide_blurs": tuple(data["guide_blurs"])}  # type: ignore[arg-type]
        return cls(**data)  # type: ignore[arg-type]


# The guided decoder's modules (absent from an unguided TinyVAE's state dict).
_GUIDE_MODULES = ("dec_guide_in.", "dec_guide_map.", "guide_filters.")


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


@lru_cache(maxsize=64)
def _linear_weights(n_in: int, n_out: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """[n_out, n_in]: torch's 1-D linear resampling (align_corners=False) as a matrix."""
    eye = torch.eye(n_in, dtype=dtype, device=device)[:, None, :]
    return F.interpolate(eye, size=n_out, mode="linear", align_corners=False)[:, 0, :].T.contiguous()


def _bilinear(x: Tensor, size: tuple[int, int]) -> Tensor:
    """``F.interpolate(x, size, mode="bilinear", align_corners=False)`` as two matrix products: bilinear
    resampling is separable, and the guided map upsamples tens of channels from a coarse grid, where
    the products take well under half the CPU time of the interpolation kernel (equal to rounding)."""
    h, w = size
    rows = _linear_weights(x.shape[-2], h, x.dtype, x.device)
    cols = _linear_weights(x.shape[-1], w, x.dtype, x.device)
    return rows @ x @ cols.T


def _unshuffle8(x: Tensor) -> Tensor:
    """``F.pixel_unshuffle(x, 8)`` as a view, a permute and one copy: 3x faster on a CPU (the kernel
    walks the frame element by element), equal exactly."""
    n, c, h, w = x.shape
    return x.view(n, c, h // 8, 8, w // 8, 8).permute(0, 1, 3, 5, 2, 4).reshape(n, c * 64, h // 8, w // 8)


def _shuffle8(x: Tensor) -> Tensor:
    """``F.pixel_shuffle(x, 8)`` the same way (2-3x faster on a CPU, equal exactly)."""
    n, c, h, w = x.shape
    return x.view(n, c // 64, 8, 8, h, w).permute(0, 1, 4, 2, 5, 3).reshape(n, c // 64, h * 8, w * 8)


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
        if config.guided:
            # The input frame's patches into the decoder's features; the full-resolution filters of the
            # input; per cell, an affine map (3 outputs x (RGB + filters), plus an offset) of them.
            self.dec_guide_in = _conv(patch, cd)
            self.guide_filters = nn.Conv2d(3, config.guide_basis, 3, padding=1) if config.guide_basis else None
            planes = 3 + config.guide_basis + 3 * len(config.guide_blurs)
            self.dec_guide_map = nn.Conv2d(cd, 3 * planes + 3, 1)
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
        if self.config.guided:
            for m in (self.dec_guide_in, self.dec_guide_map):
                nn.init.zeros_(m.weight)
        dec_out = self.dec_body[-1]
        assert isinstance(dec_out, nn.Conv2d)
        nn.init.zeros_(dec_out.weight)

    def with_guided_decoder(self, guide_basis: int | None = None, guide_blurs: tuple[int, ...] | None = None,
                            guide_per_group: bool | None = None) -> TinyVAE:
        """A copy whose decoder also reads the input frames, its guide paths at zero: it decodes exactly
        as this VAE does until they are trained (``engine.embedded.train.guide_decoder``)."""
        if self.config.guided:
            raise ValueError("this TinyVAE's decoder already reads the input frames")
        basis = self.config.guide_basis if guide_basis is None else guide_basis
        blurs = self.config.guide_blurs if guide_blurs is None else guide_blurs
        per_group = self.config.guide_per_group if guide_per_group is None else guide_per_group
        guided = TinyVAE(replace(self.config, guided=True, guide_basis=basis, guide_blurs=blurs,
                                 guide_per_group=per_group)).to(self.latent_mean)
        missing, unexpected = guided.load_state_dict(self.state_dict(), strict=False)
        if unexpected or not all(k.startswith(_GUIDE_MODULES) for k in missing):
            raise RuntimeError(f"guided copy: unexpected {unexpected}, missing {missing}")
        return guided

    def decoder_modules(self) -> list[nn.Module]:
        """The modules a decoder fine-tune trains (the encoder and the latent statistics stay)."""
        mods: list[nn.Module] = [self.dec_in, self.dec_memory, self.dec_body, self.dec_lin]
        if self.config.guided:
            mods += [self.dec_guide_in, self.dec_guide_map]
            if self.guide_filters is not None:
                mods.append(self.guide_filters)
        return mods

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
        # The patches feed both paths: unshuffled once (enc_in's first module is that unshuffle, kept
        # so that the convolutions' names, and checkpoints, stay as they were).
        patches = _unshuffle8(flat)
        feats = self.enc_in[1:](patches).unflatten(0, (b, t))
        mem = self.enc_memory(feats.flatten(0, 1), _previous_frames(feats, prev).flatten(0, 1))
        lin = self.enc_lin(patches)
        return (lin + self.enc_out(F.relu(mem))).unflatten(0, (b, t)), feats[:, -1]

    @property
    def reads_input(self) -> bool:
        """Whether the decoder reads the chunk's input frames (``guide``)."""
        return self.config.guided

    def decode_frames(self, latents: Tensor, prev: Tensor | None, guide: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Raw per-frame latents [B, T, fc, h, w] -> pixels [B, 3, T, 8h, 8w] and the last frame's features.

        ``guide``: the input frames [B, 3, T, 8h, 8w] the latents were made from, for a guided decoder
        (None: decode from the latents alone, as an unguided decoder does)."""
        b, t = latents.shape[:2]
        flat = latents.flatten(0, 1)
        feats = self.dec_in(flat)
        g = None
        if guide is not None:
            if not self.config.guided:
                raise ValueError("this TinyVAE's decoder does not read input frames (its config is not guided)")
            if guide.shape != (b, 3, t, *(8 * n for n in latents.shape[-2:])):
                raise ValueError(f"guide frames {tuple(guide.shape)} do not match latents {tuple(latents.shape)}")
            g = guide.transpose(1, 2).flatten(0, 1).to(flat.dtype)
            feats = feats + self.dec_guide_in(_unshuffle8(g))
        feats = feats.unflatten(0, (b, t))
        mem = self.dec_memory(feats.flatten(0, 1), _previous_frames(feats, prev).flatten(0, 1))
        # In the latents' dtype: under bf16 autocast the convolutions compute in bf16, the pixels add up in fp32.
        pixels = _shuffle8(self.dec_lin(flat) + self.dec_body(mem)).to(flat.dtype)
        if g is not None:
            pixels = pixels + self._guided_map(mem, g)
        return pixels.unflatten(0, (b, t)).transpose(1, 2), feats[:, -1]

    def _guided_map(self, mem: Tensor, g: Tensor) -> Tensor:
        """Per latent cell an affine map of the input frame's RGB and filters, bilinear between cells."""
        basis = [g] if self.guide_filters is None else [g, F.relu(self.guide_filters(g))]
        for block in self.config.guide_blurs:
            # Border blocks average what they hold (ceil_mode, no padding counted).
            pooled = F.avg_pool2d(g, block, ceil_mode=True)
            basis.append(_bilinear(pooled, (g.shape[-2], g.shape[-1])))
        cells = self.dec_guide_map(F.relu(mem))
        if self.config.guide_per_group:
            tc = self.temporal_compression
            cells = cells.unflatten(0, (-1, tc)).mean(1)  # [N / tc, K, h, w]: one map per latent frame
            coef = _bilinear(cells, (g.shape[-2], g.shape[-1]))
            coef = coef[:, None].expand(-1, tc, -1, -1, -1).flatten(0, 1)
        else:
            coef = _bilinear(cells, (g.shape[-2], g.shape[-1]))
        if torch.is_grad_enabled():  # training: one broadcast product, which autograd handles well
            phi = torch.cat(basis, dim=1)  # [N, K, H, W]: RGB, filters, blurred RGB
            return (coef[:, :-3].unflatten(1, (3, phi.shape[1])) * phi[:, None]).sum(2) + coef[:, -3:]
        # Serving: out_c = offset_c + sum_k gain_ck * plane_k accumulated in place, plane by plane, which
        # on a CPU reads each full-resolution plane once (several times faster than the product above).
        planes = [b[:, i] for b in basis for i in range(b.shape[1])]
        # In the frames' precision: under bf16 autocast the coefficients and filters come in bf16 and
        # the sums below still add up in fp32 (a cast of the 30 coefficient planes would cost more).
        out = coef[:, -3:].to(g.dtype, copy=True)
        for c in range(3):
            for k, plane in enumerate(planes):
                out[:, c].addcmul_(coef[:, c * len(planes) + k], plane)
        return out

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

    def decode_groups(self, latents: Tensor, prev: Tensor | None, guide: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Raw latents [B, C, K, h, w] -> pixels [B, 3, K*tc, 8h, 8w] and the last frame's features
        (``guide``: the input frames [B, 3, K*tc, 8h, 8w], see :meth:`decode_frames`)."""
        return self.decode_frames(self.unpack(latents), prev, guide)

    # -- StreamVAE protocol ---------------------------------------------------------------------------

    def new_encoder_cache(self) -> TinyVAECache:
        return TinyVAECache()

    def new_decoder_cache(self) -> TinyVAECache:
        return TinyVAECache()

    def normalize(self, raw: Tensor) -> Tensor:
        return (raw - self.latent_mean.view(1, -1, 1, 1, 1)) / self.latent_std.view(1, -1, 1, 1, 1)

    def denormalize(self, z: Tensor) -> Tensor:
        return z * self.latent_std.view(1, -1, 1, 1, 1) + self.latent_mean.view(1, -1, 1, 1, 1)

    # The stream API serves (no autograd graph, like the Wan VAE's); training uses the raw methods above.
    @torch.no_grad()
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

    @torch.no_grad()
    def decode_chunk(self, latents: Tensor, cache: TinyVAECache, guide: Tensor | None = None) -> Tensor:
        """Normalised latents [B, C, K, h, w] -> pixel frames in [-1, 1] (the first latent gives 1 frame).

        ``guide``: the chunk's input frames as :meth:`encode_chunk` took them (1 + 4k on a stream's
        first chunk, then 4k), for a guided decoder (an unguided one refuses it)."""
        if latents.ndim != 5 or latents.shape[1] != self.latent_channels:
            raise ValueError(f"latents must be [B, {self.latent_channels}, K, h, w], got {tuple(latents.shape)}")
        if guide is not None and cache.frames_seen == 0:
            # The first group of a stream was encoded as four copies of frame 0; so is its guide.
            tc = self.temporal_compression
            guide = torch.cat([guide[:, :, :1].expand(-1, -1, tc, -1, -1), guide[:, :, 1:]], dim=2)
        pixels, cache.prev = self.decode_groups(self.denormalize(latents), cache.prev, guide)
        if cache.frames_seen == 0:
            # The first group encoded four copies of frame 0; its last decoded frame stands for it.
            pixels = pixels[:, :, self.temporal_compression - 1 :]
        cache.frames_seen += pixels.shape[2]
        return pixels.clamp(-1.0, 1.0)
