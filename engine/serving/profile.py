"""Fidelity configurations, latency/quality profiles, and the Pareto frontier.

A *fidelity configuration* is one setting of every speed/quality knob the engine offers for one chunk.
A *profile* maps configurations to their measured (or, until the profiler runs, derived) per-chunk
latency and quality. The policy only ever reads profiles; the engine's profiler writes them.

File format (JSON, ``format = "diffcast-fidelity-profile/1"``)::

    {"format": "diffcast-fidelity-profile/1", "model": "...", "device": "H100-80GB",
     "resolution": [832, 480], "chunk_latent_frames": 3, "chunk_pixel_frames": 12,
     "first_chunk_pixel_frames": 9, "fps": 16.0, "source": "derived: ...",
     "points": [{"config": {"steps": 4, ...}, "latency_s": 0.857, "first_chunk_latency_s": 0.74,
                 "quality": 84.0, "state_bytes": 6.0e9, "source": "derived", "needs": ["bf16", "cuda"]}, ...]}

``needs`` (optional, default none) names the capabilities a point needs (:mod:`engine.fidelity`: a device
type such as "cuda", "bf16", "sparse-attention", "fp8-attention"); what its config's knobs need is implied
whether listed or not. :meth:`FidelityProfile.engine_runnable` keeps the points the engine can run on the
device the profile was made for, which is what every planner should use.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.fidelity import FidelityConfig, engine_capabilities, required_capabilities

__all__ = ["FidelityProfile", "ProfilePoint", "profile_device_type"]

PROFILE_FORMAT = "diffcast-fidelity-profile/1"
BUNDLED_PROFILES = Path(__file__).parent / "profiles"


@dataclass(frozen=True, slots=True)
class ProfilePoint:
    """One profiled configuration: seconds per chunk (whole stream batch), quality score, state size."""

    config: FidelityConfig
    latency_s: float
    first_chunk_latency_s: float
    quality: float
    state_bytes: float
    source: str = "measured"
    needs: tuple[str, ...] = ()  # capabilities beyond the config's own (see requirements)
    # Device memory one chunk takes beyond the states (activations, allocator slack), measured on CUDA;
    # 0 where unmeasured. Admission keeps it free (engine/serving/device_memory.py).
    workspace_bytes: float = 0.0

    def __post_init__(self) -> None:
        if self.latency_s <= 0 or self.first_chunk_latency_s <= 0:
            raise ValueError(f"latencies must be positive, got {self.latency_s}, {self.first_chunk_latency_s}")
        if not (self.state_bytes >= 0 and self.workspace_bytes >= 0):
            raise ValueError(f"state_bytes and workspace_bytes must be >= 0, got {self.state_bytes}, "
                             f"{self.workspace_bytes}")
        if not all(isinstance(n, str) and n for n in self.needs):
            raise ValueError(f"needs must be non-empty capability names, got {self.needs!r}")

    @property
    def requirements(self) -> frozenset[str]:
        """Everything running this point takes: its ``needs`` plus what its knobs need, so a file that
        lists no needs still cannot put an fp8 point before an engine without fp8 attention."""
        return frozenset(self.needs) | required_capabilities(self.config)


@dataclass(frozen=True)
class FidelityProfile:
    """All profiled configurations of one model on one device at one base resolution."""

    model: str
    device: str
    resolution: tuple[int, int]
    chunk_latent_frames: int
    chunk_pixel_frames: int
    first_chunk_pixel_frames: int
    fps: float
    points: tuple[ProfilePoint, ...]
    source: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    # The lowest quality a stream may be routed to. None: SlackServe's global floor, the median over
    # all configurations. A profile whose quality is an absolute measure with a bar of its own (the
    # embedded model's PSNR against its teachers, where a look under 20 dB is not shipped) states
    # that bar instead: the median of a ladder measured to reach down to the bar would cut off its
    # lower half, the rungs built for overload.
    quality_floor: float | None = None

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a profile needs at least one point")

    @property
    def chunk_duration_s(self) -> float:
        return self.chunk_pixel_frames / self.fps

    @property
    def first_chunk_duration_s(self) -> float:
        return self.first_chunk_pixel_frames / self.fps

    def per_stream(self) -> tuple[ProfilePoint, ...]:
        """Single-stream, single-GPU points: the configurations a per-stream router chooses among."""
        return tuple(p for p in self.points if p.config.stream_batch == 1 and p.config.gpus == 1)

    def reference(self) -> ProfilePoint:
        """The highest-quality single-stream point (ties: fastest): the static-fidelity default."""
        return max(self.per_stream(), key=lambda p: (p.quality, -p.latency_s))

    @property
    def device_type(self) -> str:
        """The torch device type this profile was made on (see :func:`profile_device_type`)."""
        return profile_device_type(self.device)

    def runnable(self, capabilities: Iterable[str]) -> FidelityProfile:
        """Only the points whose :attr:`ProfilePoint.requirements` ``capabilities`` cover."""
        have = frozenset(capabilities)
        points = tuple(p for p in self.points if p.requirements <= have)
        if not any(p.config.stream_batch == 1 and p.config.gpus == 1 for p in points):
            wanted = sorted(set().union(*(p.requirements for p in self.per_stream())) - have)
            raise ValueError(
                f"no single-stream configuration of {self.model}/{self.device} runs with capabilities "
                f"{sorted(have)}; its points also need {wanted}"
            )
        return replace(self, points=points)

    def engine_runnable(self) -> FidelityProfile:
        """Only the points this engine can run on the device type the profile was made for (today: no
        fp8 point anywhere); what a planner must use so it never routes a chunk to a missing knob."""
        return self.runnable(engine_capabilities(self.device_type))

    def filtered(self, keep: Callable[[FidelityConfig], bool]) -> FidelityProfile:
        """Only the points whose config ``keep`` accepts, e.g. what the running engine supports
        (the current CPU engine rejects fp8 and sparse attention)."""
        points = tuple(p for p in self.points if keep(p.config))
        if not any(p.config.stream_batch == 1 and p.config.gpus == 1 for p in points):
            raise ValueError(f"no single-stream configuration of {self.model}/{self.device} passes the filter")
        return replace(self, points=points)

    def find(self, config: FidelityConfig) -> ProfilePoint:
        for p in self.points:
            if p.config == config:
                return p
        raise KeyError(f"configuration {config.label()} is not in profile {self.model}/{self.device}")

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "model": self.model,
            "device": self.device,
            "resolution": list(self.resolution),
            "chunk_latent_frames": self.chunk_latent_frames,
            "chunk_pixel_frames": self.chunk_pixel_frames,
            "first_chunk_pixel_frames": self.first_chunk_pixel_frames,
            "fps": self.fps,
            "source": self.source,
            "notes": list(self.notes),
            **({"quality_floor": self.quality_floor} if self.quality_floor is not None else {}),
            "points": [
                {
                    "config": asdict(p.config),
                    "latency_s": round(p.latency_s, 6),
                    "first_chunk_latency_s": round(p.first_chunk_latency_s, 6),
                    "quality": round(p.quality, 4),
                    "state_bytes": float(p.state_bytes),
                    **({"workspace_bytes": float(p.workspace_bytes)} if p.workspace_bytes else {}),
                    "source": p.source,
                    "needs": list(p.needs),
                }
                for p in self.points
            ],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def _require(obj: dict[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise ValueError(f"{where}: missing required key {key!r}")
    return obj[key]


def profile_from_json(data: dict[str, Any], where: str = "profile") -> FidelityProfile:
    """Parse a profile document; every error names the offending field and point index."""
    fmt = _require(data, "format", where)
    if fmt != PROFILE_FORMAT:
        raise ValueError(f"{where}: unsupported format {fmt!r}, expected {PROFILE_FORMAT!r}")
    points: list[ProfilePoint] = []
    for i, raw in enumerate(_require(data, "points", where)):
        at = f"{where}: points[{i}]"
        cfg_raw = _require(raw, "config", at)
        unknown = set(cfg_raw) - set(FidelityConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{at}: unknown config knobs {sorted(unknown)}")
        try:
            config = FidelityConfig(**cfg_raw)
            latency = float(_require(raw, "latency_s", at))
            points.append(
                ProfilePoint(
                    config=config,
                    latency_s=latency,
                    first_chunk_latency_s=float(raw.get("first_chunk_latency_s", latency)),
                    quality=float(_require(raw, "quality", at)),
                    state_bytes=float(raw.get("state_bytes", 0.0)),
                    workspace_bytes=float(raw.get("workspace_bytes", 0.0)),
                    source=str(raw.get("source", "measured")),
                    needs=tuple(_needs(raw.get("needs", []))),
                )
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{at}: {exc}") from exc
    res = _require(data, "resolution", where)
    return FidelityProfile(
        model=str(_require(data, "model", where)),
        device=str(_require(data, "device", where)),
        resolution=(int(res[0]), int(res[1])),
        chunk_latent_frames=int(_require(data, "chunk_latent_frames", where)),
        chunk_pixel_frames=int(_require(data, "chunk_pixel_frames", where)),
        first_chunk_pixel_frames=int(_require(data, "first_chunk_pixel_frames", where)),
        fps=float(_require(data, "fps", where)),
        points=tuple(points),
        source=str(data.get("source", "")),
        notes=tuple(data.get("notes", ())),
        quality_floor=None if data.get("quality_floor") is None else float(data["quality_floor"]),
    )


def _needs(raw: Any) -> list[str]:
    if not isinstance(raw, list) or not all(isinstance(n, str) for n in raw):
        raise ValueError(f"needs must be a list of capability names, got {raw!r}")
    return raw


# GPU model names as torch.cuda.get_device_name and the derived profiles write them: A100, H100, H200,
# L4, L40S, T4, V100, B200, GH200 (one word of the name, e.g. "NVIDIA H100 80GB HBM3" or "H100-80GB").
_CUDA_MODEL = re.compile(r"(?:a|b|h|l|t|v|gh|gb)\d{1,3}s?")
_CUDA_WORDS = frozenset({"nvidia", "cuda", "geforce", "rtx", "tesla", "quadro"})


def profile_device_type(device: str) -> str:
    """The torch device type ("cpu" or "cuda") a profile's free-text ``device`` names.

    The profiler writes ``"<processor> cpu xN threads"`` on CPU and the CUDA device name on GPU; the
    derived profiles say ``"H100-80GB"``. The one mapping from that text to what the engine runs on.
    """
    words = re.split(r"[^a-z0-9]+", device.lower())
    if "cpu" in words:
        return "cpu"
    if _CUDA_WORDS.intersection(words) or any(_CUDA_MODEL.fullmatch(w) for w in words):
        return "cuda"
    raise ValueError(f"cannot tell which device type profile device {device!r} is (expected a CPU or an NVIDIA GPU)")


def load_profile(path: str | Path) -> FidelityProfile:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}: not valid JSON ({exc})") from exc
    return profile_from_json(data, where=str(p))


def pareto_frontier(points: Iterable[ProfilePoint]) -> tuple[ProfilePoint, ...]:
    """Non-dominated points, sorted by latency ascending (so quality ascends too).

    j dominates i when L_j <= L_i and Q_j >= Q_i with at least one strict. Exact duplicates in
    (L, Q) do not dominate each other; the first one seen is kept.
    """
    ordered = sorted(points, key=lambda p: (p.latency_s, -p.quality))
    frontier: list[ProfilePoint] = []
    best_q = float("-inf")
    for p in ordered:
        if p.quality > best_q:
            frontier.append(p)
            best_q = p.quality
    return tuple(frontier)


def quality_floor(points: Sequence[ProfilePoint], declared: float | None = None) -> float:
    """The lowest quality BMPR routes to: the profile's ``declared`` floor, else SlackServe's global
    floor, the median quality over ALL candidate configurations. A declared floor above every
    candidate (a user's step ceiling, or the device, left only lower points) keeps the best of them."""
    if declared is not None and points:
        return min(declared, max(p.quality for p in points))
    if not points:
        raise ValueError("quality_floor needs at least one point")
    return float(statistics.median(p.quality for p in points))


def bundled_profile(name: str = "wan2.1-1.3b_h100_480p") -> FidelityProfile:
    """A profile shipped with the package (``engine/serving/profiles/<name>.json``)."""
    path = BUNDLED_PROFILES / f"{name}.json"
    if not path.exists():
        have = sorted(p.stem for p in BUNDLED_PROFILES.glob("*.json"))
        raise FileNotFoundError(f"no bundled profile {name!r}; available: {have}")
    return load_profile(path)
