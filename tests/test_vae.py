"""Several streams' chunks through one VAE call (engine/vae.py): each stream's latents, frames and cache
are what its own calls give, for the Wan VAE and the tiny VAE (guided too), over a stream's first and
later chunks; caches at different points of their streams are refused."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from _runtime_fixtures import guided_tiny_vae

from engine.models.tiny_vae import TinyVAE, TinyVAEConfig
from engine.models.wan_vae import WanVAE, WanVAEConfig
from engine.streaming.state import tensors_in
from engine.vae import CacheMismatchError, decode_batch, encode_batch


def _vaes() -> list[Any]:
    torch.manual_seed(0)
    return [WanVAE(WanVAEConfig.tiny()).eval(), TinyVAE(TinyVAEConfig(latent_channels=4)).eval(), guided_tiny_vae()]


def _clips(streams: int, frames: int = 9, size: int = 16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.rand(1, 3, frames, size, size, generator=g) * 2 - 1 for _ in range(streams)]


@pytest.mark.parametrize("vae", _vaes(), ids=["wan", "tiny", "tiny-guided"])
def test_a_batched_call_is_each_streams_own_call(vae: Any) -> None:
    clips = _clips(3)
    own_enc = [vae.new_encoder_cache() for _ in clips]
    own_dec = [vae.new_decoder_cache() for _ in clips]
    enc = [vae.new_encoder_cache() for _ in clips]
    dec = [vae.new_decoder_cache() for _ in clips]
    with torch.no_grad():
        for lo, hi in ((0, 1), (1, 5), (5, 9)):  # a stream's first chunk (one frame), then 4 at a time
            pixels = [c[:, :, lo:hi] for c in clips]
            guides = pixels if vae.reads_input else [None] * len(pixels)
            alone = [vae.encode_chunk(p, c) for p, c in zip(pixels, own_enc, strict=True)]
            together = encode_batch(vae, torch.cat(pixels), enc)
            torch.testing.assert_close(together, torch.cat(alone), rtol=0, atol=1e-5)
            frames_alone = [vae.decode_chunk(z, c, g) for z, c, g in zip(alone, own_dec, guides, strict=True)]
            stacked_guide = torch.cat(pixels) if vae.reads_input else None
            frames = decode_batch(vae, torch.cat(alone), dec, stacked_guide)
            torch.testing.assert_close(frames, torch.cat(frames_alone), rtol=0, atol=1e-5)
            assert frames.shape[2] == hi - lo
    for mine, theirs in zip([*enc, *dec], [*own_enc, *own_dec], strict=True):
        assert mine.frames_seen == theirs.frames_seen
        pairs = list(zip(tensors_in(mine), tensors_in(theirs), strict=True))
        assert pairs, "the cache holds no state"
        for a, b in pairs:
            assert a.shape[0] == 1 and a.untyped_storage().nbytes() == a.numel() * a.element_size()
            torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5)  # a batch may take another conv algorithm
    # The streams' frames differ: rows were not mixed up or copied from one stream.
    assert (frames[0] - frames[1]).abs().max() > 1e-3


def test_caches_at_different_points_are_refused() -> None:
    vae = _vaes()[0]
    a, b = vae.new_encoder_cache(), vae.new_encoder_cache()
    clips = _clips(2)
    with torch.no_grad():
        vae.encode_chunk(clips[0][:, :, :1], a)
        before = copy.deepcopy(b)
        with pytest.raises(CacheMismatchError, match="differ|other keys"):
            encode_batch(vae, torch.cat([clips[0][:, :, 1:5], clips[1][:, :, :1].expand(-1, -1, 4, -1, -1)]), [a, b])
    assert b.frames_seen == before.frames_seen == 0 and not b.tensors
