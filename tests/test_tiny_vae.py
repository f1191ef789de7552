"""Tiny streaming VAE: chunked encode/decode equals whole-clip, the 1 + 4k stream layout, PCA init."""

from __future__ import annotations

import pytest
import torch

from engine.models.tiny_vae import TinyVAE, TinyVAEConfig
from engine.vae import StreamVAE

CFG = TinyVAEConfig(latent_channels=8, enc_channels=8, dec_channels=12)


def _vae(seed: int = 0) -> TinyVAE:
    torch.manual_seed(seed)
    vae = TinyVAE(CFG).eval()
    # Non-trivial weights everywhere: the zero-initialised output convs would hide the conv branches.
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(0.05 * torch.randn_like(p))
        vae.latent_mean.uniform_(-0.5, 0.5)
        vae.latent_std.uniform_(0.5, 2.0)
    return vae


def test_implements_stream_vae_protocol() -> None:
    vae = _vae()
    assert isinstance(vae, StreamVAE)
    assert (vae.temporal_compression, vae.spatial_compression) == (4, 8)


@torch.no_grad()
def test_chunked_encode_decode_equals_whole_clip() -> None:
    vae = _vae()
    clip = torch.rand(2, 3, 13, 32, 24) * 2 - 1
    whole = vae.encode_chunk(clip, vae.new_encoder_cache())
    cache = vae.new_encoder_cache()
    parts = [vae.encode_chunk(clip[:, :, a:b], cache) for a, b in ((0, 1), (1, 5), (5, 13))]
    chunked = torch.cat(parts, dim=2)
    assert whole.shape == (2, 8, 4, 4, 3)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-5)

    out_whole = vae.decode_chunk(whole, vae.new_decoder_cache())
    dcache = vae.new_decoder_cache()
    out_chunked = torch.cat([vae.decode_chunk(whole[:, :, k : k + 1], dcache) for k in range(4)], dim=2)
    assert out_whole.shape == (2, 3, 13, 32, 24)
    torch.testing.assert_close(out_chunked, out_whole, rtol=0, atol=1e-5)


@torch.no_grad()
def test_first_frame_is_a_group_of_four_copies() -> None:
    vae = _vae(1)
    frame = torch.rand(1, 3, 1, 16, 16) * 2 - 1
    z = vae.encode_chunk(frame, vae.new_encoder_cache())
    raw, _ = vae.encode_groups(frame.expand(-1, -1, 4, -1, -1), None)
    torch.testing.assert_close(z, vae.normalize(raw))
    decoded = vae.decode_chunk(z, vae.new_decoder_cache())
    full, _ = vae.decode_groups(raw, None)
    assert decoded.shape[2] == 1
    torch.testing.assert_close(decoded, full[:, :, 3:].clamp(-1, 1))


def test_memory_carries_the_previous_chunk() -> None:
    vae = _vae(2)
    clip = torch.rand(1, 3, 9, 16, 16) * 2 - 1
    with torch.no_grad():
        z = vae.encode_chunk(clip, vae.new_encoder_cache())
        other = clip.clone()
        other[:, :, :5] = -other[:, :, :5]
        z_other = vae.encode_chunk(other, vae.new_encoder_cache())
    # Frames 5..8 are identical, yet their latent differs: it saw a different previous group.
    assert not torch.allclose(z[:, :, 2], z_other[:, :, 2])


def test_bad_chunk_sizes_are_rejected_with_a_clear_message() -> None:
    vae = _vae()
    with pytest.raises(ValueError, match="first chunk of a stream needs 1 \\+ 4k frames"):
        vae.encode_chunk(torch.zeros(1, 3, 4, 16, 16), vae.new_encoder_cache())
    cache = vae.new_encoder_cache()
    vae.encode_chunk(torch.zeros(1, 3, 1, 16, 16), cache)
    with pytest.raises(ValueError, match="multiple of 4"):
        vae.encode_chunk(torch.zeros(1, 3, 3, 16, 16), cache)
    with pytest.raises(ValueError, match="divisible by 8"):
        vae.encode_chunk(torch.zeros(1, 3, 1, 12, 16), vae.new_encoder_cache())


@torch.no_grad()
def test_pca_init_reconstructs_data_of_low_rank_exactly() -> None:
    """Patches spanned by fewer directions than per-frame latent channels pass the linear paths losslessly."""
    torch.manual_seed(3)
    vae = TinyVAE(CFG)  # conv branches start at zero output: the autoencoder is the linear path
    basis = torch.randn(CFG.frame_channels, 3, 8, 8)
    coeffs = torch.randn(64, CFG.frame_channels)
    patches = torch.einsum("nk,kcij->ncij", coeffs, basis) + 0.3  # 64 patches [3, 8, 8]
    frames = patches.reshape(4, 4, 4, 3, 8, 8).permute(0, 3, 1, 4, 2, 5).reshape(4, 3, 32, 32)
    vae.init_linear_from_pca(frames)
    clip = frames.reshape(1, 4, 3, 32, 32).transpose(1, 2)  # 4 frames = 1 latent frame
    z, _ = vae.encode_groups(clip, None)
    recon, _ = vae.decode_groups(z, None)
    torch.testing.assert_close(recon, clip, rtol=0, atol=1e-4)


@torch.no_grad()
def test_each_pixel_frame_owns_a_channel_slot_and_memory_reaches_only_the_next_frame() -> None:
    vae = _vae(4)
    clip = torch.rand(1, 3, 12, 16, 16) * 2 - 1
    changed = clip.clone()
    changed[:, :, 5] = -changed[:, :, 5]  # frame 5 = slot 1 of latent frame 1
    z, _ = vae.encode_groups(clip, None)
    z_changed, _ = vae.encode_groups(changed, None)
    fc = CFG.frame_channels
    moved = [(k, slot) for k in range(3) for slot in range(4)
             if not torch.allclose(z[:, slot * fc : (slot + 1) * fc, k], z_changed[:, slot * fc : (slot + 1) * fc, k])]
    assert moved == [(1, 1), (1, 2)]  # its own slot, and the next frame's through one frame of memory
    torch.testing.assert_close(vae.pack(vae.unpack(z)), z, rtol=0, atol=0)


@torch.no_grad()
def test_a_guided_copy_decodes_as_its_source_until_trained() -> None:
    """The guide paths start at zero: the guided copy reading any input decodes exactly as the plain
    VAE (an independent module) decodes the latents alone."""
    plain = _vae(5)
    guided = plain.with_guided_decoder(guide_basis=2).eval()
    assert guided.reads_input and not plain.reads_input
    clip = torch.rand(1, 3, 9, 16, 24) * 2 - 1
    z = plain.encode_chunk(clip, plain.new_encoder_cache())
    torch.testing.assert_close(guided.encode_chunk(clip, guided.new_encoder_cache()), z, rtol=0, atol=0)
    expected = plain.decode_chunk(z, plain.new_decoder_cache())
    got = guided.decode_chunk(z, guided.new_decoder_cache(), torch.rand_like(clip) * 2 - 1)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="already reads the input frames"):
        guided.with_guided_decoder()


def _trained_guided(seed: int = 6) -> TinyVAE:
    vae = _vae(seed).with_guided_decoder(guide_basis=2, guide_blurs=(4,)).eval()
    with torch.no_grad():
        for m in (vae.dec_guide_in, vae.dec_guide_map, vae.guide_filters):
            assert m is not None
            for p in m.parameters():
                p.copy_(0.2 * torch.randn_like(p))
    return vae


@torch.no_grad()
def test_a_guided_decoder_reads_the_input_chunk_by_chunk_as_the_whole_clip() -> None:
    """Chunked decoding with each chunk's input frames equals one call over the whole clip with the whole
    input, the first group guided by four copies of frame 0 as it was encoded; the output follows the
    input frames beyond what the latents carry."""
    vae = _trained_guided()
    clip = torch.rand(1, 3, 9, 16, 16) * 2 - 1
    z = vae.encode_chunk(clip, vae.new_encoder_cache())
    whole = vae.decode_chunk(z, vae.new_decoder_cache(), clip)
    cache = vae.new_decoder_cache()
    parts = [vae.decode_chunk(z[:, :, k : k + 1], cache, clip[:, :, a:b])
             for k, (a, b) in enumerate(((0, 1), (1, 5), (5, 9)))]
    torch.testing.assert_close(torch.cat(parts, dim=2), whole, rtol=0, atol=1e-5)
    groups = torch.cat([clip[:, :, :1].expand(-1, -1, 4, -1, -1), clip[:, :, 1:]], dim=2)
    raw, _ = vae.decode_groups(vae.denormalize(z), None, groups)
    torch.testing.assert_close(whole, raw[:, :, 3:].clamp(-1, 1), rtol=0, atol=1e-5)
    other = vae.decode_chunk(z, vae.new_decoder_cache(), -clip)
    assert (other - whole).abs().mean() > 0.01  # same latents, another input: another picture
    assert (vae.decode_chunk(z, vae.new_decoder_cache()) - whole).abs().mean() > 0.01


def test_guide_frames_are_checked() -> None:
    vae = _trained_guided()
    clip = torch.rand(1, 3, 5, 16, 16) * 2 - 1
    z = vae.encode_chunk(clip, vae.new_encoder_cache())
    with pytest.raises(ValueError, match="do not match latents"):
        vae.decode_chunk(z, vae.new_decoder_cache(), clip[..., :8])
    with pytest.raises(ValueError, match="does not read input frames"):
        _vae().decode_chunk(z, _vae().new_decoder_cache(), clip)
    with pytest.raises(ValueError, match="guide_basis"):
        TinyVAEConfig(guided=True, guide_basis=-1)
    with pytest.raises(ValueError, match="guide_blurs"):
        TinyVAEConfig(guided=True, guide_blurs=(1,))
    assert TinyVAEConfig.from_dict(vae.config.to_dict()) == vae.config  # JSON keeps the blur sizes


def test_the_guided_map_trains_and_serves_the_same_function() -> None:
    """Training (autograd on) and serving (no_grad) compute the guided map two ways; they must agree."""
    vae = _trained_guided(7)
    z = torch.randn(1, CFG.latent_channels, 2, 4, 3)
    guide = torch.rand(1, 3, 8, 32, 24) * 2 - 1
    with torch.no_grad():
        served, _ = vae.decode_groups(z, None, guide)
    trained, _ = vae.decode_groups(z, None, guide)
    assert trained.requires_grad
    torch.testing.assert_close(served, trained.detach(), rtol=0, atol=1e-5)


@torch.no_grad()
def test_a_per_group_guided_map_is_one_map_for_the_four_frames_of_a_latent_frame() -> None:
    """With ``guide_per_group`` the affine map is shared by a latent frame's four pixel frames: a guide
    that is the same in all four gives the same guided term in all four even though their latents
    differ; per frame (the default) it does not."""
    z = torch.randn(1, CFG.latent_channels, 1, 4, 4)
    guide = (torch.rand(1, 3, 1, 32, 32) * 2 - 1).expand(-1, -1, 4, -1, -1)
    for per_group in (True, False):
        vae = _vae(8).with_guided_decoder(guide_basis=2, guide_per_group=per_group).eval()
        for p in vae.dec_guide_map.parameters():  # the patch path stays at zero: only the map's term differs
            p.copy_(0.2 * torch.randn_like(p))
        guided, _ = vae.decode_groups(z, None, guide)
        plain, _ = vae.decode_groups(z, None, torch.zeros_like(guide))
        term = guided - plain
        same = all(torch.allclose(term[:, :, 0], term[:, :, k], atol=1e-5) for k in range(1, 4))
        assert same == per_group


@pytest.mark.parametrize(("src", "size"), [((14, 18), (112, 144)), ((7, 5), (56, 40)), ((9, 12), (5, 7)), ((3, 3), (3, 3))])
def test_separable_bilinear_equals_torchs_interpolation(src: tuple[int, int], size: tuple[int, int]) -> None:
    """The guided map's upsampling as two matrix products, against torch's bilinear kernel (up, down, same)."""
    from engine.models.tiny_vae import _bilinear

    x = torch.randn(2, 5, *src, generator=torch.Generator().manual_seed(0))
    expected = torch.nn.functional.interpolate(x, size=size, mode="bilinear", align_corners=False)
    assert torch.allclose(_bilinear(x, size), expected, atol=1e-5)


def test_the_fast_pixel_shuffles_equal_torchs() -> None:
    from engine.models.tiny_vae import _shuffle8, _unshuffle8

    x = torch.randn(5, 3, 24, 40)
    patches = _unshuffle8(x)
    assert torch.equal(patches, torch.nn.functional.pixel_unshuffle(x, 8))
    assert torch.equal(_shuffle8(patches), x)
    y = torch.randn(2, 128, 3, 5)
    assert torch.equal(_shuffle8(y), torch.nn.functional.pixel_shuffle(y, 8))
