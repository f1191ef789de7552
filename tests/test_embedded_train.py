"""Training recipe pieces: gradients reach the whole DiT, batches are reproducible, resume works."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.embedded import train
from engine.embedded.model import EmbeddedModel, EmbeddedSpec, EmbeddedStream, SamplerSpec
from engine.embedded.styles import NOT_SHIPPED, STYLE_PROMPTS
from engine.models.tiny_vae import TinyVAE, TinyVAEConfig
from engine.models.wan_dit import CausalWanDiT
from engine.sampling import FlowMatchSchedule


def _dit() -> CausalWanDiT:
    torch.manual_seed(0)
    cfg = train.tiny_dit_config(8)
    return CausalWanDiT(type(cfg)(**{**cfg.__dict__, "dim": 48, "ffn_dim": 64, "num_heads": 2, "num_layers": 2}))


def test_training_prompt_cache_equals_encode_prompt() -> None:
    dit = _dit()
    context = torch.randn(3, 1, 384)
    ours, reference = train.prompt_cache_with_grad(dit, context), dit.encode_prompt(context)
    for a, b in zip(ours.k + ours.v, reference.k + reference.v, strict=True):
        torch.testing.assert_close(a, b)


def test_dit_loss_trains_every_parameter_and_reaches_its_target(monkeypatch: pytest.MonkeyPatch) -> None:
    dit = _dit()
    x, target = torch.randn(2, 8, 2, 4, 4), torch.randn(2, 8, 2, 4, 4)
    t, sigma = torch.full((2, 2), 300.0), torch.full((2, 2), 0.7)
    vae = TinyVAE(TinyVAEConfig(latent_channels=8, enc_channels=8, dec_channels=8))
    loss = train.dit_loss(dit, vae, x, t, sigma, target, torch.randn(2, 1, 384), temporal_weight=1.0)
    loss.backward()
    missing = [n for n, p in dit.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient reaches {missing}"
    # The loss is the x0 error of the network's velocity: with v = (x - target) / sigma it is zero,
    # temporal term included.
    monkeypatch.setattr(CausalWanDiT, "forward_masked",
                        lambda self, x_, *a, **k: (x_ - target) / sigma[:, None, :, None, None])
    assert float(train.dit_loss(dit, vae, x, t, sigma, target, torch.randn(2, 1, 384), 1.0)) < 1e-10


def test_temporal_error_ignores_errors_that_stay_put() -> None:
    target = torch.randn(2, 6, 4)
    steady = target + torch.randn(2, 1, 4)  # the same error on every frame
    flicker = target + torch.randn(2, 6, 4)
    assert train.temporal_error(steady, target, dim=1).abs().max() < 1e-6
    assert train.temporal_error(flicker, target, dim=1).abs().mean() > 0.5


def test_warped_temporal_error_counts_errors_that_shimmer_in_place_not_ones_moving_with_the_content() -> None:
    g = torch.Generator().manual_seed(0)
    dx, dy, frames = 2, 1, 5  # the content moves 2 px right and 1 px down per frame

    def moving(image: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.roll(image, (t * dy, t * dx), dims=(3, 4)) for t in range(frames)], dim=2)

    target = moving(torch.rand(1, 3, 1, 32, 32, generator=g))
    error = 0.1 * torch.randn(1, 3, 1, 32, 32, generator=g)
    flow = torch.zeros(1, frames - 1, 32, 32, 2)
    flow[..., 0], flow[..., 1] = -dx, -dy  # pixel p of frame t was at p - (dx, dy) in frame t - 1
    assert float(train.warped_temporal_error(target + moving(error), target, flow)) < 1e-6
    # An error fixed to the frame: at each pixel whose source stays inside, |e(p) - e(p - d)|.
    e = error[0].numpy()
    expected = np.abs(e[:, 0, dy:, dx:] - e[:, 0, :-dy, :-dx]).mean(axis=0).mean()
    fixed = float(train.warped_temporal_error(target + error, target, flow))
    assert fixed == pytest.approx(float(expected), rel=1e-5)
    # The unwarped term has it the other way round: the moving error is what it counts.
    assert train.temporal_error(target + error, target, dim=2).abs().max() < 1e-6
    assert train.temporal_error(target + moving(error), target, dim=2).abs().mean() > 0.05


def test_vae_batches_carry_the_flow_of_their_own_crop_flipped_and_in_the_stream_layout(tmp_path: Path) -> None:
    """The flow a VAE batch carries must warp each frame of that batch onto the next: check it on the
    raw clip variant, whose own motion the flow was measured on, through crops, flips and layouts."""
    spec = train.clipdata.ClipSpec("procedural:3", 0, train.CLIP_FRAMES)  # motion 0: a pan
    clip = train.clipdata.render_clip(spec)
    frames = np.stack([clip, clip])[None]  # [1 clip, 2 variants, T, H, W, 3]
    flows = train.build_flows(tmp_path, frames)
    cfg = train.TrainConfig(workdir=tmp_path, vae_batch=8)
    warped, still = [], []
    for step in range(4):
        x, flow = train._vae_batch(frames, cfg, step, flows)
        assert flow is not None and flow.shape == (8, 7, cfg.vae_crop, cfg.vae_crop, 2)
        for b in range(8):
            warped.append(float(train.warped_temporal_error(x[b : b + 1], torch.zeros_like(x[b : b + 1]), flow[b : b + 1])))
            still.append(float(x[b].diff(dim=1).abs().mean()))
    # Following the flow leaves a small residual; a flow flipped or shifted by one frame would not.
    assert np.mean(warped) < 0.35 * np.mean(still)


def test_grid_step_error_counts_seams_the_target_lacks_and_nothing_else() -> None:
    target = torch.randn(2, 3, 4, 32, 32)
    seams = torch.zeros(32)
    seams[16:] = 0.5  # one step across the column boundary at x = 16
    assert float(train.grid_step_error(target, target)) == 0.0
    assert float(train.grid_step_error(target + seams, target)) == pytest.approx(0.5 * 0.5 / 3)  # 1 of 3 column boundaries
    # The same step between columns 12 and 13 is inside a block: not a seam.
    inside = torch.zeros(32)
    inside[13:] = 0.5
    assert float(train.grid_step_error(target + inside, target)) == pytest.approx(0.0, abs=1e-6)
    # A target that has the step itself (pixel art's cells) costs nothing for drawing it.
    assert float(train.grid_step_error(target + seams, target + seams)) == pytest.approx(0.0, abs=1e-6)
    assert float(train.grid_step_error(target, target + seams)) > 0.0


def test_batches_are_a_pure_function_of_seed_and_step(tmp_path: Path) -> None:
    cfg = train.TrainConfig(workdir=tmp_path, dit_batch=3)
    lat = torch.randn(4, 3, 8, 3, 16, 16).half()
    emb = torch.nn.functional.normalize(torch.randn(2, 4, 384), dim=-1)
    schedule = FlowMatchSchedule(8.0)
    a = train._dit_batch(cfg, 7, lat, emb, SamplerSpec(), schedule)
    b = train._dit_batch(cfg, 7, lat, emb, SamplerSpec(), schedule)
    c = train._dit_batch(cfg, 8, lat, emb, SamplerSpec(), schedule)
    for u, w in zip(a, b, strict=True):
        torch.testing.assert_close(u, w)
    assert not torch.equal(a[0], c[0])
    # The first-step frames sit at the V2V timestep 1000*s - 100 of a noise scale in the trained range.
    lo, hi = (1000 * s - 100 for s in train.NOISE_SCALE_RANGE)
    first = a[1][a[1] > max(SamplerSpec().refine_timesteps)]
    assert ((first >= lo) & (first <= hi)).all()


def test_dit_batches_without_input_noise_are_the_scaled_input_latents(tmp_path: Path) -> None:
    """``SamplerSpec.input_noise`` 0: every first-step frame of a batch is (1 − s)·z of its own input window
    (recomputed from the latents and the window's position), s agreeing with its timestep; at 1 it is not."""
    cfg = train.TrainConfig(workdir=tmp_path, dit_batch=6)
    lat = torch.randn(3, 3, 8, 3, 16, 16).half()
    emb = torch.nn.functional.normalize(torch.randn(2, 4, 384), dim=-1)
    refine = max(SamplerSpec().refine_timesteps)
    for input_noise in (0.0, 1.0):
        windows: list[train.DitWindow] = []
        x, t = train._dit_batch(cfg, 5, lat, emb, SamplerSpec(input_noise=input_noise), FlowMatchSchedule(8.0),
                                None, windows)[:2]
        checked = 0
        for k, w in enumerate(windows):
            z = lat[w.clip, 0, :, w.frame : w.frame + 2, w.y : w.y + train.DIT_CROP, w.x : w.x + train.DIT_CROP].float()
            z = z.flip(-1) if w.flip else z
            for f in range(2):
                if float(t[k, f]) > refine:
                    # The timestep is int(1000·s) − 100, so s is known to within 1/1000 from it.
                    c = float((x[k, :, f] * z[:, f]).sum() / z[:, f].pow(2).sum())
                    same = torch.allclose(x[k, :, f], c * z[:, f], atol=1e-5)
                    assert same == (input_noise == 0.0)
                    if same:
                        assert 0 <= (1 - c) * 1000 - 100 - float(t[k, f]) < 1
                    checked += 1
        assert checked


def test_resume_restores_model_optimizer_and_step(tmp_path: Path) -> None:
    dit = _dit()
    opt = torch.optim.AdamW(dit.parameters(), lr=1e-3)
    assert train._resume(tmp_path / "ck.pt", dit, opt) == 0
    train._save(tmp_path / "ck.pt", model=dit.state_dict(), opt=opt.state_dict(), step=42)
    other = _dit()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    assert train._resume(tmp_path / "ck.pt", other, torch.optim.AdamW(other.parameters())) == 42
    for p, q in zip(dit.parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    assert np.isclose(train._lr(0, 100, 1e-3), 1e-3 / 50)


def test_decoder_batches_pair_each_latent_window_with_its_own_teacher_pixels(tmp_path: Path) -> None:
    """Stage 5 crops latents and teacher frames separately; decoding must land exactly on the target."""
    rng = np.random.default_rng(0)
    # 8x8-block-constant frames: 3 numbers per patch, so a 4-channel linear autoencoder is lossless.
    blocks = rng.integers(0, 256, (2, 3, train.CLIP_FRAMES, 32, 32, 3), dtype=np.uint8)
    frames = blocks.repeat(8, axis=3).repeat(8, axis=4)
    vae = TinyVAE(TinyVAEConfig(latent_channels=16, enc_channels=8, dec_channels=8))
    vae.init_linear_from_pca(train.to_unit(frames[:, :, 1:5]).flatten(0, 1).transpose(1, 2).flatten(0, 1))
    cfg = train.TrainConfig(workdir=tmp_path, vae_batch=4)
    lat, vae = train.encode_latents(cfg, frames, vae)
    batch = train._decoder_batch(cfg, 3, frames, lat, lat[:, 1:], None)
    with torch.no_grad():
        y, _ = vae.decode_groups(vae.denormalize(batch.z), None)
    assert batch.target.shape == batch.inputs.shape == (4, 3, 12, 64, 64)
    torch.testing.assert_close(y, batch.target, rtol=0, atol=2e-3)
    # The input frames a guided decoder reads are the same window of the input clip: with every teacher
    # the negative of its input, each batch's inputs are the negative of its targets.
    frames[:, 0] = 255 - frames[:, 1]
    frames[:, 2] = frames[:, 1]
    batch = train._decoder_batch(cfg, 3, frames, lat, lat[:, 1:], None)
    torch.testing.assert_close(batch.inputs, -batch.target, rtol=0, atol=1e-6)


def test_dit_windows_pair_each_latent_window_with_its_own_teacher_pixels_and_flow(tmp_path: Path) -> None:
    """The DiT's warp term decodes a window's x̂₀ against teacher pixels cropped separately: decoding the
    window's target latent must land on those pixels, and the flow must carry each frame onto the next."""
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (2, 3, train.CLIP_FRAMES, 32, 32, 3), dtype=np.uint8)
    frames = blocks.repeat(8, axis=3).repeat(8, axis=4)  # 8x8-block-constant: a lossless linear VAE
    vae = TinyVAE(TinyVAEConfig(latent_channels=16, enc_channels=8, dec_channels=8))
    vae.init_linear_from_pca(train.to_unit(frames[:, :, 1:5]).flatten(0, 1).transpose(1, 2).flatten(0, 1))
    cfg = train.TrainConfig(workdir=tmp_path, dit_batch=6)
    lat, vae = train.encode_latents(cfg, frames, vae)
    emb = torch.nn.functional.normalize(torch.randn(2, 4, 384), dim=-1)
    windows: list[train.DitWindow] = []
    target = train._dit_batch(cfg, 3, lat, emb, SamplerSpec(), FlowMatchSchedule(8.0), None, windows)[3]
    assert len(windows) == 6 and {w.flip for w in windows} == {False, True}
    pixels, flow = train.window_pixels(cfg, windows, frames, np.zeros((2, 8, 256, 256, 2), np.float16))
    with torch.no_grad():
        decoded, _ = vae.decode_groups(vae.denormalize(target), None)
    assert pixels.shape == (6, 3, 8, 128, 128) and flow.shape == (6, 7, 128, 128, 2)
    torch.testing.assert_close(decoded, pixels, rtol=0, atol=2e-3)
    # On a panning clip (both variants the raw clip), following the flow leaves a small residual.
    clip = train.clipdata.render_clip(train.clipdata.ClipSpec("procedural:3", 0, train.CLIP_FRAMES))
    frames = np.stack([clip, clip])[None]
    flows = train.build_flows(tmp_path / "pan", frames)
    windows = []
    for step in range(3):
        train._dit_batch(cfg, step, torch.zeros(1, 2, 64, 3, 24, 24).half(), emb[:1], SamplerSpec(),
                         FlowMatchSchedule(8.0), None, windows)
    pixels, flow = train.window_pixels(cfg, windows, frames, flows)
    residual = float(train.warped_temporal_error(pixels, torch.zeros_like(pixels), flow))
    assert residual < 0.35 * float(pixels.diff(dim=2).abs().mean())


def test_dit_loss_warp_term_decodes_x0_against_the_teacher_pixels() -> None:
    dit = _dit()
    vae = TinyVAE(TinyVAEConfig(latent_channels=8, enc_channels=8, dec_channels=8)).requires_grad_(False)
    x, target = torch.randn(2, 8, 2, 4, 4), torch.randn(2, 8, 2, 4, 4)
    t, sigma = torch.full((2, 2), 300.0), torch.full((2, 2), 0.7)
    with torch.no_grad():
        teacher, _ = vae.decode_groups(vae.denormalize(target[:1]), None)
    flow = torch.zeros(1, teacher.shape[2] - 1, 32, 32, 2)
    context = torch.randn(2, 1, 384)
    plain = train.dit_loss(dit, vae, x, t, sigma, target, context, 1.0)
    warped = train.dit_loss(dit, vae, x, t, sigma, target, context, 1.0, (teacher, flow), warp_weight=3.0)
    warped.backward()
    assert warped.item() > plain.item()
    assert all(p.grad is not None for p in dit.parameters())
    # x̂₀ = x − σ·v on target (σ = 0, x = target): the decoded frames are the teacher's, no warp term.
    with torch.no_grad():
        x0_is_target = train.dit_loss(dit, vae, target, t, torch.zeros_like(sigma), target, context, 1.0,
                                      (teacher, flow), 3.0)
    assert float(x0_is_target) == pytest.approx(0.0, abs=1e-6)


def test_style_probabilities_steer_which_styles_a_batch_holds(tmp_path: Path) -> None:
    cfg = train.TrainConfig(workdir=tmp_path, dit_batch=8)
    lat = torch.arange(4.0).view(1, 4, 1, 1, 1, 1).expand(3, 4, 8, 3, 16, 16).half()  # variant v holds v
    emb = torch.nn.functional.normalize(torch.randn(3, 4, 384), dim=-1)
    schedule = FlowMatchSchedule(8.0)
    for style in range(3):
        probs = np.eye(3)[style]
        target = train._dit_batch(cfg, 5, lat, emb, SamplerSpec(), schedule, probs)[3]
        assert torch.all(target == 1 + style)
    uniform = torch.cat([train._dit_batch(cfg, s, lat, emb, SamplerSpec(), schedule)[3] for s in range(6)])
    assert set(uniform.unique().tolist()) == {1.0, 2.0, 3.0}


def test_decoder_data_streams_each_clip_with_every_style_as_its_own_stream(tmp_path: Path) -> None:
    """Stage 5's data: each clip through the product runtime, all styles in one batch; a style's row is
    what that style's stream alone gives (the batch mixes nothing), and the result is cached."""
    vae = TinyVAE(TinyVAEConfig(latent_channels=8, enc_channels=8, dec_channels=8))
    dit = _dit()
    spec = EmbeddedSpec(vae=vae.config, dit=dit.config, styles={}, prototypes={})
    model = EmbeddedModel(spec, vae, dit)
    cfg = train.TrainConfig(workdir=tmp_path, seed=1)
    lat = torch.randn(2, 1 + len(train.STYLE_NAMES), 8, 3, 4, 4).half()
    pred = train.dit_predictions(cfg, lat, model)
    assert pred.shape == (2, len(train.STYLE_NAMES), 8, 3, 4, 4)
    style = len(train.STYLE_NAMES) - 1
    alone = EmbeddedStream(model.stream_runtime(), [STYLE_PROMPTS[train.STYLE_NAMES[style]][0]], (32, 32),
                           seed=1 * 100_003 + 1, noise_scale=spec.sampler.noise_scale, num_steps=1)
    torch.testing.assert_close(pred[1, style], alone.denoise(lat[1, :1].float())[0].half(), rtol=0, atol=2e-3)
    assert torch.equal(train.dit_predictions(cfg, lat, model), pred)


def test_a_work_directory_with_checkpoints_needs_resume(tmp_path: Path) -> None:
    train.check_workdir(tmp_path / "new", resume=False)  # nothing there yet: fine
    (tmp_path / "dit_ckpt.pt").write_bytes(b"")
    with pytest.raises(train.WorkdirInUseError, match="--resume"):
        train.check_workdir(tmp_path, resume=False)
    train.check_workdir(tmp_path, resume=True)


def test_decoder_batches_leave_out_looks_that_are_not_shipped(tmp_path: Path) -> None:
    """Every style row of the predictions holds its index; no batch may draw a look left out."""
    styles = len(train.STYLE_NAMES)
    left_out = {k for k, n in enumerate(train.STYLE_NAMES) if n in NOT_SHIPPED}
    assert left_out, "the registry leaves a trained look out (neon)"
    frames = np.zeros((1, 1 + styles, train.CLIP_FRAMES, 256, 256, 3), np.uint8)
    # Variant 1 + k of the latents (look k's teacher latents) and row k of the predictions both hold k.
    lat = torch.arange(-1.0, styles).view(1, 1 + styles, 1, 1, 1, 1).expand(1, 1 + styles, 4, 3, 24, 24).half()
    pred = lat[:, 1:]
    cfg = train.TrainConfig(workdir=tmp_path, vae_batch=64)
    drawn = set()
    for step in range(4):
        batch = train._decoder_batch(cfg, step, frames, lat, pred, None)
        rows = batch.z.flatten(1).max(dim=1).values.tolist()
        drawn |= set(rows)
        assert batch.looks == [train.STYLE_NAMES[int(k)] for k in rows]  # each sample names its own look
    assert drawn and not drawn & {float(k) for k in left_out}


@pytest.mark.parametrize("value", ["nan", "-1", "1e9"])
def test_train_default_refuses_a_bad_warp_weight_in_plain_words(tmp_path: Path, value: str) -> None:
    from app.cli import build_parser

    args = build_parser().parse_args(["train-default", "--workdir", str(tmp_path), "--warp-weight", value])
    with pytest.raises(SystemExit, match="--warp-weight must be a number from 0 to 100"):
        args._run(args)


def test_train_default_passes_the_warp_weight_to_the_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from app.cli import build_parser

    seen: list[train.TrainConfig] = []

    def recipe(cfg: train.TrainConfig, out: Path) -> Path:
        seen.append(cfg)
        return out / "default.json"

    monkeypatch.setattr(train, "train_default", recipe)
    args = build_parser().parse_args(["train-default", "--workdir", str(tmp_path), "--out", str(tmp_path),
                                      "--warp-weight", "2"])
    assert args._run(args) == 0
    assert seen[0].warp_weight == 2.0


def test_guide_decoder_is_a_finetune_option_refused_alone_in_plain_words(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from app.cli import build_parser

    args = build_parser().parse_args(["train-default", "--workdir", str(tmp_path), "--guide-decoder"])
    with pytest.raises(SystemExit, match="--guide-decoder only applies with --finetune-from"):
        args._run(args)
    base = tmp_path / "base.json"
    base.write_text("{}")
    seen: list[tuple[train.TrainConfig, Path]] = []

    def recipe(cfg: train.TrainConfig, base_config: Path, out: Path) -> Path:
        seen.append((cfg, base_config))
        return out / "default.json"

    monkeypatch.setattr(train, "guide_decoder", recipe)
    args = build_parser().parse_args(["train-default", "--workdir", str(tmp_path / "w"), "--out", str(tmp_path),
                                      "--finetune-from", str(base), "--guide-decoder", "--warp-weight", "2",
                                      "--guide-blurs", "4,16", "--guide-per-group"])
    assert args._run(args) == 0
    cfg = seen[0][0]
    assert seen[0][1] == base and cfg.warp_weight == 2.0
    assert cfg.guide_blurs == (4, 16) and cfg.guide_per_group
    with pytest.raises(SystemExit):  # argparse: "block sizes must be 2 to 256 pixels"
        build_parser().parse_args(["train-default", "--guide-blurs", "1"])
    args = build_parser().parse_args(["train-default", "--workdir", str(tmp_path / "w"), "--out", str(tmp_path),
                                      "--finetune-from", str(base), "--guide-decoder", "--warp-weight", "2",
                                      "--warp-looks", "thermal, noir"])
    assert args._run(args) == 0 and seen[-1][0].warp_looks == ("thermal", "noir")
    for extra, message in ((["--guide-decoder", "--warp-weight", "2", "--warp-looks", "thermal,sparkle"],
                            "no teacher for sparkle"),
                           (["--guide-decoder", "--warp-looks", "thermal"], "needs a --warp-weight .or --decoder-warp-weight. above 0"),
                           (["--guide-blurs", "4"], "need --guide-decoder")):
        args = build_parser().parse_args(["train-default", "--workdir", str(tmp_path / "w"), "--out", str(tmp_path),
                                          "--finetune-from", str(base), *extra])
        with pytest.raises(SystemExit, match=message):
            args._run(args)


def test_the_decoder_finetune_trains_a_guided_decoders_guide_paths_on_the_input_frames(tmp_path: Path) -> None:
    """Stage 5 with a guided decoder: the guide paths (zero at the start) move, the encoder does not, and
    the finished decoder decodes differently with the input frames than without them."""
    styles = len(train.STYLE_NAMES)
    rng = np.random.default_rng(2)
    frames = rng.integers(0, 256, (1, 1 + styles, train.CLIP_FRAMES, 256, 256, 3), dtype=np.uint8)
    torch.manual_seed(0)
    vae = TinyVAE(TinyVAEConfig(latent_channels=8, enc_channels=8, dec_channels=8)).with_guided_decoder(2)
    encoder_before = {k: v.clone() for k, v in vae.state_dict().items() if k.startswith("enc")}
    dit = _dit()
    model = EmbeddedModel(EmbeddedSpec(vae=vae.config, dit=dit.config, styles={}, prototypes={}), vae, dit)
    cfg = train.TrainConfig(workdir=tmp_path, decoder_steps=3, vae_batch=2, checkpoint_every=2)
    lat = torch.randn(1, 1 + styles, 8, 3, 24, 24).half()
    torch.save(lat[:, 1:].clone(), tmp_path / "predictions.pt")  # the stage's cached DiT predictions
    tuned = train.finetune_decoder(cfg, frames, lat, model)
    for module in (tuned.dec_guide_map, tuned.dec_guide_in):
        assert all(float(p.detach().abs().sum()) > 0 for p in module.parameters())
    for k, v in tuned.state_dict().items():
        if k.startswith("enc"):
            torch.testing.assert_close(v, encoder_before[k], rtol=0, atol=0)
    batch = train._decoder_batch(cfg, 0, frames, lat, lat[:, 1:], None)
    with torch.no_grad():
        guided, _ = tuned.decode_groups(tuned.denormalize(batch.z), None, batch.inputs)
        alone, _ = tuned.decode_groups(tuned.denormalize(batch.z), None)
    assert float((guided - alone).abs().mean()) > 1e-4


def test_the_decoder_warp_weight_reaches_the_decoder_stage_alone(tmp_path: Path) -> None:
    """``decoder_warp_weight`` sets the warp term of the decoder fine-tune whatever ``warp_weight`` (which the
    VAE and DiT stages read) is: one decoder step with the term differs from one without it, and
    ``warp_weight`` with the decoder's weight set to 0 trains exactly the decoder that no term trains."""
    styles = len(train.STYLE_NAMES)
    rng = np.random.default_rng(3)
    frames = rng.integers(0, 256, (1, 1 + styles, train.CLIP_FRAMES, 256, 256, 3), dtype=np.uint8)
    lat = torch.randn(1, 1 + styles, 8, 3, 24, 24).half()

    def tuned(name: str, warp_weight: float = 0.0, decoder_warp_weight: float | None = None) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        vae = TinyVAE(TinyVAEConfig(latent_channels=8, enc_channels=8, dec_channels=8))
        dit = _dit()
        model = EmbeddedModel(EmbeddedSpec(vae=vae.config, dit=dit.config, styles={}, prototypes={}), vae, dit)
        cfg = train.TrainConfig(workdir=tmp_path / name, decoder_steps=1, vae_batch=2, warp_weight=warp_weight,
                                decoder_warp_weight=decoder_warp_weight)
        cfg.workdir.mkdir()
        torch.save(lat[:, 1:].clone(), cfg.workdir / "predictions.pt")
        return {k: v.clone() for k, v in train.finetune_decoder(cfg, frames, lat, model).state_dict().items()}

    plain = tuned("plain")
    decoder_only = tuned("decoder", decoder_warp_weight=3.0)
    other_stages = tuned("others", warp_weight=3.0, decoder_warp_weight=0.0)
    assert any(not torch.equal(plain[k], decoder_only[k]) for k in plain)
    for k in plain:
        torch.testing.assert_close(other_stages[k], plain[k], rtol=0, atol=0)
    assert train.TrainConfig(workdir=tmp_path, warp_weight=2.0).decoder_warp == 2.0


def _finetune_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], list[train.TrainConfig]]:
    """`train-default --finetune-from` arguments on a placeholder base, and the configs its (patched-out)
    recipe is called with."""
    base = tmp_path / "base.json"
    base.write_text("{}")
    seen: list[train.TrainConfig] = []

    def recipe(cfg: train.TrainConfig, base_config: Path, out: Path) -> Path:
        seen.append(cfg)
        return out / "default.json"

    monkeypatch.setattr(train, "finetune_looks", recipe)
    return ["train-default", "--workdir", str(tmp_path / "w"), "--out", str(tmp_path), "--finetune-from", str(base)], seen


def test_train_default_passes_the_decoder_warp_weight_apart_from_the_warp_weight(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from app.cli import build_parser

    common, seen = _finetune_cli(tmp_path, monkeypatch)
    args = build_parser().parse_args([*common, "--input-noise", "0", "--decoder-warp-weight", "3",
                                      "--warp-looks", "thermal"])
    assert args._run(args) == 0
    assert seen[-1].warp_weight == 0.0 and seen[-1].decoder_warp == 3.0 and seen[-1].warp_looks == ("thermal",)
    for value in ("nan", "-1", "1e9"):
        args = build_parser().parse_args([*common, "--decoder-warp-weight", value])
        with pytest.raises(SystemExit, match="--decoder-warp-weight must be a number from 0 to 100"):
            args._run(args)
    args = build_parser().parse_args([*common, "--warp-weight", "2", "--decoder-warp-weight", "0",
                                      "--warp-looks", "thermal"])
    with pytest.raises(SystemExit, match="needs a --warp-weight .or --decoder-warp-weight. above 0"):
        args._run(args)


@pytest.mark.parametrize(("extra", "message"), [(["--input-noise", "nan"], "--input-noise must be a number from 0 to 1"),
                                                (["--input-noise", "1.5"], "--input-noise must be a number from 0 to 1"),
                                                (["--input-noise", "0", "--guide-decoder"], "run them one after another")])
def test_input_noise_is_checked_and_reaches_the_finetune(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         extra: list[str], message: str) -> None:
    from app.cli import build_parser

    common, seen = _finetune_cli(tmp_path, monkeypatch)
    args = build_parser().parse_args([*common, *extra])
    with pytest.raises(SystemExit, match=message):
        args._run(args)
    args = build_parser().parse_args([*common, "--input-noise", "0"])
    assert args._run(args) == 0 and seen[-1].input_noise == 0.0


def test_a_finetune_with_nothing_to_change_is_refused_before_any_work(tmp_path: Path) -> None:
    """The shipped model already has every look and its input noise: asking for the same input noise is
    refused in plain words before clips are rendered; another input noise is a re-tune, not refused here."""
    from engine.embedded.model import DEFAULT_CONFIG

    shipped = EmbeddedModel.load(DEFAULT_CONFIG).spec.sampler.input_noise
    cfg = train.TrainConfig(workdir=tmp_path / "w", input_noise=shipped)
    with pytest.raises(ValueError, match=f"every look and input noise {shipped:g}; nothing to fine-tune"):
        train.finetune_looks(cfg, DEFAULT_CONFIG, tmp_path / "out")
    assert not (tmp_path / "w").exists()
