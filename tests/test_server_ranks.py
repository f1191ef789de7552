"""`diffcast serve --gpus N`'s engine seam: the server's StreamProcessor over pipeline ranks.

Reference: the public Pipeline API (Stream.process) on the same tiny model in this process.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from _dit_fixtures import write_random_lora
from _parallel_fixtures import (
    S2,
    BatchScenario,
    PolicyScenario,
    ServiceScenario,
    TinyFactory,
    one_thread,  # noqa: F401  (autouse fixture)
    policy_reference,
)

from app.server.serving.engine_bridge import StreamSettings
from engine.models.wan_dit import CONFIGS, CausalWanDiT
from engine.parallel.launch import run_ring
from engine.parallel.ring import RingOptions


def test_processor_over_two_ranks_matches_the_pipeline_api() -> None:
    """Also lets the block scheduler rebalance on its own after every micro-step it sees a gain in
    (min_gain 0): whatever it moves, the frames must not change."""
    factory = TinyFactory(layers=4, sink_refresh=True)
    scenario = ServiceScenario(chunks=5, switch_at=3)
    expected = scenario.reference(factory())
    result = run_ring(factory, scenario, world=2, options=RingOptions(rebalance_every=1, min_gain=0.0))
    got = result["frames"]
    assert result["rebalances"] >= 1  # VAE decode makes the last stage slower: blocks moved (7 in a trial run)
    assert [g.shape for g in got] == [e.shape for e in expected]
    for e, g in zip(expected, got, strict=True):
        # uint8 frames: fp32-rounding differences may flip a rounding step, never more.
        assert int(np.abs(e.astype(np.int16) - g.astype(np.int16)).max()) <= 1
    assert not np.array_equal(expected[-1], expected[-2])


def test_loras_over_two_ranks_match_the_pipeline_api(tmp_path: Path) -> None:
    """A LoRA on, then its strength changed live with a prompt switch, while the scheduler moves blocks
    (the prompt K/V are re-encoded with the stream's strengths on every rank)."""
    lora = tmp_path / "ink.safetensors"
    write_random_lora(lora, CausalWanDiT(replace(CONFIGS["tiny"], num_layers=4)),
                      ("self_attn.q", "cross_attn.k", "cross_attn.v", "ffn.0"), size=0.5)
    factory = TinyFactory(layers=4, sink_refresh=True, lora=str(lora))
    scenario = ServiceScenario(chunks=4, switch_at=2, loras=(1.5, 0.5))
    expected = scenario.reference(factory())
    plain = ServiceScenario(chunks=4, switch_at=2).reference(TinyFactory(layers=4, sink_refresh=True)())
    got = run_ring(factory, scenario, world=2, options=RingOptions(rebalance_every=1, min_gain=0.0))["frames"]
    for e, g in zip(expected, got, strict=True):
        assert int(np.abs(e.astype(np.int16) - g.astype(np.int16)).max()) <= 1
    assert np.abs(expected[-1].astype(np.int16) - plain[-1].astype(np.int16)).mean() > 2  # the LoRA shows


def test_gpus_flag_rejects_bad_values() -> None:
    from app.cli import build_parser

    parser = build_parser()
    for argv, message in ((["serve", "--gpus", "0"], "--gpus must be at least 1"),
                          (["serve", "--gpus", "2", "--ray"], "cannot be combined with --ray")):
        args = parser.parse_args(argv)
        with pytest.raises(SystemExit, match=message):
            args._run(args)


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.mark.slow
async def test_serve_gpus_streams_through_two_cpu_ranks(tmp_path: Path) -> None:
    """`diffcast serve --gpus 2 --device cpu`: two gloo ranks start, a WebRTC client gets stylised
    frames back (trace-stamped IDs prove they are its own frames), SIGTERM stops every rank."""
    from conftest import free_port

    from app.client import CodedCamera, http, open_session

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--model", "tiny-random", "--device", "cpu", "--gpus", "2",
         "--port", str(port), "--allow-loopback-candidates", "--trace-stamp", "--threads", "1"],
        stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1],
    )
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if (await asyncio.to_thread(http, "GET", f"{url}/healthz"))[0] == 200:
                    break
            except OSError:
                pass
            await asyncio.sleep(0.5)
        ranks = _children(server.pid)
        assert len(ranks) >= 2  # the spawned ranks (plus multiprocessing's resource tracker)
        session = await open_session(url, CodedCamera((128, 128), fps=15), prompt="oil painting")
        deadline = time.monotonic() + 90
        while len(session.probe.records) < 10 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        status, _, body = await asyncio.to_thread(http, "GET", f"{url}/api/streams/{session.stream_id}")
        await session.close()
        assert len(session.probe.records) >= 10, (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    time.sleep(2)
    alive = [pid for pid in ranks if Path(f"/proc/{pid}").exists()]
    assert not alive, f"ranks left running: {alive}"
    # The serving policy (the default, slack) ran on the ranks and said what it runs.
    assert status == 200 and json.loads(body)["policy"] == "slackserve" and json.loads(body)["fidelity"]
    served = (tmp_path / "serve.log").read_text()
    assert "serving policy slackserve on RankExecutor" in served and "(routed per chunk)" in served, served[-3000:]


def test_batched_chunks_at_per_chunk_fidelity_match_each_stream_alone() -> None:
    """Three streams' chunks enter 2 gloo ranks together (one `run_chunks` call per chunk), each at the
    fidelity the engine core set for that chunk (steps 2 -> 1 -> 2 -> 3, a smaller KV window, half
    resolution for one chunk); every
    stream's frames equal that stream run alone on the single-process engine at the same fidelities.
    Streams a and b differ only in the stabilizer switch, so their frames must differ the same way."""
    factory = TinyFactory(layers=4, sink_refresh=True, stabilize=True)
    scenario = BatchScenario()
    expected = scenario.reference(factory())
    got = run_ring(factory, scenario, world=2)
    assert got["depth"] == 1  # sink refresh on: push() stays exact at depth 1; run() overlapped anyway
    for want, have in zip(expected, got["frames"], strict=True):
        assert [h.shape for h in have] == [w.shape for w in want]
        for w, h in zip(want, have, strict=True):
            assert int(np.abs(w.astype(np.int16) - h.astype(np.int16)).max()) <= 1
    stabilized, plain = expected[0], expected[1]
    assert any(int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max()) > 8 for a, b in zip(stabilized, plain, strict=True))
    # The per-chunk step counts mattered: a stream kept at 2 steps would have given other frames.
    fixed = replace(scenario, streams=(replace(scenario.streams[0], fidelities=(S2,) * scenario.chunks),))
    kept = fixed.reference(factory())[0]
    assert int(np.abs(kept[1].astype(np.int16) - stabilized[1].astype(np.int16)).max()) > 8


def test_the_serving_policy_drives_two_ranks() -> None:
    """The engine core on 2 gloo ranks (RankExecutor): the policy's fidelity per chunk reaches the ring
    (it downshifts when the engine is measured too slow for the best point), two streams share
    cross-user batches, and each
    stream's frames equal it alone on the single-process engine at the points the policy chose, with
    its stabilizer switch honoured."""
    factory = TinyFactory(layers=4, sink_refresh=True, stabilize=True)
    got = run_ring(factory, PolicyScenario(), world=2)
    assert got["executor"] == "RankExecutor"
    policy = got["policy"]
    assert policy.bmpr and policy.max_batch == 2 and not policy.step_preemption
    points = got["points"]
    assert not any(c.step_batch for c in points) and {c.resolution_scale for c in points} == {1.0, 0.75, 0.5}
    calls = got["calls"]
    assert any(len(call) == 2 for call in calls)  # a cross-user batch went into the ring together
    steps = [{config.steps for _, _, config, _ in call} for call in calls]
    # Full quality while the engine keeps up; too slow, fewer steps at a lower resolution (every rank
    # refits and rescales the streams' caches); back up after.
    assert steps[0] == {4} and min(min(s) for s in steps) < 4 and steps[-1] == {4}, steps
    assert any(config.resolution_scale < 1.0 for call in calls for _, _, config, _ in call)
    settings = [StreamSettings(steps=4, seed=5, stabilize=True), StreamSettings(steps=4, seed=5, stabilize=False)]
    expected = policy_reference(factory(), calls, settings)
    seen: dict[int, list[np.ndarray]] = {0: [], 1: []}
    for call in calls:
        for i, _, _, out in call:
            seen[i].append(out)
    for i in (0, 1):
        assert len(seen[i]) == len(expected[i]) >= 5
        for want, have in zip(expected[i], seen[i], strict=True):
            assert int(np.abs(want.astype(np.int16) - have.astype(np.int16)).max()) <= 1
    assert any(int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max()) > 8 for a, b in zip(expected[0], expected[1], strict=True))
