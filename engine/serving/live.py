"""How the serving policy runs live: the preset as a live server runs it, the profile points its engine
runs, and the bundled profile it plans with when none is given.

Shared by the live server (app/server/serving/executors.py) and the headless serving loop
(engine/streaming/headless.py), so that a figure measured without the media stack is what `diffcast
serve` does. Pure: the caller says what the device can do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from engine.fidelity import FidelityConfig, engine_capabilities
from engine.serving.policy import Ordering, PolicyConfig, resolve_preset
from engine.serving.profile import (
    BUNDLED_PROFILES,
    FidelityProfile,
    ProfilePoint,
    bundled_profile,
    load_profile,
)

log = logging.getLogger(__name__)

LIVE_CONTENT_S = 365 * 86400.0  # a live stream has no known end
LIVE_PROFILE = "tiny-random_cpu_128"  # measured on this repository's CPU box (docs/service.md, "Live policy")
# Share of each worker's time the policy plans live streams' chunks into (PolicyConfig.live_load): the
# rest absorbs a step that runs long and the media threads' bursts on a CPU.
LIVE_LOAD = 0.85


def bundled_live_profile(model: str | None, size: tuple[int, int]) -> FidelityProfile:
    """The bundled measured profile of ``model`` (None = the embedded default) at ``size``, else the
    tiny-random one (the policy then plans with the wrong latencies; the caller warns)."""
    name = model or "default"
    for path in sorted(BUNDLED_PROFILES.glob("*.json")):
        profile = load_profile(path)
        if profile.model == name and tuple(profile.resolution) == tuple(size) and profile.source.startswith("measured"):
            return profile
    return bundled_profile(LIVE_PROFILE)


def with_emulated_delay(profile: FidelityProfile, delay_s: float, step_delay_s: float) -> FidelityProfile:
    """The profile of an engine slowed by the server's test knobs (``--engine-delay-ms`` per chunk,
    ``--engine-step-delay-ms`` per denoising step): the policy must know what the engine costs."""
    if delay_s == 0.0 and step_delay_s == 0.0:
        return profile

    def slow(p: ProfilePoint) -> ProfilePoint:
        # The step delay is per forward (StepExecutor sleeps once per batch group): a step batch's
        # chunk takes one forward, a sequential chunk one per step.
        extra = delay_s + step_delay_s * p.config.sequential_steps
        return replace(p, latency_s=p.latency_s + extra, first_chunk_latency_s=p.first_chunk_latency_s + extra)

    return replace(profile, points=tuple(slow(p) for p in profile.points),
                   notes=(*profile.notes, f"emulated delay {delay_s:g} s + {step_delay_s:g} s/step added"))


def live_policy_config(name: str, max_batch: int, step_wise: bool, chunk_batches: bool = False,
                       workers: int = 1) -> PolicyConfig:
    """A preset as it runs live. Each worker (the in-process engine, a Ray worker actor, the ranks) is
    one device (or one lane of the in-process engine), so a preset's ``gpus_per_worker`` (a simulated
    worker's GPU count) does not apply; the preset re-homes streams between ``workers`` where there are
    several, by the workers' measured speeds (``RehomingConfig.balance_speed``). Presets that route
    fidelity plan each live stream's chunk into its share of its worker's time (``LIVE_LOAD``,
    `PolicyConfig.live_load`). ``--max-batch`` bounds the cross-user batch of presets that route
    fidelity (BMPR) and FIFO's stream batch. Engines that run whole chunks behind ``process`` (Ray)
    keep each stream's own fidelity, unbatched, with no step preemption: those need the step-wise
    executor. Engines that run batches of whole chunks at
    per-chunk fidelity (``chunk_batches``: the pipeline ranks) keep routing and batches, but a chunk
    runs to its end (no step preemption) and states stay where they are (no eviction)."""
    preset = resolve_preset(name)
    if preset.bmpr:
        batch = max_batch  # cross-user batches of streams routed to the same point
    elif preset.ordering is Ordering.FIFO:
        batch = min(preset.max_batch, max_batch)  # StreamDiffusionV2's stream batching
    else:
        batch = preset.max_batch
    # Live streams stay URGENT on every worker (they cannot get ahead of their camera), so re-homing
    # compares the workers' measured speeds instead of looking for workers without URGENT streams.
    live = replace(preset, gpus_per_worker=1, max_batch=batch, rehoming=preset.rehoming and workers > 1,
                   live_load=LIVE_LOAD if preset.bmpr else None,
                   rehome=replace(preset.rehome, balance_speed=True))
    if chunk_batches:
        live = replace(live, step_preemption=False)
    elif not step_wise:
        live = replace(live, bmpr=False, step_preemption=False, max_batch=1)
    return live


def runnable_profile(profile: FidelityProfile, device: str, step_wise: bool,
                     unsupported: Callable[[FidelityConfig], str | None] | None = None,
                     bf16_units: bool = True, fp8_units: bool = False) -> FidelityProfile:
    """Only the points this engine runs: capabilities of its device (``bf16_units``: whether it does bf16
    natively, `engine.devices.has_bf16_units`; ``fp8_units``: whether it runs the fp8 GEMM of precision
    fp8-linear, `engine.models.fp8.fp8_linear_supported`, default no); one device per worker; for
    engines that say what they run (``unsupported``: the pipeline ranks) only those points; and, for
    other engines behind ``process``, whatever fidelity the stream opened with (their single reference)."""
    if not bf16_units and any(p.config.precision == "bf16" for p in profile.per_stream()):
        log.info("profile: bf16 points dropped, this CPU has no bf16 units (AVX512-BF16 or AMX)")
    kept = profile.runnable(engine_capabilities(device.split(":")[0], bf16_units, fp8_units)).filtered(lambda c: c.gpus == 1)
    if unsupported is not None:
        kept = kept.filtered(lambda c: unsupported(replace(c, stream_batch=1)) is None)
    elif not step_wise:
        kept = kept.filtered(lambda c: c == kept.reference().config or c.stream_batch > 1)
    return kept
