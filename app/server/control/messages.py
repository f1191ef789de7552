"""Control messages from clients (data channel or WebSocket text): parsed and checked at the edge."""

from __future__ import annotations

import json
import math
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    field_validator,
)

from app.server.config import GENERIC_NOISE_SCALE, GENERIC_STEPS
from app.server.serving.engine_bridge import StreamSettings

MAX_STEPS = 4  # StreamDiffusionV2's V2V schedule has at most 4 denoising steps
# The first timestep is 1000*s - 100 after motion-aware damping (s - 0.1 at full motion), so below
# 0.2 it can go negative and the engine fails mid-stream (measured at 0.15).
MIN_NOISE_SCALE = 0.2
# Seeds arrive as JSON numbers: above 2**53 a JavaScript client cannot send them exactly, and the
# OpenAPI document (FastAPI writes bounds as floats) could not state a larger bound exactly.
MAX_SEED = 2**53 - 1
# LoRA strengths: engine.models.lora.MAX_LORA_STRENGTH (this module does not import torch). A message
# names at most MAX_LORAS of them.
MAX_LORA_STRENGTH = 4.0
MAX_LORAS = 16
LoRAStrengths = dict[
    Annotated[str, StringConstraints(min_length=1, max_length=64)],
    Annotated[float, Field(ge=-MAX_LORA_STRENGTH, le=MAX_LORA_STRENGTH)],
]


# Control (Cc: NUL, newlines, escapes), format (Cf: bidi overrides, zero-width spaces) and surrogate
# code points have no place in a prompt: they hide or reorder text in logs and the dashboard.
# Zero-width (non-)joiners are kept: emoji sequences and Persian/Indic text need them.
FORBIDDEN_CATEGORIES = {"Cc", "Cf", "Cs"}
ALLOWED_FORMAT_CHARS = {"\u200c", "\u200d"}


class ControlError(ValueError):
    """A control message or stream option that cannot be applied; the text goes back to the client."""


class _Message(BaseModel):
    # Finite numbers only, in every message and option: one NaN or Infinity in prompt_weights turned
    # the stream's prompt embedding into NaNs (black frames until a reset).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class UpdateMessage(_Message):
    """Change what a stream generates; every field is optional, applied at the next chunk boundary."""

    type: Literal["update"]
    prompt: str | list[str] | None = None
    prompt_weights: list[float] | None = None
    transition_chunks: int | None = Field(default=None, ge=0, le=64)
    noise_scale: float | None = Field(default=None, ge=MIN_NOISE_SCALE, le=1.0)
    steps: int | None = Field(default=None, ge=1, le=MAX_STEPS)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stabilize: bool | None = None
    # Strengths of the served LoRAs it names (GET /api/config lists them); the others keep theirs.
    loras: LoRAStrengths | None = Field(default=None, max_length=MAX_LORAS)
    # Start (true) or stop (false) recording the stream's output on the server (--record-dir).
    record: bool | None = None
    # Publish (true) or stop publishing (false) the stream's output as an NDI source (--ndi-out).
    ndi_out: bool | None = None

    def changes(self) -> dict[str, Any]:
        """The engine's share of the message (recording and NDI output are the session's)."""
        return self.model_dump(exclude={"type", "record", "ndi_out"}, exclude_none=True)


class PauseMessage(_Message):
    type: Literal["pause"]


class ResumeMessage(_Message):
    type: Literal["resume"]


class ResetMessage(_Message):
    type: Literal["reset"]


# A cue's name: what the page, OSC and HTTP fire it by (printable, checked in ``CueSpec``).
CueName = Annotated[str, StringConstraints(min_length=1, max_length=64)]
MAX_CUES = 64  # a stream's cue list: a show's set, small enough to send whole with every PUT
# The longest transition a cue takes; a fade longer than a minute is a different tool.
MAX_TRANSITION_S = 60.0


class CueMessage(_Message):
    """Fire one of the stream's cues (PUT /api/streams/{id}/cues sets them) by name."""

    type: Literal["cue"]
    name: CueName


class CueSpec(_Message):
    """One cue of a set (docs/cues.md): a look (prompt or blend, LoRA strengths, noise strength) and
    the seconds it takes to get there from wherever the stream is (0: a cut)."""

    name: CueName
    prompt: str | list[str]
    prompt_weights: list[float] | None = None
    loras: LoRAStrengths | None = Field(default=None, max_length=MAX_LORAS)
    noise_scale: float | None = Field(default=None, ge=MIN_NOISE_SCALE, le=1.0)
    transition_s: float = Field(default=0.0, ge=0.0, le=MAX_TRANSITION_S)

    @field_validator("name")
    @classmethod
    def _printable(cls, name: str) -> str:
        if not name.isprintable() or name != name.strip():
            raise ValueError("a cue name is printable characters, without leading or trailing spaces")
        return name


class CueSet(_Message):
    """A stream's cue list as a file: GET /api/streams/{id}/cues returns it, PUT replaces it."""

    cues: list[CueSpec] = Field(max_length=MAX_CUES)


def parse_cue_set(text: str, max_prompt_chars: int) -> CueSet:
    """A cue set file (JSON) -> :func:`cue_set`."""
    try:
        raw = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ControlError(f"cue set is not JSON: {exc}") from exc
    return cue_set(raw, max_prompt_chars)


def cue_set(raw: object, max_prompt_chars: int) -> CueSet:
    """A decoded cue set with every check a control message gets (prompts, weights, finite values in
    their ranges) and unique names; ControlError naming the first bad cue."""
    try:
        cues = CueSet.model_validate(raw)
    except ValidationError as exc:
        raise ControlError(f"bad cue set: {describe_errors(exc.errors())}") from exc
    seen: set[str] = set()
    for i, cue in enumerate(cues.cues):
        if cue.name in seen:
            raise ControlError(f"bad cue set: cues.{i}: the name {cue.name!r} is used twice")
        seen.add(cue.name)
        try:
            check_prompt(cue.prompt, cue.prompt_weights, max_prompt_chars)
        except ControlError as exc:
            raise ControlError(f"bad cue set: cues.{i} ({cue.name}): {exc}") from exc
    return cues


ControlMessage = Annotated[
    UpdateMessage | PauseMessage | ResumeMessage | ResetMessage | CueMessage, Field(discriminator="type")
]
_ADAPTER: TypeAdapter[ControlMessage] = TypeAdapter(ControlMessage)


def check_prompt(prompt: str | list[str] | None, weights: list[float] | None, max_chars: int) -> None:
    if prompt is None:
        if weights is not None:
            raise ControlError("prompt_weights given without prompt")
        return
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not prompts:
        raise ControlError("prompt list is empty")
    for text in prompts:
        if not text.strip():
            raise ControlError("prompt is empty")
        if len(text) > max_chars:
            raise ControlError(f"prompt is {len(text)} characters long; the limit is {max_chars}")
        bad = next((c for c in text if unicodedata.category(c) in FORBIDDEN_CATEGORIES
                    and c not in ALLOWED_FORMAT_CHARS), None)
        if bad is not None:
            raise ControlError(
                f"prompt contains the control character U+{ord(bad):04X} at position {text.index(bad)}"
            )
    if weights is not None:
        if len(weights) != len(prompts):
            raise ControlError(f"{len(prompts)} prompts but {len(weights)} prompt_weights")
        # Each weight is finite (the models refuse NaN and Infinity), but their sum can still overflow.
        if any(w < 0 for w in weights) or not 0 < sum(weights) < math.inf:
            raise ControlError(f"prompt_weights must be non-negative, not all zero and of a finite sum, got {weights}")


def _no_constant(name: str) -> float:
    raise ControlError(f"control message has {name}, which is not a number JSON allows")


def parse_control(text: str, max_prompt_chars: int) -> ControlMessage:
    """Parse one JSON control message; ControlError with a readable reason when it is wrong."""
    try:
        raw = json.loads(text, parse_constant=_no_constant)  # Python's json reads NaN and Infinity
    except json.JSONDecodeError as exc:
        raise ControlError(f"control message is not JSON: {exc}") from exc
    return control_message(raw, max_prompt_chars)


def control_message(raw: object, max_prompt_chars: int) -> ControlMessage:
    """A decoded control message (the JSON of one, or the playground's controls) with every check
    ``parse_control`` makes; ControlError with a readable reason when it is wrong."""
    try:
        message = _ADAPTER.validate_python(raw)
    except ValidationError as exc:
        reasons = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'message'}: {e['msg']}" for e in exc.errors())
        raise ControlError(f"bad control message: {reasons}") from exc
    if isinstance(message, UpdateMessage):
        check_prompt(message.prompt, message.prompt_weights, max_prompt_chars)
    return message


class StreamOptions(_Message):
    """Options a client may give when it opens a stream (offer body, WHIP or /ws query)."""

    # JSON has no NaN or Infinity, but Python's parser accepts them: refused as not finite.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    prompt: str | None = None
    noise_scale: float | None = Field(default=None, ge=MIN_NOISE_SCALE, le=1.0)
    steps: int | None = Field(default=None, ge=1, le=MAX_STEPS)
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    stabilize: bool = True
    loras: LoRAStrengths | None = Field(default=None, max_length=MAX_LORAS)  # over the served defaults
    # What the stream is called where a name is shown: its NDI source's name (docs/ndi.md).
    label: Annotated[str, StringConstraints(min_length=1, max_length=64)] | None = None
    # A live stream takes a camera in and sends a look out; text-to-video runs in the playground and
    # the Python API, where the model has it (GET /api/config lists the model's modes).
    mode: Literal["v2v"] = "v2v"

    @field_validator("mode", mode="before")
    @classmethod
    def _live_streams_are_v2v(cls, mode: object) -> object:
        if mode != "v2v":
            raise ValueError(f"a live stream is video-to-video (a camera in, a look out), not {mode!r}; "
                             "text-to-video runs in the playground and the Python API where the model has it "
                             "(GET /api/config lists the model's modes)")
        return mode

    @field_validator("label")
    @classmethod
    def _printable_label(cls, label: str | None) -> str | None:
        if label is not None and (not label.isprintable() or label != label.strip()):
            raise ValueError("a label is printable characters, without leading or trailing spaces")
        return label

    def to_settings(
        self, default_prompt: str, max_prompt_chars: int, default_noise_scale: float = GENERIC_NOISE_SCALE,
        default_steps: int = GENERIC_STEPS,
    ) -> StreamSettings:
        check_prompt(self.prompt, None, max_prompt_chars)
        return StreamSettings(
            prompt=self.prompt or default_prompt,
            noise_scale=self.noise_scale if self.noise_scale is not None else default_noise_scale,
            steps=self.steps if self.steps is not None else default_steps,
            seed=self.seed,
            stabilize=self.stabilize,
            loras=dict(self.loras or {}),
        )


def describe_errors(errors: Sequence[Mapping[str, Any]]) -> str:
    """Pydantic/FastAPI validation errors as one sentence: "noise_scale: must be a finite number;
    sdp: is required". Only locations and messages: the input is not echoed (it may be huge, or
    NaN, which a JSON answer cannot carry)."""
    reasons = []
    for error in errors:
        loc = [str(part) for part in error.get("loc", ())]
        if loc and loc[0] in ("body", "query", "path", "header"):
            loc = loc[1:]
        message = str(error.get("msg", "is not valid"))
        if error.get("type") == "json_invalid":
            message = "the body is not valid JSON"
        elif error.get("type") == "missing":
            message = "is required" if loc else "the request body is required"
        elif error.get("type") == "extra_forbidden":
            message = "is not a known field"
        elif message.startswith("Input should be "):
            message = "must be " + message.removeprefix("Input should be ")
        reasons.append(f"{'.'.join(loc)}: {message}" if loc else message)
    return "; ".join(reasons)


def options_from_query(query: Mapping[str, str]) -> StreamOptions:
    """StreamOptions from URL query parameters; ControlError naming the bad parameter."""
    fields = StreamOptions.model_fields
    try:
        return StreamOptions.model_validate({k: v for k, v in query.items() if k in fields})
    except ValidationError as exc:
        raise ControlError(f"bad stream option: {describe_errors(exc.errors())}") from exc
