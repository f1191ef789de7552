"""The SHIPPED embedded checkpoint: format, prompt -> style resolution, and real stylisation per style."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from engine.embedded.block_texture import GRID_LOOKS, grid_energy_ratio
from engine.embedded.clips import HELDOUT_IMAGES, heldout_specs, render_clip
from engine.embedded.evaluate import GRID_PX, codec_round_trip, psnr, stylize_stream
from engine.embedded.model import DEFAULT_CONFIG, EmbeddedModel, EmbeddedStream
from engine.embedded.styles import NOT_SHIPPED, pooled_embeddings
from engine.embedded.teachers import TEACHERS, stylize_clip
from engine.frames import frames_to_tensor
from engine.models.tiny_vae import TinyVAE
from engine.models.wan_dit import CausalWanDiT
from engine.pipeline import Pipeline, StreamParams, look_anchors
from engine.sampling import FlowMatchSchedule, NoiseSource, v2v_input, x0_from_velocity
from engine.streaming.deblock import deblock


@pytest.fixture(scope="module")
def model() -> EmbeddedModel:
    torch.set_num_threads(1)
    return EmbeddedModel.load()


@pytest.fixture(scope="module")
def pipe() -> Pipeline:
    torch.set_num_threads(1)
    return Pipeline.load()


def test_checkpoint_format() -> None:
    spec = json.loads(DEFAULT_CONFIG.read_text())
    assert spec["format"] == "diffcast-embedded/1"
    assert spec["text_encoder"] == "minilm" and spec["text_conditioning"] == "pooled"
    assert set(spec["styles"]) == set(TEACHERS) - NOT_SHIPPED == set(spec["prototypes"])
    assert len(spec["styles"]) >= 8
    weights = DEFAULT_CONFIG.with_suffix(".safetensors")
    assert weights.stat().st_size <= 25 * 1024 * 1024
    with safe_open(str(weights), "pt") as f:
        prefixes = {k.split(".", 1)[0] for k in f.keys()}
    assert prefixes == {"vae", "dit"}


def test_every_style_output_is_closest_to_its_own_teacher(model: EmbeddedModel, pipe: Pipeline) -> None:
    frames = render_clip(heldout_specs()[4])[:5]  # a held-out source, the product's first two chunks (1 + 4 frames)
    teachers = {s: stylize_clip(frames, s).astype(np.float32) for s in TEACHERS}
    wrong = []
    for style, prompts in model.spec.styles.items():
        out = stylize_stream(pipe, frames, prompts[0]).shipped
        dist = {s: float(np.mean((out.astype(np.float32) - t) ** 2)) for s, t in teachers.items()}
        nearest = min(dist, key=dist.__getitem__)
        if nearest != style:
            wrong.append(f"{prompts[0]!r} -> nearest {nearest} (MSE {dist[nearest]:.0f}), own {dist[style]:.0f}")
    assert not wrong, "; ".join(wrong)


def test_the_evaluation_scores_what_a_product_stream_serves(pipe: Pipeline) -> None:
    frames = render_clip(heldout_specs()[2])[:9]
    run = stylize_stream(pipe, frames, "watercolor", seed=3)
    # No steps or noise scale given: the Python API runs the model's own operating point.
    stream = pipe.open_stream(StreamParams(prompt="watercolor", seed=3))
    served = np.concatenate([stream.process(frames[:1]), stream.process(frames[1:5]), stream.process(frames[5:9])])
    assert np.array_equal(run.shipped, served)
    assert run.noise_rates[-1] == stream.state.last_noise_rate
    assert not np.array_equal(run.raw, run.shipped), "the default model's config enables the stabilizer"


def test_no_block_texture_on_a_held_out_photograph(model: EmbeddedModel, pipe: Pipeline) -> None:
    """Every look whose teacher draws no grid of its own stays within 1.2x the gradient energy off the
    16-px grid (the decoded frames alone showed 11-20x, the stabilizer's output 4-8x)."""
    spec = heldout_specs()[1]
    assert spec.source in HELDOUT_IMAGES
    frames = render_clip(spec)[:9]
    assert grid_energy_ratio(frames, GRID_PX) < 1.2
    blocky = []
    for style, prompts in model.spec.styles.items():
        if grid_energy_ratio(stylize_clip(frames, style), GRID_PX) > 1.2:
            continue  # the look is a grid (pixel art's 8-px cells)
        run = stylize_stream(pipe, frames, prompts[0], seed=1)
        ratio = grid_energy_ratio(run.shipped, GRID_PX)
        if ratio > 1.2:
            blocky.append(f"{style} {ratio:.2f}")
    assert not blocky, f"16-px block texture: {blocky}"


def test_every_phrasing_of_a_look_drawn_on_the_grid_is_spared_and_no_other(model: EmbeddedModel, pipe: Pipeline) -> None:
    deblocking = pipe.runtime.config.deblock
    assert deblocking is not None
    wrong = []
    for style, phrasings in model.spec.styles.items():
        for phrasing in phrasings:
            strength = pipe.runtime.deblock_strength(pipe.open_stream(StreamParams(prompt=phrasing)).state)
            if strength != (0.0 if style in GRID_LOOKS else deblocking.strength):
                wrong.append(f"{phrasing!r} ({style}): {strength:.2f}")
    assert not wrong, wrong


def test_prompt_resolution(model: EmbeddedModel) -> None:
    match = model.match("a charcoal pencil drawing")
    assert {name for name, _ in match.nearest[:2]} == {"charcoal", "pencil_sketch"} and not match.too_far
    far = model.match("quarterly tax report spreadsheet")
    assert far.too_far
    assert "nearest" in far.message() and "pencil sketch" in far.message() and "neon" not in far.message()


def _conditioning(model: EmbeddedModel, prompt: str) -> torch.Tensor:
    """The context [1, 1, dim] the model is served for ``prompt``: its pooled embedding anchored to the
    looks (the checkpoint's look temperature), as engine/pipeline.py configures the product."""
    anchors = look_anchors(json.loads(model.spec.to_json()))
    assert anchors is not None
    return anchors.anchor(pooled_embeddings([prompt]))[:, None, :]


def _masked_reference(model: EmbeddedModel, z: torch.Tensor, context: torch.Tensor, seed: int,
                      rates: list[float]) -> torch.Tensor:
    """x̂₀ of latents z [1, C, K, h, w] from ONE forward over all K frames under the block-causal mask
    with the model's KV window (1-step V2V): frame k noised at ``rates[k]`` with the k-th draw of
    ``NoiseSource(seed)`` times the model's input noise, at timestep 1000·rate − 100 (StreamDiffusionV2's
    V2V first step)."""
    noise_source = NoiseSource(seed)
    noise = torch.cat([noise_source.randn(z[:, :, :1].shape) for _ in range(z.shape[2])], dim=2)
    noise = model.spec.sampler.input_noise * noise
    x = torch.cat([v2v_input(z[:, :, k : k + 1], noise[:, :, k : k + 1], r) for k, r in enumerate(rates)], dim=2)
    t = torch.tensor([[1000.0 * r - 100.0 for r in rates]])
    dit: CausalWanDiT = model.dit
    v = dit.forward_masked(x, t, dit.encode_prompt(context), chunk_frames=model.spec.stream.chunk_latent_frames,
                           window_frames=model.spec.stream.kv_window_frames)
    sigma = FlowMatchSchedule(model.spec.sampler.shift).sigma(t).view(1, 1, -1, 1, 1)
    return x0_from_velocity(x, v, sigma)


@torch.no_grad()
def test_streaming_with_kv_cache_equals_one_masked_forward(model: EmbeddedModel, pipe: Pipeline) -> None:
    """The product's chunk-by-chunk stream (1 frame, then 4; KV cache with a 2-frame window; motion-aware
    noise) equals the whole clip under the block-causal mask, with each chunk's noise rate as streamed."""
    frames = render_clip(heldout_specs()[0])[:13]  # 4 chunks: short enough that RoPE never wraps
    prompt = model.spec.styles["thermal"][0]
    run = stylize_stream(pipe, frames, prompt, seed=5, steps=1)
    assert len(run.noise_rates) == 4 and len(set(run.noise_rates)) > 1, "the clip moves: the controller varies s"

    vae: TinyVAE = model.vae
    pixels = frames_to_tensor(frames)[None]
    z = vae.encode_chunk(pixels, vae.new_encoder_cache())
    x0 = _masked_reference(model, z, _conditioning(model, prompt), 5, run.noise_rates)
    # The whole clip decoded in one call; a decoder that reads the input frames reads the whole clip.
    whole = vae.decode_chunk(x0, vae.new_decoder_cache(), pixels if vae.reads_input else None)[0].clamp(-1, 1)
    deblocking = pipe.runtime.config.deblock
    assert deblocking is not None and pipe.runtime.deblock_strength(pipe.open_stream(StreamParams(prompt=prompt)).state) > 0
    whole = deblock(whole, vae.spatial_compression, deblocking.strength, deblocking.reach).clamp(-1, 1)
    reference = ((whole.permute(1, 2, 3, 0) + 1) * 127.5).round().byte().numpy()
    assert np.abs(run.raw.astype(int) - reference).max() <= 1


@torch.no_grad()
def test_training_time_streams_equal_one_masked_forward_per_row(model: EmbeddedModel) -> None:
    """The decoder fine-tune's batched streams (one product stream per style row) equal, row by row, the
    whole latent clip under the block-causal mask at the fixed noise scale."""
    prompts = [model.spec.styles[s][0] for s in ("thermal", "cartoon", "sepia_film")]
    torch.manual_seed(0)
    z = torch.randn(1, model.spec.vae.latent_channels, 3, 8, 8)  # 3 latent frames of a 64x64 crop
    s = model.spec.sampler.noise_scale
    stream = EmbeddedStream(model.stream_runtime(), prompts, (64, 64), seed=11, noise_scale=s, num_steps=1)
    streamed = stream.denoise(z.expand(len(prompts), -1, -1, -1, -1))
    for b, prompt in enumerate(prompts):
        reference = _masked_reference(model, z, _conditioning(model, prompt), 11, [s] * 3)
        torch.testing.assert_close(streamed[b : b + 1], reference, rtol=0, atol=1e-4)


def _look_video(pipe: Pipeline, frames: np.ndarray, prompt: str | list[str],
                weights: tuple[float, ...] | None = None) -> np.ndarray:
    stream = pipe.open_stream(StreamParams(prompt=prompt, prompt_weights=weights, seed=0))
    return np.concatenate([stream.process(frames[:1]), stream.process(frames[1:5])]).astype(np.float32)


def _dist(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.abs(x - y).mean())


def _detour(video: np.ndarray, look_a: np.ndarray, look_b: np.ndarray) -> float:
    """How far off the way from look a to look b a video is: (d(v, a) + d(v, b)) / d(a, b), 1 on it."""
    return (_dist(video, look_a) + _dist(video, look_b)) / _dist(look_a, look_b)


def test_explicit_prompt_weights_blend_two_looks_between_them(pipe: Pipeline) -> None:
    """A 50/50 blend of two looks is far from both and near the way between them (a detour of at most
    a third: black frames, noise or an unrelated look are 1.5-2.5x off it); moving the weights moves
    the output along it. A blend that came out as either end alone, or stuck, fails."""
    frames = render_clip(heldout_specs()[1])[:5]
    a, b = "pencil sketch", "thermal camera"
    look_a, look_b = _look_video(pipe, frames, a), _look_video(pipe, frames, b)
    apart = _dist(look_a, look_b)
    assert apart > 30
    middle = _look_video(pipe, frames, [a, b], (0.5, 0.5))
    to_a, to_b = _dist(middle, look_a), _dist(middle, look_b)
    assert to_a < 0.9 * apart and to_b < 0.9 * apart and to_a > 0.1 * apart and to_b > 0.1 * apart
    assert _detour(middle, look_a, look_b) < 1.35
    leaning_a = _look_video(pipe, frames, [a, b], (0.8, 0.2))
    leaning_b = _look_video(pipe, frames, [a, b], (0.2, 0.8))
    assert _dist(leaning_a, look_a) < to_a < _dist(leaning_b, look_a)


def test_a_prompt_near_two_looks_is_served_between_them(pipe: Pipeline) -> None:
    """Anchored, a prompt about as near two looks as "a charcoal pencil drawing" is served as their
    interpolation: its output lies between the two looks' own outputs, not at either end."""
    anchors = pipe.runtime.prompts.anchors
    assert anchors is not None, "the shipped model anchors prompts to its looks"
    prompt = "a charcoal pencil drawing"
    weights = dict(anchors.weights(pipe.runtime.prompts.pooled([prompt])[0]))
    assert set(weights) == {"charcoal", "pencil_sketch"} and min(weights.values()) > 0.2
    frames = render_clip(heldout_specs()[1])[:5]
    charcoal, pencil = _look_video(pipe, frames, "charcoal drawing"), _look_video(pipe, frames, "pencil sketch")
    apart = _dist(charcoal, pencil)
    both = _look_video(pipe, frames, prompt)
    to_charcoal, to_pencil = _dist(both, charcoal), _dist(both, pencil)
    assert 0.05 * apart < to_charcoal < apart and 0.05 * apart < to_pencil < apart
    assert _detour(both, charcoal, pencil) < 1.35


def test_a_prompt_naming_two_looks_is_served_as_both(pipe: Pipeline) -> None:
    """"pencil sketch and watercolor" (whose whole embedding leans 95/5 to the pencil sketch) comes out
    as the 50/50 slerp blend of the two looks' own prompts: between them, far from each end."""
    frames = render_clip(heldout_specs()[1])[:5]
    pencil, watercolor = _look_video(pipe, frames, "pencil sketch"), _look_video(pipe, frames, "watercolor")
    apart = _dist(pencil, watercolor)
    both = _look_video(pipe, frames, "pencil sketch and watercolor")
    assert 0.25 * apart < _dist(both, pencil) < 0.75 * apart
    assert 0.25 * apart < _dist(both, watercolor) < 0.75 * apart
    assert _detour(both, pencil, watercolor) < 1.35
    # The slerp midpoint of the two looks, as an explicit 50/50 slerp blend of their own prompts gives it.
    stream = pipe.open_stream(StreamParams(prompt=["pencil sketch", "watercolor"], prompt_weights=(0.5, 0.5),
                                           blend_mode="slerp", seed=0))
    explicit = np.concatenate([stream.process(frames[:1]), stream.process(frames[1:5])]).astype(np.float32)
    assert _dist(both, explicit) < 0.02 * apart


def test_codec_round_trip_reconstructs_the_clip_chunk_by_chunk(pipe: Pipeline) -> None:
    """The evaluation's codec-only flicker measure: the stream VAE's round trip of a held-out clip,
    chunked as a live stream is, against the clip itself (an independent reference)."""
    clip = render_clip(heldout_specs()[0])
    out = codec_round_trip(pipe, clip)
    assert out.shape == clip.shape
    assert psnr(out, clip) > 25.0  # the codec keeps the picture (the model card: ~30 dB)
    assert not np.array_equal(out, clip)  # and is a real encode / decode, not a copy
    # Frame to frame it changes where the clip does: a frozen or per-chunk-repeated output would not.
    change_in, change_out = np.abs(np.diff(clip.astype(float), axis=0)), np.abs(np.diff(out.astype(float), axis=0))
    per_frame = [float(np.corrcoef(a.ravel(), b.ravel())[0, 1]) for a, b in zip(change_in, change_out, strict=True)]
    assert min(per_frame) > 0.5
