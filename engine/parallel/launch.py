"""Spawning the pipeline ranks: one process per rank, torch.distributed on this machine.

``run_ring(factory, program, world)`` starts ``world`` processes (torch.multiprocessing, spawn),
joins them into a process group (NCCL on GPUs, gloo on CPU; rendezvous through a file, gloo's
connections on the loopback interface with ports the OS picks), builds the model in each from
``factory`` (a picklable callable: device -> StreamRuntime), runs ``program`` on rank 0 with the
:class:`RingRuntime` while ranks 1..N-1 serve their stages, and returns what ``program``
returned. Every rank builds the same model from the same factory, so weights agree without a
broadcast (random test models seed themselves).
"""

from __future__ import annotations

import datetime
import io
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.parallel.comm import Channel
from engine.parallel.partition import even_ranges
from engine.parallel.ring import RingOptions, RingRuntime
from engine.parallel.stage import StageWorker
from engine.streaming.runtime import StreamRuntime

if TYPE_CHECKING:
    from engine.pipeline import Pipeline

log = logging.getLogger(__name__)

RuntimeFactory = Callable[[torch.device], StreamRuntime]
Program = Callable[[RingRuntime], Any]


_LOADED: dict[tuple[str | None, str], Pipeline] = {}


@dataclass(frozen=True)
class LoadedModel:
    """Factory for :func:`run_ring`: ``Pipeline.load(model)``'s runtime on the rank's device.

    The loaded :class:`Pipeline` stays reachable in the rank's process through
    :func:`loaded_pipeline` (the service needs its default size and chunk lengths).
    """

    model: str | None = None
    loras: tuple[tuple[str, str, float], ...] = ()  # (name, path, default strength): every rank loads them
    dtype: str = "auto"  # weight dtype (engine.devices.resolve_dtype: auto = bf16 on CUDA)
    vae: str | None = None  # a Wan model's stream VAE (engine/vae_choice.py); None: the model's own

    def __call__(self, device: torch.device) -> StreamRuntime:
        from engine.devices import resolve_dtype
        from engine.pipeline import Pipeline

        pipeline = _LOADED[(self.model, str(device))] = Pipeline.load(self.model, device=str(device),
                                                                      dtype=resolve_dtype(self.dtype, device),
                                                                      vae=self.vae)
        for name, path, strength in self.loras:
            pipeline.load_lora(name, path, strength)
        return pipeline.runtime


def loaded_pipeline(model: str | None, device: torch.device) -> Pipeline:
    """The Pipeline that :class:`LoadedModel` loaded in this process."""
    try:
        return _LOADED[(model, str(device))]
    except KeyError:
        raise RuntimeError(f"model {model!r} was not loaded on {device} in this process") from None


def rank_device(device: str, rank: int) -> torch.device:
    """CPU ranks share the CPU; GPU rank r uses ``cuda:r``."""
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda":
        raise ValueError(f"pipeline ranks run on 'cpu' or 'cuda', got {device!r}")
    return torch.device("cuda", rank)


def check_world(world: int, device: str) -> None:
    if world < 1:
        raise ValueError(f"need at least one rank, got {world}")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but torch sees no CUDA device")
        if torch.cuda.device_count() < world:
            raise ValueError(f"{world} GPU ranks asked for but only {torch.cuda.device_count()} GPUs are visible")


def run_ring(factory: RuntimeFactory, program: Program, world: int, device: str = "cpu",
             options: RingOptions | None = None, threads: int = 1, timeout_s: float = 300.0) -> Any:
    """Run ``program(ring)`` on rank 0 of a fresh ``world``-rank ring; returns its result."""
    check_world(world, device)
    options = options or RingOptions()
    with tempfile.TemporaryDirectory(prefix="diffcast-pipeline-") as tmp:
        result_path = Path(tmp) / "result.pt"
        ranks = mp.start_processes(
            _rank_main,
            args=(world, str(Path(tmp) / "store"), factory, program, device, options, threads, timeout_s,
                  str(result_path)),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        try:
            while not ranks.join():
                pass
        except BaseException:
            _stop_ranks(ranks.processes)
            raise
        return torch.load(io.BytesIO(result_path.read_bytes()), weights_only=False)


def _stop_ranks(processes: list[Any], grace_s: float = 10.0) -> None:
    """Interrupted (Ctrl-C, SIGTERM, a failed rank): let rank 0 stop its program (SIGTERM; uvicorn shuts
    down gracefully on it), then terminate whatever rank is still alive. Never leaves orphans."""
    if processes and processes[0].is_alive():
        processes[0].terminate()
        processes[0].join(grace_s)
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(grace_s)
        if p.is_alive():
            p.kill()


def _rank_main(rank: int, world: int, store_path: str, factory: RuntimeFactory, program: Program, device: str,
               options: RingOptions, threads: int, timeout_s: float, result_path: str) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo on the loopback interface
    dev = rank_device(device, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    # Rendezvous through a file, not a TCP store: a TCPStore listens on every interface, and the
    # ranks only ever need to meet on this machine.
    dist.init_process_group(
        "nccl" if dev.type == "cuda" else "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        runtime = factory(dev)
        num_blocks = len(runtime.dit.blocks)
        ranges = ([range(a, b) for a, b in options.ranges] if options.ranges is not None
                  else even_ranges(num_blocks, world))
        channel = Channel(dev)
        if rank == 0:
            ring = RingRuntime(runtime, channel, world, ranges, options)
            result = program(ring)
            ring.shutdown()
            buf = io.BytesIO()
            torch.save(result, buf)
            Path(result_path).write_bytes(buf.getvalue())
        else:
            StageWorker(runtime, channel, rank, world, ranges, options.weights).serve()
    except Exception:
        # Only the first failing rank's error reaches the parent; log every rank's own cause.
        log.exception("rank %d of %d failed", rank, world)
        raise
    finally:
        dist.destroy_process_group()
