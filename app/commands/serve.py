"""`diffcast serve`: the live WebRTC service (page, WHIP/WHEP, WebSocket fallback, metrics)."""

from __future__ import annotations

import argparse
import logging
import sys

from app.commands.arguments import add_vae_argument
from app.server.config import add_lora_arguments

NAME = "serve"
HELP = "Run the live web service: webcam in over WebRTC/WHIP, stylized video out (page, WHEP, /ws)."

log = logging.getLogger(__name__)


def policy_names() -> list[str]:
    from engine.serving.policy import PRESET_ALIASES, policy_presets

    return [*PRESET_ALIASES, *policy_presets()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="HTTP port (default 8080)")
    parser.add_argument(
        "--model", default=None,
        help="model: omitted = the embedded default; 'tiny-random' = random-weight test model; "
             "'random:wan2.1-1.3b' = full-size random weights, no download; or a path",
    )
    parser.add_argument("--device", default="cpu", help="torch device for the engine: cpu (default), cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                        help="weight dtype (default auto: bf16 on cuda, fp32 on cpu), as `diffcast bench engine` "
                             "measures it; in-process, --ray workers and --gpus ranks alike")
    add_vae_argument(parser)
    add_lora_arguments(parser)
    parser.add_argument("--max-streams", type=int, default=4, help="concurrent streams before 503 (default 4)")
    parser.add_argument("--max-viewers", type=int, default=8, help="WHEP viewers per stream before 503 (default 8)")
    parser.add_argument(
        "--ice-server", action="append", default=[], metavar="URL",
        help="STUN/TURN server URL (repeatable), e.g. stun:stun.l.google.com:19302 or turn:host:3478",
    )
    parser.add_argument("--ice-username", default=None, help="username for the TURN servers")
    parser.add_argument("--ice-credential", default=None, help="credential for the TURN servers")
    parser.add_argument(
        "--allow-loopback-candidates", action="store_true",
        help="offer 127.0.0.1 as an ICE candidate (single-machine use and tests)",
    )
    parser.add_argument("--token", default=None, help="Bearer token required on WHIP/WHEP requests")
    parser.add_argument("--max-prompt-chars", type=int, default=500, help="longest accepted prompt")
    parser.add_argument(
        "--api-token", default=None,
        help="service-wide API token: needed to create or list streams, and an admin credential (docs/security.md)",
    )
    parser.add_argument(
        "--allowed-origin", action="append", default=[], metavar="ORIGIN",
        help="origin (e.g. https://example.com) whose pages may call the API besides the service's own "
             "(repeatable; default: none; WHIP and WHEP answer any origin unless this is given)",
    )
    parser.add_argument(
        "--forwarded-allow-ips", default="", metavar="IPS",
        help="comma-separated addresses of reverse proxies whose X-Forwarded-For/-Proto headers are trusted "
             "(default: none)",
    )
    parser.add_argument(
        "--private-viewing", action="store_true",
        help="WHEP and stream stats need the stream's viewer token (default: the unlisted stream id suffices)",
    )
    parser.add_argument(
        "--input-timeout-s", type=float, default=15.0,
        help="close a stream whose client sent no frame for this long (default 15)",
    )
    parser.add_argument(
        "--header-timeout-s", type=float, default=10.0,
        help="408 for a client that has not sent a request's headers this long after starting it (default 10)",
    )
    parser.add_argument(
        "--body-timeout-s", type=float, default=10.0,
        help="408 for a request body not received within this grace plus 1 s per 1000 bytes (default 10)",
    )
    parser.add_argument("--max-body-bytes", type=int, default=65536, help="largest request body (default 65536)")
    parser.add_argument(
        "--max-upload-bytes", type=int, default=64 << 20, help="largest playground upload (default 64 MiB)"
    )
    parser.add_argument(
        "--max-uploads", type=int, default=8, help="playground uploads kept at once (default 8)"
    )
    parser.add_argument(
        "--max-streams-per-client", type=int, default=2, help="concurrent streams per client address (default 2)"
    )
    parser.add_argument(
        "--max-messages-per-s", type=float, default=10.0, help="control messages per second per stream (default 10)"
    )
    parser.add_argument("--max-fps", type=float, default=30.0, help="upper bound of the output frame rate")
    parser.add_argument("--engine-delay-ms", type=float, default=0.0, help="test knob: extra delay per chunk")
    parser.add_argument(
        "--engine-step-delay-ms", type=float, default=0.0,
        help="test knob: extra delay per denoising step of each forward (emulates a DiT-bound model)",
    )
    parser.add_argument(
        "--policy", choices=policy_names(), default="slack", metavar="PRESET",
        help="serving policy preset the engine core runs (docs/configuration.md): slack (= slackserve, the "
             "default) admits streams, orders chunks, picks each chunk's fidelity, batches streams, evicts and "
             "preempts by playout slack; fifo: streams take turns at their own fixed fidelity; or any of "
             + ", ".join(n for n in policy_names() if n not in ("slack", "fifo")),
    )
    parser.add_argument(
        "--state-slots", type=int, default=0,
        help="stream states resident in the engine at once; the policy parks the others in host memory "
             "(credit-aware eviction) and restores them bit-identically when they run (default 0 = no limit; "
             "on CUDA also no more than fit the GPU's free memory)",
    )
    parser.add_argument(
        "--device-memory-gib", type=float, default=None,
        help="device memory the engine may use, weights included: stream states beyond what fits are parked "
             "in host memory or refused at admission (default: the GPU's free memory on CUDA; no bound on a CPU)",
    )
    parser.add_argument(
        "--profile", default=None, metavar="FILE",
        help="fidelity profile the policy plans with (default: the bundled one; write one with `diffcast profile`)",
    )
    parser.add_argument("--max-batch", type=int, default=4, help="most streams per batched forward (default 4)")
    parser.add_argument(
        "--trace-stamp", action="store_true",
        help="copy each input frame's frame-ID band onto its output (glass-to-glass measurements)",
    )
    parser.add_argument("--no-playground", action="store_true",
                        help="leave the Gradio playground (/playground) out: the server does not import Gradio")
    parser.add_argument(
        "--https", action="store_true",
        help="serve over TLS (a phone's browser gives the page its camera only over HTTPS): with a self-signed "
             "certificate made on first run and kept (docs/service.md), unless --ssl-certfile/--ssl-keyfile",
    )
    parser.add_argument("--ssl-certfile", default=None, metavar="PEM", help="TLS certificate (chain); implies --https")
    parser.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="private key of --ssl-certfile")
    parser.add_argument(
        "--osc-port", type=int, default=None, metavar="PORT",
        help="accept OSC control messages on this UDP port (docs/osc.md; default: off)",
    )
    parser.add_argument(
        "--osc-host", default="127.0.0.1",
        help="address the OSC port listens on (default 127.0.0.1; 0.0.0.0 for controllers on the LAN)",
    )
    parser.add_argument(
        "--osc-reply", type=int, default=None, metavar="PORT",
        help="UDP port on the sender's host that OSC errors and acks go to when a message names none",
    )
    parser.add_argument("--break-ice", action="store_true", help="test knob: make every ICE negotiation fail")
    parser.add_argument(
        "--record-dir", default=None,
        help="enable server-side recording (the control field record) into this directory (default: off)",
    )
    parser.add_argument(
        "--record-max-gb", type=float, default=10.0,
        help="most disk the recordings may use, in GB; full = new recordings refused (default 10)",
    )
    parser.add_argument(
        "--ndi-out", action="store_true",
        help="let streams publish their output as NDI sources (the control field ndi_out; docs/ndi.md): NDI has "
             "no viewer authentication, anyone on the network can watch",
    )
    parser.add_argument(
        "--ndi-in", default=None, metavar='"MACHINE (SOURCE)"',
        help="open one stream at start whose camera is this NDI source (docs/ndi.md)",
    )
    parser.add_argument(
        "--ndi-allow", action="append", default=[], metavar="PATTERN",
        help="NDI sources stream owners may open through POST /api/ndi, as shell-style patterns "
             "(e.g. 'STUDIO (*)'; repeatable; default: none)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads for the engine (0 = torch default)")
    parser.add_argument(
        "--lanes", type=int, default=0,
        help="engine lanes: steps of different streams run side by side, each lane on its share of the "
             "threads (0 = auto: one per thread on a CPU, up to 2; one on a GPU)",
    )
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
        "--worker-delay-ms", default=None, metavar="D1,D2,...",
        help="test knob: extra delay per chunk on each Ray worker, in start order (makes workers unequal; "
             "the policy finds out by measuring)",
    )
    parser.add_argument(
        "--min-workers", type=int, default=1, help="fewest Ray workers the autoscaler keeps (default 1)"
    )
    parser.add_argument(
        "--max-workers", type=int, default=0,
        help="most Ray workers the autoscaler may run (default 0 = --workers, no autoscaling)",
    )
    parser.add_argument(
        "--scale-in-cooldown-s", type=float, default=60.0,
        help="the autoscaler removes a worker only this long after its last scale event (default 60)",
    )
    parser.add_argument(
        "--gpus", type=int, default=1,
        help="pipeline-parallel ranks: the DiT's blocks split over N processes (NCCL, one GPU each, with "
             "--device cuda; gloo CPU ranks with --device cpu); the service runs in rank 0 (docs/parallel.md)",
    )


def run(args: argparse.Namespace) -> int:
    from app.server.app import serve
    from app.server.config import ServerConfig, TokenTooShortError
    from app.server.osc import OscBindError
    from app.server.tls import with_certificate
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
    if args.lanes and (ray or args.gpus != 1):
        raise SystemExit("--lanes is for the in-process engine: Ray workers (--ray) and pipeline ranks (--gpus) "
                         "each run their own steps; leave it out")
    if not ray and (args.max_workers or args.worker_delay_ms):
        raise SystemExit("--max-workers, --min-workers and --worker-delay-ms are for Ray workers: add --ray")
    if args.max_workers and not args.min_workers <= args.workers <= args.max_workers:
        raise SystemExit(f"--workers ({args.workers}) must lie within --min-workers ({args.min_workers}) and "
                         f"--max-workers ({args.max_workers})")
    if args.gpus != 1:
        if args.gpus < 1:
            raise SystemExit(f"--gpus must be at least 1, got {args.gpus}")
        if args.ray or args.ray_address:
            raise SystemExit("--gpus N (pipeline ranks) cannot be combined with --ray")
        from app.server.ranks import serve_ranks

        serve_ranks(config, args.gpus, max(args.threads, 1))
        return 0
    try:
        factory = None
        if args.ray or args.ray_address:
            from app.server.engine_bridge import RayFactory

            factory = RayFactory.start(args.model, args.device, args.workers, args.ray_address, max(args.threads, 1),
                                       config.loras, args.max_workers, config.dtype, config.vae)
        serve(config, factory)
    except (ModelNotAvailableError, OscBindError, LoRAError) as exc:
        log.error("%s", exc)
        return 2
    return 0
