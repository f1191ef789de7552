"""Busy neighbours for the benchmarks: N processes that only burn CPU beside the measured one.

A creator's laptop runs OBS, a browser and the like beside the server; `diffcast bench engine --busy N`
and `demos/bench_live.py --busy N` measure every figure quiet and then beside N such processes, in one
run (issue 36). Each neighbour is a tight Python loop in a process of its own (its own GIL, one core's
worth of demand), started before the loaded rows and killed after them. A neighbour also ends by
itself once its parent is gone, so a benchmark killed outright leaves no spinner on the machine.
"""

from __future__ import annotations

import subprocess
import sys
from types import TracebackType

# Signals that it runs, then spins; checks its parent between a million iterations (a few ms).
SPIN = ("import os, sys\n"
        "parent = os.getppid()\n"
        "sys.stdout.write('1'); sys.stdout.flush()\n"
        "while os.getppid() == parent:\n"
        "    for _ in range(1_000_000): pass\n")


class BusyNeighbours:
    """``count`` CPU spinners from entry to exit (none for 0); entry returns once every one runs."""

    def __init__(self, count: int) -> None:
        if count < 0:
            raise ValueError(f"busy neighbours must be 0 or more, got {count}")
        self.count = count
        self.processes: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> BusyNeighbours:
        try:
            for _ in range(self.count):
                process = subprocess.Popen([sys.executable, "-I", "-c", SPIN], stdin=subprocess.DEVNULL,
                                           stdout=subprocess.PIPE)
                self.processes.append(process)
            for process in self.processes:
                assert process.stdout is not None
                if process.stdout.read(1) != b"1":
                    raise RuntimeError(f"busy neighbour {process.pid} exited at start ({process.wait()})")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def stop(self) -> None:
        """Kill every neighbour and reap it."""
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.wait()
            if process.stdout is not None:
                process.stdout.close()
        self.processes = []
