"""The engine's thread budget: as many intra-op threads as the cores this process actually gets.

A step split over OpenMP threads waits at every barrier for its slowest thread; beside a busy
neighbour on 2 cores one of them is always off its core, and the step pays for the neighbour many
times over: `diffcast bench engine --model default --steps 1 --threads 2` took 107 ms per chunk on a
quiet box and 397 ms beside one busy process, where 1 thread took 195 ms (issue 36). The wait policy
cannot follow (libgomp reads OMP_WAIT_POLICY / GOMP_SPINCOUNT once, at load), but the thread count
can, at every step: at one thread there is no barrier, so nothing spins or sleeps on a partner.

The signal is the CPU time of the cores this process may use that is not its own (`/proc/stat` less
`/proc/self/stat`) over a window: what other programs want is what the process cannot have. It is
measured while the engine competes with them, so where the cores were all busy, a neighbour got only
its scheduler share (CFS: the same per runnable thread; one spinner beside two engine threads on two
cores used 2/3 of a core, wanting 1): its demand is then its use scaled by the engine's threads over
this process's use. The count changes with a gap between the thresholds down and up, so it does not
flap. Without the kernel's figures (not Linux) the budget stays at its most.

Only where OpenMP's threads spin: with `OMP_WAIT_POLICY=PASSIVE` (what `diffcast serve` sets) a thread
waiting at a barrier sleeps and gives its core back, and beside one busy process two threads ran a
chunk faster than one (docs/performance.md, "The CPU engine beside busy programs"): the budget then
keeps every thread and only reports the cores left.

OpenCV's own thread pool (the stabilizer's optical flow and remaps, the frames' resizes and colour
conversions) is made serial for a CPU engine (`serial_opencv`): the lanes are the engine's parallelism,
one thread each, and OpenCV splitting a 128x128 remap over a pool of its own on top only adds runnable
threads the cores do not have (four streams on the 2-core box: 8-12 % of the engine's CPU per frame).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class CpuTimes:
    """Cumulative CPU seconds: the cores this process may use busy (with anything), and this process
    (all its threads)."""

    machine_busy_s: float
    own_s: float


@dataclass(frozen=True)
class ThreadBudgetConfig:
    window_s: float = 0.5  # the CPU times are read at most this often (a step's call costs nothing between)
    # The cores count as all busy (others got only their scheduler share) within this of all of them:
    # /proc/stat counts in 10 ms ticks, a 0.5 s window on 2 cores is 100 of them.
    saturated_margin: float = 0.15
    # One thread fewer once the cores left fall this far below the count, one more once they are within
    # ``up_margin`` of the next (the gap between keeps the count from flapping on a noisy neighbour).
    down_margin: float = 0.4
    up_margin: float = 0.3
    # Whether OpenMP's threads spin at a barrier (`openmp_spins`); sleeping ones keep every thread.
    spinning: bool = True


class ThreadBudget:
    """The intra-op threads the engine may use now, between 1 and ``most``, from the cores left to this
    process by everything else on the machine. ``sample`` reads the CPU times (None: no figures) and
    ``clock`` says when; both injected so a test drives the budget with a simulated neighbour."""

    def __init__(self, most: int, cores: float, sample: Callable[[], CpuTimes | None],
                 clock: Callable[[], float] = time.monotonic, config: ThreadBudgetConfig | None = None) -> None:
        self.most = max(1, most)
        self.cores = cores
        self.threads = self.most
        self.cores_left: float | None = None  # the last window's figure; None before the first
        self.changes = 0
        self._sample = sample
        self._clock = clock
        self.config = config or ThreadBudgetConfig()
        self._last: tuple[float, CpuTimes] | None = None

    def update(self) -> int:
        """The budget now: re-decided once a window has passed since the last reading."""
        now = self._clock()
        if self._last is not None and now - self._last[0] < self.config.window_s:
            return self.threads
        times = self._sample()
        if times is None:
            return self.threads
        if self._last is not None:
            at, before = self._last
            own = (times.own_s - before.own_s) / (now - at)
            others = max(0.0, (times.machine_busy_s - before.machine_busy_s) / (now - at) - own)
            self.cores_left = max(0.0, self.cores - self._demand(others, own))
            self._decide(self.cores_left)
        self._last = (now, times)
        return self.threads

    def _demand(self, others: float, own: float) -> float:
        """The cores other programs want: what they used, or where every core was busy, what they used
        scaled to one scheduler share per runnable thread (this process's: the engine's threads)."""
        if own <= 0 or others + own < self.cores - self.config.saturated_margin:
            return others
        return others * self.threads / own

    def _decide(self, left: float) -> None:
        if not self.config.spinning:
            return
        threads = self.threads
        while threads > 1 and left < threads - self.config.down_margin:
            threads -= 1
        while threads < self.most and left >= threads + 1 - self.config.up_margin:
            threads += 1
        if threads != self.threads:
            log.info("engine threads %d -> %d: %.2f of %g cores left to this process", self.threads, threads,
                     left, self.cores)
            self.threads = threads
            self.changes += 1


def process_cpu_times(cpus: frozenset[int]) -> CpuTimes | None:
    """The busy CPU seconds of the cores in ``cpus`` (/proc/stat's user, nice, system, irq, softirq and
    steal of each) and this process's (/proc/self/stat utime + stime); None where /proc has neither."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in values[:8])
            busy += user + nice + system + irq + softirq + steal
    return CpuTimes(machine_busy_s=busy / CLOCK_TICKS, own_s=(int(own[11]) + int(own[12])) / CLOCK_TICKS)


def process_cpus() -> frozenset[int]:
    """The cores this process may run on (its affinity; every core where the OS cannot say)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return frozenset(range(os.cpu_count() or 1))


def openmp_spins(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether OpenMP's threads spin at a barrier, from the variables libgomp read at load (this process's
    environment, set before torch loaded: app/cli.py): not with OMP_WAIT_POLICY=PASSIVE or
    GOMP_SPINCOUNT=0."""
    return environ.get("OMP_WAIT_POLICY", "").strip().lower() != "passive" and \
        environ.get("GOMP_SPINCOUNT", "").strip() != "0"


def serial_opencv() -> None:
    """OpenCV runs every function on its caller's thread from now on (process-wide: OpenCV has one pool).
    For a CPU engine, whose lanes already take the cores (module docstring); the results are the same
    bytes, OpenCV's parallel loops split rows, not sums."""
    import cv2

    cv2.setNumThreads(1)


def thread_budget(most: int) -> ThreadBudget:
    """A budget of at most ``most`` threads over the kernel's figures for the cores this process may use."""
    cpus = process_cpus()
    return ThreadBudget(most, len(cpus), lambda: process_cpu_times(cpus),
                        config=ThreadBudgetConfig(spinning=openmp_spins()))
