"""The SHIPPED embedded checkpoint: format, prompt -> style resolution, and real stylisation per style."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from engine.embedded.clips import heldout_specs, render_clip
from engine.embedded.evaluate import stylize_stream
from engine.embedded.model import DEFAULT_CONFIG, EmbeddedModel
from engine.embedded.styles import NOT_SHIPPED, pooled_embeddings
from engine.embedded.teachers import TEACHERS, stylize_clip
from engine.sampling import NoiseSource, noise_scale_to_timestep, v2v_input, x0_from_velocity


@pytest.fixture(scope="module")
def model() -> EmbeddedModel:
    torch.set_num_threads(1)
    return EmbeddedModel.load()


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


def test_every_style_output_is_closest_to_its_own_teacher(model: EmbeddedModel) -> None:
    frames = render_clip(heldout_specs()[4])[:5]  # a held-out source, first chunk (1 + 4 frames)
    teachers = {s: stylize_clip(frames, s).astype(np.float32) for s in TEACHERS}
    wrong = []
    for style, prompts in model.spec.styles.items():
        out, _, _ = stylize_stream(model, frames, prompts[0])
        dist = {s: float(np.mean((out.astype(np.float32) - t) ** 2)) for s, t in teachers.items()}
        nearest = min(dist, key=dist.__getitem__)
        if nearest != style:
            wrong.append(f"{prompts[0]!r} -> nearest {nearest} (MSE {dist[nearest]:.0f}), own {dist[style]:.0f}")
    assert not wrong, "; ".join(wrong)


def test_prompt_resolution(model: EmbeddedModel) -> None:
    match = model.match("a charcoal pencil drawing")
    assert match.style == "pencil_sketch" and not match.too_far
    far = model.match("quarterly tax report spreadsheet")
    assert far.too_far
    assert "nearest" in far.message() and "pencil_sketch" in far.message()


@torch.no_grad()
def test_streaming_with_kv_cache_equals_one_masked_forward(model: EmbeddedModel) -> None:
    """Chunk-by-chunk stylisation (KV cache, 2-frame window) equals the whole clip under the block-causal mask."""
    frames = render_clip(heldout_specs()[0])[:13]
    prompt = model.spec.styles["thermal"][0]
    _, streamed, _ = stylize_stream(model, frames, prompt, seed=5, num_steps=1)

    pixels = torch.from_numpy(frames).float().div(127.5).sub(1.0).permute(3, 0, 1, 2)[None]
    z = model.vae.encode_chunk(pixels, model.vae.new_encoder_cache())
    noise_source = NoiseSource(5)
    noise = torch.cat([noise_source.randn(z[:, :, :1].shape) for _ in range(z.shape[2])], dim=2)
    s = model.spec.sampler.noise_scale
    x = v2v_input(z, noise, s)
    t = float(noise_scale_to_timestep(s))
    context = pooled_embeddings([prompt])[:, None, :]
    v = model.dit.forward_masked(x, torch.full((1, z.shape[2]), t), model.dit.encode_prompt(context), chunk_frames=1,
                                 window_frames=model.spec.stream.kv_window_frames)
    x0 = x0_from_velocity(x, v, model.schedule.sigma(t))
    whole = model.vae.decode_chunk(x0, model.vae.new_decoder_cache())
    reference = ((whole[0].permute(1, 2, 3, 0).clamp(-1, 1) + 1) * 127.5).round().byte().numpy()
    assert np.abs(streamed.astype(int) - reference).max() <= 1
