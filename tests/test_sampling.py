import pickle

import pytest
import torch

from engine.sampling import (
    CAUSVID,
    PRESETS,
    SELF_FORCING,
    STREAMDIFFUSION_V2,
    FlowMatchSchedule,
    NoiseSource,
    SamplerPreset,
    noise_scale_to_timestep,
    renoise,
    v2v_input,
    x0_from_velocity,
)


def test_grid_follows_the_shift_formula() -> None:
    sched = FlowMatchSchedule(shift=5.0)
    assert sched.sigmas.shape == (1000,)
    i = torch.arange(1000, dtype=torch.float64)
    u = 1 - i / 1000
    expected = 5 * u / (1 + 4 * u)
    torch.testing.assert_close(sched.sigmas, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(sched.timesteps, 1000 * expected, atol=1e-3, rtol=0)
    assert sched.timesteps[0] == 1000.0
    assert sched.sigmas[-1] > 0  # the grid stops one step short of 0, like the reference's extra_one_step


def test_sigma_lookup_takes_nearest_grid_point() -> None:
    sched = FlowMatchSchedule(shift=8.0)
    # Grid point i=250: u = 0.75, sigma = 6 / 6.25 = 0.96, t = 960.
    assert float(sched.sigma(960.0)) == pytest.approx(0.96, abs=1e-6)
    assert float(sched.sigma(960.1)) == pytest.approx(0.96, abs=1e-6)
    ts = torch.tensor([[1000.0, 500.0], [0.0, 700.0]])
    sig = sched.sigma(ts)
    assert sig.shape == ts.shape and sig.dtype == torch.float64
    nearest = (sched.timesteps.reshape(-1, 1) - ts.reshape(1, -1).double()).abs().argmin(0)
    assert torch.equal(sig.flatten(), sched.sigmas[nearest])
    assert abs(float(sched.sigma(500.0)) - 0.5) < 2e-3  # nearest grid point, not interpolated
    with pytest.raises(ValueError, match="timesteps must lie"):
        sched.sigma(1000.5)


def test_self_forcing_warp_matches_published_values() -> None:
    assert SELF_FORCING.timesteps() == pytest.approx((1000.0, 937.5, 833.3333, 625.0), abs=1e-3)
    assert FlowMatchSchedule(5.0).warp([0]) == (0.0,)
    with pytest.raises(ValueError, match="integer steps"):
        FlowMatchSchedule(5.0).warp([937.5])


def test_presets() -> None:
    assert CAUSVID.shift == 8.0 and CAUSVID.timesteps() == (1000.0, 757.0, 522.0)
    assert STREAMDIFFUSION_V2.shift == 8.0
    assert STREAMDIFFUSION_V2.timesteps() == (700.0, 500.0)  # default 2 steps
    assert STREAMDIFFUSION_V2.timesteps(4) == (700.0, 500.0, 400.0, 200.0)
    assert STREAMDIFFUSION_V2.first(1).steps == (700.0,)
    assert SELF_FORCING.first(2).timesteps() == pytest.approx((1000.0, 937.5))
    assert set(PRESETS) == {"self_forcing", "causvid", "streamdiffusion_v2"}
    with pytest.raises(ValueError, match="asked for 5"):
        CAUSVID.first(5)
    with pytest.raises(ValueError, match="decreasing"):
        SamplerPreset("bad", 5.0, (500.0, 700.0), warp=False)


def test_renoise_then_x0_round_trips() -> None:
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 16, 3, 4, 5, generator=g)
    eps = torch.randn(x0.shape, generator=g)
    sched = SELF_FORCING.schedule
    for t in SELF_FORCING.timesteps():
        sigma = sched.sigma(t)
        x_t = renoise(x0, eps, sigma)
        v = eps - x0  # the exact flow target
        torch.testing.assert_close(x0_from_velocity(x_t, v, sigma), x0, atol=1e-6, rtol=0)
    # per-sample sigma broadcasts
    sig = torch.tensor([0.3, 0.9], dtype=torch.float64).reshape(2, 1, 1, 1, 1)
    x_t = renoise(x0, eps, sig)
    torch.testing.assert_close(x_t[1], 0.1 * x0[1] + 0.9 * eps[1])
    torch.testing.assert_close(x0_from_velocity(x_t, eps - x0, sig), x0, atol=1e-6, rtol=0)


def test_x0_is_float64_internally_and_keeps_dtype() -> None:
    x_t = torch.full((4,), 1.0, dtype=torch.bfloat16)
    v = torch.full((4,), 3.0, dtype=torch.bfloat16)
    out = x0_from_velocity(x_t, v, 1 / 3)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.zeros(4, dtype=torch.bfloat16))  # 1 - (1/3)*3 in float64 is exactly 0
    with pytest.raises(ValueError, match="same shape"):
        x0_from_velocity(x_t, v[:2], 0.5)


def test_v2v_input_and_noise_scale_timestep() -> None:
    z = torch.ones(3)
    eps = torch.zeros(3)
    torch.testing.assert_close(v2v_input(z, eps, 0.8), torch.full((3,), 0.2))
    assert noise_scale_to_timestep(0.8) == 700
    assert noise_scale_to_timestep(0.7) == 600
    with pytest.raises(ValueError, match="noise_scale"):
        noise_scale_to_timestep(0.05)
    with pytest.raises(ValueError, match="noise_scale"):
        v2v_input(z, eps, 1.5)


def test_noise_source_reproducible_and_resumable() -> None:
    a, b = NoiseSource(1234), NoiseSource(1234)
    assert torch.equal(a.randn((2, 3)), b.randn((2, 3)))
    a.randn((5,))
    saved = pickle.loads(pickle.dumps(a.state_dict()))  # survives serialisation
    expected = [a.randn((4, 4)) for _ in range(3)]
    restored = NoiseSource.from_state_dict(saved)
    assert [torch.equal(x, restored.randn((4, 4))) for x in expected] == [True] * 3
    clone = pickle.loads(pickle.dumps(restored))  # the source itself pickles, mid-stream
    assert torch.equal(clone.randn((3,)), restored.randn((3,)))
    assert not torch.equal(NoiseSource(1235).randn((4, 4)), NoiseSource(1234).randn((4, 4)))
    assert NoiseSource(1).randn((2,), dtype=torch.float64).dtype == torch.float64
    with pytest.raises(ValueError, match="cannot restore onto cuda"):
        NoiseSource.from_state_dict(saved, device="cuda")
    with pytest.raises(ValueError, match="lacks"):
        NoiseSource.from_state_dict({"seed": 1})
