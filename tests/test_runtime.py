"""Live stream runtime: stream batch, multi-stream batching, bounded long streams, controls, state moves,
the temporal stabilizer stage."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
from _runtime_fixtures import clip, fidelity, tiny_runtime

from engine.fidelity import FidelityConfig
from engine.models.wan_dit import KVCache
from engine.streaming.parcel import park, unpark
from engine.streaming.runtime import RopeOverflowError, refresh_sinks
from engine.streaming.stabilizer import StabilizerConfig, StabilizerState, TemporalStabilizer
from engine.streaming.stream_batch import StreamBatch


def _run(rt, state, chunks):  # type: ignore[no-untyped-def]
    return [rt.run_chunk(state, c).frames for c in chunks]


@pytest.fixture(autouse=True)
def one_thread():  # type: ignore[no-untyped-def]
    """Batched vs. single-row forwards agree to fp32 rounding (a different batch size may change the
    summation order inside matmuls); one thread keeps that rounding small and repeatable, and on
    test-size tensors it is also much faster than thread hand-offs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("steps", "stabilizer"), [(2, None), (3, None), (2, StabilizerConfig())])
def test_stream_batch_equals_sequential_denoising(steps: int, stabilizer: StabilizerConfig | None) -> None:
    rt = tiny_runtime(sink_tau=0.5, stabilizer=stabilizer)
    chunks = clip(9)
    seq_state = rt.open("s", "oil painting", (32, 32), fidelity(steps=steps, window=5), seed=3)
    expected = _run(rt, seq_state, chunks)

    batch_state = rt.open("b", "oil painting", (32, 32), fidelity(steps=steps, window=5), seed=3)
    batch = StreamBatch(rt, [batch_state])
    got = [r[0].frames for r in (batch.push([c]) for c in chunks) if r[0] is not None]
    got += [r.frames for r in batch.drain()]
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # One forward per micro-step once warm: n chunks in flight share it.
    assert batch.forwards < steps * len(chunks)


@pytest.mark.parametrize("guided", [False, True], ids=["wan-vae", "guided-tiny-vae"])
def test_several_streams_batch_into_one_forward_and_one_vae_call(guided: bool) -> None:
    rt = tiny_runtime(guided_vae=guided)
    prompts = ["oil painting", "pencil sketch", "neon"]
    singles = [rt.open(f"s{i}", p, (32, 32), fidelity(), seed=i) for i, p in enumerate(prompts)]
    batched = [rt.open(f"b{i}", p, (32, 32), fidelity(), seed=i) for i, p in enumerate(prompts)]
    streams_chunks = [clip(4, seed=i) for i in range(3)]
    calls: list[tuple[str, int]] = []
    for name in ("encode_chunk", "decode_chunk"):
        inner = getattr(rt.vae, name)

        def counted(x: torch.Tensor, *args: object, _inner: object = inner, _name: str = name) -> torch.Tensor:
            calls.append((_name, x.shape[0]))
            return _inner(x, *args)  # type: ignore[operator, no-any-return]

        setattr(rt.vae, name, counted)
    for k in range(4):
        expected = [rt.run_chunk(s, c[k]).frames for s, c in zip(singles, streams_chunks, strict=True)]
        calls.clear()
        got = [r.frames for r in rt.run_chunks(batched, [c[k] for c in streams_chunks])]
        # The batch's chunks went through the VAE together: one encode and one decode of three rows.
        assert calls == [("encode_chunk", 3), ("decode_chunk", 3)], calls
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=5e-5)  # a batched convolution rounds apart
    # The three outputs are three different stylisations, never the same tensor.
    assert not torch.allclose(expected[0], expected[1])


def test_hour_long_stream_stays_bounded() -> None:
    """One hour at 16 fps (14 400 V2V chunks) on the latent core: bounded cache, positions, values."""
    rt = tiny_runtime()
    state = rt.open("long", "watercolor", (16, 16), fidelity(steps=1, window=6), seed=0)
    g = torch.Generator().manual_seed(0)
    chunks = 16 * 3600 // 4
    sizes = set()
    max_rope = 0
    for k in range(chunks):
        z = torch.randn(1, 16, 1, 2, 2, generator=g)
        x0 = rt.denoise_latents([state], [z], [0.8])
        max_rope = max(max_rope, state.rope_frame)
        if k % 997 == 0 or k == chunks - 1:
            assert torch.isfinite(x0).all()
            if k > 10:
                sizes.add(sum(t.numel() for t in state.kv[0].k) + state.kv[0].local_end)
    assert len(sizes) == 1, "KV cache size must be constant after warm-up"
    assert max_rope <= rt.config.rope_reset_frame + 1 < rt.dit.config.rope_max_positions
    assert state.rope_resets > 0
    assert state.frame == chunks


def test_rope_overflow_without_refresh_is_reported() -> None:
    rt = tiny_runtime(rope_refresh=False)
    state = rt.open("o", "sepia", (16, 16), fidelity(steps=1), seed=0)
    state.rope_frame = rt.dit.config.rope_max_positions
    with pytest.raises(RopeOverflowError, match="enable rope_refresh"):
        rt.denoise_latents([state], [torch.zeros(1, 16, 1, 2, 2)], [0.8])


def _cache_with_frames(frame_vectors: list[torch.Tensor], sinks: int) -> KVCache:
    k = torch.stack(frame_vectors)[None, :, None, :]  # [1, frames, heads=1, hd]
    return KVCache([k.clone()], [k.clone()], 1, len(frame_vectors), sinks, [len(frame_vectors)], len(frame_vectors))


def test_sink_refresh_replaces_only_the_least_similar_sink_below_tau() -> None:
    e = torch.eye(4)
    new = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # sink 0 equals the new frame, sink 1 is orthogonal (least similar), sink 2 is close.
    frames = [e[0], e[1], e[0] + 0.1 * e[2], e[3], new]
    cache = _cache_with_frames(frames, sinks=3)
    assert refresh_sinks(cache, 1, tau=0.2)
    torch.testing.assert_close(cache.k[0][0, 1, 0], new)
    torch.testing.assert_close(cache.k[0][0, 0, 0], e[0])
    torch.testing.assert_close(cache.k[0][0, 2, 0], e[0] + 0.1 * e[2])

    similar = _cache_with_frames([e[0], e[0], e[0], e[3], new], sinks=3)
    before = similar.k[0].clone()
    assert not refresh_sinks(similar, 1, tau=0.2)
    torch.testing.assert_close(similar.k[0], before)


def test_prompt_switch_changes_output_next_chunk_without_rewarm() -> None:
    rt = tiny_runtime()
    chunks = clip(5)
    a = rt.open("a", "oil painting", (32, 32), fidelity(), seed=0)
    b = rt.open("b", "oil painting", (32, 32), fidelity(), seed=0)
    for c in chunks[:3]:
        rt.run_chunk(a, c)
        rt.run_chunk(b, c)
    fill = b.kv[0].local_end
    rt.set_prompt(b, "pencil sketch")
    out_a = rt.run_chunk(a, chunks[3]).frames
    out_b = rt.run_chunk(b, chunks[3]).frames
    # A twin with the same prompt reproduces a bit for bit; the switched stream differs at once.
    assert (out_a - out_b).abs().max() > 1e-4, "the new prompt must show in the very next chunk"
    assert b.chunks == a.chunks and b.frame == a.frame, "no restart"
    assert b.kv[0].local_end == fill + 1, "the KV cache carried on (no re-warm-up)"


def test_fidelity_change_applies_from_that_chunk_only() -> None:
    rt = tiny_runtime()
    chunks = clip(5)
    a = rt.open("a", "oil painting", (32, 32), fidelity(steps=2), seed=0)
    b = rt.open("b", "oil painting", (32, 32), fidelity(steps=2), seed=0)
    for c in chunks[:3]:
        torch.testing.assert_close(rt.run_chunk(a, c).frames, rt.run_chunk(b, c).frames, rtol=0, atol=0)
    rt.set_fidelity(b, fidelity(steps=1))
    assert len(b.kv) == 2, "nothing changes before the chunk boundary"
    out_a, out_b = rt.run_chunk(a, chunks[3]).frames, rt.run_chunk(b, chunks[3]).frames
    assert len(b.kv) == 1
    assert (out_a - out_b).abs().max() > 1e-4


def test_parked_pickled_and_copied_states_go_on_bit_identical() -> None:
    rt = tiny_runtime()
    chunks = clip(6)
    a = rt.open("a", "thermal", (32, 32), fidelity(), seed=7)
    for c in chunks[:3]:
        rt.run_chunk(a, c)
    restored = unpark(park(a))
    carried = unpark(pickle.loads(pickle.dumps(park(a))))  # as Ray carries a parcel
    twin = copy.deepcopy(a)
    for c in chunks[3:]:
        expected = rt.run_chunk(a, c).frames
        torch.testing.assert_close(rt.run_chunk(restored, c).frames, expected, rtol=0, atol=0)
        torch.testing.assert_close(rt.run_chunk(carried, c).frames, expected, rtol=0, atol=0)
        torch.testing.assert_close(rt.run_chunk(twin, c).frames, expected, rtol=0, atol=0)
    assert restored.nbytes() > 0


def test_stabilizer_in_the_runtime_is_the_filter_applied_to_the_raw_output() -> None:
    config = StabilizerConfig()
    raw_rt, stab_rt = tiny_runtime(), tiny_runtime(stabilizer=config)
    raw = raw_rt.open("a", "thermal", (32, 32), fidelity(), seed=3)
    stab = stab_rt.open("b", "thermal", (32, 32), fidelity(), seed=3)
    off = stab_rt.open("c", "thermal", (32, 32), fidelity(), seed=3, stabilize=False)
    reference, history = TemporalStabilizer(config), StabilizerState()
    moved = 0.0
    for c in clip(4):
        r = raw_rt.run_chunk(raw, c).frames
        s = stab_rt.run_chunk(stab, c).frames
        torch.testing.assert_close(stab_rt.run_chunk(off, c).frames, r, rtol=0, atol=0)
        torch.testing.assert_close(s, reference(history, c, r), rtol=0, atol=1e-6)
        moved = max(moved, float((s - r).abs().max()))
    assert moved > 1e-3, "the stabilizer changed nothing"
    assert stab_rt.last_timings.stabilize_s > 0


def test_below_x1_the_stabilizer_filters_the_engine_size_frames_and_a_rung_change_keeps_its_history() -> None:
    """A 64x64 stream at resolution scale 0.5: the shipped frames are the filter run on the decoder's
    32x32 frames (from an unstabilised twin's stages) with the input fitted to 32x32, then fitted to
    64x64 — not the filter run after the upscale. Back at x1 the history goes on (rescaled), so the
    first frame after the change is still filtered."""
    from engine.streaming.runtime import fit_frames

    config = StabilizerConfig(strength=0.8, motion_tolerance=1.0, change_tolerance=1.0)
    half = FidelityConfig(steps=2, kv_window_frames=6, precision="fp32", resolution_scale=0.5)
    raw_rt, rt = tiny_runtime(), tiny_runtime(stabilizer=config)
    raw = raw_rt.open("r", "thermal", (64, 64), half, seed=3)
    stab = rt.open("s", "thermal", (64, 64), half, seed=3)
    engine, stream = TemporalStabilizer(config), TemporalStabilizer(config)
    at_engine, at_stream = StabilizerState(), StabilizerState()
    # A smooth picture (camera-like: a 2x down-and-up loses little of it) rolling sideways.
    base = torch.nn.functional.interpolate(torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(1)) * 2 - 1,
                                           size=(64, 64), mode="bicubic", align_corners=False)[0].clamp(-1, 1)
    chunks, t = [], 0
    for n in (1, 4, 4, 4, 4):
        chunks.append(torch.stack([torch.roll(base, shifts=t + i, dims=2) for i in range(n)], dim=1))
        t += n
    for c in chunks[:4]:
        chunk = raw_rt.enter_chunk(raw, c)
        raw_rt.run_to_end([chunk])
        drawn = raw_rt.decode_chunk(chunk).frames
        assert drawn.shape[-2:] == (32, 32)
        expected = fit_frames(engine(at_engine, fit_frames(c, (32, 32)), drawn), (64, 64))
        got = rt.run_chunk(stab, c).frames
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        upscaled_first = stream(at_stream, c, fit_frames(drawn, (64, 64)))
    assert (got - upscaled_first).abs().max() > 1e-3, "filtering after the upscale gives other frames"
    for runtime, state in ((raw_rt, raw), (rt, stab)):
        runtime.set_fidelity(state, FidelityConfig(steps=2, kv_window_frames=6, precision="fp32"))
    r, s = raw_rt.run_chunk(raw, chunks[4]).frames, rt.run_chunk(stab, chunks[4]).frames
    assert s.shape == r.shape == (3, 4, 64, 64)
    assert (s[:, 0] - r[:, 0]).abs().max() > 1e-3, "the history was dropped at the rung change"


def test_hard_prompt_switch_drops_the_stabilizer_history_and_state_moves_with_it() -> None:
    raw_rt, rt = tiny_runtime(), tiny_runtime(stabilizer=StabilizerConfig())
    chunks = clip(6)
    raw = raw_rt.open("r", "oil painting", (32, 32), fidelity(), seed=0)
    a = rt.open("a", "oil painting", (32, 32), fidelity(), seed=0)
    for c in chunks[:3]:
        raw_rt.run_chunk(raw, c)
        rt.run_chunk(a, c)
    restored = unpark(park(a))
    torch.testing.assert_close(rt.run_chunk(restored, chunks[3]).frames, rt.run_chunk(a, chunks[3]).frames, rtol=0, atol=0)
    raw_rt.run_chunk(raw, chunks[3])
    for runtime, state in ((raw_rt, raw), (rt, a)):
        runtime.set_prompt(state, "pencil sketch", transition_chunks=2)
    assert not a.restart_stabilizer, "a gradual transition keeps the history"
    for runtime, state in ((raw_rt, raw), (rt, a)):
        runtime.set_prompt(state, "pencil sketch")
    expected, got = raw_rt.run_chunk(raw, chunks[4]).frames, rt.run_chunk(a, chunks[4]).frames
    # The first frame after a hard switch is the model's own; the history restarts from it.
    torch.testing.assert_close(got[:, 0], expected[:, 0], rtol=0, atol=1e-6)
    assert (got[:, 1:] - expected[:, 1:]).abs().max() > 1e-4


@torch.no_grad()
def test_a_decoder_that_reads_the_input_gets_each_chunks_engine_frames() -> None:
    """With a guided VAE the runtime keeps each chunk's input at the engine size as the encoder took it,
    and decodes x̂₀ with it: the stream's frames equal the VAE's own decode of that x̂₀ with the input
    frames (an independent call), and differ from a decode without them."""
    rt = tiny_runtime(guided_vae=True)
    state = rt.open("s", "oil painting", (32, 32), fidelity(steps=2), seed=3)
    for frames in clip(3):
        decoder = copy.deepcopy(state.vae_decoder)
        chunk = rt.enter_chunk(state, frames)
        assert chunk.guide is not None
        torch.testing.assert_close(chunk.guide, frames[None], rtol=0, atol=0)  # 32x32: the engine size
        rt.run_to_end([chunk])
        got = rt.decode_chunk(chunk).frames
        expected = rt.vae.decode_chunk(chunk.x, copy.deepcopy(decoder), frames[None])[0].float().clamp(-1, 1)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
        unguided = rt.vae.decode_chunk(chunk.x, decoder)[0].float().clamp(-1, 1)
        assert (got - unguided).abs().mean() > 0.01


@pytest.mark.parametrize("guided_vae", [False, True], ids=["wan-vae", "guided-tiny-vae"])
def test_a_bf16_chunk_encodes_and_decodes_in_bf16_too(guided_vae: bool) -> None:
    """Precision bf16 is the whole chunk's: the stream enters the VAE's own encode under torch's bf16
    autocast (an independent call; no input noise, so x = (1 − s)·z) and gives the VAE's decode under
    it; an fp32 stream of the same frames gets neither (its VAE computes in fp32)."""
    from engine.streaming.noise import NoiseControllerConfig

    rt = tiny_runtime(guided_vae=guided_vae, noise=NoiseControllerConfig(input_noise=0.0))
    for precision in ("bf16", "fp32"):
        state = rt.open("s", "oil painting", (32, 32), FidelityConfig(steps=1, kv_window_frames=6,
                                                                      precision=precision), seed=3)
        for frames in clip(2):
            encoder, decoder = copy.deepcopy(state.vae_encoder), copy.deepcopy(state.vae_decoder)
            chunk = rt.enter_chunk(state, frames)
            entered = chunk.x.clone()
            rt.run_to_end([chunk])
            got = rt.decode_chunk(chunk).frames
            guide = frames[None] if guided_vae else None
            with torch.autocast("cpu", dtype=torch.bfloat16):
                z16 = rt.vae.encode_chunk(frames[None], copy.deepcopy(encoder)).float()
                out16 = rt.vae.decode_chunk(chunk.x, copy.deepcopy(decoder), guide)[0].float().clamp(-1, 1)
            z32 = rt.vae.encode_chunk(frames[None], encoder)
            out32 = rt.vae.decode_chunk(chunk.x, decoder, guide)[0].float().clamp(-1, 1)
            s = chunk.noise_rate
            same, other = ((z16, out16), (z32, out32)) if precision == "bf16" else ((z32, out32), (z16, out16))
            torch.testing.assert_close(entered, (1 - s) * same[0], rtol=0, atol=1e-6)
            torch.testing.assert_close(got, same[1], rtol=0, atol=1e-6)
            assert (entered - (1 - s) * other[0]).abs().max() > 1e-4
            assert (got - other[1]).abs().max() > 1e-4
            assert entered.dtype == torch.float32


@pytest.mark.parametrize("input_noise", [0.0, 0.5])
def test_input_noise_scales_only_the_gaussian_term_of_the_v2v_input(input_noise: float) -> None:
    """x = (1 − s)·z + input_noise·s·ε, computed independently: z from a fresh encoder cache, ε the
    stream's first draw from its seed. At 0 two one-step streams with different seeds enter identical
    inputs and restyle identically; at 0.5 they differ by exactly half of StreamDiffusionV2's noise term."""
    from engine.sampling import NoiseSource
    from engine.streaming.noise import NoiseControllerConfig

    rt = tiny_runtime(noise=NoiseControllerConfig(noise_scale=0.8, input_noise=input_noise))
    frames = clip(1)[0]
    states = [rt.open(f"s{seed}", "oil painting", (32, 32), fidelity(steps=1), seed=seed) for seed in (1, 2)]
    chunks = [rt.enter_chunk(state, frames) for state in states]
    z = rt.vae.encode_chunk(frames[None], rt.vae.new_encoder_cache())
    for seed, chunk in zip((1, 2), chunks, strict=True):
        s = chunk.noise_rate
        eps = NoiseSource(seed).randn(z.shape)
        torch.testing.assert_close(chunk.x, (1 - s) * z + input_noise * s * eps, rtol=0, atol=1e-5)
    rt.run_to_end(chunks)
    out = [rt.decode_chunk(c).frames for c in chunks]
    gap = (out[0] - out[1]).abs().max()
    assert gap == 0 if input_noise == 0 else gap > 1e-3


def test_input_noise_outside_0_to_1_is_refused() -> None:
    from engine.streaming.noise import NoiseControllerConfig

    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="input_noise"):
            NoiseControllerConfig(input_noise=bad)


def test_fit_frames_on_the_cpu_is_an_area_average_down_and_torchs_bilinear_up() -> None:
    """The CPU path (OpenCV) against independent computations: at an integer factor an area average is
    the mean of each block; at a fractional one it keeps the picture's mean (every source pixel counts
    by the area it covers) and a smooth ramp stays a ramp; up, it is torch's bilinear to rounding; any
    aspect is centre-cropped first, never stretched."""
    from engine.streaming.runtime import fit_frames

    g = torch.Generator().manual_seed(0)
    frames = torch.rand(3, 4, 64, 96, generator=g) * 2 - 1
    half = fit_frames(frames[..., 16:80], (32, 32))
    blocks = torch.nn.functional.avg_pool2d(frames[..., 16:80].permute(1, 0, 2, 3), 2).permute(1, 0, 2, 3)
    assert half.shape == (3, 4, 32, 32) and torch.allclose(half, blocks, atol=1e-6)

    ramp = torch.linspace(-1, 1, 90).expand(3, 4, 90, 90).contiguous()
    fitted = fit_frames(ramp, (40, 40))  # 2.25x: windows of fractional width
    assert torch.allclose(fitted.mean(), ramp.mean(), atol=1e-3)
    # The exact area average of a ramp is the ramp at each output pixel's centre (OpenCV's weights
    # are rounded: within 0.2 of a level).
    centres = (torch.arange(40) + 0.5) * 2.25 - 0.5
    assert torch.allclose(fitted[0, 0, 0], -1 + 2 / 89 * centres, atol=3e-3)

    small = torch.rand(3, 4, 24, 40, generator=g) * 2 - 1
    up = fit_frames(small, (64, 48))  # 40x24 is wider than 4:3: the centre 32x24 is kept
    expected = torch.nn.functional.interpolate(small[..., 4:36].permute(1, 0, 2, 3), size=(48, 64), mode="bilinear")
    assert up.shape == (3, 4, 48, 64) and torch.allclose(up, expected.permute(1, 0, 2, 3), atol=1e-5)


def test_fit_frames_resizes_a_cameras_bytes_as_it_resizes_floats() -> None:
    """uint8 frames (a camera's) are fitted as bytes: against the float path on the same pixels, each
    output within half a level of rounding plus OpenCV's weight rounding, down and up, cropped alike."""
    from engine.frames import frames_as_uint8, frames_to_tensor, unit_range
    from engine.streaming.runtime import fit_frames

    frames = np.random.default_rng(3).integers(0, 256, (4, 64, 96, 3), dtype=np.uint8)
    for size in ((32, 32), (40, 30), (160, 120)):
        as_bytes = fit_frames(frames_as_uint8(frames), size)
        assert as_bytes.dtype == torch.uint8 and as_bytes.shape == (3, 4, size[1], size[0])
        as_floats = fit_frames(frames_to_tensor(frames), size)
        assert (unit_range(as_bytes) - as_floats).abs().max() <= 1.5 / 127.5


def test_a_chunk_of_camera_bytes_runs_as_the_same_chunk_in_floats() -> None:
    """The runtime takes uint8 frames and fits them to the engine size before converting: below
    resolution scale 1 the stylised chunks match those from float frames to rounding, and differ from
    the input (not a pass-through)."""
    from engine.frames import frames_as_uint8, frames_to_tensor

    half = FidelityConfig(steps=2, kv_window_frames=6, precision="fp32", resolution_scale=0.5)
    rng = np.random.default_rng(4)
    chunks = [rng.integers(0, 256, (n, 64, 64, 3), dtype=np.uint8) for n in (1, 4, 4)]
    runtimes = [tiny_runtime(), tiny_runtime()]
    states = [rt.open("s", "thermal", (64, 64), half, seed=3) for rt in runtimes]
    for frames in chunks:
        as_bytes = runtimes[0].run_chunk(states[0], frames_as_uint8(frames)).frames
        as_floats = runtimes[1].run_chunk(states[1], frames_to_tensor(frames)).frames
        assert as_bytes.shape == as_floats.shape == (3, len(frames), 64, 64)
        assert (as_bytes - as_floats).abs().max() < 1e-3
        assert (as_bytes - frames_to_tensor(frames)).abs().mean() > 0.05
