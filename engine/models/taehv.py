"""A tiny stream VAE for Wan 2.1 latents in the TAEHV layout, loadable from the public ``taew2_1`` weights.

TAEHV ("Tiny AutoEncoder for Hunyuan Video", github.com/madebyollin/taehv) is a stack of 2D convs run
on every frame, with three kinds of temporal layers: memory blocks that read the previous frame's
features at their level, pooling layers that merge the frames of a group into one (encoder), and growing
layers that split one frame into several (decoder). Its ``taew2_1`` weights encode to and decode from
the Wan 2.1 VAE's latent space (16 channels, 8x space, 4x time) at a small fraction of its cost.

Our own implementation, written for this engine's stream protocol (``engine.vae.StreamVAE``): the
module names, and so the state-dict keys, are the reference's ``nn.Sequential`` indices
(``encoder.4.conv.0.weight``, ``decoder.7.conv.weight``, ...), so its .pth / .safetensors files load
as they are; nothing is downloaded (:func:`load_taehv` reads a local file).

Streaming. The only temporal state is each memory block's input for the previous frame at its level
(a ``TAEHVCache`` the caller owns). Pooling and growing need no state across calls: a chunk always holds
whole groups (4 pixel frames per latent frame), so every group is pooled inside one call. Within a call
all frames of the chunk run together, each memory block reading the frame before it; so any split of a
stream into chunks gives the whole clip's result up to float rounding.

Stream convention, Wan's (1 pixel frame / 1 latent frame first, then 4 per latent frame):
- Decoding: each latent frame grows into 4 pixel frames; the first 3 of a stream are dropped. This is
  the reference's ``frames_to_trim`` (``decode_video`` returns ``x[:, t_upscale - 1:]``): the decoder
  was trained on Wan latents, whose first latent frame holds frame 0 alone, and its 4th output is that
  frame. So a stream's first latent frame decodes to 1 frame and every later one to 4.
- Encoding: the first frame of a stream is encoded as a group of four copies of itself (3 copies in
  front), so latent frame ``i`` covers pixel frames ``4i-3 .. 4i`` as Wan's does and a round trip lines
  up with the decoder's trim. The reference's whole-clip ``encode_video`` pads the *end* of a clip to a
  multiple of 4 instead; a live stream cannot wait for its end, and front padding is what the decoder's
  alignment assumes.

Value conventions at the boundary (converted here, so callers see the StreamVAE's):
- Pixels: TAEHV works in [0, 1] (reference README, "TAEHV stores image values in the range [0, 1]");
  StreamVAE frames are [-1, 1].
- Latents: TAEHV "does not use any latent scales / shifts (TAEHV encodes / decodes exactly what
  diffusion models use)" (reference README): its latents are the Wan DiT's, i.e. the Wan VAE's
  ``(mu - latents_mean) / latents_std``. StreamDiffusionV2's ``--use_taehv`` wrapper
  (causvid/models/wan/taehv_wrapper.py) feeds the DiT's latents to ``decode_video`` unchanged while its
  Wan wrapper un-normalises them before the Wan decoder. Those are exactly StreamVAE's normalised
  latents, so no conversion is applied to latents.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.vae import check_chunk_frames

# The taew2_1 layout: three stages of three memory blocks in each of the encoder and decoder. Which
# stages pool / grow time is part of the layout too (a pool of stride 1 still has its 1x1 conv's weights).
BLOCKS_PER_STAGE = 3
ENCODER_TIME_POOL = (2, 2, 1)
DECODER_TIME_GROW = (1, 2, 2)


@dataclass(frozen=True)
class TAEHVConfig:
    latent_channels: int = 16
    encoder_channels: int = 64
    decoder_channels: tuple[int, int, int, int] = (256, 128, 64, 64)

    @classmethod
    def tiny(cls) -> TAEHVConfig:
        """A few channels: the real layout at test speed."""
        return cls(encoder_channels=8, decoder_channels=(16, 8, 8, 8))


@dataclass
class TAEHVCache:
    """Causal state of one stream's encoder or decoder: each memory block's input for the stream's last
    frame at its level, keyed by the block's index in its ``nn.Sequential`` (empty before the first chunk)."""

    kind: str  # "encoder" or "decoder"
    memory: dict[str, Tensor] = field(default_factory=dict)
    frames_seen: int = 0  # pixel frames encoded / latent frames decoded so far


def _conv3(cin: int, cout: int, stride: int = 1, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=bias)


class _SoftClamp(nn.Module):
    """3·tanh(x/3): the decoder's input squashed smoothly into (-3, 3) (latents the DiT overshoots)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x / 3) * 3


class _MemBlock(nn.Module):
    """relu(convs([x_t, x_{t-1}]) + skip(x_t)): one frame of memory at its level."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        # Sequential only for the reference's parameter names (conv.0/2/4).
        self.conv = nn.Sequential(_conv3(2 * cin, cout), nn.ReLU(), _conv3(cout, cout), nn.ReLU(), _conv3(cout, cout))
        self.skip: nn.Module = nn.Conv2d(cin, cout, 1, bias=False) if cin != cout else nn.Identity()

    def forward(self, x: Tensor, past: Tensor) -> Tensor:
        return F.relu(self.conv(torch.cat([x, past], dim=1)) + self.skip(x))


class _TimePool(nn.Module):
    """``stride`` consecutive frames, stacked along channels, -> one frame (a 1x1 conv)."""

    def __init__(self, ch: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(ch * stride, ch, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        # [B*T, C, H, W] batch-major with T a multiple of the stride: each group lies inside one stream.
        _, c, h, w = x.shape
        return self.conv(x.reshape(-1, self.stride * c, h, w))


class _TimeGrow(nn.Module):
    """One frame -> ``stride`` consecutive frames (a 1x1 conv to ``stride`` times the channels)."""

    def __init__(self, ch: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(ch, ch * stride, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        _, c, h, w = x.shape
        return self.conv(x).reshape(-1, c, h, w)


def _encoder(cfg: TAEHVConfig) -> nn.Sequential:
    ch = cfg.encoder_channels
    layers: list[nn.Module] = [_conv3(3, ch), nn.ReLU()]
    for pool in ENCODER_TIME_POOL:
        layers += [_TimePool(ch, pool), _conv3(ch, ch, stride=2, bias=False)]
        layers += [_MemBlock(ch, ch) for _ in range(BLOCKS_PER_STAGE)]
    layers.append(_conv3(ch, cfg.latent_channels))
    return nn.Sequential(*layers)


def _decoder(cfg: TAEHVConfig) -> nn.Sequential:
    ch = cfg.decoder_channels
    layers: list[nn.Module] = [_SoftClamp(), _conv3(cfg.latent_channels, ch[0]), nn.ReLU()]
    for stage, grow in enumerate(DECODER_TIME_GROW):
        layers += [_MemBlock(ch[stage], ch[stage]) for _ in range(BLOCKS_PER_STAGE)]
        layers += [nn.Upsample(scale_factor=2), _TimeGrow(ch[stage], grow), _conv3(ch[stage], ch[stage + 1], bias=False)]
    layers += [nn.ReLU(), _conv3(ch[-1], 3)]
    return nn.Sequential(*layers)


def _run(layers: nn.Sequential, x: Tensor, batch: int, memory: dict[str, Tensor]) -> Tensor:
    """``x`` [B*T, C, H, W] (batch-major frames) through ``layers``; each memory block reads the frame
    before each of its inputs (the stream's last one from ``memory`` for the first, zeros at a stream's
    start) and leaves its last input there for the next call."""
    for index, layer in enumerate(layers):
        if isinstance(layer, _MemBlock):
            frames = x.unflatten(0, (batch, -1))
            prev = memory.get(str(index))
            first = torch.zeros_like(frames[:, :1]) if prev is None else prev[:, None].to(frames.dtype)
            past = torch.cat([first, frames[:, :-1]], dim=1).flatten(0, 1)
            memory[str(index)] = frames[:, -1].clone()
            x = layer(x, past)
        else:
            x = layer(x)
    return x


class TAEHV(nn.Module):
    """TAEHV as an ``engine.vae.StreamVAE`` on Wan 2.1 latents: normalised latents out of encode, into decode."""

    spatial_compression = 8
    temporal_compression = 4
    reads_input = False  # its decoder sees the latents only

    def __init__(self, config: TAEHVConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = config or TAEHVConfig()
        self.latent_channels = cfg.latent_channels
        self.encoder = _encoder(cfg)
        self.decoder = _decoder(cfg)

    def new_encoder_cache(self) -> TAEHVCache:
        return TAEHVCache("encoder")

    def new_decoder_cache(self) -> TAEHVCache:
        return TAEHVCache("decoder")

    @torch.no_grad()
    def encode_chunk(self, frames: Tensor, cache: TAEHVCache) -> Tensor:
        """Pixels [B, 3, T, H, W] in [-1, 1] -> normalised latents [B, 16, T', H/8, W/8].

        T = 1 + 4k on a stream's first call (-> 1 + k latents), 4k afterwards (-> k latents)."""
        _check_cache(cache, "encoder")
        check_chunk_frames(frames, cache.frames_seen, self.temporal_compression, self.spatial_compression)
        t, tc = frames.shape[2], self.temporal_compression
        x = frames.to(self._dtype)
        if cache.frames_seen == 0:  # frame 0 as a whole group, three copies in front (see the module docstring)
            x = torch.cat([x[:, :, :1].expand(-1, -1, tc - 1, -1, -1), x], dim=2)
        b = x.shape[0]
        unit = (x.transpose(1, 2).flatten(0, 1) + 1) / 2  # TAEHV's [0, 1] pixels
        z = _run(self.encoder, unit, b, cache.memory)
        cache.frames_seen += t
        return z.unflatten(0, (b, -1)).transpose(1, 2).to(frames.dtype)

    @torch.no_grad()
    def decode_chunk(self, latents: Tensor, cache: TAEHVCache, guide: Tensor | None = None) -> Tensor:
        """Normalised latents [B, 16, t, h, w] -> pixels [B, 3, T, 8h, 8w] clamped to [-1, 1].

        T = 1 + 4(t - 1) on a stream's first call, 4t afterwards."""
        if guide is not None:
            raise ValueError("the TAEHV decoder does not read input frames (reads_input is False)")
        _check_cache(cache, "decoder")
        if latents.ndim != 5 or latents.shape[1] != self.latent_channels or latents.shape[2] == 0:
            raise ValueError(f"latents must be [B, {self.latent_channels}, t>0, h, w], got {tuple(latents.shape)}")
        b = latents.shape[0]
        x = latents.to(self._dtype).transpose(1, 2).flatten(0, 1)
        pixels = _run(self.decoder, x, b, cache.memory).unflatten(0, (b, -1)).transpose(1, 2)
        if cache.frames_seen == 0:  # the reference's frames_to_trim: the stream's first 3 frames
            pixels = pixels[:, :, self.temporal_compression - 1 :]
        cache.frames_seen += latents.shape[2]
        return (pixels * 2 - 1).clamp(-1.0, 1.0).to(latents.dtype)

    def encode(self, frames: Tensor) -> Tensor:
        """Whole clip (1 + 4k frames) in one call."""
        return self.encode_chunk(frames, self.new_encoder_cache())

    def decode(self, latents: Tensor) -> Tensor:
        """Whole clip in one call."""
        return self.decode_chunk(latents, self.new_decoder_cache())

    @property
    def _dtype(self) -> torch.dtype:
        weight = self.encoder[0].weight
        assert isinstance(weight, Tensor)
        return weight.dtype


def _check_cache(cache: TAEHVCache, kind: str) -> None:
    if not isinstance(cache, TAEHVCache) or cache.kind != kind:
        got = cache.kind if isinstance(cache, TAEHVCache) else type(cache).__name__
        raise ValueError(f"expected a TAEHV {kind} cache (new_{kind}_cache()), got {got}")


def load_taehv(path: str | Path, config: TAEHVConfig | None = None, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> TAEHV:
    """Load ``taew2_1.pth`` / ``taew2_1.safetensors`` (the reference's key names) from a local file.

    Strict: a file with missing, unexpected or mis-shaped keys raises a ValueError naming them."""
    from engine.models.wan_vae import check_state_dict, read_weights

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no tiny VAE weights at {path} (a local taew2_1.pth or .safetensors file; "
                                "nothing is downloaded)")
    state = read_weights(path)
    with torch.device("meta"):
        model = TAEHV(config)
    check_state_dict(model, state, path, "the TAEHV (taew2_1) layout")
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)
