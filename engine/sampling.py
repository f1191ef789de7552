"""Flow-matching sampler math for Wan-family causal video models: schedule, presets, x̂₀ / re-noise.

No model lives here. The network predicts a velocity v = ε − x₀ at timestep t; with σ = σ(t) the
noisy sample is x_t = (1 − σ)·x₀ + σ·ε, so x̂₀ = x_t − σ·v. A few-step sampler alternates
"predict x̂₀ at t_k" and "re-noise x̂₀ to t_{k+1} with fresh noise".

The timestep grid mirrors the reference ``FlowMatchScheduler`` that CausVid, Self-Forcing and
StreamDiffusionV2 all use (DiffSynth-Studio's, built with ``sigma_min=0, extra_one_step=True`` and
``set_timesteps(1000)``): u_i = 1 − i/1000 for i = 0..999, σ_i = s·u_i / (1 + (s − 1)·u_i),
t_i = 1000·σ_i, computed in float32 exactly as the reference does so that σ values match the
checkpoints' training bit for bit. σ for an arbitrary timestep is the σ of the nearest grid point.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


class FlowMatchSchedule:
    """The shifted flow-matching grid of one model family (shift s, 1000 training timesteps)."""

    def __init__(self, shift: float, num_train_timesteps: int = 1000) -> None:
        if not shift > 0:
            raise ValueError(f"shift must be > 0, got {shift}")
        if num_train_timesteps < 2:
            raise ValueError(f"num_train_timesteps must be >= 2, got {num_train_timesteps}")
        self.shift = float(shift)
        self.num_train_timesteps = int(num_train_timesteps)
        n = self.num_train_timesteps
        # float32 on purpose: this is the reference's arithmetic (torch.linspace default dtype).
        u = torch.linspace(1.0, 0.0, n + 1, dtype=torch.float32)[:-1]
        sigmas32 = self.shift * u / (1 + (self.shift - 1) * u)
        self.sigmas: torch.Tensor = sigmas32.double()  # [n], σ_0 = 1 down to σ_{n-1} > 0
        self.timesteps: torch.Tensor = (sigmas32 * n).double()  # [n], t_0 = 1000
        self._grids: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def sigma(self, timestep: float | torch.Tensor) -> torch.Tensor:
        """σ (float64, same shape and device as ``timestep``) of the grid point nearest to each timestep.

        Range checks run for numbers and CPU tensors only: on a GPU they would force a device sync
        inside the sampling loop.
        """
        t = torch.as_tensor(timestep, dtype=torch.float64)
        on_host = t.device.type == "cpu"
        if on_host and t.numel() and (bool((t < 0).any()) or bool((t > self.num_train_timesteps).any())):
            raise ValueError(
                f"timesteps must lie in [0, {self.num_train_timesteps}], got {t.flatten().tolist()[:8]}"
            )
        if t.device not in self._grids:  # copy once per device: a host->GPU copy per step would sync
            self._grids[t.device] = (self.timesteps.to(t.device), self.sigmas.to(t.device))
        grid, sigmas = self._grids[t.device]
        index = (grid.reshape(-1, 1) - t.reshape(1, -1)).abs().argmin(dim=0)
        return sigmas[index].reshape(t.shape)

    def warp(self, steps: Sequence[float]) -> tuple[float, ...]:
        """Map nominal steps (integers in [0, N]) onto the shifted grid: t ↦ t_{N−t}, t_N := 0.

        Self-Forcing's ``warp_denoising_step``: [1000, 750, 500, 250] ↦ [1000, 937.5, 833.3, 625] at shift 5.
        """
        n = self.num_train_timesteps
        extended = torch.cat([self.timesteps, torch.zeros(1, dtype=torch.float64)])
        out = []
        for step in steps:
            if step != int(step) or not 0 <= step <= n:
                raise ValueError(f"warp needs integer steps in [0, {n}], got {step}")
            out.append(float(extended[n - int(step)]))
        return tuple(out)


@dataclass(frozen=True)
class SamplerPreset:
    """A published few-step schedule. ``steps`` are nominal timesteps; ``warp`` maps them onto the grid."""

    name: str
    shift: float
    steps: tuple[float, ...]
    warp: bool
    default_num_steps: int | None = None  # None: all of ``steps``

    def __post_init__(self) -> None:
        if not self.steps:
            raise ValueError(f"preset {self.name!r} has no steps")
        if list(self.steps) != sorted(self.steps, reverse=True):
            raise ValueError(f"preset {self.name!r}: steps must be decreasing, got {self.steps}")
        if self.default_num_steps is not None and not 1 <= self.default_num_steps <= len(self.steps):
            raise ValueError(
                f"preset {self.name!r}: default_num_steps={self.default_num_steps} not in [1, {len(self.steps)}]"
            )

    @property
    def schedule(self) -> FlowMatchSchedule:
        return FlowMatchSchedule(self.shift)

    def first(self, num_steps: int) -> SamplerPreset:
        """The same preset cut to its first ``num_steps`` steps (the fidelity knob: fewer steps, faster)."""
        if not 1 <= num_steps <= len(self.steps):
            raise ValueError(f"preset {self.name!r} has {len(self.steps)} steps; asked for {num_steps}")
        return SamplerPreset(f"{self.name}[:{num_steps}]", self.shift, self.steps[:num_steps], self.warp)

    def timesteps(self, num_steps: int | None = None) -> tuple[float, ...]:
        """The timesteps to feed the model, in order: first ``num_steps`` (default: preset default), warped if set."""
        n = num_steps if num_steps is not None else (self.default_num_steps or len(self.steps))
        steps = self.first(n).steps
        return self.schedule.warp(steps) if self.warp else tuple(float(s) for s in steps)


# Self-Forcing (configs/self_forcing_dmd.yaml): shift 5, warp_denoising_step true.
SELF_FORCING = SamplerPreset("self_forcing", 5.0, (1000.0, 750.0, 500.0, 250.0), warp=True)
# CausVid (tianweiy/CausVid configs/wan_causal_dmd.yaml): denoising_step_list [1000, 757, 522, 0],
# timestep_shift 8; its InferencePipeline drops the trailing 0 and does not warp.
CAUSVID = SamplerPreset("causvid", 8.0, (1000.0, 757.0, 522.0), warp=False)
# StreamDiffusionV2 demo: [700, 500, 400, 200, 0], ``--step n`` takes the first n, default 2, no warp.
# (Its streamv2v/inference*.py scripts map step 3 -> [700, 600, 400] and 4 -> [700, 600, 500, 400]
# instead; 1 and 2 steps agree.) The V2V first step is replaced per chunk by the noise controller.
STREAMDIFFUSION_V2 = SamplerPreset(
    "streamdiffusion_v2", 8.0, (700.0, 500.0, 400.0, 200.0), warp=False, default_num_steps=2
)
PRESETS: dict[str, SamplerPreset] = {p.name: p for p in (SELF_FORCING, CAUSVID, STREAMDIFFUSION_V2)}


def _as_sigma(sigma: float | torch.Tensor, like: torch.Tensor) -> float | torch.Tensor:
    # Python numbers stay numbers: building a device tensor from one costs a host->device copy.
    if isinstance(sigma, torch.Tensor):
        return sigma.to(device=like.device, dtype=torch.float64)
    return float(sigma)


def x0_from_velocity(x_t: torch.Tensor, v: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
    """x̂₀ = x_t − σ·v, computed in float64 (as the reference does), returned in ``x_t``'s dtype.

    ``sigma`` is a float or a tensor broadcastable against ``x_t`` (per sample or per frame).
    """
    if x_t.shape != v.shape:
        raise ValueError(f"x_t {tuple(x_t.shape)} and v {tuple(v.shape)} must have the same shape")
    x0 = x_t.double() - _as_sigma(sigma, x_t) * v.double()
    return x0.to(x_t.dtype)


def renoise(x0: torch.Tensor, noise: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
    """x = (1 − σ′)·x̂₀ + σ′·ε with fresh noise ε, in float64, returned in ``x0``'s dtype."""
    if x0.shape != noise.shape:
        raise ValueError(f"x0 {tuple(x0.shape)} and noise {tuple(noise.shape)} must have the same shape")
    s = _as_sigma(sigma, x0)
    return ((1 - s) * x0.double() + s * noise.double()).to(x0.dtype)


def v2v_input(z: torch.Tensor, noise: torch.Tensor, noise_scale: float) -> torch.Tensor:
    """StreamDiffusionV2's V2V model input s·ε + (1 − s)·z for encoded (normalised) latents z."""
    if not 0.0 <= noise_scale <= 1.0:
        raise ValueError(f"noise_scale must be in [0, 1], got {noise_scale}")
    return renoise(z, noise, noise_scale)


def noise_scale_to_timestep(noise_scale: float) -> int:
    """First V2V timestep for a noise scale: int(1000·s) − 100 (StreamDiffusionV2's truncation)."""
    if not math.isfinite(noise_scale) or not 0.1 <= noise_scale <= 1.1:
        raise ValueError(f"noise_scale must be in [0.1, 1.1] so the timestep lies in [0, 1000], got {noise_scale}")
    return int(1000 * noise_scale) - 100


class NoiseSource:
    """Seeded Gaussian noise for one stream; its state can be saved and restored bit-identically.

    The generator lives on CPU by default so that a stream's noise is identical on every worker
    (CPU tests, any GPU) and survives migration; samples are then moved to the requested device.
    A CUDA generator is faster for big tensors but its state only restores onto a CUDA generator.
    """

    def __init__(self, seed: int, device: str | torch.device = "cpu") -> None:
        self.seed = int(seed)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(self.seed)

    def randn(
        self,
        shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
    ) -> torch.Tensor:
        out = torch.randn(tuple(shape), generator=self.generator, dtype=dtype, device=self.generator.device)
        return out if device is None else out.to(device)

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "device_type": self.generator.device.type,
            "rng_state": self.generator.get_state(),
        }

    # torch.Generator does not pickle; its state does (so copy.deepcopy, torch.save and parcels work too).
    # Pickled as bytes, not a tensor: a generator's state is host data (torch restores it only from a CPU
    # ByteTensor, for a CUDA generator too), so no device mapping of the tensors around it may move it.
    def __getstate__(self) -> dict[str, Any]:
        state = self.state_dict()
        state["rng_state"] = state["rng_state"].numpy().tobytes()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        restored = NoiseSource.from_state_dict(state)
        self.seed, self.generator = restored.seed, restored.generator

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], device: str | torch.device | None = None) -> NoiseSource:
        missing = {"seed", "device_type", "rng_state"} - state.keys()
        if missing:
            raise ValueError(f"noise state lacks {sorted(missing)}")
        target = torch.device(device if device is not None else state["device_type"])
        if target.type != state["device_type"]:
            raise ValueError(
                f"noise state was saved from a {state['device_type']} generator; it cannot restore onto {target.type}"
            )
        source = cls(state["seed"], target)
        rng_state = state["rng_state"]
        if isinstance(rng_state, bytes | bytearray):
            rng_state = torch.frombuffer(bytearray(rng_state), dtype=torch.uint8)
        source.generator.set_state(rng_state.to("cpu", torch.uint8))
        return source
