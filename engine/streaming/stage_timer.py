"""A chunk's stage times without a device-wide sync: marks at the stage boundaries, read when asked for.

`StreamRuntime.run_chunks` used to take ``time.perf_counter()`` after a ``torch.cuda.synchronize`` at
every stage boundary (encode / DiT / decode / deblock / stabilize): six device-wide syncs per chunk on
the first H100 run, each one draining the GPU's queue while the CPU waited, so the stages could not
overlap the next one's launches. Here each boundary records a mark: on CUDA an event on the device's
current stream (the kernels' order, not the CPU's), on a CPU ``perf_counter`` (its kernels run
synchronously, so the wall clock is the compute clock). Nothing waits while the chunk runs; the times
are resolved when someone reads them (:meth:`StageTimer.last`), by then the chunk's frames have gone to
the host (the stabilizer's OpenCV, the output's conversion) and the last event has long completed, so
the read's one wait (on that event, not the device) returns at once. A chunk's marks nobody reads are
dropped at the next chunk.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

# The boundaries of one chunk, in the order the runtime records them: each stage runs from the mark
# before it to its own (encode ends at "entered", the DiT at "denoised", decode at "decoded", and the
# stabilizer with the fit to the stream's size at "end").
BOUNDARIES = ("begin", "entered", "denoised", "decoded", "end")


@dataclass(frozen=True)
class StageTimings:
    """Wall time of the last chunk's stages (for the whole batch of streams)."""

    encode_s: float = 0.0
    dit_s: float = 0.0
    decode_s: float = 0.0
    stabilize_s: float = 0.0  # stage 4: the stabilizer at the engine size and the fit to the stream's size
    deblock_s: float = 0.0  # part of decoding, timed apart (not in decode_s)

    @property
    def total_s(self) -> float:
        return self.encode_s + self.dit_s + self.decode_s + self.deblock_s + self.stabilize_s


class Mark(Protocol):
    """A point in the device's work: what ``torch.cuda.Event(enable_timing=True)`` offers."""

    def record(self) -> None: ...

    def synchronize(self) -> None:
        """Wait until the work before the mark is done (on CUDA: that work only, not the device's)."""
        ...

    def elapsed_time(self, end: Mark) -> float:
        """Milliseconds from this mark to ``end``, both recorded and done."""
        ...


class WallMark:
    """A mark on a CPU: the wall clock when recorded (``now``, injectable for tests)."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self._now = now
        self.t: float | None = None

    def record(self) -> None:
        self.t = self._now()

    def synchronize(self) -> None:
        """Nothing to wait for: the CPU's work was done when the mark was recorded."""

    def elapsed_time(self, end: Mark) -> float:
        if not isinstance(end, WallMark) or self.t is None or end.t is None:
            raise ValueError("elapsed_time needs two recorded wall marks")
        return (end.t - self.t) * 1000.0


class CudaMark:
    """A timing event recorded on ``device``'s current stream, where the runtime's kernels queue."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.event = torch.cuda.Event(enable_timing=True)

    def record(self) -> None:
        self.event.record(torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        self.event.synchronize()

    def elapsed_time(self, end: Mark) -> float:
        if not isinstance(end, CudaMark):
            raise ValueError("elapsed_time needs two CUDA marks")
        return float(self.event.elapsed_time(end.event))


def mark_factory(device: torch.device) -> Callable[[], Mark]:
    """New marks for ``device``: CUDA events on a GPU, the wall clock elsewhere."""
    if device.type == "cuda":
        return lambda: CudaMark(device)
    return WallMark


class _Chunk:
    """One chunk's marks: the stage boundaries, and the deblocking spans inside decoding."""

    def __init__(self) -> None:
        self.marks: dict[str, Mark] = {}
        self.deblocks: list[tuple[Mark, Mark]] = []
        self.timings: StageTimings | None = None

    def resolve(self) -> StageTimings:
        if self.timings is None:
            m = self.marks
            m["end"].synchronize()  # every other mark was recorded before it, on the same stream

            def seconds(a: Mark, b: Mark) -> float:
                return a.elapsed_time(b) / 1000.0

            deblock = sum(seconds(a, b) for a, b in self.deblocks)
            self.timings = StageTimings(
                encode_s=seconds(m["begin"], m["entered"]), dit_s=seconds(m["entered"], m["denoised"]),
                decode_s=seconds(m["denoised"], m["decoded"]) - deblock, deblock_s=deblock,
                stabilize_s=seconds(m["decoded"], m["end"]))
        return self.timings


class StageTimer:
    """Stage boundaries of the chunks a runtime runs whole (:meth:`StreamRuntime.run_chunks`).

    ``start`` opens a chunk, ``boundary(name)`` marks the end of each stage in :data:`BOUNDARIES` order,
    ``span`` times a part of decoding (deblocking) while a chunk is open, and ``last`` returns the
    newest finished chunk's `StageTimings`, resolved on the first read. ``marks``: the mark factory
    (default :func:`mark_factory`; tests inject their own)."""

    def __init__(self, device: torch.device, marks: Callable[[], Mark] | None = None) -> None:
        self._new = marks or mark_factory(device)
        self._open: _Chunk | None = None
        self._done: _Chunk | None = None

    def _mark(self) -> Mark:
        mark = self._new()
        mark.record()
        return mark

    def start(self) -> None:
        self._open = _Chunk()
        self._open.marks["begin"] = self._mark()

    def boundary(self, name: str) -> None:
        chunk = self._open
        if chunk is None:
            raise RuntimeError("no chunk is open: call start() first")
        expected = BOUNDARIES[len(chunk.marks)]
        if name != expected:
            raise ValueError(f"stage boundary {name!r} out of order: {expected!r} comes next")
        chunk.marks[name] = self._mark()
        if name == BOUNDARIES[-1]:
            self._done, self._open = chunk, None

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        """Times the block as a deblocking span of the open chunk; nothing at all when none is open (a
        chunk run stage by stage, as the serving path does, records no marks)."""
        chunk = self._open
        if chunk is None:
            yield
            return
        start = self._mark()
        yield
        chunk.deblocks.append((start, self._mark()))

    def last(self) -> StageTimings:
        """The newest finished chunk's stage times (zeros before the first)."""
        return self._done.resolve() if self._done is not None else StageTimings()
