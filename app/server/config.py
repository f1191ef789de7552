"""Server configuration: one dataclass, filled by `diffcast serve` or by tests. Each option is declared once,
as a field: its default, its flag and help, and its checks (``__post_init__``)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

# Admin tokens (--api-token, --token) shorter than this are refused: the wait after wrong guesses
# (app/server/edge/security.py GuessThrottle) slows guessing, it cannot save a token of a few characters.
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
class Flag:
    """How `diffcast serve` sets a ServerConfig field. The field's default is the flag's, and ``{default}``
    in the help text says it: an option is declared once, beside its field."""

    help: str
    name: str | None = None  # the flag; None: --field-name
    metavar: str | None = None
    # The values a string option takes (a function: the policy presets are read only when the parser is built).
    choices: Callable[[], list[str]] | None = None
    # From the flag's text (or list of texts, for a repeatable one) to the field's value.
    parse: Callable[[Any], Any] | None = None
    inverted: bool = False  # a flag that switches a True field off (--no-playground)


def option(default: Any, help: str, **flag: Any) -> Any:
    """A ServerConfig field that `diffcast serve` sets by a flag (``Flag``'s keywords)."""
    return field(default=default, metadata={"flag": Flag(help, **flag)})


def _policy_names() -> list[str]:
    from engine.serving.policy import PRESET_ALIASES, policy_presets

    return [*PRESET_ALIASES, *policy_presets()]


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


@dataclass(frozen=True)
class ServerConfig:
    host: str = option("127.0.0.1", "address to listen on (default {default})")
    port: int = option(8080, "HTTP port (default {default})")
    # None = the engine's embedded default model; "tiny-random" = tiny random-weight model (tests).
    model: str | None = option(
        None, "model: omitted = the embedded default; 'tiny-random' = random-weight test model; "
              "'random:wan2.1-1.3b' = full-size random weights, no download; or a path")
    # LoRAs loaded with the model (--lora and --lora-strength, shared with `diffcast stylize`; docs/lora.md).
    loras: tuple[LoRASpec, ...] = ()
    device: str = option("cpu", "torch device for the engine: cpu (default), cuda or cuda:N")
    # Weight dtype (engine.devices.resolve_dtype): auto = bf16 on CUDA, fp32 on a CPU.
    dtype: str = option("auto", "weight dtype (default auto: bf16 on cuda, fp32 on cpu), as `diffcast bench engine` "
                                "measures it; in-process, --ray workers and --gpus ranks alike",
                        choices=lambda: ["auto", "fp32", "bf16"])
    # A Wan model's stream VAE (--vae, shared with the other commands: app/commands/arguments.py,
    # engine/vae_choice.py); None: the model's own.
    vae: str | None = None
    # torch.compile of the in-process engine's DiT and VAE at the serving profile's shapes (--compile,
    # --compile-cache, --compile-sites, --compile-backend, shared with bench and profile:
    # app/commands/arguments.py, engine/compiled.py); the warm-up before serving is the cold start.
    compile: bool = False
    compile_cache: str | None = None
    compile_sites: tuple[str, ...] = ("dit", "vae.encode", "vae.decode")
    compile_backend: str = "inductor"
    # Engine lanes of the in-process engine: steps of different streams side by side, each lane a
    # worker of the serving policy (engine/streaming/lanes.py). 0 = auto: one per thread on a CPU, up
    # to 2; one on an accelerator.
    lanes: int = option(0, "engine lanes: steps of different streams run side by side, each lane on its share of "
                           "the threads (0 = auto: one per thread on a CPU, up to 2; one on a GPU)")
    max_streams: int = option(4, "concurrent streams before 503 (default {default})")
    # WHEP viewers per stream: each one costs a video encoder on the server.
    max_viewers: int = option(8, "WHEP viewers per stream before 503 (default {default})")
    # STUN/TURN URLs handed to aiortc and to the page. Empty by default: a public STUN server delays
    # every answer by seconds on an offline host and is not needed on a LAN.
    ice_servers: tuple[str, ...] = option(
        (), "STUN/TURN server URL (repeatable), e.g. stun:stun.l.google.com:19302 or turn:host:3478",
        name="--ice-server", metavar="URL")
    ice_username: str | None = option(None, "username for the TURN servers")
    ice_credential: str | None = option(None, "credential for the TURN servers")
    # aioice leaves 127.0.0.1 out of host candidates; tests and single-machine use need it.
    allow_loopback_candidates: bool = option(
        False, "offer 127.0.0.1 as an ICE candidate (single-machine use and tests)")
    # Bearer token required on WHIP/WHEP requests (OBS "Bearer Token" field); None = open.
    token: str | None = option(None, "Bearer token required on WHIP/WHEP requests")
    max_prompt_chars: int = option(500, "longest accepted prompt (default {default})")
    # Hardening (app/server/edge/security.py, limits.py; docs/security.md). Service-wide API token: needed
    # to create or list streams, and an admin credential over every stream; None = no such gate.
    api_token: str | None = option(
        None, "service-wide API token: needed to create or list streams, and an admin credential (docs/security.md)")
    # Origins whose pages may call the API (CORS and an Origin check) besides the service's own;
    # () = its own pages only, while WHIP and WHEP answer any origin (third-party players).
    allowed_origins: tuple[str, ...] = option(
        (), "origin (e.g. https://example.com) whose pages may call the API besides the service's own "
            "(repeatable; default: none; WHIP and WHEP answer any origin unless this is given)",
        name="--allowed-origin", metavar="ORIGIN")
    # Reverse proxies whose X-Forwarded-For / X-Forwarded-Proto are believed (uvicorn's proxy headers
    # handling); () = none: every client is its socket's peer address.
    forwarded_allow_ips: tuple[str, ...] = option(
        (), "comma-separated addresses of reverse proxies whose X-Forwarded-For/-Proto headers are trusted "
            "(default: none)", metavar="IPS", parse=_comma_list)
    # True: WHEP/stats need the stream's viewer (or owner) token; False: the unlisted stream id suffices.
    private_viewing: bool = option(
        False, "WHEP and stream stats need the stream's viewer token (default: the unlisted stream id suffices)")
    max_body_bytes: int = option(65536, "largest request body (default {default})")
    # Playground uploads (video files): bytes each, and files kept at once. Each is deleted when the
    # job that used it ends, or after upload_ttl_s (Gradio's delete_cache), whichever comes first.
    max_upload_bytes: int = option(64 << 20, "largest playground upload in bytes (default {default}: 64 MiB)")
    max_uploads: int = option(8, "playground uploads kept at once (default {default})")
    upload_ttl_s: int = 1800
    max_streams_per_client: int = option(2, "concurrent streams per client address (default {default})")
    # Control messages (data channel, WebSocket text, HTTP control): bytes each, and per second.
    max_message_bytes: int = 4096
    max_messages_per_s: float = option(10.0, "control messages per second per stream (default {default})")
    # WebSocket video frames: bytes each, and pixels before decoding (larger ones are downscaled).
    max_frame_bytes: int = 1 << 20
    max_frame_pixels: int = 4096 * 4096
    # A stream whose client sent no frame for this long is closed (a vanished or idle client).
    input_timeout_s: float = option(15.0, "close a stream whose client sent no frame for this long (default {default})")
    # A client must send a request's head within this many seconds of starting it (or of
    # connecting), and its body within this grace plus one second per 1000 bytes
    # (app/server/edge/http_server.py): slow clients cannot hold connections.
    header_timeout_s: float = option(
        10.0, "408 for a client that has not sent a request's headers this long after starting it (default {default})")
    body_timeout_s: float = option(
        10.0, "408 for a request body not received within this grace plus 1 s per 1000 bytes (default {default})")
    # Seconds a client is told to wait when the server is full.
    retry_after_s: int = 5
    # Test knob: extra sleep per engine chunk, to emulate a model slower than the camera.
    engine_delay_ms: float = option(0.0, "test knob: extra delay per chunk")
    # Test knob: extra sleep per denoising step of each forward (fewer steps are then faster, as with
    # a DiT-dominated model on a GPU); the policy's profile is charged the same delays.
    engine_step_delay_ms: float = option(
        0.0, "test knob: extra delay per denoising step of each forward (emulates a DiT-bound model)")
    # Test knob (--worker-delay-ms): extra delay per chunk on each Ray worker actor, in start order, to
    # make workers unequal; the policy is not told (it measures its streams' chunk times).
    worker_delay_ms: tuple[float, ...] = option(
        (), "test knob: extra delay per chunk on each Ray worker, in start order (makes workers unequal; the "
            "policy finds out by measuring)", metavar="D1,D2,...", parse=lambda text: parse_delays(text))
    # Ray worker actors the autoscaler may run: at least min_workers, at most max_workers (0 = the
    # number started, no autoscaling).
    min_workers: int = option(1, "fewest Ray workers the autoscaler keeps (default {default})")
    max_workers: int = option(0, "most Ray workers the autoscaler may run (default 0 = --workers, no autoscaling)")
    # Scale-in waits this long after the last scale event (workers are not removed and re-added).
    scale_in_cooldown_s: float = option(
        60.0, "the autoscaler removes a worker only this long after its last scale event (default {default})")
    # Serving policy preset the engine core runs (engine.serving.policy.policy_presets, or the alias
    # "slack" = "slackserve"): admission, order, per-chunk fidelity, batching, eviction, preemption.
    # "fifo" = streams take turns at their own fixed fidelity.
    policy: str = option(
        "slack", "serving policy preset the engine core runs (docs/configuration.md): slack (= slackserve, the "
                 "default) admits streams, orders chunks, picks each chunk's fidelity, batches streams, evicts and "
                 "preempts by playout slack; fifo: streams take turns at their own fixed fidelity; or any of {choices}",
        metavar="PRESET", choices=_policy_names)
    # Stream states resident in the engine at once; more streams are parked in host memory and
    # brought back when they run (credit-aware eviction). 0 = no limit.
    state_slots: int = option(
        0, "stream states resident in the engine at once; the policy parks the others in host memory "
           "(credit-aware eviction) and restores them bit-identically when they run (default 0 = no limit; "
           "on CUDA also no more than fit the GPU's free memory)")
    # Device memory the engine may use, weights included (None: the GPU's free memory on CUDA, no bound
    # on a CPU); states beyond it are parked or refused at admission (engine/serving/device_memory.py).
    device_memory_gib: float | None = option(
        None, "device memory the engine may use, weights included: stream states beyond what fits are parked "
              "in host memory or refused at admission (default: the GPU's free memory on CUDA; no bound on a CPU)")
    # Fidelity profile for the policy (diffcast-fidelity-profile/1); None = the bundled measured one.
    profile: str | None = option(
        None, "fidelity profile the policy plans with (default: the bundled one; write one with `diffcast profile`)",
        metavar="FILE")
    # Most streams one batched forward may carry under the slack policy.
    max_batch: int = option(4, "most streams per batched forward (default {default})")
    # Test/bench knob: copy the frame-ID band (app.server.media.framecode) of each input frame onto the
    # output frame made from it, so an external client can measure glass-to-glass latency.
    trace_stamp: bool = option(
        False, "copy each input frame's frame-ID band onto its output (glass-to-glass measurements)")
    # The Gradio playground at /playground: off, the server neither mounts nor imports Gradio (a GPU
    # machine that carries the media packages as wheels carries no Gradio: it alone is most of the room).
    playground: bool = option(
        True, "leave the Gradio playground (/playground) out: the server does not import Gradio",
        name="--no-playground", inverted=True)
    # Test knob: strip ICE candidates from both sides of every WebRTC negotiation so ICE must
    # fail (exercises the page's WebSocket fallback).
    break_ice: bool = option(False, "test knob: make every ICE negotiation fail")
    # Playout bounds: the output clock follows the model's production rate within these limits.
    max_fps: float = option(30.0, "upper bound of the output frame rate (default {default})")
    min_fps: float = 2.0
    jpeg_quality: int = 80
    # Server-side recording (app/server/control/recordings.py): the directory (None = recording off) and
    # the most it may hold, in GB (1024**3 bytes).
    record_dir: str | None = option(
        None, "enable server-side recording (the control field record) into this directory (default: off)")
    record_max_gb: float = option(
        10.0, "most disk the recordings may use, in GB; full = new recordings refused (default {default})")
    default_prompt: str = "oil painting"
    # Stream defaults when a client gives none; None = the model's own (engine.pipeline.model_capabilities).
    default_noise_scale: float | None = None
    default_steps: int | None = None
    # TLS (app/server/edge/tls.py): https=True with no files = the kept self-signed certificate, made on
    # first run; serve() fills the two paths in before uvicorn starts.
    https: bool = option(
        False, "serve over TLS (a phone's browser gives the page its camera only over HTTPS): with a self-signed "
               "certificate made on first run and kept (docs/service.md), unless --ssl-certfile/--ssl-keyfile")
    ssl_certfile: str | None = option(None, "TLS certificate (chain); implies --https", metavar="PEM")
    ssl_keyfile: str | None = option(None, "private key of --ssl-certfile", metavar="PEM")
    # OSC control over UDP (app/server/control/osc.py); None = off. Loopback unless --osc-host widens it.
    osc_port: int | None = option(
        None, "accept OSC control messages on this UDP port (docs/osc.md; default: off)", metavar="PORT")
    osc_host: str = option(
        "127.0.0.1", "address the OSC port listens on (default {default}; 0.0.0.0 for controllers on the LAN)")
    # UDP port on the sender's host that refusals (and acks) go to when a message names none.
    osc_reply_port: int | None = option(
        None, "UDP port on the sender's host that OSC errors and acks go to when a message names none",
        name="--osc-reply", metavar="PORT")
    # NDI (app/server/media/ndi*.py, docs/ndi.md): publishing streams as NDI sources (the control field
    # ndi_out, once the operator opts in: NDI has no viewer authentication); an NDI source opened as
    # a stream at start; and the sources stream owners may open through POST /api/ndi (patterns).
    ndi_out: bool = option(
        False, "let streams publish their output as NDI sources (the control field ndi_out; docs/ndi.md): NDI has "
               "no viewer authentication, anyone on the network can watch")
    ndi_in: str | None = option(
        None, "open one stream at start whose camera is this NDI source (docs/ndi.md)", metavar='"MACHINE (SOURCE)"')
    ndi_allow: tuple[str, ...] = option(
        (), "NDI sources stream owners may open through POST /api/ndi, as shell-style patterns "
            "(e.g. 'STUDIO (*)'; repeatable; default: none)", metavar="PATTERN")
    presets: tuple[str, ...] = (
        "oil painting",
        "watercolor sketch",
        "anime cel shading",
        "cyberpunk neon city",
        "charcoal drawing",
        "claymation",
    )

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """`diffcast serve`'s flag for every field declared with ``option``; the engine launch flags
        (--gpus, --ray, --workers, --threads) are the command's own (app/commands/serve.py)."""
        hints = get_type_hints(cls)
        for item in fields(cls):
            flag: Flag | None = item.metadata.get("flag")
            if flag is None:
                continue
            name = flag.name or "--" + item.name.replace("_", "-")
            kind = hints[item.name]
            choices = flag.choices() if flag.choices else None
            text = flag.help.format(default=item.default, choices=", ".join(choices or ()))
            if kind is bool:
                action = "store_false" if flag.inverted else "store_true"
                parser.add_argument(name, dest=item.name, action=action, help=text)
            elif isinstance(item.default, tuple) and flag.parse is None:
                parser.add_argument(name, dest=item.name, action="append", default=[], metavar=flag.metavar,
                                    help=text)
            else:
                # int and float options (optional or not) parse their text; the rest are strings.
                scalar: Callable[[str], Any] = next((t for t in (int, float) if kind in (t, t | None)), str)
                parser.add_argument(name, dest=item.name, type=scalar, default=item.default, metavar=flag.metavar,
                                    choices=choices, help=text)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        """The config `diffcast serve`'s flags describe. Raises ValueError with a plain-words message for a
        value out of range (``__post_init__`` checks every field, however it was set)."""
        values: dict[str, Any] = {}
        for item in fields(cls):
            flag: Flag | None = item.metadata.get("flag")
            if flag is None:
                continue
            value = getattr(args, item.name)
            if flag.parse is not None:
                value = flag.parse(value) if value else item.default
            elif isinstance(value, list):
                value = tuple(value)
            values[item.name] = value
        values["https"] = values["https"] or values["ssl_certfile"] is not None
        return cls(**values, loras=lora_specs(args.lora, args.lora_strength), vae=args.vae, compile=args.compile,
                   compile_cache=None if args.compile_cache is None else str(args.compile_cache),
                   compile_sites=args.compile_sites,
                   compile_backend=args.compile_backend)

    def stream_defaults(self) -> tuple[float, int]:
        """(noise scale, steps) for a stream whose client gives none: the configured (or, after
        ``create_app``, the served model's) values, else the generic operating point."""
        noise = GENERIC_NOISE_SCALE if self.default_noise_scale is None else self.default_noise_scale
        return noise, GENERIC_STEPS if self.default_steps is None else self.default_steps

    def __post_init__(self) -> None:
        from engine.serving.policy import resolve_preset

        resolve_preset(self.policy)  # ValueError naming the presets
        if self.max_streams < 1:
            raise ValueError(f"--max-streams must be at least 1, got {self.max_streams}")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("--ssl-certfile and --ssl-keyfile go together: give both, or neither (with --https "
                             "a self-signed certificate is made)")
        for flag, port in (("--osc-port", self.osc_port), ("--osc-reply", self.osc_reply_port)):
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"{flag} must be a UDP port (1-65535), got {port}")
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
            from app.server.media.ndi import runtime

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
