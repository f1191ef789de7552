"""Ray workers: re-homing and offload keep a stream bit-identical to an unmoved twin, the serving policy's
plans are applied to the actors, and a killed worker's streams are re-admitted while the others' stay
untouched.

The twin is an independent computation: the same model and inputs run in this process through
`engine.pipeline`, never through the cluster code. One local Ray cluster (2 worker actors, 1 torch
thread each, tiny-random model) serves the whole module; the failure test kills workers, so it is last.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from _dit_fixtures import write_random_lora

from engine.cluster.controller import ClusterConfig, ClusterController, ClusterError
from engine.models.wan_dit import CONFIGS, CausalWanDiT
from engine.pipeline import Pipeline, Stream, StreamParams
from engine.serving.derived_profiles import derived_h100_profile
from engine.serving.policy import PolicyConfig, SlackPolicy
from engine.serving.snapshot import Snapshot, StreamView, WorkerView


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA every replica loads switched off (strength 0); one test turns it on for its stream."""
    path = tmp_path_factory.mktemp("lora") / "ink.safetensors"
    write_random_lora(path, CausalWanDiT(CONFIGS["tiny"]), ("ffn.0", "cross_attn.k"), size=0.5)
    return path


@pytest.fixture(scope="module")
def cluster(lora: Path) -> Iterator[ClusterController]:
    config = ClusterConfig(model="tiny-random", workers=2, threads_per_worker=1, object_store_mb=200,
                           loras=(("ink", str(lora), 0.0),))
    controller = ClusterController.start(config)
    yield controller
    controller.shutdown()


@pytest.fixture(scope="module")
def local(lora: Path) -> Pipeline:
    torch.set_num_threads(1)  # the actors run one thread each; same reduction order here
    pipe = Pipeline.load("tiny-random")
    pipe.load_lora("ink", lora, 0.0)
    return pipe


class Feed:
    """Deterministic camera chunks: the first of 1 frame, then of 4."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.first = True

    def next(self) -> np.ndarray:
        n = 1 if self.first else 4
        self.first = False
        return self.rng.integers(0, 256, (n, 128, 128, 3), dtype=np.uint8)


def run_both(cluster: ClusterController, sid: int, twin: Stream, feed: Feed, chunks: int) -> None:
    for _ in range(chunks):
        frames = feed.next()
        np.testing.assert_array_equal(cluster.process(sid, frames), twin.process(frames))


def test_migrated_stream_matches_unmigrated_twin(cluster: ClusterController, local: Pipeline) -> None:
    params = StreamParams(prompt="oil painting", seed=11)
    cluster.open(101, params, worker_id=0)
    twin = local.open_stream(params, "twin")
    feed = Feed(1)
    run_both(cluster, 101, twin, feed, 3)
    # A prompt transition in flight at the move: its progress must travel with the state.
    cluster.update(101, prompt="charcoal drawing", transition_chunks=3)
    twin.update(prompt="charcoal drawing", transition_chunks=3)
    run_both(cluster, 101, twin, feed, 1)

    stats = cluster.migrate(101, dst=1)
    assert cluster.placement()[101] == 1
    assert (stats.src, stats.dst) == (0, 1)
    assert stats.nbytes >= twin.state.nbytes() > 0
    assert stats.hold_s >= stats.export_s + stats.import_s

    # The comparison can fail: a stream that lost its state would produce other frames.
    probe = local.open_stream(twin.params, "restarted")
    probe.process(Feed(99).next())
    frames = feed.next()
    expected = twin.process(frames)
    assert not np.array_equal(probe.process(frames), expected)
    np.testing.assert_array_equal(cluster.process(101, frames), expected)
    run_both(cluster, 101, twin, feed, 2)
    # A LoRA switched on live, then the move back: the strengths travel with the state.
    assert [info["name"] for info in cluster.info.loras] == ["ink"]
    cluster.update(101, loras={"ink": 1.5})
    twin.update(loras={"ink": 1.5})
    run_both(cluster, 101, twin, feed, 1)
    cluster.migrate(101, dst=0)  # and back
    run_both(cluster, 101, twin, feed, 2)
    cluster.close(101)


def test_offloaded_stream_resumes_bit_identical(cluster: ClusterController, local: Pipeline) -> None:
    policy = SlackPolicy(derived_h100_profile(), PolicyConfig())
    params_a, params_b = StreamParams(prompt="claymation", seed=5), StreamParams(prompt="watercolor", seed=6)
    cluster.open(201, params_a, worker_id=1)
    cluster.open(202, params_b, worker_id=1)
    twins = {201: local.open_stream(params_a, "a"), 202: local.open_stream(params_b, "b")}
    feeds = {201: Feed(2), 202: Feed(3)}
    for sid in twins:
        run_both(cluster, sid, twins[sid], feeds[sid], 2)

    # One state slot and two resident streams: the policy evicts the one with more credit (202).
    worker = WorkerView(1, state_slots=1)
    urgent_a = [StreamView(201, 1, slack_s=0.05), StreamView(202, 1, slack_s=50.0)]
    evict = policy.dispatch(0.0, worker, urgent_a)
    assert evict.evict == (202,)
    cluster.apply_dispatch(evict)
    with pytest.raises(RuntimeError, match="suspended"):
        cluster.process(202, feeds[202].next())
    run_both(cluster, 201, twins[201], feeds[201], 1)

    # Now 202 is urgent and off-device: the policy restores it (and evicts 201 for the slot).
    urgent_b = [StreamView(201, 1, slack_s=50.0), StreamView(202, 1, slack_s=0.05, resident=False)]
    swap = policy.dispatch(1.0, worker, urgent_b)
    assert (swap.restore, swap.evict) == ((202,), (201,))
    cluster.apply_dispatch(swap)
    run_both(cluster, 202, twins[202], feeds[202], 2)
    cluster.resume(201)
    run_both(cluster, 201, twins[201], feeds[201], 1)
    for sid in twins:
        cluster.close(sid)


def test_policy_rehome_plan_is_applied(cluster: ClusterController, local: Pipeline) -> None:
    policy = SlackPolicy(derived_h100_profile(), PolicyConfig())
    params = {301: StreamParams(prompt="anime", seed=1), 302: StreamParams(prompt="neon", seed=2)}
    twins, feeds = {}, {}
    for sid, p in params.items():
        cluster.open(sid, p, worker_id=0)
        twins[sid], feeds[sid] = local.open_stream(p, str(sid)), Feed(sid)
        run_both(cluster, sid, twins[sid], feeds[sid], 2)

    # Both streams are URGENT on worker 0 and worker 1 is idle: the tick re-homes the lowest-credit one.
    views = [StreamView(301, 0, slack_s=0.01), StreamView(302, 0, slack_s=0.02)]
    plan = policy.tick(Snapshot(now=100.0, streams=views, workers=cluster.worker_views()))
    assert [(r.stream_id, r.src, r.dst) for r in plan.rehomes] == [(301, 0, 1)]
    done = cluster.apply_tick(plan)
    assert [m.stream_id for m in done] == [301]
    assert cluster.placement() == {301: 1, 302: 0}
    assert cluster.apply_tick(plan) == []  # replayed plan is stale: skipped, not re-applied
    for sid in params:
        run_both(cluster, sid, twins[sid], feeds[sid], 2)
        cluster.close(sid)


def test_killed_worker_streams_readmitted_others_untouched(cluster: ClusterController, local: Pipeline) -> None:
    victim_params, other_params = StreamParams(prompt="oil painting", seed=21), StreamParams(prompt="sketch", seed=22)
    cluster.open(401, victim_params, worker_id=0)
    cluster.open(402, other_params, worker_id=1)
    other, victim_feed, other_feed = local.open_stream(other_params, "other"), Feed(21), Feed(22)
    run_both(cluster, 402, other, other_feed, 2)
    for _ in range(2):
        cluster.process(401, victim_feed.next())
    updated = cluster.update(401, prompt="pencil sketch", noise_scale=0.6, seed=9)

    ray.kill(cluster.actor(0))
    killed = time.monotonic()
    # Detected by the failing call: the chunk comes back from a fresh stream on worker 1.
    frames = victim_feed.next()
    out = cluster.process(401, frames)
    served = time.monotonic() - killed
    [recovery] = cluster.recoveries
    assert recovery.detected_by == "call" and recovery.readmitted == {401: 1} and not recovery.lost
    assert cluster.worker_ids == [1] and cluster.placement() == {401: 1, 402: 1}
    # Fresh caches, controls kept: the output equals a new stream with the updated controls, started
    # from the newest frame and held for the whole chunk.
    fresh = local.open_stream(updated, "fresh").process(frames[-1:])
    np.testing.assert_array_equal(out, np.repeat(fresh, len(frames), axis=0))
    run_both(cluster, 402, other, other_feed, 2)  # the survivor's stream never noticed
    print(f"\nre-admission: detected+re-admitted {1000 * (recovery.done_at - killed):.0f} ms after the kill, "
          f"first chunk served {1000 * served:.0f} ms after it")
    assert served < 10.0

    # Detected by the health ping: the last worker dies idle; its streams have nowhere to go.
    ray.kill(cluster.actor(1))
    deadline = time.monotonic() + 10.0
    while not (lost := cluster.check_health()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [(r.worker_id, r.detected_by, sorted(r.lost)) for r in lost] == [(1, "ping", [401, 402])]
    with pytest.raises(ClusterError, match="no stream 402"):
        cluster.process(402, other_feed.next())
