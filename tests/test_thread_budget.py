"""The engine's thread budget follows the cores other programs leave the process (a simulated neighbour
on a virtual clock), and the lanes run their steps on it."""

from __future__ import annotations

import torch

from engine.streaming.lanes import EngineLanes
from engine.streaming.thread_budget import (
    CpuTimes,
    ThreadBudget,
    ThreadBudgetConfig,
    openmp_spins,
    process_cpu_times,
    process_cpus,
)


class Machine:
    """Two cores on a virtual clock: this process and a neighbour, each using so many cores per second."""

    def __init__(self, cores: int = 2) -> None:
        self.cores = cores
        self.now = 0.0
        self.busy = 0.0
        self.own = 0.0
        self.ours = 2.0  # the engine's threads take what the neighbour leaves them
        self.neighbour = 0.0
        self.readings = 0

    def run(self, seconds: float) -> None:
        own = min(self.ours, self.cores - self.neighbour)
        self.now += seconds
        self.own += own * seconds
        self.busy += (own + self.neighbour) * seconds

    def sample(self) -> CpuTimes:
        self.readings += 1
        return CpuTimes(machine_busy_s=self.busy, own_s=self.own)

    def budget(self, most: int = 2, spinning: bool = True) -> ThreadBudget:
        return ThreadBudget(most, self.cores, self.sample, clock=lambda: self.now,
                            config=ThreadBudgetConfig(spinning=spinning))


def follow(machine: Machine, budget: ThreadBudget, neighbour: float, seconds: float = 3.0) -> int:
    """Steps of 0.1 s for ``seconds`` with a neighbour using ``neighbour`` cores: the budget at the end.
    Beside a neighbour the engine gets a CFS share of the cores (its threads against the neighbour's)."""
    for _ in range(int(seconds / 0.1)):
        threads = budget.update()
        share = machine.cores * neighbour / (neighbour + threads) if neighbour + threads > machine.cores else neighbour
        machine.neighbour = share
        machine.ours = threads
        machine.run(0.1)
    return budget.threads


def test_the_budget_drops_to_one_thread_beside_a_busy_neighbour_and_comes_back_when_it_leaves() -> None:
    machine = Machine()
    budget = machine.budget()
    assert follow(machine, budget, 0.0) == 2  # quiet: every thread
    assert budget.cores_left is not None and budget.cores_left > 1.9
    assert follow(machine, budget, 1.0) == 1  # a whole core's neighbour (it shows as 2/3 beside 2 threads)
    assert budget.cores_left is not None and budget.cores_left < 1.1
    assert follow(machine, budget, 1.0) == 1  # stays: no flapping while the neighbour stays
    assert follow(machine, budget, 0.0) == 2  # gone: every thread again
    assert budget.changes == 2


def test_a_light_neighbour_keeps_both_threads_and_two_busy_ones_leave_one() -> None:
    machine = Machine()
    budget = machine.budget()
    assert follow(machine, budget, 0.15) == 2  # a browser tab's worth: both threads
    assert follow(machine, budget, 2.0) == 1  # the machine is full: one thread, never none
    assert follow(machine, budget, 0.15) == 2


def test_more_cores_give_more_threads_back_one_by_one() -> None:
    machine = Machine(cores=8)
    budget = machine.budget(most=8)
    assert follow(machine, budget, 0.0) == 8
    assert follow(machine, budget, 3.0) == 5
    assert follow(machine, budget, 7.0) == 1
    assert follow(machine, budget, 0.0) == 8


def test_sleeping_openmp_threads_keep_every_thread_and_the_budget_still_reports_the_cores_left() -> None:
    machine = Machine()
    budget = machine.budget(spinning=False)
    assert follow(machine, budget, 1.0) == 2 and budget.changes == 0
    assert budget.cores_left is not None and budget.cores_left < 1.1
    assert openmp_spins({}) and openmp_spins({"OMP_WAIT_POLICY": "active"})
    assert not openmp_spins({"OMP_WAIT_POLICY": "PASSIVE"}) and not openmp_spins({"GOMP_SPINCOUNT": "0"})


def test_the_budget_reads_the_kernel_once_a_window_and_keeps_its_most_without_figures() -> None:
    machine = Machine()
    budget = machine.budget()
    for _ in range(10):  # ten steps within one window: one reading
        budget.update()
        machine.run(0.01)
    assert machine.readings == 1 and budget.cores_left is None
    blind = ThreadBudget(4, 4, lambda: None, clock=lambda: machine.now)
    machine.run(5.0)
    assert blind.update() == 4 and blind.cores_left is None


def test_lanes_take_the_budget_and_split_it() -> None:
    machine = Machine()
    lanes = EngineLanes(1, 2, machine.budget())
    before = torch.get_num_threads()
    try:
        with lanes.step():
            assert torch.get_num_threads() == 2
        machine.neighbour = 2.0  # the machine is taken: the next window leaves this process nothing
        machine.run(1.0)
        with lanes.step():
            assert torch.get_num_threads() == 1
        assert lanes.allowed() == 1 and lanes.last_threads == {0: 1}
    finally:
        torch.set_num_threads(before)


def test_the_kernel_figures_of_this_machine() -> None:
    cpus = process_cpus()
    times = process_cpu_times(cpus)
    assert cpus and times is not None  # the suite runs on Linux
    assert times.machine_busy_s > 0 and 0 < times.own_s
    none = process_cpu_times(frozenset())  # no core of its own: nothing busy to count
    assert none is not None and none.machine_busy_s == 0


def test_a_cpu_engine_runs_opencv_on_its_callers_thread_and_the_stabilizer_gives_the_same_bytes() -> None:
    """The lanes are a CPU engine's parallelism: once the serving engine is loaded OpenCV adds no pool
    threads of its own, and the stabilizer (optical flow, remaps, blurs) steadies a moving clip to
    exactly the bytes it gave with OpenCV's pool."""
    import cv2
    import numpy as np

    from app.server.serving.engine_bridge import InProcessFactory
    from engine.streaming.stabilizer import StabilizerConfig, StabilizerState, TemporalStabilizer

    rng = np.random.default_rng(3)
    size = 256  # large enough for OpenCV to split its loops over a pool
    scene = cv2.GaussianBlur(rng.uniform(0, 255, (size + 64, size + 64, 3)).astype(np.float32), (0, 0), 2.0)
    scene = cv2.normalize(scene, None, 40, 215, cv2.NORM_MINMAX)
    camera = np.stack([scene[8 : 8 + size, 3 * t : 3 * t + size] for t in range(9)]).round().astype(np.uint8)
    model = np.clip(255.0 - camera + rng.normal(0, 8.0, camera.shape), 0, 255)  # a look with flicker

    def steadied() -> list[torch.Tensor]:
        stab, state = TemporalStabilizer(StabilizerConfig()), StabilizerState()
        return [stab(state, torch.from_numpy(camera[a:b]).permute(3, 0, 1, 2),
                     torch.from_numpy(model[a:b]).float().div(127.5).sub(1.0).permute(3, 0, 1, 2))
                for a, b in ((0, 1), (1, 5), (5, 9))]

    before = cv2.getNumThreads()
    try:
        cv2.setNumThreads(2)
        pooled = steadied()
        InProcessFactory.load("tiny-random", "cpu")
        assert cv2.getNumThreads() == 1
        serial = steadied()
    finally:
        cv2.setNumThreads(before)
    for a, b in zip(pooled, serial, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    raw = torch.from_numpy(model[5:9]).float().div(127.5).sub(1.0).permute(3, 0, 1, 2)
    assert (serial[-1] - raw).abs().mean() > 0.01  # it did steady the flicker, not pass the model through
