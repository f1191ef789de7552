"""The serving loop for a server: the engine core with the executor its engine's declared kind needs.

The one module that knows every live executor (in process, Ray actors, pipeline ranks), so that the
executors themselves import no sibling (app/server/serving/executors.py, app/server/serving/cluster_executor.py).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor as ThreadExecutor
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from app.server.config import ServerConfig
from app.server.serving.cluster_executor import RayExecutor
from app.server.serving.engine_bridge import (
    ChunkBatchFactory,
    EngineKind,
    InProcessFactory,
    ProcessorFactory,
    RayFactory,
)
from app.server.serving.executors import (
    LEDGER_LOG_ROWS,
    UNLIMITED_SLOTS,
    RankExecutor,
    ServingLoop,
    StepExecutor,
    _LiveExecutor,
)
from engine.devices import has_bf16_units
from engine.serving.core import Clock, EngineCore
from engine.serving.device_memory import GIB, DeviceMemory
from engine.serving.ledger import StreamLedger
from engine.serving.live import (
    bundled_live_profile,
    live_policy_config,
    runnable_profile,
    with_emulated_delay,
)
from engine.serving.policy import SlackPolicy
from engine.serving.profile import FidelityProfile, load_profile
from engine.serving.scaler import Scaler
from engine.sim.runner import advisory_autoscale

log = logging.getLogger(__name__)


def stream_memory_budget(config: ServerConfig, factory: ProcessorFactory,
                         profile: FidelityProfile) -> DeviceMemory | None:
    """What one worker's device holds for stream states (engine/serving/device_memory.py): its free bytes
    after the model loaded (CUDA), or ``--device-memory-gib`` less the weights; None where unbounded."""
    free, weights = factory.device_memory()
    if config.device_memory_gib is not None:
        free = max(0, int(config.device_memory_gib * GIB) - weights)
    return None if free is None else DeviceMemory.for_profile(free, profile)


def fp8_units(device: str) -> bool:
    """Whether ``device`` runs fp8 linears (engine/models/fp8.py); asked only of CUDA devices."""
    if not device.startswith("cuda"):
        return False
    from engine.models.fp8 import fp8_linear_supported

    return fp8_linear_supported(device)


def build_serving_loop(config: ServerConfig, factory: ProcessorFactory, threads: ThreadExecutor,
                       clock: Clock = time.monotonic) -> ServingLoop:
    """The engine core with the executor that fits ``factory``'s engine (its `EngineKind`)."""
    kind = factory.kind
    step_wise = kind is not EngineKind.CHUNK_BATCHES
    batches: ChunkBatchFactory | None = None
    if not step_wise:
        if not isinstance(factory, ChunkBatchFactory):
            raise TypeError(f"{type(factory).__name__} declares chunk batches but has no run_chunks/unsupported")
        batches = factory
    profile = load_profile(config.profile) if config.profile else bundled_live_profile(config.model, factory.size)
    if tuple(profile.resolution) != tuple(factory.size):
        log.warning("fidelity profile %s was measured at %s but the engine runs at %s: latencies are off; "
                    "measure one with `diffcast profile --out FILE` and pass --profile FILE",
                    profile.model, profile.resolution, factory.size)
    profile = runnable_profile(profile, config.device, step_wise, batches.unsupported if batches else None,
                               has_bf16_units(config.device), fp8_units(config.device))
    # Content time on this server runs at the playout clock's rate, not the profile's video rate.
    profile = replace(with_emulated_delay(profile, config.engine_delay_ms / 1000.0, config.engine_step_delay_ms / 1000.0),
                      fps=config.max_fps)
    # Ray: its worker actors; in process: the engine's lanes (each a worker with streams of its own);
    # the ranks: one ring.
    ray = isinstance(factory, RayFactory)
    if (kind is EngineKind.RAY) != ray:
        raise TypeError(f"{type(factory).__name__} declares {kind.value}: Ray workers are a RayFactory's")
    workers = len(factory.controller.worker_ids) if isinstance(factory, RayFactory) else factory.parallel_chunks
    most = max(workers, config.max_workers if ray else 1)
    slots = (config.state_slots or UNLIMITED_SLOTS) if step_wise else UNLIMITED_SLOTS  # only states it can park
    max_batch = config.max_batch
    memory = stream_memory_budget(config, factory, profile)
    fit = None if memory is None else memory.slots
    if memory is not None and fit is not None:
        log.info("device memory: %s", memory.describe())
        if step_wise:  # states past the slots are parked in host memory; a batch's states are all resident
            slots = min(slots, fit if ray else fit // workers)
            max_batch = max(1, min(max_batch, slots))
    policy = SlackPolicy(profile, live_policy_config(config.policy, max_batch, step_wise, batches is not None,
                                                     workers=most))
    if config.compile and isinstance(factory, InProcessFactory):
        # Before the first stream: the warm-up is the server's cold start, and no shape the profile names
        # compiles in the serving loop.
        width, height = profile.resolution
        factory.compile([p.config for p in profile.points], (int(width), int(height)), range(1, max_batch + 1),
                        config.compile_sites, config.compile_cache, config.compile_backend)
    delays = (config.engine_delay_ms / 1000.0, config.engine_step_delay_ms / 1000.0)
    executor: _LiveExecutor
    scaler: Scaler | None = None
    if isinstance(factory, RayFactory):
        # One engine thread per worker actor (each waits on its actor's step), so the workers step at once.
        pool = ThreadPoolExecutor(max_workers=most, thread_name_prefix="ray-step")
        ray_executor = RayExecutor(factory.controller, pool, clock, slots, config.max_fps, *delays,
                                   worker_delays_s=[d / 1000.0 for d in config.worker_delay_ms])
        executor = ray_executor
        if config.max_workers:
            # K: streams one worker sustains in real time at the policy's fastest acceptable point.
            scale = replace(advisory_autoscale(profile), min_workers=config.min_workers, max_workers=config.max_workers)
            scaler = Scaler(scale, ray_executor, cooldown_s=config.scale_in_cooldown_s,
                            capacity=lambda p: advisory_autoscale(p).streams_per_worker)
    elif kind is EngineKind.IN_PROCESS:
        executor = StepExecutor(workers, threads, clock, slots, config.max_fps, *delays)
        if isinstance(factory, InProcessFactory):
            executor.lanes = factory.lanes
    else:
        assert batches is not None
        executor = RankExecutor(batches, threads, clock, config.max_fps, *delays)
    executor.device = config.device
    if fit is not None and not step_wise:  # an engine that cannot park holds every stream's state
        executor.views = [replace(v, max_streams=fit) for v in executor.views]
    ledger = StreamLedger(max_lookahead_s=None, max_log=LEDGER_LOG_ROWS)
    core = EngineCore(policy, executor, clock, ledger, calibrate=True, scaler=scaler)
    loop = ServingLoop(core, executor, config.max_fps)
    pc = policy.config
    log.info("serving policy %s on %s: %d fidelity points (%s), cross-user batches up to %d, step preemption %s, "
             "eviction %s, initial slack %.2f s, content rate %g fps", policy.name, type(executor).__name__,
             len(profile.points), "routed per chunk" if pc.bmpr else "fixed", pc.max_batch,
             "on" if pc.step_preemption else "off", "on" if slots < UNLIMITED_SLOTS else "off",
             policy.initial_slack_s, config.max_fps)
    return loop
