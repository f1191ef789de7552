"""What a loaded model can do: its modes, its looks, the operating point it is meant to run at.

Every surface (the Python API, `diffcast stylize`, `diffcast serve`'s /api/config and stream
openings, the playground) reads this one declaration, so none offers a mode the model lacks or
starts a stream at controls that give noise on it. It is derived from the checkpoint's config
(engine/pipeline.py ``model_capabilities``), never guessed per surface.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

Mode = Literal["v2v", "t2v"]
MODES: tuple[Mode, ...] = get_args(Mode)
MODE_NAMES: dict[str, str] = {"v2v": "video-to-video", "t2v": "text-to-video"}

# The embedded default model is a refiner: it learned to restyle an input video from a light
# noise (scale 0.2, one refine step); started from pure noise it has nothing to refine and
# returns noise.
EMBEDDED_T2V_REASON = (
    "it was trained only to restyle an input video (one refine step at a light noise); started from "
    "pure noise it returns noise"
)


def look_name(style: str) -> str:
    """A style's name in a checkpoint as users type it ("pencil_sketch" -> "pencil sketch")."""
    return style.replace("_", " ")


class UnsupportedModeError(ValueError):
    """The loaded model cannot run the mode a caller asked for (the text says why and what it can do)."""


@dataclass(frozen=True)
class ModelCapabilities:
    """A model's declaration: the modes it runs, its shipped looks (empty for an open-vocabulary
    model) and its recommended operating point (noise scale, denoising steps)."""

    modes: tuple[Mode, ...] = MODES
    looks: tuple[str, ...] = ()
    noise_scale: float = 0.8
    steps: int = 2
    # Why a mode is missing, for the error and the playground's disabled tab.
    reasons: dict[str, str] = field(default_factory=dict)

    def supports(self, mode: str) -> bool:
        return mode in self.modes

    def reason(self, mode: str) -> str | None:
        """None when the model runs ``mode``; otherwise one sentence a user can read."""
        if self.supports(mode):
            return None
        name = MODE_NAMES.get(mode, repr(mode))
        why = self.reasons.get(mode, "the checkpoint does not declare it")
        offers = ", ".join(MODE_NAMES[m] for m in self.modes) or "nothing"
        return f"this model cannot do {name}: {why}. It does: {offers}."

    def require(self, mode: str) -> None:
        """UnsupportedModeError unless the model runs ``mode``."""
        reason = self.reason(mode)
        if reason is not None:
            raise UnsupportedModeError(reason)

    def to_json(self) -> dict[str, Any]:
        return {
            "modes": list(self.modes),
            "looks": list(self.looks),
            "noiseScale": self.noise_scale,
            "steps": self.steps,
            "unsupported": {m: self.reason(m) for m in MODES if not self.supports(m)},
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelCapabilities:
        """From a diffcast model config (the ``.json`` beside a ``.safetensors``): ``modes`` where the
        config names them, else video-to-video only for the embedded format and both otherwise."""
        sampler = config.get("sampler", {})
        embedded = str(config.get("format", "")).startswith("diffcast-embedded")
        modes = tuple(config.get("modes") or (("v2v",) if embedded else MODES))
        unknown = [m for m in modes if m not in MODES]
        if unknown:
            raise ValueError(f"unknown modes {unknown} in the model config; known: {list(MODES)}")
        return cls(
            modes=modes,
            looks=tuple(look_name(name) for name in config.get("prototypes", {})),
            noise_scale=float(sampler.get("noise_scale", 0.8)),
            steps=int(sampler.get("default_num_steps", 2)),
            reasons={"t2v": EMBEDDED_T2V_REASON} if embedded else {},
        )
