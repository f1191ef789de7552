"""Memory arithmetic of a model at a frame size: weight bytes, per-stream state bytes, streams per GPU.

Arithmetic, not measurement: sizes follow from the configs (parameter counts from ``meta`` builds, so
nothing is allocated, which is how the 14B is sized on a machine that cannot hold it). What a stream
keeps between chunks (engine/streaming/state.py), in the layout the runtime allocates:

* KV caches: one per denoising step in ``per-step`` mode (StreamDiffusionV2), one in ``clean`` mode;
  each holds K and V of every block for the whole window, ``[1, window * frame_tokens, heads, head_dim]``,
  allocated full-size when the stream starts.
* prompt K/V: the cross-attention keys and values of the prompt, every block, ``[1, text_len, dim]``.
* the text embedding ``[1, text_len, text_dim]`` in the text encoder's dtype (float32), kept for blending.
* Wan VAE caches: every causal 3x3x3 conv keeps its last 2 input frames, each temporal downsampler its
  last frame, each temporal upsampler 2 frames of its input, at that layer's resolution and width
  (:func:`wan_vae_cache_elements`); they reach this size on a stream's third chunk.
* host memory: the motion controller's last input frame, ``[3, H, W]`` float32, kept on the CPU.

Not counted: a chunk's transient tensors (latents, noise, activations), which the workspace margin
covers, and what a stream parked in host memory occupies there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from engine.devices import dtype_name
from engine.models.wan_dit import WanDiTConfig
from engine.models.wan_vae import CACHE_FRAMES, WanVAEConfig
from engine.random_model import RandomModel, dit_parameter_count, vae_parameter_count
from engine.streaming.config import RuntimeConfig

GIB = 1024**3
TEXT_EMBEDDING_BYTES = 4  # the text encoders return float32 rows

# umT5-XXL's encoder (Wan's text encoder), from its published config: d_model 4096, d_ff 10240 (gated FFN:
# wi_0, wi_1, wo), 24 layers of 64 heads x 64, a 256,384-token vocabulary and a relative-position bias
# (32 buckets x 64 heads) in every layer (umT5 does not share it). Listed for memory: it runs once per prompt.
UMT5_XXL = {"d_model": 4096, "d_ff": 10240, "layers": 24, "heads": 64, "d_kv": 64, "vocab": 256384, "buckets": 32}


def umt5_xxl_parameter_count() -> int:
    c = UMT5_XXL
    inner = c["heads"] * c["d_kv"]
    per_layer = (4 * c["d_model"] * inner  # q, k, v, o
                 + 3 * c["d_model"] * c["d_ff"]  # wi_0, wi_1, wo
                 + 2 * c["d_model"]  # the two RMS norms
                 + c["buckets"] * c["heads"])  # relative attention bias
    return c["vocab"] * c["d_model"] + c["layers"] * per_layer + c["d_model"]  # + the final norm


def wan_vae_cache_elements(config: WanVAEConfig, width: int, height: int) -> tuple[int, int]:
    """Elements of one stream's Wan VAE encoder and decoder caches in steady state (batch 1).

    Walks the topology of engine/models/wan_vae.py stage by stage: which convs keep frames, how wide
    their inputs are and at what resolution.
    """
    frames = CACHE_FRAMES
    dims = [config.base_dim * m for m in (1, *config.dim_mult)]
    stages = len(config.dim_mult)
    res = width * height

    def at(level: int) -> int:  # pixels of a feature map ``level`` spatial halvings down
        return (width >> level) * (height >> level)

    # Encoder: conv1 on RGB; per stage, res blocks (two 3x3x3 convs each: inputs in_dim then out_dim), then
    # the downsampler (a temporal one keeps its last output frame); middle (2 res blocks); head conv.
    encoder = frames * 3 * res
    for i in range(stages):
        in_dim, out_dim = dims[i], dims[i + 1]
        for _ in range(config.num_res_blocks):
            encoder += frames * (in_dim + out_dim) * at(i)
            in_dim = out_dim
        if i != stages - 1 and config.temporal_downsample[i]:
            encoder += out_dim * at(i + 1)
    low = stages - 1
    encoder += frames * 4 * dims[-1] * at(low) + frames * dims[-1] * at(low)

    # Decoder: conv1 on the latents; middle; per stage num_res_blocks + 1 res blocks (after an upsampler
    # halved the channels), then the upsampler (a temporal one keeps 2 input frames); head conv.
    up_dims = [config.base_dim * m for m in (config.dim_mult[-1], *reversed(config.dim_mult))]
    temporal_up = tuple(reversed(config.temporal_downsample))
    decoder = frames * config.z_dim * at(low) + frames * 4 * up_dims[0] * at(low)
    for i in range(stages):
        in_dim, out_dim = up_dims[i] // (2 if i else 1), up_dims[i + 1]
        level = low - i
        for _ in range(config.num_res_blocks + 1):
            decoder += frames * (in_dim + out_dim) * at(level)
            in_dim = out_dim
        if i != stages - 1 and temporal_up[i]:
            decoder += frames * out_dim * at(level)
    decoder += frames * up_dims[-1] * res
    return encoder, decoder


def engine_grid(dit: WanDiTConfig, vae: WanVAEConfig, size: tuple[int, int]) -> tuple[int, int, int]:
    """The size the model runs at for frames of ``size`` (rounded down to what the VAE and the patches
    divide, as ``StreamRuntime.engine_size`` does) and its DiT tokens per latent frame."""
    spatial = vae.spatial_compression
    multiple = spatial * dit.patch_size[1]
    width, height = size[0] // multiple * multiple, size[1] // multiple * multiple
    if width <= 0 or height <= 0:
        raise ValueError(f"frame size {size} is smaller than one {multiple}-pixel cell")
    return width, height, dit.frame_tokens(height // spatial, width // spatial)


@dataclass(frozen=True)
class StreamStateBytes:
    """One stream's state between chunks, by part; ``device`` is what sits on the model's device."""

    kv_caches: int
    prompt_kv: int
    text_embedding: int
    vae_encoder: int
    vae_decoder: int
    host: int  # the motion controller's last frame (CPU)

    @property
    def device(self) -> int:
        return self.kv_caches + self.prompt_kv + self.text_embedding + self.vae_encoder + self.vae_decoder

    @property
    def total(self) -> int:
        return self.device + self.host


def stream_state_bytes(dit: WanDiTConfig, vae: WanVAEConfig, size: tuple[int, int], steps: int, window: int,
                       dtype: torch.dtype, runtime: RuntimeConfig | None = None) -> StreamStateBytes:
    """The state of one stream at ``size`` (width, height; rounded down as the runtime does) with
    ``steps`` denoising steps and a ``window``-frame KV cache, tensors in ``dtype``."""
    runtime = runtime or RuntimeConfig()
    width, height, frame_tokens = engine_grid(dit, vae, size)
    caches = steps if runtime.cache_mode == "per-step" else 1
    es = dtype.itemsize
    encoder, decoder = wan_vae_cache_elements(vae, width, height)
    return StreamStateBytes(
        kv_caches=caches * dit.num_layers * 2 * window * frame_tokens * dit.dim * es,
        prompt_kv=dit.num_layers * 2 * dit.text_len * dit.dim * es,
        text_embedding=dit.text_len * dit.text_dim * TEXT_EMBEDDING_BYTES,
        vae_encoder=encoder * es,
        vae_decoder=decoder * es,
        host=3 * width * height * 4,
    )


@dataclass(frozen=True)
class StreamsRow:
    steps: int
    state: StreamStateBytes
    streams: int  # that fit beside the weights and the workspace, text encoder off the GPU
    streams_with_umt5: int  # the same with umT5-XXL's weights on the GPU too


@dataclass(frozen=True)
class MemoryReport:
    model: str
    size: tuple[int, int]
    dtype: str  # of the weights counted against the GPU and of the stream state
    window: int
    frame_tokens: int
    dit_parameters: int
    vae_parameters: int
    umt5_parameters: int
    weight_bytes: dict[str, int]  # DiT + VAE, per dtype name
    gpu_memory_bytes: int
    workspace_bytes: int
    rows: list[StreamsRow] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        for raw, row in zip(doc["rows"], self.rows, strict=True):
            raw["state"].update(device=row.state.device, total=row.state.total)
        doc["kind"] = "arithmetic, not measured"
        return doc


def streams_that_fit(gpu_bytes: int, fixed_bytes: int, per_stream: int) -> int:
    """Whole streams of ``per_stream`` bytes in what ``fixed_bytes`` (weights, workspace) leave free."""
    return max(0, (gpu_bytes - fixed_bytes) // per_stream)


def memory_report(model: RandomModel, size: tuple[int, int] | None = None, steps: tuple[int, ...] = (1, 2, 3, 4),
                  window: int | None = None, dtype: torch.dtype = torch.bfloat16, gpu_memory_gib: float = 141.0,
                  workspace_gib: float | None = None, runtime: RuntimeConfig | None = None) -> MemoryReport:
    """Weights, per-stream state for each step count, and streams per GPU of ``gpu_memory_gib``.

    Weights and state are in ``dtype``. ``workspace_gib`` (default: 10 % of the GPU) is kept free for a
    chunk's activations, the CUDA context and allocator slack: an assumption until a GPU run measures
    the peak (``diffcast bench engine --device cuda --json`` reports ``cuda_peak_mb`` per row).
    """
    runtime = runtime or RuntimeConfig()
    size = size or model.size
    window = window or runtime.kv_window_frames
    if window < runtime.sink_frames + runtime.chunk_latent_frames:
        raise ValueError(f"a {window}-frame KV window cannot hold {runtime.sink_frames} sinks plus a chunk")
    if not steps or min(steps) < 1:
        raise ValueError(f"steps must be >= 1, got {list(steps)}")
    gpu = int(gpu_memory_gib * GIB)
    workspace = int((workspace_gib if workspace_gib is not None else 0.1 * gpu_memory_gib) * GIB)
    dit_n, vae_n, umt5_n = dit_parameter_count(model.dit), vae_parameter_count(model.vae), umt5_xxl_parameter_count()
    weights = {name: (dit_n + vae_n) * d.itemsize for name, d in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    fixed = (dit_n + vae_n) * dtype.itemsize + workspace
    umt5 = umt5_n * dtype.itemsize
    rows = []
    for s in steps:
        state = stream_state_bytes(model.dit, model.vae, size, s, window, dtype, runtime)
        rows.append(StreamsRow(s, state, streams_that_fit(gpu, fixed, state.device),
                               streams_that_fit(gpu, fixed + umt5, state.device)))
    frame_tokens = engine_grid(model.dit, model.vae, size)[2]
    return MemoryReport(model.spec, size, dtype_name(dtype), window, frame_tokens, dit_n, vae_n, umt5_n, weights, gpu,
                        workspace, rows)
