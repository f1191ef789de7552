"""SLO-aware stream-batch sizing (StreamDiffusionV2 §4.1).

The DiT is memory-bound at small batch sizes, so one forward over B stream slots costs little more
than one over a single slot: latency grows roughly linearly in the number of frames in flight,
L(T, B) ~ a + b * B * T. A stream that receives T frames per forward meets its frame-rate target
f when T / L(T, B) >= f. We fit (a, b) to measured forwards (recent ones weigh more, so the model
follows load changes) and pick the largest B that still meets the target: the largest B gives
the best hardware utilisation, the target bounds it.

Pure Python (no torch): the serving policy and the simulator use it too.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class LatencySample:
    frames_per_slot: int  # T
    batch: int  # B
    seconds: float


class LatencyModel:
    """Weighted least-squares fit of L(T, B) = a + b * B * T over a window of recent samples."""

    def __init__(self, window: int = 64, decay: float = 0.95) -> None:
        if window < 2:
            raise ValueError("window must hold at least 2 samples")
        if not 0.0 < decay <= 1.0:
            raise ValueError("decay must be in (0, 1]")
        self._samples: deque[LatencySample] = deque(maxlen=window)
        self._decay = decay

    def observe(self, frames_per_slot: int, batch: int, seconds: float) -> None:
        if frames_per_slot < 1 or batch < 1:
            raise ValueError("frames_per_slot and batch must be >= 1")
        if seconds <= 0.0:
            raise ValueError("a measured latency must be positive")
        self._samples.append(LatencySample(frames_per_slot, batch, seconds))

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    @property
    def batch_levels(self) -> set[int]:
        """Distinct batch sizes among the samples in the window."""
        return {s.batch for s in self._samples}

    def coefficients(self) -> tuple[float, float]:
        """(a, b) of L = a + b * B * T; with one distinct load level, all cost is put in b."""
        if not self._samples:
            raise ValueError("no latency samples yet")
        n = len(self._samples)
        weights = [self._decay ** (n - 1 - i) for i in range(n)]
        xs = [float(s.frames_per_slot * s.batch) for s in self._samples]
        ys = [s.seconds for s in self._samples]
        w_sum = sum(weights)
        x_mean = sum(w * x for w, x in zip(weights, xs, strict=True)) / w_sum
        y_mean = sum(w * y for w, y in zip(weights, ys, strict=True)) / w_sum
        var = sum(w * (x - x_mean) ** 2 for w, x in zip(weights, xs, strict=True))
        if var <= 1e-12:
            return 0.0, y_mean / x_mean
        cov = sum(w * (x - x_mean) * (y - y_mean) for w, x, y in zip(weights, xs, ys, strict=True))
        b = max(cov / var, 0.0)
        a = max(y_mean - b * x_mean, 0.0)
        return a, b

    def predict(self, frames_per_slot: int, batch: int) -> float:
        a, b = self.coefficients()
        return a + b * frames_per_slot * batch


@dataclass(frozen=True)
class BatchChoice:
    batch: int
    predicted_latency_s: float
    per_stream_fps: float
    meets_target: bool


def choose_batch_size(
    model: LatencyModel,
    frames_per_slot: int,
    target_fps: float,
    max_batch: int,
    frames_available: int | None = None,
) -> BatchChoice:
    """Largest B in [1, max_batch] whose predicted per-stream rate T / L(T, B) meets ``target_fps``.

    ``frames_available`` caps B * T at the frames already collected (a batch cannot wait for
    frames that have not arrived). With no B meeting the target, B = 1 (the fastest option).
    """
    if target_fps <= 0.0:
        raise ValueError("target_fps must be positive")
    limit = max_batch
    if frames_available is not None:
        limit = min(limit, max(frames_available // frames_per_slot, 1))
    best: BatchChoice | None = None
    for batch in range(1, limit + 1):
        latency = model.predict(frames_per_slot, batch)
        fps = frames_per_slot / latency if latency > 0 else float("inf")
        if fps >= target_fps:
            best = BatchChoice(batch, latency, fps, True)
    if best is not None:
        return best
    latency = model.predict(frames_per_slot, 1)
    return BatchChoice(1, latency, frames_per_slot / latency if latency > 0 else float("inf"), False)


@dataclass(frozen=True)
class BatchRequest:
    """One stream's ready chunk: ``key`` says which streams may share a forward (same fidelity,
    same cache fill level); streams with different keys never batch together."""

    stream_id: str
    key: tuple[object, ...]


class SloBatcher:
    """Groups ready chunks into forwards of at most B rows, B chosen from the measured L(T, B).

    Call :meth:`plan` with the ready chunks, run each group as one batched forward, and report the
    measured time of each group with :meth:`observe`; the latency model keeps re-fitting, so B
    follows load changes while streams run.
    """

    def __init__(self, frames_per_slot: int, target_fps: float, max_batch: int = 8, model: LatencyModel | None = None) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        self.frames_per_slot = frames_per_slot
        self.target_fps = target_fps
        self.max_batch = max_batch
        self.model = model or LatencyModel()

    def batch_size(self) -> int:
        # Until two distinct load levels are measured, explore: grow B one step at a time.
        levels = self.model.batch_levels
        if len(levels) < 2:
            return min(self.max_batch, max(levels, default=0) + 1)
        return choose_batch_size(self.model, self.frames_per_slot, self.target_fps, self.max_batch).batch

    def plan(self, ready: list[BatchRequest]) -> list[list[str]]:
        limit = self.batch_size()
        groups: dict[tuple[object, ...], list[str]] = {}
        for request in ready:
            groups.setdefault(request.key, []).append(request.stream_id)
        plan: list[list[str]] = []
        for ids in groups.values():
            plan.extend(ids[i : i + limit] for i in range(0, len(ids), limit))
        return plan

    def observe(self, batch: int, seconds: float) -> None:
        self.model.observe(self.frames_per_slot, batch, seconds)
