"""`diffcast serve`: the live WebRTC service (page, WHIP/WHEP, WebSocket fallback, metrics)."""

from __future__ import annotations

import argparse
import logging
import sys

from app.commands.arguments import add_compile_arguments, add_vae_argument
from app.server.config import ServerConfig, add_lora_arguments

NAME = "serve"
HELP = "Run the live web service: webcam in over WebRTC/WHIP, stylized video out (page, WHEP, /ws)."

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Every server option is declared once, as a ServerConfig field (app/server/config.py); the VAE and
    # LoRA flags are shared with the other commands; the engine launch flags are this command's own.
    ServerConfig.add_arguments(parser)
    add_vae_argument(parser)
    add_lora_arguments(parser)
    add_compile_arguments(parser)
    parser.add_argument("--threads", type=int, default=0, help="torch threads for the engine (0 = torch default)")
    parser.add_argument(
        "--ray", action="store_true",
        help="run the engine as Ray worker actors on a local Ray cluster started here (needs the cluster extra)",
    )
    parser.add_argument(
        "--ray-address", default=None, metavar="ADDR",
        help="join the Ray cluster at ADDR (e.g. 10.0.0.5:6379 or 'auto') instead of starting one; implies --ray",
    )
    parser.add_argument("--workers", type=int, default=2, help="Ray worker actors (model replicas) with --ray")
    parser.add_argument(
        "--gpus", type=int, default=1,
        help="pipeline-parallel ranks: the DiT's blocks split over N processes (NCCL, one GPU each, with "
             "--device cuda; gloo CPU ranks with --device cpu); the service runs in rank 0 (docs/parallel.md)",
    )


def run(args: argparse.Namespace) -> int:
    from app.server.app import serve
    from app.server.config import TokenTooShortError
    from app.server.control.osc import OscBindError
    from app.server.edge.tls import with_certificate
    from engine.devices import resolve_device, resolve_dtype
    from engine.models.lora import LoRAError
    from engine.pipeline import ModelNotAvailableError
    from engine.vae_choice import vae_choice_for

    try:
        # Before the model loads: a bad certificate or device is said at once (CertificateError is a ValueError).
        vae_choice_for(args.model, args.vae)  # --vae for a model that takes none is said before loading
        config = with_certificate(ServerConfig.from_args(args))
        resolve_dtype(config.dtype, resolve_device(config.device))
    except TokenTooShortError as exc:
        print(f"diffcast serve: error: {exc}", file=sys.stderr)  # argparse's form and status for bad flags
        return 2
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    ray = bool(args.ray or args.ray_address)
    if ray and args.workers < 1:
        raise SystemExit(f"--workers must be at least 1, got {args.workers}")
    if config.compile and (ray or args.gpus != 1):
        raise SystemExit("--compile runs the in-process engine compiled; Ray workers (--ray) and pipeline ranks "
                         "(--gpus) run eager: leave it out")
    if config.lanes and (ray or args.gpus != 1):
        raise SystemExit("--lanes is for the in-process engine: Ray workers (--ray) and pipeline ranks (--gpus) "
                         "each run their own steps; leave it out")
    if not ray and (config.max_workers or config.worker_delay_ms):
        raise SystemExit("--max-workers, --min-workers and --worker-delay-ms are for Ray workers: add --ray")
    if config.max_workers and not config.min_workers <= args.workers <= config.max_workers:
        raise SystemExit(f"--workers ({args.workers}) must lie within --min-workers ({config.min_workers}) and "
                         f"--max-workers ({config.max_workers})")
    if args.gpus != 1:
        if args.gpus < 1:
            raise SystemExit(f"--gpus must be at least 1, got {args.gpus}")
        if args.ray or args.ray_address:
            raise SystemExit("--gpus N (pipeline ranks) cannot be combined with --ray")
        from app.server.serving.ranks import serve_ranks

        serve_ranks(config, args.gpus, max(args.threads, 1))
        return 0
    try:
        factory = None
        if args.ray or args.ray_address:
            from app.server.serving.engine_bridge import RayFactory

            factory = RayFactory.start(args.model, args.device, args.workers, args.ray_address, max(args.threads, 1),
                                       config.loras, config.max_workers, config.dtype, config.vae)
        serve(config, factory)
    except (ModelNotAvailableError, OscBindError, LoRAError) as exc:
        log.error("%s", exc)
        return 2
    return 0
