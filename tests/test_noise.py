import pytest
import torch

from engine.streaming.noise import (
    MotionAwareNoiseController,
    NoiseControllerConfig,
    NoiseControllerState,
    measure_motion,
)


def _chunk(step: float, frames: int = 4, size: int = 16) -> torch.Tensor:
    """Frames whose consecutive difference is exactly ``step`` everywhere (RMS = step)."""
    base = torch.zeros(3, frames, size, size)
    for i in range(frames):
        base[:, i] = -0.5 + step * i
    return base


def test_motion_is_rms_over_scale_and_clipped() -> None:
    assert measure_motion(_chunk(0.0), None, 0.2) == 0.0
    assert measure_motion(_chunk(0.05), None, 0.2) == pytest.approx(0.25)
    assert measure_motion(_chunk(0.3), None, 0.2) == 1.0


def test_motion_counts_the_cut_between_chunks() -> None:
    static = _chunk(0.0)
    previous = torch.full((3, 16, 16), 0.5)  # differs by 1.0 from the chunk's -0.5 frames
    assert measure_motion(static, previous, 0.2) == 1.0


def test_more_motion_gives_less_noise_and_bounds_hold() -> None:
    cfg = NoiseControllerConfig(noise_scale=0.8)
    rates = []
    for step in (0.0, 0.02, 0.05, 0.1, 0.3):
        ctrl = MotionAwareNoiseController(cfg)
        state = NoiseControllerState()
        rate = ctrl.step(_chunk(step), state)
        assert cfg.s_min - 1e-9 <= rate <= cfg.s_max + 1e-9
        rates.append(rate)
    assert rates == sorted(rates, reverse=True)
    assert rates[0] == pytest.approx(0.8)
    assert rates[-1] == pytest.approx(0.7)


def test_ema_smooths_a_jump() -> None:
    cfg = NoiseControllerConfig(noise_scale=0.8, ema=0.9)
    ctrl = MotionAwareNoiseController(cfg)
    state = NoiseControllerState()
    assert ctrl.step(_chunk(0.0), state) == pytest.approx(0.8)
    # A chunk at full motion: target 0.7, smoothed 0.9 * 0.7 + 0.1 * 0.8.
    fast = _chunk(0.3) + 0.0
    state.last_frame = None  # measure the chunk alone
    assert ctrl.step(fast, state) == pytest.approx(0.9 * 0.7 + 0.1 * 0.8)


def test_first_timestep_reference_mapping() -> None:
    ctrl = MotionAwareNoiseController(NoiseControllerConfig(noise_scale=0.8))
    assert ctrl.first_timestep(0.8) == pytest.approx(700.0)


def test_disabled_controller_keeps_the_user_noise() -> None:
    ctrl = MotionAwareNoiseController(NoiseControllerConfig(noise_scale=0.6, enabled=False))
    assert ctrl.step(_chunk(0.3), NoiseControllerState()) == 0.6


@pytest.mark.parametrize("kwargs", [{"noise_scale": 0.0}, {"noise_scale": 1.5}, {"motion_range": 0.9}, {"ema": 0.0}])
def test_invalid_configs_are_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        NoiseControllerConfig(**kwargs)


def test_noise_too_low_for_a_positive_timestep_is_refused() -> None:
    with pytest.raises(ValueError, match="first timestep could reach -50"):
        NoiseControllerConfig(noise_scale=0.15)
    assert MotionAwareNoiseController(NoiseControllerConfig(noise_scale=0.15, motion_range=0.04)).first_timestep(0.11) > 0
