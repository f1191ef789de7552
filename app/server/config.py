"""Server configuration (one dataclass, filled by `diffcast serve` or by tests)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

# Admin tokens (--api-token, --token) shorter than this are refused: the wait after wrong guesses
# (app/server/security.py GuessThrottle) slows guessing, it cannot save a token of a few characters.
MIN_TOKEN_CHARS = 16

# The generic (StreamDiffusionV2-style) operating point: stream defaults for a model that names none.
GENERIC_NOISE_SCALE = 0.8
GENERIC_STEPS = 2


class TokenTooShortError(ValueError):
    """An admin token shorter than MIN_TOKEN_CHARS (`diffcast serve` exits 2, as for a usage error)."""


@dataclass(frozen=True)
class LoRASpec:
    """A LoRA to load at start-up (``--lora NAME=PATH``) and the strength new streams get."""

    name: str
    path: str
    strength: float = 1.0


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """``--lora`` / ``--lora-strength``, shared by `diffcast serve` and `diffcast stylize` (docs/lora.md)."""
    parser.add_argument(
        "--lora", action="append", default=[], metavar="NAME=PATH",
        help="load a LoRA safetensors file (diffusers/PEFT or original Wan/kohya keys) under NAME (repeatable); "
             "applied as a side path, the base weights stay as they are",
    )
    parser.add_argument(
        "--lora-strength", action="append", default=[], metavar="NAME=S",
        help="strength of LoRA NAME for new streams (default 1; 0 loads it switched off; repeatable)",
    )


def lora_specs(loras: list[str], strengths: list[str]) -> tuple[LoRASpec, ...]:
    """The LoRAs the flags describe; ValueError in plain words for a malformed or dangling flag."""
    specs: dict[str, LoRASpec] = {}
    for text in loras:
        name, path = _pair(text, "--lora", "NAME=PATH (e.g. ink=loras/ink.safetensors)")
        if name in specs:
            raise ValueError(f"--lora names {name!r} twice")
        specs[name] = LoRASpec(name, path)
    for text in strengths:
        name, value = _pair(text, "--lora-strength", "NAME=S (e.g. ink=0.7)")
        if name not in specs:
            raise ValueError(f"--lora-strength names {name!r}, which no --lora loads")
        try:
            strength = float(value)
        except ValueError:
            raise ValueError(f"--lora-strength {text!r}: {value!r} is not a number") from None
        if not math.isfinite(strength):
            raise ValueError(f"--lora-strength {text!r}: the strength must be a finite number")
        specs[name] = LoRASpec(name, specs[name].path, strength)
    return tuple(specs.values())


def _pair(text: str, flag: str, form: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise ValueError(f"{flag} takes {form}, got {text!r}")
    return name.strip(), value.strip()


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # None = the engine's embedded default model; "tiny-random" = tiny random-weight model (tests).
    model: str | None = None
    # LoRAs loaded with the model (--lora); streams set their strengths (docs/lora.md).
    loras: tuple[LoRASpec, ...] = ()
    device: str = "cpu"
    dtype: str = "auto"  # weight dtype (engine.devices.resolve_dtype): auto = bf16 on CUDA, fp32 on a CPU
    vae: str | None = None  # a Wan model's stream VAE (--vae, engine/vae_choice.py); None: the model's own
    # Engine lanes of the in-process engine: steps of different streams side by side, each lane a
    # worker of the serving policy (engine/streaming/lanes.py). 0 = auto: one per thread on a CPU, up
    # to 2; one on an accelerator.
    lanes: int = 0
    max_streams: int = 4
    # WHEP viewers per stream: each one costs a video encoder on the server.
    max_viewers: int = 8
    # STUN/TURN URLs handed to aiortc and to the page. Empty by default: a public STUN server delays
    # every answer by seconds on an offline host and is not needed on a LAN.
    ice_servers: tuple[str, ...] = ()
    ice_username: str | None = None
    ice_credential: str | None = None
    # aioice leaves 127.0.0.1 out of host candidates; tests and single-machine use need it.
    allow_loopback_candidates: bool = False
    # Bearer token required on WHIP/WHEP requests (OBS "Bearer Token" field); None = open.
    token: str | None = None
    max_prompt_chars: int = 500
    # Hardening (app/server/security.py, limits.py; docs/security.md). Service-wide API token: needed
    # to create or list streams, and an admin credential over every stream; None = no such gate.
    api_token: str | None = None
    # Origins whose pages may call the API (CORS and an Origin check) besides the service's own;
    # () = its own pages only, while WHIP and WHEP answer any origin (third-party players).
    allowed_origins: tuple[str, ...] = ()
    # Reverse proxies whose X-Forwarded-For / X-Forwarded-Proto are believed (uvicorn's proxy headers
    # handling); () = none: every client is its socket's peer address.
    forwarded_allow_ips: tuple[str, ...] = ()
    # True: WHEP/stats need the stream's viewer (or owner) token; False: the unlisted stream id suffices.
    private_viewing: bool = False
    max_body_bytes: int = 65536
    # Playground uploads (video files): bytes each, and files kept at once. Each is deleted when the
    # job that used it ends, or after upload_ttl_s (Gradio's delete_cache), whichever comes first.
    max_upload_bytes: int = 64 << 20
    max_uploads: int = 8
    upload_ttl_s: int = 1800
    max_streams_per_client: int = 2
    # Control messages (data channel, WebSocket text, HTTP control): bytes each, and per second.
    max_message_bytes: int = 4096
    max_messages_per_s: float = 10.0
    # WebSocket video frames: bytes each, and pixels before decoding (larger ones are downscaled).
    max_frame_bytes: int = 1 << 20
    max_frame_pixels: int = 4096 * 4096
    # A stream whose client sent no frame for this long is closed (a vanished or idle client).
    input_timeout_s: float = 15.0
    # A client must send a request's head within this many seconds of starting it (or of
    # connecting), and its body within this grace plus one second per 1000 bytes
    # (app/server/http_server.py): slow clients cannot hold connections.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    # Seconds a client is told to wait when the server is full.
    retry_after_s: int = 5
    # Test knob: extra sleep per engine chunk, to emulate a model slower than the camera.
    engine_delay_ms: float = 0.0
    # Test knob: extra sleep per denoising step of each forward (fewer steps are then faster, as with
    # a DiT-dominated model on a GPU); the policy's profile is charged the same delays.
    engine_step_delay_ms: float = 0.0
    # Test knob (--worker-delay-ms): extra delay per chunk on each Ray worker actor, in start order, to
    # make workers unequal; the policy is not told (it measures its streams' chunk times).
    worker_delay_ms: tuple[float, ...] = ()
    # Ray worker actors the autoscaler may run: at least min_workers, at most max_workers (0 = the
    # number started, no autoscaling).
    min_workers: int = 1
    max_workers: int = 0
    # Scale-in waits this long after the last scale event (workers are not removed and re-added).
    scale_in_cooldown_s: float = 60.0
    # Serving policy preset the engine core runs (engine.serving.policy.policy_presets, or the alias
    # "slack" = "slackserve"): admission, order, per-chunk fidelity, batching, eviction, preemption.
    # "fifo" = streams take turns at their own fixed fidelity.
    policy: str = "slack"
    # Stream states resident in the engine at once; more streams are parked in host memory and
    # brought back when they run (credit-aware eviction). 0 = no limit.
    state_slots: int = 0
    # Device memory the engine may use, weights included (None: the GPU's free memory on CUDA, no bound
    # on a CPU); states beyond it are parked or refused at admission (engine/serving/device_memory.py).
    device_memory_gib: float | None = None
    # Fidelity profile for the policy (diffcast-fidelity-profile/1); None = the bundled measured one.
    profile: str | None = None
    # Most streams one batched forward may carry under the slack policy.
    max_batch: int = 4
    # Test/bench knob: copy the frame-ID band (app.server.framecode) of each input frame onto the
    # output frame made from it, so an external client can measure glass-to-glass latency.
    trace_stamp: bool = False
    # The Gradio playground at /playground: off, the server neither mounts nor imports Gradio (a GPU
    # machine that carries the media packages as wheels carries no Gradio: it alone is most of the room).
    playground: bool = True
    # Test knob: strip ICE candidates from both sides of every WebRTC negotiation so ICE must
    # fail (exercises the page's WebSocket fallback).
    break_ice: bool = False
    # Playout bounds: the output clock follows the model's production rate within these limits.
    max_fps: float = 30.0
    min_fps: float = 2.0
    jpeg_quality: int = 80
    # Server-side recording (app/server/recordings.py): the directory (None = recording off) and
    # the most it may hold, in GB (1024**3 bytes).
    record_dir: str | None = None
    record_max_gb: float = 10.0
    default_prompt: str = "oil painting"
    # Stream defaults when a client gives none; None = the model's own (engine.pipeline.model_capabilities).
    default_noise_scale: float | None = None
    default_steps: int | None = None
    # TLS (app/server/tls.py): https=True with no files = the kept self-signed certificate, made on
    # first run; serve() fills the two paths in before uvicorn starts.
    https: bool = False
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # OSC control over UDP (app/server/osc.py); None = off. Loopback unless --osc-host widens it.
    osc_port: int | None = None
    osc_host: str = "127.0.0.1"
    # UDP port on the sender's host that refusals (and acks) go to when a message names none.
    osc_reply_port: int | None = None
    # NDI (app/server/ndi*.py, docs/ndi.md): publishing streams as NDI sources (the control field
    # ndi_out, once the operator opts in: NDI has no viewer authentication); an NDI source opened as
    # a stream at start; and the sources stream owners may open through POST /api/ndi (patterns).
    ndi_out: bool = False
    ndi_in: str | None = None
    ndi_allow: tuple[str, ...] = ()
    presets: tuple[str, ...] = (
        "oil painting",
        "watercolor sketch",
        "anime cel shading",
        "cyberpunk neon city",
        "charcoal drawing",
        "claymation",
    )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        """The config `diffcast serve`'s flags describe (app/commands/serve.py adds them); the engine
        launch flags (--gpus, --ray, --workers, --threads) are the command's own. Raises ValueError
        with a plain-words message for a value out of range."""
        if args.max_streams < 1:
            raise ValueError(f"--max-streams must be at least 1, got {args.max_streams}")
        if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
            raise ValueError("--ssl-certfile and --ssl-keyfile go together: give both, or neither (with --https "
                             "a self-signed certificate is made)")
        for flag, port in (("--osc-port", args.osc_port), ("--osc-reply", args.osc_reply)):
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"{flag} must be a UDP port (1-65535), got {port}")
        return cls(
            host=args.host,
            port=args.port,
            model=args.model,
            loras=lora_specs(args.lora, args.lora_strength),
            device=args.device,
            dtype=getattr(args, "dtype", "auto"),
            vae=getattr(args, "vae", None),
            max_streams=args.max_streams,
            max_viewers=args.max_viewers,
            ice_servers=tuple(args.ice_server),
            ice_username=args.ice_username,
            ice_credential=args.ice_credential,
            allow_loopback_candidates=args.allow_loopback_candidates,
            token=args.token,
            max_prompt_chars=args.max_prompt_chars,
            api_token=args.api_token,
            allowed_origins=tuple(args.allowed_origin),
            forwarded_allow_ips=tuple(ip.strip() for ip in args.forwarded_allow_ips.split(",") if ip.strip()),
            private_viewing=args.private_viewing,
            max_body_bytes=args.max_body_bytes,
            max_upload_bytes=args.max_upload_bytes,
            max_uploads=args.max_uploads,
            max_streams_per_client=args.max_streams_per_client,
            max_messages_per_s=args.max_messages_per_s,
            input_timeout_s=args.input_timeout_s,
            header_timeout_s=args.header_timeout_s,
            body_timeout_s=args.body_timeout_s,
            max_fps=args.max_fps,
            engine_delay_ms=args.engine_delay_ms,
            engine_step_delay_ms=args.engine_step_delay_ms,
            worker_delay_ms=parse_delays(getattr(args, "worker_delay_ms", None)),
            min_workers=getattr(args, "min_workers", 1),
            max_workers=getattr(args, "max_workers", 0),
            lanes=getattr(args, "lanes", 0),
            scale_in_cooldown_s=getattr(args, "scale_in_cooldown_s", 60.0),
            policy=args.policy,
            state_slots=args.state_slots,
            device_memory_gib=getattr(args, "device_memory_gib", None),
            profile=args.profile,
            max_batch=args.max_batch,
            trace_stamp=args.trace_stamp,
            playground=not getattr(args, "no_playground", False),
            break_ice=args.break_ice,
            https=args.https or args.ssl_certfile is not None,
            ssl_certfile=args.ssl_certfile,
            ssl_keyfile=args.ssl_keyfile,
            osc_port=args.osc_port,
            osc_host=args.osc_host,
            osc_reply_port=args.osc_reply,
            record_dir=args.record_dir,
            record_max_gb=args.record_max_gb,
            ndi_out=args.ndi_out,
            ndi_in=args.ndi_in,
            ndi_allow=tuple(args.ndi_allow),
        )

    def stream_defaults(self) -> tuple[float, int]:
        """(noise scale, steps) for a stream whose client gives none: the configured (or, after
        ``create_app``, the served model's) values, else the generic operating point."""
        noise = GENERIC_NOISE_SCALE if self.default_noise_scale is None else self.default_noise_scale
        return noise, GENERIC_STEPS if self.default_steps is None else self.default_steps

    def __post_init__(self) -> None:
        from engine.serving.policy import resolve_preset

        resolve_preset(self.policy)  # ValueError naming the presets
        for flag, token in (("--api-token", self.api_token), ("--token", self.token)):
            if token is not None and len(token) < MIN_TOKEN_CHARS:  # its length only: never echo a secret
                raise TokenTooShortError(
                    f"{flag} is too short ({len(token)} characters): an admin token needs at least {MIN_TOKEN_CHARS} "
                    "(a random one: openssl rand -base64 32)")
        if self.state_slots < 0:
            raise ValueError(f"state_slots must be >= 0, got {self.state_slots}")
        if self.device_memory_gib is not None and not 0 < self.device_memory_gib < 1e6:
            raise ValueError(f"--device-memory-gib must be a positive number of GiB, got {self.device_memory_gib}")
        if not self.record_max_gb > 0:
            raise ValueError(f"--record-max-gb must be more than 0, got {self.record_max_gb}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if any(d < 0 for d in self.worker_delay_ms):
            raise ValueError(f"--worker-delay-ms values must be >= 0, got {list(self.worker_delay_ms)}")
        if self.scale_in_cooldown_s < 0:
            raise ValueError(f"--scale-in-cooldown-s must be >= 0, got {self.scale_in_cooldown_s}")
        if self.min_workers < 1:
            raise ValueError(f"--min-workers must be at least 1, got {self.min_workers}")
        if not 0 <= self.lanes <= 64:
            raise ValueError(f"--lanes must be between 0 (auto) and 64, got {self.lanes}")
        if self.ndi_in is not None and not self.ndi_in.strip():
            raise ValueError('--ndi-in names an NDI source, "MACHINE (SOURCE)"; got an empty name')
        if self.ndi_out or self.ndi_in is not None or self.ndi_allow:
            from app.server.ndi import runtime

            runtime()  # NdiError (a ValueError) in plain words when the ndi extra is missing
        if self.max_workers and self.max_workers < self.min_workers:
            raise ValueError(f"--max-workers ({self.max_workers}) must be at least --min-workers ({self.min_workers})")


def parse_delays(text: str | None) -> tuple[float, ...]:
    """``--worker-delay-ms 0,250`` -> (0.0, 250.0); ValueError in plain words for anything else."""
    if not text:
        return ()
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--worker-delay-ms takes comma-separated milliseconds such as 0,250; got {text!r}") from None
