"""The TAEHV tiny stream VAE (engine/models/taehv.py) and the VAE choice (engine/vae_choice.py): streaming equals
the whole clip and a frame-by-frame walk written apart from the module, the taew2_1 key layout, strict loading,
parked caches, and the Wan encoder with the tiny decoder through the real runtime. Tiny sizes, random weights."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from _runtime_fixtures import HashTextEncoder, clip, fidelity
from safetensors.torch import save_file
from torch import Tensor, nn

from app.commands import bench
from engine.models.taehv import TAEHV, TAEHVCache, TAEHVConfig, load_taehv
from engine.models.wan_dit import CONFIGS, CausalWanDiT
from engine.models.wan_vae import WanVAE, WanVAECache, WanVAEConfig
from engine.pipeline import ModelNotAvailableError, Pipeline
from engine.random_model import build_taehv
from engine.sampling import STREAMDIFFUSION_V2
from engine.streaming.config import RuntimeConfig
from engine.streaming.parcel import park, unpark
from engine.streaming.rescale import rescale_vae_cache
from engine.streaming.runtime import PromptEncoder, StreamRuntime
from engine.vae_choice import SplitVAE, VAEChoice, vae_choice_for

H, W = 32, 48  # not square: a swapped height and width shows


@pytest.fixture(scope="module")
def vae() -> TAEHV:
    return build_taehv(TAEHVConfig.tiny(), "cpu")


def _frames(t: int, seed: int = 0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(1, 3, t, H, W, generator=g) * 2 - 1


def _split(x: Tensor, sizes: list[int]) -> list[Tensor]:
    return list(x.split(sizes, dim=2))


def test_streaming_chunks_equal_the_whole_clip(vae: TAEHV) -> None:
    """1 + 4 + 4 + 4 frames one chunk at a time, and their latents 1 + 1 + 2 at a time, give the one-call
    results: the memory blocks carry each stream's last frame across calls."""
    frames = _frames(13)
    whole = vae.encode(frames)
    assert whole.shape == (1, 16, 4, H // 8, W // 8)
    enc = vae.new_encoder_cache()
    streamed = torch.cat([vae.encode_chunk(c, enc) for c in _split(frames, [1, 4, 4, 4])], dim=2)
    torch.testing.assert_close(streamed, whole, rtol=0, atol=1e-5)
    assert enc.frames_seen == 13

    pixels = vae.decode(whole)
    assert pixels.shape == (1, 3, 13, H, W)  # 1 frame for the first latent frame, then 4 each
    dec = vae.new_decoder_cache()
    chunks = [vae.decode_chunk(z, dec) for z in _split(whole, [1, 1, 2])]
    assert [c.shape[2] for c in chunks] == [1, 4, 8]
    torch.testing.assert_close(torch.cat(chunks, dim=2), pixels, rtol=0, atol=1e-5)
    # Not the same result whatever the memory holds: a fresh cache mid-stream decodes otherwise.
    assert not torch.allclose(vae.decode_chunk(whole[:, :, 1:2], TAEHVCache("decoder", frames_seen=1)), chunks[1])


def _frame_by_frame(layers: nn.Sequential, frames: list[Tensor]) -> list[Tensor]:
    """TAEHV's sequential semantics written apart from the module's batched walk: one frame at a time through
    the layers; a memory block reads its own previous input (zeros first), a pool waits for its group and
    stacks it along channels in time order, a grow splits its output channels into frames in order."""
    memory: dict[int, Tensor] = {}
    pending: dict[int, list[Tensor]] = {}
    out: list[Tensor] = []

    def push(x: Tensor, i: int) -> None:
        while i < len(layers):
            layer = layers[i]
            kind = type(layer).__name__
            if kind == "_MemBlock":
                prev = memory.get(i, torch.zeros_like(x))
                memory[i] = x
                x = layer(x, prev)
            elif kind == "_TimePool":
                group = pending.setdefault(i, [])
                group.append(x)
                if len(group) < layer.stride:
                    return
                x = layer.conv(torch.cat(group, dim=1))
                pending[i] = []
            elif kind == "_TimeGrow":
                for part in layer.conv(x).chunk(layer.stride, dim=1):
                    push(part, i + 1)
                return
            else:
                x = layer(x)
            i += 1
        out.append(x)

    for frame in frames:
        push(frame, 0)
    return out


def test_the_batched_walk_matches_a_frame_by_frame_walk(vae: TAEHV) -> None:
    """Encoding: frame 0 as four copies, [0, 1] pixels, one latent per group of 4; decoding: 4 frames per
    latent, the stream's first 3 dropped, back to [-1, 1]."""
    frames = _frames(9, seed=1)
    with torch.no_grad():
        unit = [(f + 1) / 2 for f in frames.unbind(2)]
        latents = _frame_by_frame(vae.encoder, [unit[0]] * 3 + unit)
        torch.testing.assert_close(vae.encode(frames), torch.stack(latents, dim=2), rtol=0, atol=1e-5)
        z = torch.randn(1, 16, 3, H // 8, W // 8, generator=torch.Generator().manual_seed(2))
        raw = _frame_by_frame(vae.decoder, list(z.unbind(2)))[3:]
        expected = (torch.stack(raw, dim=2) * 2 - 1).clamp(-1, 1)
    torch.testing.assert_close(vae.decode(z), expected, rtol=0, atol=1e-5)
    assert expected.std() > 0.05  # random weights that still draw a picture, not a constant


def _taew2_1_shapes() -> dict[str, tuple[int, ...]]:
    """The keys and shapes of the public taew2_1 file, written out from the reference's module list
    (madebyollin/taehv, taehv.py: TAEHV's encoder and decoder nn.Sequential at their defaults)."""
    shapes: dict[str, tuple[int, ...]] = {
        "encoder.0.weight": (64, 3, 3, 3), "encoder.0.bias": (64,),
        "encoder.17.weight": (16, 64, 3, 3), "encoder.17.bias": (16,),
        "decoder.1.weight": (256, 16, 3, 3), "decoder.1.bias": (256,),
        "decoder.22.weight": (3, 64, 3, 3), "decoder.22.bias": (3,),
    }
    for pool, conv, stride in ((2, 3, 2), (7, 8, 2), (12, 13, 1)):  # TPool then the strided conv (no bias)
        shapes[f"encoder.{pool}.conv.weight"] = (64, 64 * stride, 1, 1)
        shapes[f"encoder.{conv}.weight"] = (64, 64, 3, 3)
    for grow, conv, cin, cout, stride in ((7, 8, 256, 128, 1), (13, 14, 128, 64, 2), (19, 20, 64, 64, 2)):
        shapes[f"decoder.{grow}.conv.weight"] = (cin * stride, cin, 1, 1)  # TGrow, then a conv without bias
        shapes[f"decoder.{conv}.weight"] = (cout, cin, 3, 3)
    blocks = [("encoder", i, 64) for i in (4, 5, 6, 9, 10, 11, 14, 15, 16)]
    blocks += [("decoder", i, ch) for ch, first in ((256, 3), (128, 9), (64, 15)) for i in range(first, first + 3)]
    for part, i, ch in blocks:  # MemBlock: conv.0 reads [x, past], then conv.2 and conv.4; an identity skip
        shapes[f"{part}.{i}.conv.0.weight"] = (ch, 2 * ch, 3, 3)
        for j in (0, 2, 4):
            shapes[f"{part}.{i}.conv.{j}.bias"] = (ch,)
        for j in (2, 4):
            shapes[f"{part}.{i}.conv.{j}.weight"] = (ch, ch, 3, 3)
    return shapes


def test_the_state_dict_is_the_taew2_1_layout() -> None:
    with torch.device("meta"):
        model = TAEHV()
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == _taew2_1_shapes()


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_a_saved_state_dict_loads_back_to_the_same_outputs(vae: TAEHV, tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"taew2_1{suffix}"
    state = {k: v.contiguous() for k, v in vae.state_dict().items()}
    save_file(state, str(path)) if suffix == ".safetensors" else torch.save(state, path)
    loaded = load_taehv(path, TAEHVConfig.tiny())
    frames = _frames(5, seed=3)
    torch.testing.assert_close(loaded.encode(frames), vae.encode(frames), rtol=0, atol=0)
    z = vae.encode(frames)
    torch.testing.assert_close(loaded.decode(z), vae.decode(z), rtol=0, atol=0)


@pytest.mark.parametrize(("change", "words"), [
    ("missing", r"missing \(1\): \['decoder.22.bias'\]"),
    ("extra", r"unexpected \(1\): \['decoder.23.weight'\]"),
    ("misshapen", r"mis-shaped \(1\): \['encoder.0.weight: checkpoint \(8, 3, 1, 1\) vs model \(8, 3, 3, 3\)'\]"),
])
def test_a_file_with_wrong_keys_is_refused_by_name(vae: TAEHV, tmp_path: Path, change: str, words: str) -> None:
    state = {k: v.contiguous() for k, v in vae.state_dict().items()}
    if change == "missing":
        del state["decoder.22.bias"]
    elif change == "extra":
        state["decoder.23.weight"] = torch.zeros(3)
    else:
        state["encoder.0.weight"] = torch.zeros(8, 3, 1, 1)
    path = tmp_path / "bad.safetensors"
    save_file(state, str(path))
    with pytest.raises(ValueError, match=f"does not match the TAEHV \\(taew2_1\\) layout: {words}"):
        load_taehv(path, TAEHVConfig.tiny())
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        load_taehv(tmp_path / "absent.pth")


def test_caches_survive_a_park_and_unpark(vae: TAEHV) -> None:
    frames = _frames(9, seed=4)
    enc, dec = vae.new_encoder_cache(), vae.new_decoder_cache()
    vae.decode_chunk(vae.encode_chunk(frames[:, :, :5], enc), dec)
    assert len(enc.memory) == len(dec.memory) == 9  # one per memory block, each a dataclass-held tensor
    enc2, dec2 = unpark(park((enc, dec)), "cpu")
    assert isinstance(enc2, TAEHVCache) and isinstance(dec2, TAEHVCache) and enc2.frames_seen == 5
    nxt = frames[:, :, 5:]
    z, z2 = vae.encode_chunk(nxt, enc), vae.encode_chunk(nxt, enc2)
    torch.testing.assert_close(z2, z, rtol=0, atol=0)
    torch.testing.assert_close(vae.decode_chunk(z2, dec2), vae.decode_chunk(z, dec), rtol=0, atol=0)


def test_a_cache_rescales_to_another_engine_size(vae: TAEHV) -> None:
    enc = vae.new_encoder_cache()
    vae.encode_chunk(_frames(1), enc)
    moved = rescale_vae_cache(enc, (W, H), (2 * W, H))
    assert isinstance(moved, TAEHVCache) and moved.memory.keys() == enc.memory.keys()
    for k, t in enc.memory.items():
        assert moved.memory[k].shape == (*t.shape[:2], t.shape[2], 2 * t.shape[3])
    assert vae.encode_chunk(torch.zeros(1, 3, 4, H, 2 * W), moved).shape == (1, 16, 1, H // 8, W // 4)


def test_wan_encoder_with_the_tiny_decoder_runs_a_stream_through_the_runtime() -> None:
    torch.manual_seed(0)
    dit = CausalWanDiT(CONFIGS["tiny"]).eval()
    split = SplitVAE(WanVAE(WanVAEConfig.tiny()).eval(), build_taehv(TAEHVConfig.tiny(), "cpu"))
    rt = StreamRuntime(dit, split, PromptEncoder(HashTextEncoder()), STREAMDIFFUSION_V2, RuntimeConfig())  # type: ignore[arg-type]
    state = rt.open("s", "thermal", (32, 32), fidelity())
    assert isinstance(state.vae_encoder, WanVAECache) and isinstance(state.vae_decoder, TAEHVCache)
    for chunk in clip(4):
        out = rt.run_chunk(state, chunk).frames
        assert out.shape == chunk.shape
        assert torch.isfinite(out).all() and out.std() > 0.01
    parts = state.nbytes_by_part()
    assert parts["vae_encoder"] > 0 and parts["vae_decoder"] == sum(
        t.numel() * t.element_size() for t in state.vae_decoder.memory.values())


def test_the_vae_choice_is_for_wan_models_only() -> None:
    assert vae_choice_for("random:tiny", "tiny-random") == VAEChoice("wan-encoder-tiny-decoder", "tiny-random")
    assert vae_choice_for("tiny-random", None) is None
    for model in ("tiny-random", None, "model.safetensors"):
        with pytest.raises(ValueError, match="--vae is for Wan 2.1 models"):
            vae_choice_for(model, "taew2_1.pth")
    with pytest.raises(ModelNotAvailableError, match="--vae is for Wan 2.1 models"):
        Pipeline.load("tiny-random", vae="tiny-random")
    assert VAEChoice.parse("wan") == VAEChoice()
    assert VAEChoice.parse("x.pth") == VAEChoice("wan-encoder-tiny-decoder", "x.pth")
    assert VAEChoice.parse("tiny:x.pth") == VAEChoice("tiny", "x.pth")
    root = Path("/models/m")
    assert VAEChoice.from_manifest("t.pth", None, root) == VAEChoice("wan-encoder-tiny-decoder", "/models/m/t.pth")
    assert VAEChoice.from_manifest("t.pth", "wan", root) == VAEChoice()
    with pytest.raises(ValueError, match="needs a tiny VAE file"):
        VAEChoice.from_manifest(None, "tiny", root)


def test_random_models_load_with_each_vae() -> None:
    split = Pipeline.load("random:tiny", vae="tiny-random").runtime.vae
    assert isinstance(split, SplitVAE) and isinstance(split.decoder_vae, TAEHV)
    assert isinstance(Pipeline.load("random:tiny", vae="tiny:tiny-random").runtime.vae, TAEHV)
    with pytest.raises(ModelNotAvailableError, match="no tiny VAE weights at absent.pth"):
        Pipeline.load("random:tiny", vae="absent.pth")


def test_bench_engine_measures_the_tiny_decoder(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["engine", "--model", "random:tiny", "--vae", "tiny-random", "--steps", "1",
                              "--chunks", "1", "--json"])
    assert bench.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "random:tiny (wan-encoder-tiny-decoder VAE: tiny-random)"
    assert report["results"][0]["state_parts_mb"]["vae_decoder"] > 0
