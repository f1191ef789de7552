import pytest

from engine.streaming.slo import LatencyModel, choose_batch_size


def _fitted(a: float, b: float) -> LatencyModel:
    model = LatencyModel()
    for batch in (1, 2, 3, 4, 6, 8):
        model.observe(4, batch, a + b * 4 * batch)
    return model


def test_fit_recovers_a_linear_latency_law() -> None:
    a, b = _fitted(0.05, 0.01).coefficients()
    assert a == pytest.approx(0.05, rel=1e-6)
    assert b == pytest.approx(0.01, rel=1e-6)


def test_choose_largest_batch_meeting_target() -> None:
    model = _fitted(0.05, 0.01)  # L(4, B) = 0.05 + 0.04 B; fps = 4 / L
    choice = choose_batch_size(model, frames_per_slot=4, target_fps=20.0, max_batch=8)
    # 4 / (0.05 + 0.04 B) >= 20  <=>  B <= 3.75
    assert choice.batch == 3 and choice.meets_target
    assert choice.per_stream_fps >= 20.0


def test_no_batch_meets_target_falls_back_to_one() -> None:
    choice = choose_batch_size(_fitted(0.5, 0.1), frames_per_slot=4, target_fps=30.0, max_batch=8)
    assert choice.batch == 1 and not choice.meets_target


def test_batch_capped_by_collected_frames() -> None:
    choice = choose_batch_size(_fitted(0.0, 0.001), frames_per_slot=4, target_fps=1.0, max_batch=8, frames_available=9)
    assert choice.batch == 2


def test_model_follows_load_changes() -> None:
    model = LatencyModel(window=16, decay=0.7)
    for batch in (1, 2, 4, 8):
        model.observe(4, batch, 0.01 * batch)
    for _ in range(3):
        for batch in (1, 2, 4, 8):
            model.observe(4, batch, 0.05 * batch)  # the machine got 5x slower
    assert model.predict(4, 4) == pytest.approx(0.2, rel=0.1)


def test_bad_samples_are_rejected() -> None:
    model = LatencyModel()
    with pytest.raises(ValueError):
        model.observe(4, 1, 0.0)
    with pytest.raises(ValueError):
        model.predict(4, 1)


def test_slo_batcher_explores_then_respects_the_target() -> None:
    from engine.streaming.slo import BatchRequest, SloBatcher

    batcher = SloBatcher(frames_per_slot=4, target_fps=20.0, max_batch=8)
    ready = [BatchRequest(f"s{i}", ("S2/W6", 6)) for i in range(6)]
    assert [len(g) for g in batcher.plan(ready)] == [1] * 6  # nothing measured yet: one at a time
    batcher.observe(1, 0.05 + 0.04)
    assert [len(g) for g in batcher.plan(ready)] == [2, 2, 2]  # explore a second load level
    batcher.observe(2, 0.05 + 0.08)
    # L(4, B) = 0.05 + 0.04 B meets 20 fps up to B = 3.
    assert [len(g) for g in batcher.plan(ready)] == [3, 3]


def test_slo_batcher_never_mixes_keys() -> None:
    from engine.streaming.slo import BatchRequest, SloBatcher

    batcher = SloBatcher(frames_per_slot=4, target_fps=1.0, max_batch=8)
    batcher.observe(1, 0.01)
    batcher.observe(8, 0.02)
    ready = [BatchRequest("a", ("S2",)), BatchRequest("b", ("S1",)), BatchRequest("c", ("S2",))]
    assert sorted(map(sorted, batcher.plan(ready))) == [["a", "c"], ["b"]]
