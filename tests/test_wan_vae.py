import io
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLWan
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
from safetensors.torch import save_file

from engine.models.wan_vae import (
    WanVAE,
    WanVAECache,
    WanVAEConfig,
    load_wan_vae,
    original_to_diffusers,
    original_to_diffusers_keys,
)
from engine.vae import StreamVAE

CFG = WanVAEConfig.tiny()


def _diffusers_vae(cfg: WanVAEConfig) -> AutoencoderKLWan:
    return AutoencoderKLWan(
        base_dim=cfg.base_dim,
        z_dim=cfg.z_dim,
        dim_mult=list(cfg.dim_mult),
        num_res_blocks=cfg.num_res_blocks,
        temperal_downsample=list(cfg.temporal_downsample),
        latents_mean=list(cfg.latents_mean),
        latents_std=list(cfg.latents_std),
    ).eval()


@pytest.fixture(scope="module")
def models() -> tuple[WanVAE, AutoencoderKLWan]:
    torch.manual_seed(0)
    ours = WanVAE(CFG).eval()
    with torch.no_grad():  # non-trivial norm gains, so a swapped gamma would show
        for name, p in ours.named_parameters():
            if name.endswith("gamma"):
                p.add_(0.2 * torch.randn_like(p))
    ref = _diffusers_vae(CFG)
    ref.load_state_dict(original_to_diffusers(ours.state_dict(), CFG), strict=True)
    return ours, ref


def _clip(frames: int = 13) -> torch.Tensor:
    return torch.rand(1, 3, frames, 32, 24, generator=torch.Generator().manual_seed(1)) * 2 - 1


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def test_is_a_stream_vae(models: tuple[WanVAE, AutoencoderKLWan]) -> None:
    ours, _ = models
    assert isinstance(ours, StreamVAE)
    assert (ours.latent_channels, ours.temporal_compression, ours.spatial_compression) == (16, 4, 8)


def test_streaming_encode_equals_whole_clip_and_diffusers(models: tuple[WanVAE, AutoencoderKLWan]) -> None:
    ours, ref = models
    x = _clip(13)
    cache = ours.new_encoder_cache()
    streamed = torch.cat([ours.encode_chunk(x[:, :, a:b], cache) for a, b in ((0, 1), (1, 5), (5, 9), (9, 13))], 2)
    assert streamed.shape == (1, 16, 4, 4, 3) and cache.frames_seen == 13
    _close(streamed, ours.encode(x))
    with torch.no_grad():
        mu = ref.encode(x).latent_dist.mode()
    _close(streamed, (mu - ours.latents_mean) / ours.latents_std)
    cache = ours.new_encoder_cache()  # other chunkings give the same latents
    other = torch.cat([ours.encode_chunk(x[:, :, :5], cache), ours.encode_chunk(x[:, :, 5:], cache)], 2)
    _close(other, streamed)


def test_streaming_decode_equals_whole_clip_and_diffusers(models: tuple[WanVAE, AutoencoderKLWan]) -> None:
    ours, ref = models
    z = torch.randn(1, 16, 4, 4, 3, generator=torch.Generator().manual_seed(2))
    cache = ours.new_decoder_cache()
    chunks = [ours.decode_chunk(z[:, :, i : i + 1], cache) for i in range(4)]
    assert [c.shape[2] for c in chunks] == [1, 4, 4, 4]
    streamed = torch.cat(chunks, 2)
    assert streamed.shape == (1, 3, 13, 32, 24)
    assert streamed.std() > 0.05 and (streamed.abs() < 1).float().mean() > 0.9  # not saturated: a real test
    _close(streamed, ours.decode(z))
    with torch.no_grad():
        expected = ref.decode(z * ours.latents_std + ours.latents_mean).sample
    _close(streamed, expected)


def test_cache_serialises_and_moves(models: tuple[WanVAE, AutoencoderKLWan]) -> None:
    ours, _ = models
    x = _clip(9)
    cache = ours.new_encoder_cache()
    ours.encode_chunk(x[:, :, :5], cache)
    buffer = io.BytesIO()
    torch.save(cache.state_dict(), buffer)
    buffer.seek(0)
    restored = WanVAECache.from_state_dict(torch.load(buffer, weights_only=True)).to("cpu")
    assert restored.nbytes == cache.nbytes > 0
    assert torch.equal(ours.encode_chunk(x[:, :, 5:], restored), ours.encode_chunk(x[:, :, 5:], cache))


def test_bad_chunks_and_caches_are_rejected(models: tuple[WanVAE, AutoencoderKLWan]) -> None:
    ours, _ = models
    x = _clip(9)
    with pytest.raises(ValueError, match="1 \\+ 4k frames"):
        ours.encode_chunk(x[:, :, :4], ours.new_encoder_cache())
    cache = ours.new_encoder_cache()
    ours.encode_chunk(x[:, :, :1], cache)
    with pytest.raises(ValueError, match="multiple of 4"):
        ours.encode_chunk(x[:, :, 1:4], cache)
    with pytest.raises(ValueError, match="multiples of 8"):
        ours.encode_chunk(x[:, :, :1, :12], ours.new_encoder_cache())
    with pytest.raises(ValueError, match="decoder cache"):
        ours.decode_chunk(torch.zeros(1, 16, 1, 2, 2), ours.new_encoder_cache())
    with pytest.raises(ValueError, match="latents must be"):
        ours.decode_chunk(torch.zeros(1, 4, 1, 2, 2), ours.new_decoder_cache())


def test_key_mapping_matches_diffusers_converter_on_real_config() -> None:
    cfg = WanVAEConfig()
    mapping = original_to_diffusers_keys(cfg)
    assert len(mapping) == 194
    # diffusers' own single-file converter (hard-coded for the real config) is the independent reference
    converted = convert_wan_vae_to_diffusers({k: k for k in mapping})
    assert {v: k for k, v in mapping.items()} == converted
    with torch.device("meta"):
        ref_shapes = {k: v.shape for k, v in AutoencoderKLWan().state_dict().items()}
        ours = WanVAE(cfg).state_dict()
    assert {mapping[k]: v.shape for k, v in ours.items()} == ref_shapes


def test_loads_diffusers_dir_and_original_files(models: tuple[WanVAE, AutoencoderKLWan], tmp_path: Path) -> None:
    ours, ref = models
    x = _clip(5)
    expected = ours.encode(x)
    ref.save_pretrained(tmp_path / "pipe" / "vae")
    from_dir = load_wan_vae(tmp_path / "pipe")  # a pipeline dir with vae/ works too
    assert from_dir.config == CFG
    _close(from_dir.encode(x), expected)
    torch.save(ours.state_dict(), tmp_path / "Wan2.1_VAE.pth")
    assert torch.equal(load_wan_vae(tmp_path / "Wan2.1_VAE.pth", CFG).encode(x), expected)
    save_file(original_to_diffusers(ours.state_dict(), CFG), str(tmp_path / "vae.safetensors"))
    assert torch.equal(load_wan_vae(tmp_path / "vae.safetensors", CFG).encode(x), expected)


def test_wrong_checkpoints_give_clear_errors(models: tuple[WanVAE, AutoencoderKLWan], tmp_path: Path) -> None:
    ours, _ = models
    state = dict(ours.state_dict())
    state.pop("encoder.conv1.bias")
    state["encoder.extra.weight"] = torch.zeros(1)
    state["conv2.weight"] = torch.zeros(3, 3, 1, 1, 1)
    torch.save(state, tmp_path / "bad.pth")
    with pytest.raises(ValueError) as err:
        load_wan_vae(tmp_path / "bad.pth", CFG)
    message = str(err.value)
    assert "missing (1): ['encoder.conv1.bias']" in message
    assert "unexpected (1): ['encoder.extra.weight']" in message
    assert "mis-shaped (1): ['conv2.weight: checkpoint (3, 3, 1, 1, 1)" in message
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_wan_vae(tmp_path)
    _diffusers_vae(WanVAEConfig(base_dim=4, num_res_blocks=1)).save_pretrained(tmp_path / "v")
    cfg_file = tmp_path / "v" / "config.json"
    cfg_file.write_text(cfg_file.read_text().replace('"is_residual": false', '"is_residual": true'))
    with pytest.raises(ValueError, match="is_residual"):
        load_wan_vae(tmp_path / "v")


def test_channels_last_layout_gives_the_same_stream(models: tuple[WanVAE, AutoencoderKLWan]) -> None:
    """The layout CUDA runs the VAE in (engine.models.wan_vae.for_device): the same latents and frames as
    diffusers' reference, chunk by chunk, with the caches parked and unparked between chunks (on a CPU
    the convolutions' outputs come back contiguous; cuDNN keeps them channels-last); switching back
    restores the weights' layout."""
    import copy

    from engine.streaming.parcel import park, unpark

    ours, ref = models
    fast = copy.deepcopy(ours).use_channels_last()
    conv = fast.decoder.conv1
    assert conv.weight.is_contiguous(memory_format=torch.channels_last_3d)
    x = _clip(9)
    enc, dec = fast.new_encoder_cache(), fast.new_decoder_cache()
    latents, frames = [], []
    for a, b in ((0, 1), (1, 5), (5, 9)):
        z = fast.encode_chunk(x[:, :, a:b], enc)
        assert z.is_contiguous()
        latents.append(z)
        frames.append(fast.decode_chunk(z, dec))
        enc, dec = unpark(park((enc, dec)))
    with torch.no_grad():
        mu = ref.encode(x).latent_dist.mode()
        expected = ref.decode(mu).sample
    _close(torch.cat(latents, 2), (mu - ours.latents_mean) / ours.latents_std)
    _close(torch.cat(frames, 2), expected.clamp(-1, 1))
    fast.use_channels_last(False)
    assert conv.weight.is_contiguous()
