"""The temporal stabilizer against independent references: the clean signal it should recover, the
closed-form noise reduction of a recursive average, and the raw output it must pass through on cuts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.streaming.stabilizer import LookStabilizers, StabilizerConfig, StabilizerState, TemporalStabilizer

SIZE = 64


def texture(seed: int, size: int = SIZE) -> np.ndarray:
    """A smooth random texture (blurred noise, values 40–215) that optical flow can lock onto."""
    import cv2

    rng = np.random.default_rng(seed)
    img = cv2.GaussianBlur(rng.uniform(0, 255, (size, size, 3)).astype(np.float32), (0, 0), 2.0)
    img = (img - img.min()) / (img.max() - img.min())
    return (40 + 175 * img).astype(np.float32)


def style(frames: np.ndarray) -> np.ndarray:
    """A per-pixel 'style' (colour inversion): what a flicker-free model would output."""
    return 255.0 - frames


def as_chunk(frames: np.ndarray) -> torch.Tensor:
    """[T, H, W, 3] in 0–255 -> [3, T, H, W] in [-1, 1]."""
    return torch.from_numpy(np.ascontiguousarray(frames)).float().div(127.5).sub(1.0).permute(3, 0, 1, 2)


def as_frames(chunk: torch.Tensor) -> np.ndarray:
    return ((chunk.permute(1, 2, 3, 0) + 1) * 127.5).numpy()


def run(config: StabilizerConfig, inputs: np.ndarray, outputs: np.ndarray, chunk: int = 4) -> np.ndarray:
    """Feed a clip through in chunks like the runtime does; returns the stabilised frames (0–255)."""
    stab, state = TemporalStabilizer(config), StabilizerState()
    out = [as_frames(stab(state, as_chunk(inputs[a : a + chunk]), as_chunk(outputs[a : a + chunk])))
           for a in range(0, len(inputs), chunk)]
    return np.concatenate(out)


def test_static_scene_flicker_falls_as_a_recursive_average_predicts() -> None:
    frames = np.repeat(texture(0)[None], 48, axis=0)
    rng = np.random.default_rng(1)
    sigma = 6.0
    raw = style(frames) + rng.normal(0, sigma, frames.shape)
    strength = 0.8
    # Gates wide open: with flow 0 and no change, y_t = α·y_{t−1} + (1 − α)·out_t exactly.
    y = run(StabilizerConfig(strength=strength, motion_tolerance=10.0, change_tolerance=10.0), frames, raw)
    steady = y[16:] - style(frames[16:])
    expected = sigma * np.sqrt((1 - strength) / (1 + strength))  # stationary std of an AR(1) average
    assert steady.std() == pytest.approx(expected, rel=0.1)
    assert np.abs(np.diff(y[16:], axis=0)).mean() < 0.5 * np.abs(np.diff(raw[16:], axis=0)).mean()


def test_moving_camera_output_moves_with_the_scene_and_loses_its_noise() -> None:
    big = texture(2, size=SIZE + 64)
    # A pan of 2 px per frame: every frame is a window of one larger image.
    frames = np.stack([big[8 : 8 + SIZE, 2 * t : 2 * t + SIZE] for t in range(24)])
    rng = np.random.default_rng(3)
    clean = style(frames)
    raw = clean + rng.normal(0, 6.0, frames.shape)
    y = run(StabilizerConfig(), frames, raw)
    inner = (slice(8, None), slice(8, SIZE - 8), slice(8, SIZE - 8))  # frames past warm-up, away from borders
    err_raw = np.abs(raw - clean)[inner].mean()
    err_stab = np.abs(y - clean)[inner].mean()
    assert err_stab < 0.6 * err_raw, f"stabilised error {err_stab:.2f} vs raw {err_raw:.2f}"


def test_scene_cut_passes_the_model_frame_through() -> None:
    a, b = texture(4), texture(5)
    frames = np.stack([a] * 8 + [b] * 8)
    raw = style(frames)
    y = run(StabilizerConfig(), frames, raw)
    # Frame 8 is the cut: the history shows a different scene and must not leak into it.
    assert np.abs(y[8] - raw[8]).mean() < 0.02 * np.abs(raw[8] - raw[7]).mean()


def test_a_new_look_on_a_static_scene_is_held_back_only_by_the_change_gate() -> None:
    frames = np.repeat(texture(6)[None], 12, axis=0)
    before = style(frames[:8])
    after = (before[:4] + 128.0) % 256.0  # every channel of every pixel moves by exactly 128 (0.5 in 0–1 units)
    raw = np.concatenate([before, after])
    config = StabilizerConfig()
    y = run(config, frames, raw)
    # Static input: no motion residual, so the history weight is the change gate alone, the same everywhere.
    expected = config.strength * np.exp(-((0.5 / config.change_tolerance) ** 2))
    leak = np.abs(y[8] - raw[8]).mean() / np.abs(raw[8] - raw[7]).mean()
    assert leak == pytest.approx(expected, rel=0.05)
    assert expected < 0.06, "a look change this large shows at once"


def test_first_frame_and_size_change_start_a_fresh_history() -> None:
    stab, state = TemporalStabilizer(StabilizerConfig()), StabilizerState()
    small = np.repeat(texture(7, 32)[None], 4, axis=0)
    out = stab(state, as_chunk(small), as_chunk(style(small)))
    torch.testing.assert_close(out[:, 0], as_chunk(style(small))[:, 0], rtol=0, atol=1e-5)
    big = np.repeat(texture(8)[None], 4, axis=0)
    out = stab(state, as_chunk(big), as_chunk(style(big)))
    assert out.shape == (3, 4, SIZE, SIZE)
    torch.testing.assert_close(out[:, 0], as_chunk(style(big))[:, 0], rtol=0, atol=1e-5)


def test_large_frames_use_downscaled_flow_and_still_track_motion() -> None:
    big = texture(9, size=480)
    frames = np.stack([big[8:408, 4 * t : 4 * t + 400] for t in range(12)])
    rng = np.random.default_rng(10)
    raw = style(frames) + rng.normal(0, 6.0, frames.shape)
    y = run(StabilizerConfig(flow_max_side=160), frames, raw)
    inner = (slice(6, None), slice(16, -16), slice(16, -16))
    assert np.abs(y - style(frames))[inner].mean() < 0.7 * np.abs(raw - style(frames))[inner].mean()


def test_a_cameras_bytes_steady_the_output_as_their_floats_do() -> None:
    """The runtime keeps a chunk's camera bytes (uint8 [3, T, H, W], a view of [T, H, W, 3]); the
    stabilizer follows their motion exactly as it follows the same frames in floats."""
    big = texture(11, size=SIZE + 64)
    frames = np.round(np.stack([big[8 : 8 + SIZE, 2 * t : 2 * t + SIZE] for t in range(13)])).astype(np.uint8)
    raw = style(frames.astype(np.float32)) + np.random.default_rng(12).normal(0, 6.0, frames.shape)
    raw = np.clip(raw, 0, 255)
    config = StabilizerConfig()
    stab, by_floats, by_bytes = TemporalStabilizer(config), StabilizerState(), StabilizerState()
    for a, b in ((0, 1), (1, 5), (5, 9), (9, 13)):
        floats = stab(by_floats, as_chunk(frames[a:b].astype(np.float32)), as_chunk(raw[a:b]))
        camera = torch.from_numpy(frames[a:b]).permute(3, 0, 1, 2)
        steadied = stab(by_bytes, camera, as_chunk(raw[a:b]))
        torch.testing.assert_close(steadied, floats, rtol=0, atol=0)
    assert by_bytes.prev_in is not None and by_bytes.prev_in.dtype == torch.uint8
    np.testing.assert_array_equal(by_bytes.prev_in.numpy(), frames[-1])  # the history is the last frame
    # and it did steady: the last chunk is not the raw output
    assert np.abs(as_frames(steadied) - raw[9:13]).mean() > 0.5


def test_bad_shapes_and_config_are_refused() -> None:
    stab = TemporalStabilizer(StabilizerConfig())
    with pytest.raises(ValueError, match="one shape"):
        stab(StabilizerState(), torch.zeros(3, 4, 32, 32), torch.zeros(3, 4, 32, 48))
    with pytest.raises(ValueError, match="strength"):
        StabilizerConfig(strength=1.0)
    with pytest.raises(ValueError, match="tolerances"):
        StabilizerConfig(motion_tolerance=0.0)


def _unit(v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(v.double(), dim=-1)


def test_a_stream_between_two_looks_gets_their_settings_blended_by_its_place_on_the_arc() -> None:
    rng = torch.Generator().manual_seed(0)
    protos = _unit(torch.randn(3, 16, generator=rng))
    strong = StabilizerConfig(strength=0.9, motion_tolerance=0.1, change_tolerance=0.3)
    light = StabilizerConfig(strength=0.3, motion_tolerance=0.15, change_tolerance=0.1)
    looks = LookStabilizers(tuple(map(tuple, protos.tolist())), (strong, light, StabilizerConfig()))
    # On a look's prototype (as a [1, 1, dim] conditioning, the runtime's shape): that look's setting.
    assert looks.for_conditioning(protos[1].float()[None, None]) == light
    # On the slerp from look 0 to look 1 at t (what look anchoring serves): the settings' lerp at t,
    # computed here from the slerp's own formula.
    omega = float(torch.arccos(protos[0] @ protos[1]))
    for t in (0.25, 0.6):
        e = (np.sin((1 - t) * omega) * protos[0] + np.sin(t * omega) * protos[1]) / np.sin(omega)
        got = looks.for_conditioning(e.float())
        assert got.strength == pytest.approx(0.9 + t * (0.3 - 0.9), abs=1e-4)
        assert got.motion_tolerance == pytest.approx(0.1 + t * 0.05, abs=1e-4)
        assert got.change_tolerance == pytest.approx(0.3 - t * 0.2, abs=1e-4)
    # Near one end of an arc a third look can be nearer than the far end: the arc's pair still decides.
    a, b = torch.eye(16, dtype=torch.float64)[:2]
    c = np.cos(np.radians(40)) * a + np.sin(np.radians(40)) * torch.eye(16, dtype=torch.float64)[2]
    third = LookStabilizers(tuple(map(tuple, torch.stack([a, b, c]).tolist())),
                            (strong, light, StabilizerConfig(strength=0.0)))
    e = np.cos(np.radians(18)) * a + np.sin(np.radians(18)) * b  # the slerp from a to b at t = 0.2
    assert float(e @ c) > float(e @ b)
    assert third.for_conditioning(e.float()).strength == pytest.approx(0.9 + 0.2 * (0.3 - 0.9), abs=1e-4)
    with pytest.raises(ValueError, match="16-d embeddings"):
        looks.for_conditioning(torch.zeros(8))
    with pytest.raises(ValueError, match="one setting each"):
        LookStabilizers(tuple(map(tuple, protos.tolist())), (strong, light))


def test_a_call_with_a_setting_runs_that_setting_not_the_operators() -> None:
    frames = np.repeat(texture(3)[None], 8, axis=0)
    raw = style(frames) + np.random.default_rng(4).normal(0, 6.0, frames.shape)
    weak, strong = StabilizerConfig(strength=0.2), StabilizerConfig(strength=0.9)
    stab, state = TemporalStabilizer(weak), StabilizerState()
    passed = np.concatenate([as_frames(stab(state, as_chunk(frames[a:a + 4]), as_chunk(raw[a:a + 4]), strong))
                             for a in (0, 4)])
    np.testing.assert_allclose(passed, run(strong, frames, raw), atol=1e-3)
    assert np.abs(passed - run(weak, frames, raw)).mean() > 0.5


def test_a_model_config_names_per_look_settings_and_a_wrong_one_is_refused_in_plain_words() -> None:
    from engine.pipeline import stream_recipe

    looks = {"cartoon": [1.0, 0.0], "noir": [0.0, 1.0]}
    base = {"strength": 0.7, "motion_tolerance": 0.15}
    _, runtime = stream_recipe({"prototypes": looks, "runtime": {
        "stabilizer": base, "stabilizer_looks": {"noir": {"strength": 0.9}}}}, "m")
    assert runtime.stabilizer_looks is not None
    assert runtime.stabilizer_looks.looks == ((1.0, 0.0), (0.0, 1.0))
    assert runtime.stabilizer_looks.settings == (StabilizerConfig(**base),
                                                 StabilizerConfig(strength=0.9, motion_tolerance=0.15))
    assert stream_recipe({"prototypes": looks, "runtime": {"stabilizer": base}}, "m")[1].stabilizer_looks is None
    for runtime_json, message in [
        ({"stabilizer": base, "stabilizer_looks": {"neon": {"strength": 0.9}}}, "does not have: neon"),
        ({"stabilizer_looks": {"noir": {"strength": 0.9}}}, "needs runtime.stabilizer"),
        ({"stabilizer": base, "stabilizer_looks": {"noir": {"strenght": 0.9}}}, "strenght"),
        ({"stabilizer": base, "stabilizer_looks": {"noir": {"strength": 1.5}}}, r"strength must be in \[0, 1\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            stream_recipe({"prototypes": looks, "runtime": runtime_json}, "m")
    with pytest.raises(ValueError, match="a model with looks"):
        stream_recipe({"runtime": {"stabilizer": base, "stabilizer_looks": {"noir": {}}}}, "m")
