"""Busy neighbours: started before the loaded rows, every one gone after (also after an error), and
`diffcast bench engine --busy N` reports quiet rows, then loaded ones, in one run."""

from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Iterator

import psutil
import pytest
import torch

from app.busy_neighbours import BusyNeighbours
from app.commands import bench


@pytest.fixture(autouse=True)
def keep_threads() -> Iterator[None]:
    previous = torch.get_num_threads()  # --threads changes torch's global setting
    yield
    torch.set_num_threads(previous)


def spinners() -> list[psutil.Process]:
    """This process's children that are busy neighbours (a zombie counts: not reaped)."""
    return [child for child in psutil.Process().children() if "getppid" in " ".join(child.cmdline() or [""])]


def test_neighbours_spin_while_entered_and_leave_nothing_behind() -> None:
    with BusyNeighbours(2) as busy:
        pids = busy.pids
        assert len(pids) == 2 and sorted(p.pid for p in spinners()) == sorted(pids)
        for pid in pids:
            assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    assert spinners() == [] and not any(psutil.pid_exists(pid) and psutil.Process(pid).ppid() == os.getpid()
                                        for pid in pids)
    with pytest.raises(RuntimeError, match="measured"), BusyNeighbours(1):
        raise RuntimeError("measured row failed")
    assert spinners() == []
    with BusyNeighbours(0) as none:
        assert none.pids == []


def test_a_neighbour_ends_itself_once_its_parent_is_gone() -> None:
    """A benchmark killed outright: its neighbours see a new parent and stop spinning."""
    import subprocess
    import sys

    parent = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from app.busy_neighbours import BusyNeighbours\n"
                               "busy = BusyNeighbours(1).__enter__()\n"
                               "print(busy.pids[0], flush=True)\n"
                               "time.sleep(60)\n"], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    child = psutil.Process(pid)
    try:
        child.wait(timeout=10)
    except psutil.TimeoutExpired:
        child.kill()
        raise AssertionError("the busy neighbour outlived its parent") from None


def test_bench_engine_measures_quiet_rows_then_loaded_rows(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["engine", "--model", "random:tiny", "--steps", "1", "--sparsity", "0,0.5", "--chunks", "2",
                              "--threads", "2", "--busy", "1", "--json"])
    assert bench.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["busy"] == 1 and report["threads"] == 2 and report["thread_budget"] is True
    assert [(r["busy"], r["sparsity"]) for r in report["results"]] == [(0, 0.0), (0, 0.5), (1, 0.0), (1, 0.5)]
    for row in report["results"]:
        assert sum(row["step_threads"].values()) == 2  # every timed chunk ran on a thread count of 1 or 2
        assert set(row["step_threads"]) <= {"1", "2"}
    assert report["prompt_switch_busy"]["prompt_kv_ms"] > 0
    assert spinners() == []


def test_bench_engine_fixed_threads_keeps_every_step_on_them(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["engine", "--model", "random:tiny", "--steps", "1", "--chunks", "2", "--threads", "2",
                              "--fixed-threads", "--json"])
    assert bench.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["thread_budget"] is False and "prompt_switch_busy" not in report
    (row,) = report["results"]
    assert row["busy"] == 0 and row["step_threads"] == {"2": 2}
