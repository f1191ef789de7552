"""Which stream VAE a Wan model serves with: the Wan 2.1 VAE, the TAEHV tiny VAE, or Wan's encoder with
the tiny decoder (StreamDiffusionV2's ``--use_taehv``). Chosen once per model when it loads, never per chunk.

Three ways to say it, the later overriding the earlier:

- a model directory's ``diffcast.json``: ``"tiny_vae": "taew2_1.safetensors"`` (a file in the directory)
  and ``"vae_mode": "wan" | "tiny" | "wan-encoder-tiny-decoder"`` (default: the last where ``tiny_vae`` is
  set, else ``"wan"``);
- ``--vae SPEC`` on ``diffcast serve`` / ``stylize`` / ``bench engine``: ``wan``; a taew2_1 FILE (Wan
  encoder, tiny decoder); ``tiny:FILE`` (tiny both ways); FILE may be ``tiny-random`` (random weights, for
  measuring speed and memory without a file);
- ``Pipeline.load(model, vae=SPEC)``.

Why the Wan encoder with the tiny decoder is the default pairing: the DiT was trained on the Wan
encoder's latents, and the decoder is the costly half (it runs at full resolution on every output frame);
the tiny encoder is offered for the cheapest path.

`diffcast serve` carries the choice in its configuration (``ServerConfig.vae``) to every engine host that
loads the model: the in-process engine, each Ray worker, each pipeline-parallel rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

import torch
from torch import nn

from engine.models.taehv import TAEHVConfig, load_taehv
from engine.models.wan_vae import WanVAE
from engine.vae import StreamVAE

VAEMode = Literal["wan", "tiny", "wan-encoder-tiny-decoder"]
VAE_MODES: tuple[VAEMode, ...] = ("wan", "tiny", "wan-encoder-tiny-decoder")
RANDOM_TINY_VAE = "tiny-random"  # in place of a file: the tiny VAE with random weights
TINY_PREFIX = "tiny:"


@dataclass(frozen=True)
class VAEChoice:
    mode: VAEMode = "wan"
    tiny: str | None = None  # the taew2_1 file, or RANDOM_TINY_VAE; None for "wan"

    def __post_init__(self) -> None:
        if self.mode not in VAE_MODES:
            raise ValueError(f"unknown VAE mode {self.mode!r}; choose from {', '.join(VAE_MODES)}")
        if (self.mode == "wan") != (self.tiny is None):
            raise ValueError(f"VAE mode {self.mode!r} " + ("takes no tiny VAE file" if self.mode == "wan"
                                                           else "needs a tiny VAE file (taew2_1) or 'tiny-random'"))

    @classmethod
    def parse(cls, spec: str) -> VAEChoice:
        """``--vae``'s value: ``wan``, ``FILE`` (Wan encoder, tiny decoder) or ``tiny:FILE`` (tiny both ways)."""
        if not spec.strip():
            raise ValueError("--vae needs 'wan', a taew2_1 file, 'tiny:FILE' or 'tiny-random'")
        if spec == "wan":
            return cls()
        if spec.startswith(TINY_PREFIX):
            return cls("tiny", spec.removeprefix(TINY_PREFIX))
        return cls("wan-encoder-tiny-decoder", spec)

    @classmethod
    def from_manifest(cls, tiny_vae: str | None, vae_mode: str | None, root: Path) -> VAEChoice:
        """A ``diffcast.json``'s ``tiny_vae`` (a file in ``root``) and ``vae_mode``."""
        mode = vae_mode or ("wan" if tiny_vae is None else "wan-encoder-tiny-decoder")
        if mode not in VAE_MODES:
            raise ValueError(f"{root / 'diffcast.json'}: vae_mode {mode!r} is not one of {', '.join(VAE_MODES)}")
        tiny = None if tiny_vae is None or mode == "wan" else tiny_vae
        if tiny is not None and tiny != RANDOM_TINY_VAE:
            tiny = str(root / tiny)
        return cls(cast(VAEMode, mode), tiny)

    def build(self, wan: Callable[[], WanVAE], random_config: TAEHVConfig, device: torch.device | str,
              dtype: torch.dtype) -> StreamVAE:
        """The stream VAE this choice names; ``wan`` loads the model's Wan VAE (not called in "tiny" mode),
        ``random_config`` is the tiny VAE's size for ``tiny-random``."""
        if self.mode == "wan":
            return wan()
        assert self.tiny is not None
        if self.tiny == RANDOM_TINY_VAE:
            from engine.random_model import build_taehv

            tiny = build_taehv(random_config, device, dtype)
        else:
            tiny = load_taehv(self.tiny, device=device, dtype=dtype)
        return tiny if self.mode == "tiny" else SplitVAE(wan(), tiny)


def is_wan_model(model: str) -> bool:
    """Whether ``model`` (as ``Pipeline.load`` takes it) is a Wan 2.1 model, the only kind a VAE choice fits:
    a ``random:`` model or a directory with a ``diffcast.json`` manifest."""
    return model.startswith("random:") or (Path(model) / "diffcast.json").is_file()


def vae_choice_for(model: str | None, vae: str | None) -> VAEChoice | None:
    """``--vae`` checked against ``model``: the choice, None without one, or a ValueError in plain words
    for a model that is not a Wan model or a spec that does not parse."""
    if vae is None:
        return None
    choice = VAEChoice.parse(vae)
    if model is None or not is_wan_model(model):
        raise ValueError(f"--vae is for Wan 2.1 models (a directory with a diffcast.json manifest, or "
                         f"'random:wan2.1-1.3b' and the other random: models), not {model or 'the embedded default'!r}: "
                         "its own VAE is part of the model")
    return choice


class SplitVAE(nn.Module):
    """A StreamVAE that encodes with one VAE and decodes with another of the same latent space (the Wan
    encoder with the TAEHV decoder). The stream state holds both caches: the encoder's in ``vae_encoder``,
    the decoder's in ``vae_decoder``, each its own VAE's kind (so parking and batching see them as usual)."""

    def __init__(self, encoder: StreamVAE, decoder: StreamVAE) -> None:
        super().__init__()
        for name in ("latent_channels", "temporal_compression", "spatial_compression"):
            if getattr(encoder, name) != getattr(decoder, name):
                raise ValueError(f"encoder and decoder VAEs differ in {name}: "
                                 f"{getattr(encoder, name)} vs {getattr(decoder, name)}")
        self.encoder_vae = encoder
        self.decoder_vae = decoder
        self.latent_channels = encoder.latent_channels
        self.temporal_compression = encoder.temporal_compression
        self.spatial_compression = encoder.spatial_compression

    @property
    def reads_input(self) -> bool:
        return self.decoder_vae.reads_input

    def new_encoder_cache(self) -> object:
        return self.encoder_vae.new_encoder_cache()

    def new_decoder_cache(self) -> object:
        return self.decoder_vae.new_decoder_cache()

    def encode_chunk(self, frames: torch.Tensor, cache: object) -> torch.Tensor:
        return self.encoder_vae.encode_chunk(frames, cache)

    def decode_chunk(self, latents: torch.Tensor, cache: object, guide: torch.Tensor | None = None) -> torch.Tensor:
        return self.decoder_vae.decode_chunk(latents, cache, guide)

