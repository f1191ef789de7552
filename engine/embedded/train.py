"""Training recipe of the embedded default model (CPU, about an hour): data -> VAE -> latents -> DiT -> decoder -> export.

Stages, each resumable (checkpoints every ``checkpoint_every`` steps in the work directory):

1. data: render the training clips (``clips.train_specs``) and every teacher's output into one uint8
   memmap ``frames.npy`` [clips, 1 + styles, 9, 256, 256, 3] (index 0 = the raw clip).
2. vae: train ``TinyVAE`` on random crops of raw and stylised clips in the streaming layout
   (frame 0 as a static group, then 4-frame groups), L1 + gradient L1 + temporal-difference L1 (so
   reconstruction errors stay put from frame to frame instead of flickering); then measure the
   latent statistics that normalise latents.
3. latents: encode a 192x192 crop of every training clip and its stylisations with the frozen VAE
   (3 latent frames each).
4. dit: train ``CausalWanDiT`` on pairs (noised input latent, style latent, style prompt) with the
   block-causal mask over 2 latent frames, so that the V2V first step (and the optional refinement
   step) predicts the teacher's latent: x̂₀ = x − σ·v ≈ z_style, plus the same temporal-difference
   term on the per-frame latents; then tune rounds at a lower learning rate that draw the shipped
   styles in proportion to their loss.
5. decoder: fine-tune the VAE decoder on what it will really decode, the frozen DiT's stylised
   latents of every training clip (run through the streaming recipe, KV cache and noise included),
   against the teacher's frames, with the same losses as stage 2. The decoder's frame memory learns
   to hold the DiT's chunk-to-chunk wobble still; a quarter of the batches keep the encoder's own
   latents so plain reconstruction is not forgotten.
6. export: ``default.safetensors`` (keys ``vae.*``, ``dit.*``) + ``default.json``.

Sample order is a pure function of (seed, step), so a resumed run draws the same batches.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, cast

import cv2
import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from engine.embedded import clips as clipdata
from engine.embedded.model import EmbeddedModel, EmbeddedSpec, EmbeddedStream, SamplerSpec, StreamSpec
from engine.embedded.styles import (
    LOOK_TEMPERATURE,
    NOT_SHIPPED,
    STYLE_PROMPTS,
    pooled_embeddings,
    prototypes,
    style_phrasings,
)
from engine.embedded.teachers import TEACHERS, stylize_clip
from engine.models.tiny_vae import TinyVAE, TinyVAEConfig
from engine.models.wan_dit import CausalWanDiT, PromptCache, WanBlock, WanDiTConfig
from engine.sampling import FlowMatchSchedule, noise_scale_to_timestep, renoise, v2v_input

log = logging.getLogger(__name__)

STYLE_NAMES: tuple[str, ...] = tuple(TEACHERS)
CLIP_FRAMES = 9  # 1 + 2*4: the streaming layout (a first frame, then two 4-frame chunks)


@dataclass
class TrainConfig:
    workdir: Path
    vae_steps: int = 2000
    vae_batch: int = 8
    vae_crop: int = 64
    vae_lr: float = 1e-3
    dit_steps: int = 3000
    dit_batch: int = 16
    dit_lr: float = 6e-4
    dit_tune_steps: int = 1500  # per tune round
    dit_tune_rounds: int = 4
    dit_tune_lr: float = 2e-4
    decoder_steps: int = 1500
    decoder_lr: float = 3e-4
    temporal_weight: float = 1.0  # weight of the temporal-difference terms (VAE and DiT)
    # Fine-tuning new looks onto a shipped model (``finetune_looks``): steps that draw the looks the base
    # model lacks ``new_look_share`` of the time and replay the base's looks the rest, then the tune rounds.
    looks_steps: int = 2500
    looks_lr: float = 3e-4
    new_look_share: float = 0.6
    grid_weight: float = 0.0  # weight of the block-seam term in the decoder fine-tune (grid_step_error)
    # Weight of the motion-compensated temporal term (``warped_temporal_error``, along the input clip's
    # optical flow) in the VAE, DiT (decoded, ``dit_loss``) and decoder stages: the evaluation's warp
    # error as a loss.
    warp_weight: float = 0.0
    # The decoder stage's weight of that term (None: ``warp_weight``): a DiT re-tune and its decoder can
    # take different weights in one run (the shipped checkpoint's decoder has it, its DiT rounds did not).
    decoder_warp_weight: float | None = None
    # Decoder stage only: the looks whose samples carry the warp term (empty: every look). A look drawn
    # as lines or paint loses fidelity to it; one drawn as a per-pixel colour map gains (docs/default-model.md).
    warp_looks: tuple[str, ...] = ()
    # The guided decoder's input features (``TinyVAEConfig.guide_basis`` / ``guide_blurs`` / ``guide_per_group``).
    guide_basis: int = 6
    guide_blurs: tuple[int, ...] = ()
    guide_per_group: bool = False
    # The V2V input's share of Gaussian noise (``SamplerSpec.input_noise``) the DiT is trained for; None:
    # the base model's on a fine-tune, the SamplerSpec default on a full run.
    input_noise: float | None = None
    threads: int = 2
    seed: int = 0
    checkpoint_every: int = 100

    @property
    def decoder_warp(self) -> float:
        """The warp term's weight in the decoder stage."""
        return self.warp_weight if self.decoder_warp_weight is None else self.decoder_warp_weight


def to_unit(frames_u8: np.ndarray) -> torch.Tensor:
    """uint8 [..., T, H, W, 3] -> float [..., 3, T, H, W] in [-1, 1]."""
    t = torch.from_numpy(np.array(frames_u8, dtype=np.uint8)).float().div_(127.5).sub_(1.0)
    return t.movedim(-1, -4)


def stream_groups(pixels: torch.Tensor) -> torch.Tensor:
    """[B, 3, 1 + 4k, H, W] -> [B, 3, 4 + 4k, H, W]: frame 0 repeated as its own group (stream layout)."""
    return torch.cat([pixels[:, :, :1].expand(-1, -1, 3, -1, -1), pixels], dim=2)


# -- stage 1: data ------------------------------------------------------------------------------------


def build_frames(workdir: Path) -> np.ndarray:
    """The training clips and their teacher stylisations, as a uint8 memmap (built once)."""
    path, done = workdir / "frames.npy", workdir / "frames.done"
    specs = clipdata.train_specs(CLIP_FRAMES)
    shape = (len(specs), 1 + len(STYLE_NAMES), CLIP_FRAMES, clipdata.SIZE, clipdata.SIZE, 3)
    if done.exists():
        arr = np.load(path, mmap_mode="r")
        if arr.shape != shape:
            raise ValueError(f"{path} has shape {arr.shape}, expected {shape}; delete it to rebuild")
        return arr
    workdir.mkdir(parents=True, exist_ok=True)
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=shape)
    for i, spec in enumerate(tqdm(specs, desc="data: clips x teachers")):
        raw = clipdata.render_clip(spec)
        arr[i, 0] = raw
        for j, style in enumerate(STYLE_NAMES):
            arr[i, 1 + j] = stylize_clip(raw, style)
    arr.flush()
    done.write_text(json.dumps({"clips": len(specs), "styles": list(STYLE_NAMES)}))
    return np.load(path, mmap_mode="r")


def build_flows(workdir: Path, frames: np.ndarray) -> np.ndarray:
    """Optical flow of every training clip from frame t to frame t−1, float16 [clips, 8, 256, 256, 2]
    (pixels; DIS, medium preset, on the raw clip: the flow the evaluation's warp error follows)."""
    path, done = workdir / "flows.npy", workdir / "flows.done"
    shape = (frames.shape[0], CLIP_FRAMES - 1, clipdata.SIZE, clipdata.SIZE, 2)
    if done.exists():
        return np.load(path, mmap_mode="r")
    workdir.mkdir(parents=True, exist_ok=True)
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=shape)
    dis = cv2.DISOpticalFlow_create(cv2.DISOPTICAL_FLOW_PRESET_MEDIUM)  # type: ignore[attr-defined]
    for i in tqdm(range(frames.shape[0]), desc="data: optical flow"):
        gray = [cv2.cvtColor(np.ascontiguousarray(f), cv2.COLOR_RGB2GRAY) for f in frames[i, 0]]
        for t in range(1, CLIP_FRAMES):
            arr[i, t - 1] = dis.calc(gray[t], gray[t - 1], None)
    arr.flush()
    done.write_text(json.dumps({"clips": frames.shape[0]}))
    return np.load(path, mmap_mode="r")


def stream_flow(flows: np.ndarray, clip: int, y: int, x: int, size: int, flip: bool) -> torch.Tensor:
    """The clip's flow between consecutive frames of the stream layout (``stream_groups``: frame 0 four
    times, then frames 1-8), cropped at (y, x) and mirrored like the pixels: [11, size, size, 2], zero
    between the copies of frame 0. Latent group g's frames and the next group's are ``[4g : 4g + 7]``."""
    flow = np.array(flows[clip, :, y : y + size, x : x + size], dtype=np.float32)
    if flip:
        flow = flow[:, :, ::-1] * np.array([-1.0, 1.0], np.float32)
    moving = torch.from_numpy(np.ascontiguousarray(flow))
    return torch.cat([moving.new_zeros(3, size, size, 2), moving])


# -- shared training utilities ----------------------------------------------------------------------


def _lr(step: int, total: int, peak: float, warmup: int = 50) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))))


def _save(path: Path, **state: Any) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # atomic: an interrupted save never leaves a broken checkpoint behind


def _load(path: Path) -> dict[str, Any] | None:
    return torch.load(path, map_location="cpu", weights_only=False) if path.exists() else None


def _resume(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Load a stage checkpoint if there is one; returns the step to continue from."""
    state = _load(path)
    if state is None:
        return 0
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    log.info("resuming %s at step %d", path.name, state["step"])
    return int(state["step"])


# -- stage 2: VAE -------------------------------------------------------------------------------------


def _vae_batch(frames: np.ndarray, cfg: TrainConfig, step: int,
               flows: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, 3, 8, crop, crop]: two groups, either (frame 0 as a static group, frames 1-4) or (1-4, 5-8);
    with ``flows`` also the clip's flow between consecutive frames of that layout [B, 7, crop, crop, 2]."""
    rng = np.random.default_rng([cfg.seed, 1, step])
    n_clips, n_variants = frames.shape[:2]
    crop = cfg.vae_crop
    out, out_flows = [], []
    for _ in range(cfg.vae_batch):
        i = int(rng.integers(n_clips))
        j = 0 if rng.random() < 0.3 else int(rng.integers(1, n_variants))
        y, x = (int(v) for v in rng.integers(0, clipdata.SIZE - crop + 1, 2))
        clip = frames[i, j, :, y : y + crop, x : x + crop]
        flip = rng.random() < 0.5
        if flip:
            clip = clip[:, :, ::-1]
        pixels = to_unit(clip)[None]
        first = rng.random() < 0.4
        out.append(stream_groups(pixels[:, :, :5]) if first else pixels[:, :, 1:])
        if flows is not None:
            group = 0 if first else 1
            out_flows.append(stream_flow(flows, i, y, x, crop, flip)[4 * group : 4 * group + 7])
    return torch.cat(out), torch.stack(out_flows) if out_flows else None


def _reconstruction_loss(y: torch.Tensor, x: torch.Tensor, temporal_weight: float) -> torch.Tensor:
    """Pixels [B, 3, T, H, W]: L1 + 0.5 x gradient L1 + ``temporal_weight`` x temporal-difference L1."""
    return (y - x).abs().mean() + 0.5 * _grad_l1(y, x) + temporal_weight * temporal_error(y, x, dim=2).abs().mean()


def _grad_l1(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    dx = (a[..., :, 1:] - a[..., :, :-1]) - (b[..., :, 1:] - b[..., :, :-1])
    dy = (a[..., 1:, :] - a[..., :-1, :]) - (b[..., 1:, :] - b[..., :-1, :])
    return dx.abs().mean() + dy.abs().mean()


def grid_step_error(y: torch.Tensor, x: torch.Tensor, block: int = TinyVAE.spatial_compression) -> torch.Tensor:
    """Pixels [..., H, W]: mean |step of ``y`` − step of ``x``| across the boundaries between ``block``-pixel
    blocks (the decoder's cells; the DiT's 16-pixel patch seams are among them).

    Measured against the target's own steps, so a look whose teacher draws on the grid (pixel art) keeps
    its edges while a seam the target does not have costs extra, on top of the gradient term that
    weighs every boundary alike.
    """
    w, h = y.shape[-1], y.shape[-2]
    cols = (slice(block, w, block), slice(block - 1, w - 1, block))
    rows = (slice(block, h, block), slice(block - 1, h - 1, block))
    sx = (y[..., cols[0]] - y[..., cols[1]]) - (x[..., cols[0]] - x[..., cols[1]])
    sy = (y[..., rows[0], :] - y[..., rows[1], :]) - (x[..., rows[0], :] - x[..., rows[1], :])
    return 0.5 * (sx.abs().mean() + sy.abs().mean())


def temporal_error(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """Difference between the frame-to-frame changes of ``a`` and of ``b`` along ``dim``.

    Zero for an error that stays the same from one frame to the next, so a loss on it penalises
    exactly what shows up as flicker (warp error) and leaves static errors to the per-frame loss.
    """
    return a.diff(dim=dim) - b.diff(dim=dim)


def warped_temporal_error(y: torch.Tensor, x: torch.Tensor, flow: torch.Tensor) -> torch.Tensor:
    """Mean |(y_t − W y_{t−1}) − (x_t − W x_{t−1})| over pixels whose flow stays inside the frame.

    Pixels [B, 3, T, H, W]; ``flow`` [B, T−1, H, W, 2] in pixels, from frame t to frame t−1 (W warps frame
    t−1 onto t along it, bilinear). The motion-compensated twin of ``temporal_error``: an error that
    moves with the content costs nothing, one that shimmers in place does, which is what the warp
    error of the evaluation counts.
    """
    b, c, t, h, w = y.shape
    gy, gx = torch.meshgrid(torch.arange(h, dtype=flow.dtype), torch.arange(w, dtype=flow.dtype), indexing="ij")
    px, py = gx + flow[..., 0], gy + flow[..., 1]
    valid = ((px >= 0) & (px <= w - 1) & (py >= 0) & (py <= h - 1)).flatten(0, 1)
    grid = torch.stack([2 * px / (w - 1) - 1, 2 * py / (h - 1) - 1], dim=-1).flatten(0, 1)
    prev = torch.cat([y[:, :, :-1], x[:, :, :-1]], dim=1).movedim(2, 1).flatten(0, 1)
    warped = F.grid_sample(prev, grid, mode="bilinear", padding_mode="border", align_corners=True)
    wy, wx = warped[:, :c], warped[:, c:]
    ny, nx = y[:, :, 1:].movedim(2, 1).flatten(0, 1), x[:, :, 1:].movedim(2, 1).flatten(0, 1)
    err = ((ny - wy) - (nx - wx)).abs().mean(dim=1)
    return err[valid].mean()


def train_vae(cfg: TrainConfig, frames: np.ndarray, vae_config: TinyVAEConfig) -> TinyVAE:
    """Train the autoencoder (latent statistics are set later, by ``encode_latents``)."""
    ckpt_path, trained_path = cfg.workdir / "vae_ckpt.pt", cfg.workdir / "vae_trained.pt"
    vae = TinyVAE(vae_config)
    trained = _load(trained_path)
    if trained is not None:
        vae.load_state_dict(trained["model"])
        return vae.eval()
    torch.manual_seed(cfg.seed)
    vae = TinyVAE(vae_config)
    vae.init_linear_from_pca(torch.cat([_vae_batch(frames, cfg, 10**9 + i)[0][:, :, 4:].transpose(1, 2).flatten(0, 1)
                                        for i in range(16)]))
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, weight_decay=0.0)
    start = _resume(ckpt_path, vae, opt)
    flows = build_flows(cfg.workdir, frames) if cfg.warp_weight else None
    bar = tqdm(range(start, cfg.vae_steps), desc="vae", initial=start, total=cfg.vae_steps)
    ema = None
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = _lr(step, cfg.vae_steps, cfg.vae_lr)
        x, flow = _vae_batch(frames, cfg, step, flows)
        z, _ = vae.encode_groups(x, None)
        y, _ = vae.decode_groups(z, None)
        l1 = (y - x).abs().mean()
        loss = _reconstruction_loss(y, x, cfg.temporal_weight) + 1e-4 * z.pow(2).mean()
        if flow is not None:
            loss = loss + cfg.warp_weight * warped_temporal_error(y, x, flow)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        psnr = float(10 * torch.log10(4.0 / (y.detach() - x).pow(2).mean()))
        ema = psnr if ema is None else 0.95 * ema + 0.05 * psnr
        bar.set_postfix(l1=f"{float(l1):.4f}", psnr=f"{ema:.2f}")
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.vae_steps:
            _save(ckpt_path, model=vae.state_dict(), opt=opt.state_dict(), step=step + 1)
    _save(trained_path, model=vae.state_dict())
    return vae.eval()


# -- stage 3: latents ---------------------------------------------------------------------------------

# DiT training sees 16x16-latent windows, so each clip is encoded as one 192x192 crop (at a position
# fixed by the clip index): 1.8x less encoding than full frames, which dominates this stage on a CPU,
# while random 16x16 windows of the 24x24 latents still vary the content the DiT sees.
LATENT_CROP = 192


def _latent_crop_origin(cfg: TrainConfig, clip: int) -> tuple[int, int]:
    """Pixel (y, x) of the crop of ``clip`` that stage 3 encodes (on the 8-pixel latent grid)."""
    y, x = np.random.default_rng([cfg.seed, 3, clip]).integers(0, (clipdata.SIZE - LATENT_CROP) // 8 + 1, 2)
    return 8 * int(y), 8 * int(x)


@torch.no_grad()
def encode_latents(cfg: TrainConfig, frames: np.ndarray, vae: TinyVAE,
                   measure_stats: bool = True) -> tuple[torch.Tensor, TinyVAE]:
    """Latents of every clip crop and variant, float16 [clips, 1 + styles, C, 3, 24, 24], normalised.

    Also sets the VAE's per-channel latent statistics (measured on these raw latents) unless
    ``measure_stats`` is off (a fine-tune keeps its base model's: its DiT was trained on them). Cached
    in the work directory together with the final VAE.
    """
    lat_path, final_path = cfg.workdir / "latents.pt", cfg.workdir / "vae_final.pt"
    if lat_path.exists() and final_path.exists():
        vae.load_state_dict(_load(final_path)["model"])  # type: ignore[index]
        return torch.load(lat_path, map_location="cpu"), vae.eval()
    raw = []
    for i in tqdm(range(frames.shape[0]), desc="latents"):
        y, x = _latent_crop_origin(cfg, i)
        crop = frames[i, :, :, y : y + LATENT_CROP, x : x + LATENT_CROP]
        z, _ = vae.encode_groups(stream_groups(to_unit(crop)), None)
        raw.append(z)
    allz = torch.stack(raw)  # [clips, variants, C, 3, h, w]
    if measure_stats:
        _measure_latent_stats(vae, allz)
    lat = vae.normalize(allz.flatten(0, 1)).unflatten(0, allz.shape[:2]).half()
    torch.save(lat, lat_path)
    _save(final_path, model=vae.state_dict())
    return lat, vae.eval()


def _measure_latent_stats(vae: TinyVAE, allz: torch.Tensor) -> None:
    flat = allz.transpose(0, 2).flatten(1)
    vae.latent_mean.copy_(flat.mean(dim=1))
    # A per-channel std, so every channel reaches the DiT with the same signal-to-noise ratio under V2V
    # noise. The teachers keep the input's fine detail, so the model must too: with one shared scale
    # the PCA-ordered fine-detail channels (10x smaller than the colour channels) drowned in s = 0.2
    # noise, and the DiT could only guess them anew each chunk, which came out as blur and flicker.
    # ``dit_loss`` weights channels by their variance so its MSE still tracks pixel MSE.
    vae.latent_std.copy_(flat.std(dim=1).clamp_min(1e-4))


# -- stage 4: DiT -------------------------------------------------------------------------------------


def tiny_dit_config(latent_channels: int) -> WanDiTConfig:
    """The embedded DiT: 4 blocks of width 256 over 2x2 latent patches (256 tokens per 256x256 latent frame)."""
    return WanDiTConfig(
        dim=256, ffn_dim=1024, num_heads=4, num_layers=4,
        in_channels=latent_channels, out_channels=latent_channels, patch_size=(1, 2, 2),
        text_dim=384, text_len=1, freq_dim=128,
    )


# The noise scales the DiT sees at its first step: around the default, down to what the motion-aware
# controller uses on fast motion (it lowers s by up to 0.05), with margin above. Not below
# 0.15: s = 0.1 maps to t = 0, where σ ≈ 0.008 leaves the model nothing to learn.
NOISE_SCALE_RANGE = (0.15, 0.3)
REFINE_PROBABILITY = 0.15  # share of frames trained as a refinement step (standard flow matching)
# Latent crops for DiT training (16x16 latents = 128x128 pixels, 64 tokens a frame): 4x cheaper than
# full frames; attention is over relative (RoPE) positions, so the model runs on full 32x32 latents.
DIT_CROP = 16
WARP_SAMPLES = 4  # samples of a DiT batch decoded for the warp term (a regulariser: all pay the latent losses)


@dataclass(frozen=True)
class DitWindow:
    """Where one DiT sample came from: clip, style variant, first latent frame, latent row and column,
    mirrored."""

    clip: int
    variant: int
    frame: int
    y: int
    x: int
    flip: bool


def _dit_batch(cfg: TrainConfig, step: int, lat: torch.Tensor, emb: torch.Tensor, sampler: SamplerSpec,
               schedule: FlowMatchSchedule, style_probs: np.ndarray | None = None,
               windows: list[DitWindow] | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [B,C,2,h,w], timesteps [B,2], σ [B,2], target z_style [B,C,2,h,w], context [B,1,384]).

    Styles are drawn uniformly, or with ``style_probs`` (one probability per style) when given. Each
    sample's window is appended to ``windows`` when given (``window_pixels`` gives their pixels and flows).
    """
    rng = np.random.default_rng([cfg.seed, 2, step])
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 62)))
    n_clips, n_variants = lat.shape[:2]
    crop = DIT_CROP
    xs, ts, sig, tgt, ctx = [], [], [], [], []
    for _ in range(cfg.dit_batch):
        i = int(rng.integers(n_clips))
        j = 1 + int(rng.integers(n_variants - 1) if style_probs is None else rng.choice(n_variants - 1, p=style_probs))
        f0 = int(rng.integers(lat.shape[3] - 1))
        y, x = (int(v) for v in rng.integers(0, lat.shape[-1] - crop + 1, 2))
        window = (slice(None), slice(f0, f0 + 2), slice(y, y + crop), slice(x, x + crop))
        z_in, z_sty = lat[i, 0][window].float(), lat[i, j][window].float()
        flip = rng.random() < 0.5
        if flip:
            z_in, z_sty = z_in.flip(-1), z_sty.flip(-1)
        if windows is not None:
            windows.append(DitWindow(i, j, f0, y, x, flip))
        s = float(rng.uniform(*NOISE_SCALE_RANGE))
        noise = torch.randn(z_in.shape, generator=gen)
        frames_x, frames_t = [], []
        for f in range(2):
            if rng.random() < REFINE_PROBABILITY and sampler.refine_timesteps:
                t = float(sampler.refine_timesteps[int(rng.integers(len(sampler.refine_timesteps)))])
                frames_x.append(renoise(z_sty[:, f], noise[:, f], schedule.sigma(t)))
            else:
                t = float(noise_scale_to_timestep(s))
                frames_x.append(v2v_input(z_in[:, f], sampler.input_noise * noise[:, f], s))
            frames_t.append(t)
        xs.append(torch.stack(frames_x, dim=1))
        ts.append(torch.tensor(frames_t))
        sig.append(schedule.sigma(torch.tensor(frames_t)).float())
        tgt.append(z_sty)
        e = emb[j - 1, int(rng.integers(emb.shape[1]))]
        # A little embedding noise so nearby phrasings the model never saw land on the same style.
        e = F.normalize(e + 0.02 * torch.randn(e.shape, generator=gen), dim=-1)
        ctx.append(e[None])
    return torch.stack(xs), torch.stack(ts), torch.stack(sig), torch.stack(tgt), torch.stack(ctx)


def window_pixels(cfg: TrainConfig, windows: list[DitWindow], frames: np.ndarray,
                  flows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's pixels under each DiT window [B, 3, 8, 8·crop, 8·crop] and the clip's flow between
    consecutive ones [B, 7, 8·crop, 8·crop, 2]: latent frame 0 of a clip's latents is frame 0 four times
    (zero flow between them), 1 is frames 1-4, 2 is frames 5-8."""
    size = DIT_CROP * TinyVAE.spatial_compression
    pixels, out = [], []
    for w in windows:
        oy, ox = _latent_crop_origin(cfg, w.clip)
        py, px = oy + TinyVAE.spatial_compression * w.y, ox + TinyVAE.spatial_compression * w.x
        clip = frames[w.clip, w.variant, :, py : py + size, px : px + size]
        if w.flip:
            clip = clip[:, :, ::-1]
        unit = stream_groups(to_unit(clip)[None])[0]  # [3, 12, size, size]: frame 0 four times, then 1-8
        pixels.append(unit[:, 4 * w.frame : 4 * w.frame + 8])
        out.append(stream_flow(flows, w.clip, py, px, size, w.flip)[4 * w.frame : 4 * w.frame + 7])
    return torch.stack(pixels), torch.stack(out)


def prompt_cache_with_grad(dit: CausalWanDiT, context: torch.Tensor) -> PromptCache:
    """``dit.encode_prompt`` (an inference API, under no_grad) recomputed with gradients for training.

    Same arithmetic: zero-pad/truncate the context to ``text_len`` rows, text MLP, per-block K/V. A test
    checks it against ``encode_prompt`` so the two cannot drift apart.
    """
    cfg = dit.config
    context = F.pad(context[:, : cfg.text_len], (0, 0, 0, max(0, cfg.text_len - context.shape[1])))
    tokens = dit.text_embedding(context)
    ks, vs = zip(*(cast(WanBlock, block).cross_attn.project_kv(tokens) for block in dit.blocks), strict=True)
    return PromptCache(list(ks), list(vs))


def dit_loss(dit: CausalWanDiT, vae: TinyVAE, x: torch.Tensor, t: torch.Tensor, sigma: torch.Tensor,
             target: torch.Tensor, context: torch.Tensor, temporal_weight: float,
             pixels: tuple[torch.Tensor, torch.Tensor] | None = None, warp_weight: float = 0.0) -> torch.Tensor:
    """MSE of x̂₀ = x − σ·v against the style latent, under the block-causal mask (1 latent frame/chunk),
    plus ``temporal_weight`` x the MSE of its frame-to-frame changes (per pixel frame, across chunks too).

    Channels are weighted by their raw variance (normalised to mean 1), so the loss is the MSE of the
    unnormalised latents, which the linear decoder path maps to pixels isometrically.

    With ``pixels`` (the first samples' teacher pixels and flows, ``window_pixels``), those samples' x̂₀
    are decoded by the (frozen) decoder and ``warp_weight`` x ``warped_temporal_error`` against the
    teacher's pixels is added: flicker as the evaluation measures it, through the decoder that shows it.
    """
    # forward_masked is the DiT's reference path and runs under no_grad; its undecorated function is
    # the same code with gradients.
    masked = getattr(CausalWanDiT.forward_masked, "__wrapped__", CausalWanDiT.forward_masked)
    v = masked(dit, x, t, prompt_cache_with_grad(dit, context), chunk_frames=1)
    x0 = x - sigma[:, None, :, None, None] * v
    warp = x0.new_zeros(())
    if pixels is not None and warp_weight:
        ref, flow = pixels
        y, _ = vae.decode_groups(vae.denormalize(x0[: ref.shape[0]]), None)
        warp = warp_weight * warped_temporal_error(y, ref, flow)
    scale = (vae.latent_std / vae.latent_std.pow(2).mean().sqrt()).view(1, -1, 1, 1, 1)
    x0, target = x0 * scale, target * scale
    temporal = temporal_error(vae.unpack(x0), vae.unpack(target), dim=1).pow(2).mean()
    return F.mse_loss(x0, target) + temporal_weight * temporal + warp


def train_dit(cfg: TrainConfig, vae: TinyVAE, lat: torch.Tensor, emb: torch.Tensor, dit_config: WanDiTConfig,
              sampler: SamplerSpec, clips: tuple[np.ndarray, np.ndarray] | None = None) -> CausalWanDiT:
    """Phase 1: every style equally often. Then ``dit_tune_rounds`` tune rounds (``dit_tune_steps`` each,
    lower LR), each drawing the shipped styles in proportion to their loss at the start of the round,
    so the steps go where the fidelity is lowest. ``clips`` (frames, flows): the warp term (``_dit_phase``)."""
    torch.manual_seed(cfg.seed + 1)
    dit = CausalWanDiT(dit_config)
    _dit_phase(cfg, dit, vae, lat, emb, sampler, "dit", cfg.dit_steps, cfg.dit_lr, None, 0, clips)
    _tune_rounds(cfg, dit, vae, lat, emb, sampler, "dit_tune", cfg.dit_steps, clips)
    return dit.eval()


def _tune_rounds(cfg: TrainConfig, dit: CausalWanDiT, vae: TinyVAE, lat: torch.Tensor, emb: torch.Tensor,
                 sampler: SamplerSpec, name: str, offset: int, clips: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """``dit_tune_rounds`` rounds of ``dit_tune_steps``, each drawing the shipped styles in proportion
    to their loss at the start of the round (phases ``name``, ``name2``, ...)."""
    for r in range(cfg.dit_tune_rounds):
        probs = _hard_style_probs(cfg, dit, vae, lat, emb, sampler)
        log.info("tune round %d style probabilities: %s", r + 1, dict(zip(STYLE_NAMES, probs.round(3).tolist(), strict=True)))
        _dit_phase(cfg, dit, vae, lat, emb, sampler, name if r == 0 else f"{name}{r + 1}", cfg.dit_tune_steps,
                   cfg.dit_tune_lr, probs, offset + r * cfg.dit_tune_steps, clips)


@torch.no_grad()
def _hard_style_probs(cfg: TrainConfig, dit: CausalWanDiT, vae: TinyVAE, lat: torch.Tensor, emb: torch.Tensor,
                      sampler: SamplerSpec, batches: int = 3) -> np.ndarray:
    """Per-style loss of ``dit`` on fixed batches, normalised to probabilities; 0 for styles not shipped."""
    schedule = FlowMatchSchedule(sampler.shift)
    dit.eval()
    losses = np.zeros(len(STYLE_NAMES))
    for k, name in enumerate(STYLE_NAMES):
        if name in NOT_SHIPPED:
            continue
        onehot = np.eye(len(STYLE_NAMES))[k]
        losses[k] = np.mean([float(dit_loss(dit, vae, *_dit_batch(cfg, 10**9 + b, lat, emb, sampler, schedule, onehot),
                                            cfg.temporal_weight)) for b in range(batches)])
    return losses / losses.sum()


def _dit_phase(cfg: TrainConfig, dit: CausalWanDiT, vae: TinyVAE, lat: torch.Tensor, emb: torch.Tensor,
               sampler: SamplerSpec, name: str, steps: int, peak_lr: float, style_probs: np.ndarray | None,
               offset: int, clips: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """One resumable DiT training phase (checkpoints ``<name>_ckpt.pt``, result ``<name>_final.pt``);
    its batches are the sample order's steps ``offset ..``, so no phase redraws another's batches.
    With ``clips`` (frames, flows) and ``cfg.warp_weight``, the first ``WARP_SAMPLES`` of each batch
    also pay the decoded warp term (``dit_loss``)."""
    ckpt_path, final_path = cfg.workdir / f"{name}_ckpt.pt", cfg.workdir / f"{name}_final.pt"
    final = _load(final_path)
    if final is not None:
        dit.load_state_dict(final["model"])
        return
    schedule = FlowMatchSchedule(sampler.shift)
    opt = torch.optim.AdamW(dit.parameters(), lr=peak_lr, weight_decay=0.01)
    start = _resume(ckpt_path, dit, opt)
    dit.train()
    vae.requires_grad_(False)  # the warp term decodes through it; only the DiT learns here
    bar = tqdm(range(start, steps), desc=name, initial=start, total=steps)
    ema = None
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = _lr(step, steps, peak_lr)
        windows: list[DitWindow] = []
        batch = _dit_batch(cfg, offset + step, lat, emb, sampler, schedule, style_probs, windows)
        pixels = None
        if clips is not None and cfg.warp_weight:
            pixels = window_pixels(cfg, windows[:WARP_SAMPLES], *clips)
        loss = dit_loss(dit, vae, *batch, cfg.temporal_weight, pixels, cfg.warp_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dit.parameters(), 1.0)
        opt.step()
        value = loss.item()  # a Python float: no autograd warning, one device sync per step
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        bar.set_postfix(loss=f"{ema:.4f}")
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == steps:
            _save(ckpt_path, model=dit.state_dict(), opt=opt.state_dict(), step=step + 1)
    _save(final_path, model=dit.state_dict())
    dit.eval()
    vae.requires_grad_(True)


# -- stage 5: decoder fine-tune ------------------------------------------------------------------------


@torch.no_grad()
def dit_predictions(cfg: TrainConfig, lat: torch.Tensor, model: EmbeddedModel) -> torch.Tensor:
    """The frozen DiT's stylised latents of every clip crop, float16 [clips, styles, C, 3, h, w].

    Each clip is streamed through the product's runtime (``EmbeddedStream``: one latent frame at a
    time, KV cache, V2V noise at the default noise scale), all styles at once as a batch, each under
    its first phrasing.
    """
    path = cfg.workdir / "predictions.pt"
    if path.exists():
        return cast(torch.Tensor, torch.load(path, map_location="cpu"))
    n_clips, n_variants = lat.shape[:2]
    styles = n_variants - 1
    if styles != len(STYLE_NAMES):
        raise ValueError(f"latents hold {styles} styles, the teachers {len(STYLE_NAMES)}")
    prompts = [STYLE_PROMPTS[name][0] for name in STYLE_NAMES]
    size = (lat.shape[-1] * model.vae.spatial_compression, lat.shape[-2] * model.vae.spatial_compression)
    runtime = model.stream_runtime()
    sampler = model.spec.sampler
    out = torch.empty(n_clips, styles, *lat.shape[2:], dtype=torch.float16)
    for i in tqdm(range(n_clips), desc="decoder data: DiT predictions"):
        stream = EmbeddedStream(runtime, prompts, size, cfg.seed * 100_003 + i, sampler.noise_scale,
                                sampler.default_num_steps)
        out[i] = stream.denoise(lat[i, 0].float()[None].expand(styles, -1, -1, -1, -1)).half()
    torch.save(out, path)
    return out


@dataclass
class DecoderBatch:
    """One decoder fine-tune batch, in the stream layout (a first group of four copies of frame 0)."""

    z: torch.Tensor  # normalised latents [B, C, 3, w, w]: the DiT's predictions (or the teachers' own)
    target: torch.Tensor  # the teachers' pixels [B, 3, 12, 8w, 8w]
    inputs: torch.Tensor  # the input clip's pixels the latents were made from [B, 3, 12, 8w, 8w]
    flow: torch.Tensor | None  # with flows: the input's flow between consecutive frames [B, 11, 8w, 8w, 2]
    looks: list[str]  # each sample's look


def _decoder_batch(cfg: TrainConfig, step: int, frames: np.ndarray, lat: torch.Tensor, pred: torch.Tensor,
                   flows: np.ndarray | None) -> DecoderBatch:
    rng = np.random.default_rng([cfg.seed, 4, step])
    n_clips, styles = pred.shape[:2]
    w = 8  # latent window: 64x64 pixels, like the VAE's crops
    zs, xs, gs, fs, looks = [], [], [], [], []
    shipped = [k for k in range(styles) if STYLE_NAMES[k] not in NOT_SHIPPED]
    for _ in range(cfg.vae_batch):
        # A look left out is not served, and its stylised latents (anchored to the shipped looks' prompts)
        # do not match its teacher: training the decoder on such pairs would teach it wrong colours.
        i, j = int(rng.integers(n_clips)), shipped[int(rng.integers(len(shipped)))]
        ly, lx = (int(v) for v in rng.integers(0, lat.shape[-1] - w + 1, 2))
        source = lat[i, 1 + j] if rng.random() < 0.25 else pred[i, j]
        zs.append(source[:, :, ly : ly + w, lx : lx + w].float())
        oy, ox = _latent_crop_origin(cfg, i)
        y, x = oy + 8 * ly, ox + 8 * lx
        xs.append(stream_groups(to_unit(frames[i, 1 + j, :, y : y + 8 * w, x : x + 8 * w])[None])[0])
        gs.append(stream_groups(to_unit(frames[i, 0, :, y : y + 8 * w, x : x + 8 * w])[None])[0])
        looks.append(STYLE_NAMES[j])
        if flows is not None:
            fs.append(stream_flow(flows, i, y, x, 8 * w, flip=False))
    return DecoderBatch(torch.stack(zs), torch.stack(xs), torch.stack(gs), torch.stack(fs) if fs else None, looks)


def finetune_decoder(cfg: TrainConfig, frames: np.ndarray, lat: torch.Tensor, model: EmbeddedModel) -> TinyVAE:
    """Fine-tune the decoder (only) on the DiT's stylised latents against the teachers' frames (a guided
    decoder reading the input frames the latents were made from, as it does in the product)."""
    ckpt_path, final_path = cfg.workdir / "decoder_ckpt.pt", cfg.workdir / "decoder_final.pt"
    vae = model.vae
    final = _load(final_path)
    if final is not None:
        vae.load_state_dict(final["model"])
        return vae.eval()
    pred = dit_predictions(cfg, lat, model)
    flows = build_flows(cfg.workdir, frames) if cfg.decoder_warp else None
    params = [p for m in vae.decoder_modules() for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.decoder_lr, weight_decay=0.0)
    start = _resume(ckpt_path, vae, opt)
    vae.train()
    bar = tqdm(range(start, cfg.decoder_steps), desc="decoder", initial=start, total=cfg.decoder_steps)
    ema = None
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = _lr(step, cfg.decoder_steps, cfg.decoder_lr)
        batch = _decoder_batch(cfg, step, frames, lat, pred, flows)
        x = batch.target
        y, _ = vae.decode_groups(vae.denormalize(batch.z), None, batch.inputs if vae.reads_input else None)
        loss = _reconstruction_loss(y, x, cfg.temporal_weight)
        if cfg.grid_weight:
            loss = loss + cfg.grid_weight * grid_step_error(y, x)
        if batch.flow is not None:
            rows = [k for k, look in enumerate(batch.looks) if not cfg.warp_looks or look in cfg.warp_looks]
            if rows:
                loss = loss + cfg.decoder_warp * warped_temporal_error(y[rows], x[rows], batch.flow[rows])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        psnr = float(10 * torch.log10(4.0 / (y.detach() - x).pow(2).mean()))
        ema = psnr if ema is None else 0.95 * ema + 0.05 * psnr
        bar.set_postfix(psnr=f"{ema:.2f}")
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.decoder_steps:
            _save(ckpt_path, model=vae.state_dict(), opt=opt.state_dict(), step=step + 1)
    _save(final_path, model=vae.state_dict())
    return vae.eval()


# -- stage 6: export ----------------------------------------------------------------------------------


def build_spec(vae: TinyVAE, dit: CausalWanDiT, sampler: SamplerSpec, stream: StreamSpec, emb: torch.Tensor,
               metrics: dict[str, Any] | None = None) -> EmbeddedSpec:
    """The checkpoint's config: architecture, shipped styles with their prototypes, sampler, stream."""
    names, _ = style_phrasings()
    protos = prototypes(emb.flatten(0, 1), names, emb.shape[1])
    shipped = [i for i, n in enumerate(names) if n not in NOT_SHIPPED]
    return EmbeddedSpec(
        vae=vae.config, dit=dit.config, styles={names[i]: STYLE_PROMPTS[names[i]] for i in shipped},
        prototypes={names[i]: [round(float(v), 6) for v in protos[i]] for i in shipped},
        sampler=sampler, stream=stream, metrics=metrics or {}, look_temperature=LOOK_TEMPERATURE,
    )


def export(out_dir: Path, spec: EmbeddedSpec, vae: TinyVAE, dit: CausalWanDiT) -> Path:
    """Write ``default.safetensors`` (float16 DiT, float32 VAE) and ``default.json``; returns the json path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {f"vae.{k}": v.detach().float().contiguous() for k, v in vae.state_dict().items()}
    # float16 halves the file; the evaluation numbers are measured on these rounded weights.
    tensors.update({f"dit.{k}": v.detach().half().contiguous() for k, v in dit.state_dict().items()})
    save_file(tensors, str(out_dir / "default.safetensors"))
    (out_dir / "default.json").write_text(spec.to_json())
    return out_dir / "default.json"


class WorkdirInUseError(RuntimeError):
    """The work directory holds another run's checkpoints and resuming was not asked for."""


def check_workdir(workdir: Path, resume: bool) -> None:
    """Refuse to start over a work directory that holds checkpoints unless ``resume`` is set: a stage
    that finds its checkpoint continues from it, so a new run there would silently mix two runs."""
    found = sorted(p.name for p in workdir.glob("*.pt")) if workdir.is_dir() else []
    if found and not resume:
        raise WorkdirInUseError(
            f"{workdir} already holds a run's checkpoints ({', '.join(found[:4])}{', ...' if len(found) > 4 else ''}); "
            "pass --resume to continue it, or choose another --workdir")


def finetune_looks(cfg: TrainConfig, base_config: Path, out_dir: Path) -> Path:
    """Teach a shipped model the looks it lacks without starting over: the base's VAE encoder and latent
    statistics stay (its DiT was trained on them), the DiT continues from the base's weights on steps
    that draw the new looks ``new_look_share`` of the time and replay the base's looks the rest (so
    they are not forgotten), then the usual loss-proportional tune rounds over every shipped look, then
    the decoder fine-tune on the new DiT's outputs. Every stage resumes like ``train_default``'s."""
    torch.set_num_threads(cfg.threads)
    started = time.time()
    base = EmbeddedModel.load(base_config)
    unknown = sorted(set(base.spec.styles) - set(STYLE_NAMES))
    if unknown:
        raise ValueError(f"the base model ships looks with no teacher here: {unknown}")
    new = [n for n in STYLE_NAMES if n not in base.spec.styles and n not in NOT_SHIPPED]
    sampler, stream = base.spec.sampler, base.spec.stream
    if cfg.input_noise is not None:
        sampler = replace(sampler, input_noise=cfg.input_noise)
    if not new and sampler == base.spec.sampler:
        raise ValueError(f"the base model already has every look and input noise {sampler.input_noise:g}; nothing to "
                         f"fine-tune ({sorted(base.spec.styles)})")
    if new:
        log.info("fine-tuning %d new looks onto %s: %s", len(new), base_config, ", ".join(new))
    if sampler != base.spec.sampler:
        log.info("re-tuning %s's DiT from input noise %g to %g", base_config, base.spec.sampler.input_noise,
                 sampler.input_noise)
    frames = build_frames(cfg.workdir)
    lat, vae = encode_latents(cfg, frames, base.vae, measure_stats=False)
    names, phrasings = style_phrasings()
    emb = pooled_embeddings(phrasings).reshape(len(names), -1, 384)
    # The prototype joins each look's phrasings as one more context the DiT learns: a prompt between two
    # looks is served as a blend of their prototypes (``PromptEncoder``'s look anchoring), so the
    # prototypes themselves must give the look.
    trained = torch.cat([emb, prototypes(emb.flatten(0, 1), names, emb.shape[1])[:, None]], dim=1)
    clips = (frames, build_flows(cfg.workdir, frames)) if cfg.warp_weight else None
    dit = base.dit.float()
    if new:
        probs = np.array([0.0 if n in NOT_SHIPPED else cfg.new_look_share / len(new) if n in new
                          else (1 - cfg.new_look_share) / (len(STYLE_NAMES) - len(new) - len(NOT_SHIPPED))
                          for n in STYLE_NAMES])
        _dit_phase(cfg, dit, vae, lat, trained, sampler, "looks", cfg.looks_steps, cfg.looks_lr, probs / probs.sum(),
                   0, clips)
    _tune_rounds(cfg, dit, vae, lat, trained, sampler, "looks_tune", cfg.looks_steps, clips)
    vae = finetune_decoder(cfg, frames, lat, EmbeddedModel(build_spec(vae, dit, sampler, stream, emb), vae, dit))
    elapsed = time.time() - started
    log.info("fine-tuned in %.1f min (this run; resumed stages not counted)", elapsed / 60)
    metrics = {"train_config": {k: str(v) for k, v in asdict(cfg).items()}, "base": str(base_config),
               "new_looks": new, "input_noise": sampler.input_noise, "train_minutes_this_run": elapsed / 60,
               "base_metrics": base.spec.metrics}  # the lineage: each fine-tune keeps the one before it
    return export(out_dir, build_spec(vae, dit, sampler, stream, emb, metrics), vae, dit)


def guide_decoder(cfg: TrainConfig, base_config: Path, out_dir: Path) -> Path:
    """Give a shipped model a decoder that reads the input frames (``TinyVAEConfig.guided``): its VAE
    encoder, latent statistics and DiT stay; the decoder, its guide paths starting at zero, is fine-tuned
    (stage 5) on the DiT's outputs against the teachers, reading each clip's input frames. Resumes like
    every stage."""
    torch.set_num_threads(cfg.threads)
    started = time.time()
    base = EmbeddedModel.load(base_config)
    if base.vae.reads_input:
        raise ValueError(f"{base_config}: its decoder already reads the input frames")
    frames = build_frames(cfg.workdir)
    lat, vae = encode_latents(cfg, frames, base.vae, measure_stats=False)
    guided = vae.with_guided_decoder(cfg.guide_basis, cfg.guide_blurs, cfg.guide_per_group)
    spec = replace(base.spec, vae=guided.config)
    guided = finetune_decoder(cfg, frames, lat, EmbeddedModel(spec, guided, base.dit.float()))
    elapsed = time.time() - started
    log.info("decoder guided in %.1f min (this run; resumed stages not counted)", elapsed / 60)
    metrics = {**base.spec.metrics, "guided_decoder": {"train_config": {k: str(v) for k, v in asdict(cfg).items()},
                                                       "base": str(base_config), "train_minutes_this_run": elapsed / 60}}
    return export(out_dir, replace(spec, metrics=metrics), guided, base.dit)


def train_default(cfg: TrainConfig, out_dir: Path) -> Path:
    """Run every stage (resuming whatever the work directory already holds) and export the checkpoint."""
    torch.set_num_threads(cfg.threads)
    started = time.time()
    frames = build_frames(cfg.workdir)
    lat, vae = encode_latents(cfg, frames, train_vae(cfg, frames, TinyVAEConfig()))
    # The autoencoder learns without the input frames (it would copy them); the decoder reads them from
    # the fine-tune on, where the input and the look it should become differ.
    vae = vae.with_guided_decoder(cfg.guide_basis, cfg.guide_blurs, cfg.guide_per_group)
    names, phrasings = style_phrasings()
    if tuple(names) != STYLE_NAMES:
        raise ValueError(f"style registry {names} and teachers {STYLE_NAMES} disagree")
    emb = pooled_embeddings(phrasings).reshape(len(names), -1, 384)
    sampler, stream = SamplerSpec(), StreamSpec()
    if cfg.input_noise is not None:
        sampler = replace(sampler, input_noise=cfg.input_noise)
    clips = (frames, build_flows(cfg.workdir, frames)) if cfg.warp_weight else None
    dit = train_dit(cfg, vae, lat, emb, tiny_dit_config(vae.latent_channels), sampler, clips)
    vae = finetune_decoder(cfg, frames, lat, EmbeddedModel(build_spec(vae, dit, sampler, stream, emb), vae, dit))
    elapsed = time.time() - started
    log.info("trained in %.1f min (this run; resumed stages not counted)", elapsed / 60)
    metrics = {"train_config": {k: str(v) for k, v in asdict(cfg).items()}, "train_minutes_this_run": elapsed / 60}
    return export(out_dir, build_spec(vae, dit, sampler, stream, emb, metrics), vae, dit)
