"""Engine lanes: steps of different streams run side by side on one loaded model.

On a CPU the embedded model's operations are too small for OpenMP to split well: on the 2-core box a
2-stream step at the x0.5 rung ran only 1.1x faster on 2 threads than on 1, and a split step waits at
every barrier for the thread a media thread (codecs, the event loop) has just taken its core from
(live, a 4-stream step took 168 ms against 107 ms alone, 43 ms of it queued for a core). Two lanes of
one thread each, every lane a worker of the engine core with streams of its own, ran the same
streams 1.3-1.4x faster alone and lose only their own time to a media thread (docs/service.md,
"Engine lanes").

A lane alone takes every thread: one stream keeps the latency of the whole machine. The thread count
is set per lane thread (OpenMP's setting belongs to the calling thread) at every step, from the
engine's thread budget when it has one (engine/streaming/thread_budget.py: the cores other programs
leave this process; beside a busy neighbour a lane alone runs one thread, not two that wait for each
other at every barrier).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from engine.streaming.thread_budget import ThreadBudget

MAX_AUTO_LANES = 2  # measured on 2 cores; more lanes on bigger CPUs are the operator's choice (--lanes)


def auto_lanes(device: str, threads: int) -> int:
    """Lanes for ``--lanes 0``: one per thread on a CPU, up to MAX_AUTO_LANES; one on an accelerator,
    where one batched forward already fills the device."""
    if device.split(":")[0] != "cpu":
        return 1
    return max(1, min(MAX_AUTO_LANES, threads))


class EngineLanes:
    """How many lanes an engine runs and the threads each step gets (``threads`` None: one lane that
    leaves torch's thread count as it is); with a ``budget`` the lanes share the threads it allows now
    (at most ``threads``) instead of all of them."""

    def __init__(self, lanes: int = 1, threads: int | None = None, budget: ThreadBudget | None = None) -> None:
        if lanes < 1:
            raise ValueError(f"an engine needs at least one lane, got {lanes}")
        if lanes > 1 and threads is None:
            raise ValueError("lanes share the engine's threads: say how many there are")
        self.lanes = lanes
        self.threads = None if threads is None else max(1, threads)
        self.budget = budget
        self.last_threads: dict[int, int] = {}  # lane -> the threads its last step ran on (the stats)
        self._busy = 0
        self._lock = threading.Lock()

    def allowed(self) -> int | None:
        """The threads the lanes share now: the budget's, at most ``threads``."""
        if self.threads is None or self.budget is None:
            return self.threads
        return min(self.threads, self.budget.threads)

    @contextmanager
    def step(self, lane: int = 0) -> Iterator[None]:
        """Around one step on lane ``lane``'s thread: the threads split evenly among the lanes busy now."""
        with self._lock:
            self._busy += 1
            busy = self._busy
            if self.budget is not None:
                self.budget.update()
            allowed = self.allowed()
        if allowed is not None:
            import torch

            # A thread's OpenMP setting starts as the process-wide one at its first torch call; make
            # that call first so that the setting below stays this thread's.
            torch.get_num_threads()
            threads = max(1, allowed // busy)
            torch.set_num_threads(threads)
            self.last_threads[lane] = threads
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
