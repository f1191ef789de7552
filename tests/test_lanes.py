"""Engine lanes: the threads each lane's step gets, and the lane count chosen for a device."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.streaming.lanes import MAX_AUTO_LANES, EngineLanes, auto_lanes


def test_auto_lanes_one_per_cpu_thread_up_to_the_cap_and_one_on_an_accelerator() -> None:
    assert auto_lanes("cpu", 1) == 1
    assert auto_lanes("cpu", 2) == 2
    assert auto_lanes("cpu", 16) == MAX_AUTO_LANES
    assert auto_lanes("cuda:0", 16) == 1


def test_lanes_need_a_thread_count() -> None:
    with pytest.raises(ValueError, match="at least one lane"):
        EngineLanes(0, 2)
    with pytest.raises(ValueError, match="threads"):
        EngineLanes(2)


def test_a_lane_alone_takes_every_thread_and_a_lane_joining_a_busy_one_takes_its_share() -> None:
    lanes = EngineLanes(2, 4)
    seen: dict[str, int] = {}
    first_inside, second_done = threading.Event(), threading.Event()

    def first() -> None:
        with lanes.step():  # no other lane busy: every thread
            seen["first"] = torch.get_num_threads()
            first_inside.set()
            second_done.wait(timeout=30)

    def second() -> None:
        first_inside.wait(timeout=30)
        with lanes.step():  # the first lane is mid-step: half the threads
            seen["second"] = torch.get_num_threads()
        second_done.set()

    before = torch.get_num_threads()
    pair = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in pair:
        t.start()
    for t in pair:
        t.join()
    assert seen == {"first": 4, "second": 2}
    assert torch.get_num_threads() == before  # the lanes' settings stayed on their own threads


def test_one_lane_without_a_thread_count_leaves_torch_alone() -> None:
    before = torch.get_num_threads()
    with EngineLanes().step():
        assert torch.get_num_threads() == before
