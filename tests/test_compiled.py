"""torch.compile at the shapes a profile names (engine/compiled.py): the gate's rules, and the tiny runtime
compiled with the ``eager`` backend (tracing, no code generation: seconds) against its eager twin; one
inductor compile at test size, skipped without a C++ compiler."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Hashable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _runtime_fixtures import clip, fidelity, tiny_runtime

from engine.compiled import (
    CompileShape,
    ShapeGate,
    compile_pipeline,
    config_shapes,
    default_cache_dir,
)
from engine.fidelity import FidelityConfig
from engine.models.wan_dit import attention_backend
from engine.serving.profile import FidelityProfile, ProfilePoint
from engine.streaming.runtime import StreamRuntime


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test compiles from nothing, and leaves no compiled frames to the next."""
    torch._dynamo.reset()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    torch._dynamo.reset()


def _gate(reason: str | None = None) -> tuple[ShapeGate, list[str]]:
    ran: list[str] = []

    def key(x: int) -> tuple[Hashable, str | None]:
        return ("size", x), reason

    return ShapeGate("g", lambda x: ran.append("eager"), lambda x: ran.append("compiled"), key), ran


def test_the_gate_compiles_only_the_keys_admitted_and_logs_each_other_key_once(caplog: pytest.LogCaptureFixture) -> None:
    gate, ran = _gate()
    gate(1)  # quiet: the warm-up before the steady state
    gate.mode = "admit"
    gate(2)
    gate.mode = "serve"
    with caplog.at_level(logging.INFO, logger="engine.compiled"):
        for x in (2, 3, 3, 1, 2):
            gate(x)
    assert ran == ["eager", "compiled", "compiled", "eager", "eager", "eager", "compiled"]
    assert (gate.compiled_calls, gate.eager_calls) == (3, 4)
    # One line for the new key 3; none for 1, already met (quietly) in the warm-up.
    assert [r.getMessage() for r in caplog.records if r.name == "engine.compiled"] == [
        "g runs eager at a shape it was not compiled for (no profile names it): input , key #2"]


def test_a_call_that_cannot_compile_is_never_admitted_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    gate, ran = _gate(reason="torch.bfloat16 autocast over torch.float32 weights")
    gate.mode = "admit"
    gate(2)
    gate.mode = "serve"
    with caplog.at_level(logging.INFO, logger="engine.compiled"):
        gate(3)
    assert ran == ["eager", "eager"] and gate.admitted == set()
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.compiled"]
    assert len(lines) == 1 and "bfloat16 autocast over torch.float32 weights" in lines[0]


def test_a_profiles_shapes_are_each_points_engine_size_precision_and_window() -> None:
    rt = tiny_runtime()
    point = ProfilePoint(config=FidelityConfig(steps=2, kv_window_frames=6, precision="fp32"), latency_s=0.1,
                         first_chunk_latency_s=0.1, quality=30.0, state_bytes=1.0)
    points = (point,
              ProfilePoint(config=FidelityConfig(steps=1, kv_window_frames=6, resolution_scale=0.5, precision="bf16"),
                           latency_s=0.05, first_chunk_latency_s=0.05, quality=25.0, state_bytes=1.0),
              ProfilePoint(config=FidelityConfig(steps=2, kv_window_frames=6, step_batch=True), latency_s=0.05,
                           first_chunk_latency_s=0.05, quality=29.0, state_bytes=1.0))
    profile = FidelityProfile(model="tiny", device="cpu", resolution=(64, 64), chunk_latent_frames=1,
                              chunk_pixel_frames=4, first_chunk_pixel_frames=1, fps=16.0, points=points)
    half = rt.engine_size((64, 64), FidelityConfig(resolution_scale=0.5))
    assert half == (32, 32)
    assert config_shapes(rt, profile.resolution, [p.config for p in profile.points], batches=(1, 2)) == [
        CompileShape((64, 64), 2, 1, "fp32", 6), CompileShape((64, 64), 2, 2, "fp32", 6),
        CompileShape((32, 32), 1, 1, "bf16", 6), CompileShape((32, 32), 1, 2, "bf16", 6)]
    # The same config twice names one shape.
    assert config_shapes(rt, (64, 64), [point.config, point.config]) == [CompileShape((64, 64), 2, 1, "fp32", 6)]


def test_the_default_cache_is_under_the_users_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "diffcast" / "torch-compile"


def _pipe(rt: StreamRuntime) -> Any:
    """What compile_pipeline reads of a Pipeline: the runtime and its chunk lengths (1 frame, then 4)."""
    return SimpleNamespace(runtime=rt, first_chunk_frames=1, chunk_frames=4)


@pytest.mark.parametrize("guided", [False, True], ids=["wan-vae", "guided-tiny-vae"])
def test_compiled_chunks_equal_eager_ones_and_other_shapes_never_compile(
        guided: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    eager_rt, rt = tiny_runtime(guided_vae=guided), tiny_runtime(guided_vae=guided)
    window = 4
    compiled, report = compile_pipeline(_pipe(rt), [CompileShape((32, 32), 2, 1, "fp32", window)],
                                        backend="eager", cache_dir=tmp_path)
    # One graph per call site: the DiT's block stack and the VAE's encoder and decoder, no graph break.
    assert report.cold_start_s > 0 and report.graphs == 3 and len(report.shapes) == 1
    assert {g.name: len(g.admitted) for g in compiled.gates} == {"dit": 1, "vae.encode": 1, "vae.decode": 1}
    graphs = compiled.graphs
    ref = eager_rt.open("s", "oil painting", (32, 32), fidelity(steps=2, window=window), seed=3)
    state = rt.open("s", "oil painting", (32, 32), fidelity(steps=2, window=window), seed=3)
    chunks = clip(8)
    for frames in chunks:
        torch.testing.assert_close(rt.run_chunk(state, frames).frames, eager_rt.run_chunk(ref, frames).frames,
                                   rtol=0, atol=1e-6)
    # The steady chunks ran compiled: every chunk once the window rolled, two DiT steps each.
    steady = len(chunks) - (1 + window)
    calls = compiled.stats()
    assert calls["dit"]["compiled_calls"] >= 2 * steady + 2  # and the warm-up's two admitted chunks (1 step)
    # Another size and a batch of two: eager, one log line per new key, no new graph.
    with caplog.at_level(logging.INFO, logger="engine.compiled"):
        other = rt.open("o", "oil painting", (48, 48), fidelity(steps=2, window=window))
        pair = [rt.open(f"p{i}", "oil painting", (32, 32), fidelity(steps=2, window=window), seed=i) for i in range(2)]
        for frames, big in zip(chunks, clip(8, size=48), strict=True):
            rt.run_chunk(other, big)
            rt.run_chunks(pair, [frames, frames])
    # A context variable the compiled graph read at trace time (the attention backend) set otherwise: the
    # key differs, so the call runs eager, as the eager runtime does.
    dit_eager = compiled.stats()["dit"]["eager_calls"]
    with attention_backend("reference"):
        frames = clip(9)[-1]
        torch.testing.assert_close(rt.run_chunk(state, frames).frames, eager_rt.run_chunk(ref, frames).frames,
                                   rtol=0, atol=1e-6)
    assert compiled.stats()["dit"]["eager_calls"] == dit_eager + 2
    assert compiled.graphs == graphs
    lines = [r.getMessage() for r in caplog.records if r.name == "engine.compiled"]
    assert lines and len(lines) == len(set(lines))
    assert all("runs eager at a shape it was not compiled for" in line for line in lines)
    compiled.remove()
    assert "_run" not in rt.dit.__dict__


def test_bf16_autocast_over_fp32_weights_runs_eager(tmp_path: Path) -> None:
    rt = tiny_runtime()
    shape = CompileShape((32, 32), 1, 1, "bf16", 4)
    compiled, report = compile_pipeline(_pipe(rt), [shape], backend="eager", cache_dir=tmp_path)
    assert report.graphs == 0 and all(not g.admitted for g in compiled.gates)
    compiled.remove()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor on a CPU needs a C++ compiler")
def test_inductor_compiles_the_tiny_runtime_into_its_cache_dir(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """~2.5 min on 2 busy cores with an empty cache (C++ code generation); a rerun finds the code in the
    cache dir kept under pytest's cache and takes a fraction of that."""
    pytest_cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    cache = Path(pytest_cache.mkdir("inductor")) if pytest_cache is not None else tmp_path
    eager_rt, rt = tiny_runtime(guided_vae=True), tiny_runtime(guided_vae=True)
    compiled, report = compile_pipeline(_pipe(rt), [CompileShape((32, 32), 1, 1, "fp32", 4)], cache_dir=cache,
                                        threads=(1, 2))
    assert report.backend == "inductor" and report.graphs == 6  # three call sites at two thread counts
    assert any(Path(report.cache_dir).rglob("*.py")), "inductor kept no code in the cache dir"
    ref = eager_rt.open("s", "oil painting", (32, 32), fidelity(steps=1, window=4), seed=3)
    state = rt.open("s", "oil painting", (32, 32), fidelity(steps=1, window=4), seed=3)
    for k, frames in enumerate(clip(6)):
        # The engine's thread budget moves a lane between thread counts: each was compiled, none recompiles.
        torch.set_num_threads(1 + k % 2)
        torch.testing.assert_close(rt.run_chunk(state, frames).frames, eager_rt.run_chunk(ref, frames).frames,
                                   rtol=0, atol=1e-4)
    assert compiled.graphs == report.graphs
    assert compiled.stats()["dit"]["compiled_calls"] > 2
    compiled.remove()


def test_a_thread_count_not_compiled_for_runs_eager(tmp_path: Path) -> None:
    """A compiled graph is guarded on the torch thread count: one the warm-up did not compile runs eager
    (through the gate), never a recompile."""
    rt = tiny_runtime()
    compiled, report = compile_pipeline(_pipe(rt), [CompileShape((32, 32), 1, 1, "fp32", 4)], backend="eager",
                                        cache_dir=tmp_path, threads=(1, 2))
    assert report.graphs == 6 and report.threads == [1, 2] and torch.get_num_threads() == 1  # put back
    state = rt.open("s", "oil painting", (32, 32), fidelity(steps=1, window=4))
    calls = []
    for k, frames in enumerate(clip(8)):
        torch.set_num_threads(3 if k >= 6 else 1 + k % 2)
        rt.run_chunk(state, frames)
        calls.append(compiled.stats()["dit"]["compiled_calls"])
    assert calls[5] > calls[4] > calls[3]  # steady at 1 and at 2 threads: compiled
    assert calls[7] == calls[6] == calls[5]  # 3 threads: eager
    assert compiled.graphs == report.graphs
    compiled.remove()


def test_only_the_sites_named_are_compiled(tmp_path: Path) -> None:
    rt = tiny_runtime()
    compiled, report = compile_pipeline(_pipe(rt), [CompileShape((32, 32), 1, 1, "fp32", 4)], backend="eager",
                                        cache_dir=tmp_path, sites=["dit"])
    assert [g.name for g in compiled.gates] == ["dit"] and report.graphs == 1 and report.sites == ["dit"]
    assert "forward" not in rt.vae.encoder.__dict__  # type: ignore[union-attr]
    compiled.remove()
    with pytest.raises(ValueError, match="no compiled call site"):
        compile_pipeline(_pipe(rt), [], sites=["vae.middle"])


def test_serve_compiles_the_in_process_engine_at_its_profiles_points(tmp_path: Path) -> None:
    """`diffcast serve --compile`: the serving loop's build compiles the in-process engine at the shapes of
    the profile's points that run at the weights' precision (fp32 here; its bf16 points autocast, eager),
    for streams at the profile's size and from 4:3 and 16:9 cameras, before any stream comes."""
    from concurrent.futures import ThreadPoolExecutor

    from app.server.config import ServerConfig
    from app.server.serving.engine_bridge import InProcessFactory
    from app.server.serving.serving_loop import build_serving_loop

    factory = InProcessFactory.load("tiny-random", lanes=1)
    config = ServerConfig(model="tiny-random", max_batch=1, compile=True, compile_backend="eager",
                          compile_cache=str(tmp_path), compile_sites=("dit",))
    with ThreadPoolExecutor(1) as pool:
        build_serving_loop(config, factory, pool)
    assert factory.compiled is not None
    stats = factory.compiled.stats()
    assert set(stats) == {"dit"}
    pipe = factory.pipeline
    sizes = {(128, 128), pipe.stream_size((640, 480)), pipe.stream_size((1280, 720))}
    assert len(sizes) == 3
    # One admitted key per engine size the fp32 points run at (three scales of three stream sizes), at least.
    assert stats["dit"]["admitted"] >= 3 * len(sizes), stats
