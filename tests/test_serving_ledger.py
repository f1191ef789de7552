"""Executor-side ledger: observations become the views the policy reads."""

from __future__ import annotations

import pytest

from engine.serving.ledger import Camera, StreamLedger
from engine.serving.profile import bundled_profile
from engine.serving.snapshot import Admission, WorkerView

REF = bundled_profile().reference()


def admitted(ledger: StreamLedger, sid: int = 1, worker: int = 0, now: float = 0.0) -> None:
    ledger.admit(Admission(sid, True, worker, 3.0), now, content_s=5.0, state_bytes=1e9)


def test_admission_view_and_inflight_remaining() -> None:
    led = StreamLedger()
    admitted(led)
    v = led.view(1, 0.0, running=False)
    assert v.slack_s == pytest.approx(3.0) and v.first_chunk and not v.resident and v.runnable
    led.restore(1)
    led.chunk_started(1, 0.0, REF)
    step = REF.first_chunk_latency_s / REF.config.steps
    led.step_done(1, step)
    v = led.view(1, step + 0.5 * step, running=True)
    assert v.inflight_remaining_s == pytest.approx(2.5 * step)  # 3 steps left, half of one elapsed
    assert v.inflight_point is REF
    for k in range(3):
        led.step_done(1, step * (k + 2))
    out = led.chunk_done(1, 4 * step, 0.5625)
    assert out is not None and out.on_time
    assert led.view(1, 4 * step, running=False).slack_s == pytest.approx(3.0 - 4 * step + 0.5625)


def test_prompt_switch_discards_the_old_prompts_chunk() -> None:
    led = StreamLedger()
    admitted(led)
    led.chunk_started(1, 0.0, REF)
    assert led.prompt_switch(1, 0.2, running=True)
    assert led.chunk_done(1, 0.8, 0.75) is None  # started before the switch: not playable
    assert led.entries[1].tracker.generated_s == 0.0


def test_move_requires_chunk_boundary_and_sets_cooldown_and_transfer() -> None:
    led = StreamLedger()
    admitted(led)
    led.chunk_started(1, 0.0, REF)
    with pytest.raises(ValueError, match="chunk boundary"):
        led.move(1, 3, 0.1, 0.05)
    for k in range(REF.config.steps):
        led.step_done(1, 0.1 * (k + 1))
    led.chunk_done(1, 0.5, 0.5625)
    led.move(1, 3, 0.5, 0.05)
    assert [e.sid for e in led.on_worker(3)] == [1] and led.on_worker(0) == []
    v = led.view(1, 0.52, running=False)
    assert v.last_rehomed_at == 0.5 and not v.runnable
    assert led.view(1, 0.56, running=False).runnable


def test_snapshot_lists_active_streams_and_lookahead_cap() -> None:
    led = StreamLedger(max_lookahead_s=2.0)
    admitted(led, 1, 0)
    admitted(led, 2, 1)
    led.leave(2, running=False)
    snap = led.snapshot(0.5, [WorkerView(0), WorkerView(1)])
    assert [v.stream_id for v in snap.streams] == [1]
    assert not snap.streams[0].runnable  # slack 2.5 s >= cap 2.0 s: live input is not there yet
    assert led.view(1, 1.1, running=False).runnable
    with pytest.raises(ValueError, match="not admitted"):
        led.admit(Admission(9, False, None, 3.0, "full"), 0.0, 5.0, 0.0)


def finish_chunk(led: StreamLedger, sid: int, now: float, duration_s: float) -> None:
    led.chunk_started(sid, now, REF)
    for _ in range(REF.config.sequential_steps):
        led.step_done(sid, now)
    led.chunk_done(sid, now, duration_s)


def test_camera_gates_each_chunk_on_its_last_input_frame() -> None:
    # 8 fps camera, first chunk 1 frame, then 4-frame chunks; frame i is captured at i / 8 s, so the
    # chunk holding frames 1-4 can start at 0.5 s, frames 5-8 at 1.0 s (plus the pause below).
    led = StreamLedger(camera=Camera(first_chunk_s=0.125, chunk_s=0.5, frame_s=0.125))
    admitted(led)
    assert led.view(1, 0.0, running=False).runnable  # frame 0 is there at arrival
    finish_chunk(led, 1, 0.05, 0.125)
    assert not led.view(1, 0.49, running=False).runnable
    assert led.input_wait_s(1, 0.3) == pytest.approx(0.2)
    assert led.view(1, 0.5, running=False).runnable
    finish_chunk(led, 1, 0.6, 0.5)
    led.pause(1, 0.7)  # the camera stands still for 1 s
    assert led.input_wait_s(1, 1.2) == float("inf")
    led.resume(1, 1.7)
    assert not led.view(1, 1.99, running=False).runnable
    assert led.view(1, 2.0, running=False).runnable
