"""Live versus simulated: one trace replayed against a live Ray cluster and against the simulator.

The trace (a few dozen streams: Poisson arrivals, a burst, prompt switches, pauses) runs twice per
policy preset (slackserve and fifo-batch by default):

* live: the server's own serving loop (app/server/serving/executors.py, `RayExecutor`) on a local Ray cluster
  of 2 worker actors (tiny-random, CPU, one torch thread each), fed by in-process camera sources at the
  content rate (no codec: the figure measures the policy, not video coding);
* sim: the simulator (engine/sim/, the same engine core) with 2 simulated workers.

Both sides plan with the same profile: the bundled measured tiny-random CPU profile with every latency
times ``--scale`` (so that a few dozen streams contend for 2 workers, as real models do). The live
workers run the real tiny model and then sleep only the difference between the profile's step time and
the measured one (``pad_to_profile``). CPR, TTFC and stalls come from each side's playout ledger with
the simulator's own definitions (engine/sim/metrics.py ``summarise``): a chunk is on time when it is
ready before the playout cursor reaches it.

    .venv/bin/python demos/bench_cluster.py                 # table
    .venv/bin/python demos/bench_cluster.py --json          # {"policies": {preset: {"live": ..., "sim": ...}}}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.server.config import ServerConfig  # noqa: E402
from app.server.media.frame_path import ChunkAssembler, InputFrame, Playout, StreamRunner  # noqa: E402
from app.server.serving.engine_bridge import RayFactory, StreamSettings  # noqa: E402
from app.server.serving.executors import AdmissionError, ServingLoop  # noqa: E402
from app.server.serving.serving_loop import build_serving_loop  # noqa: E402
from engine.cluster.controller import ClusterConfig, ClusterController  # noqa: E402
from engine.serving.ledger import Camera  # noqa: E402
from engine.serving.live import live_policy_config  # noqa: E402
from engine.serving.policy import SlackPolicy  # noqa: E402
from engine.serving.profile import FidelityProfile, bundled_profile  # noqa: E402
from engine.sim.metrics import Summary, summarise  # noqa: E402
from engine.sim.simulator import SimConfig, SimResult, Simulator, StreamRecord  # noqa: E402
from engine.sim.workload import EventKind, TraceEvent  # noqa: E402

FPS = 8.0  # content rate: a 4-frame chunk is 0.5 s of video
WORKERS = 2
PROMPTS = ("oil painting", "charcoal drawing", "watercolor sketch")
DRAIN_S = 180.0  # longest a stream waits for its last chunks after its camera stopped
KEYS = ("cpr", "ttfc_p50_s", "ttfc_p95_s", "stalls_per_stream", "rehomes", "evictions")
log = logging.getLogger("bench_cluster")


def make_trace(streams: int, rate: float, burst: int, burst_t: float, seed: int) -> list[TraceEvent]:
    """Poisson arrivals at ``rate``/s, ``burst`` more arriving within a second at ``burst_t``; streams of
    6 to 12 s; every third switches prompt half-way, every fifth pauses for 2 s."""
    rng = np.random.default_rng(seed)
    arrivals = list(np.cumsum(rng.exponential(1 / rate, streams - burst)))
    arrivals += list(burst_t + rng.uniform(0, 1, burst))
    events = []
    for sid, t in enumerate(sorted(arrivals)):
        content = float(rng.uniform(6, 12))
        events.append(TraceEvent(float(t), EventKind.ARRIVE, sid, int(content * FPS), FPS, (128, 128)))
        if sid % 3 == 1:
            events.append(TraceEvent(float(t) + content / 2, EventKind.PROMPT_SWITCH, sid))
        if sid % 5 == 2:
            events.append(TraceEvent(float(t) + content / 3, EventKind.PAUSE, sid))
            events.append(TraceEvent(float(t) + content / 3 + 2.0, EventKind.RESUME, sid))
    return sorted(events, key=lambda e: e.t)


def scaled_profile(scale: float) -> FidelityProfile:
    profile = bundled_profile("tiny-random_cpu_128")
    points = tuple(replace(p, latency_s=p.latency_s * scale, first_chunk_latency_s=p.first_chunk_latency_s * scale)
                   for p in profile.points)
    return replace(profile, points=points, fps=FPS,
                   notes=(*profile.notes, f"every latency x{scale:g} (demos/bench_cluster.py)"))


def row(summary: Summary, ttfc: list[float], result: SimResult) -> dict[str, Any]:
    return {
        "chunks": sum(s.chunks_on_time + s.chunks_late for s in result.streams),
        "fidelity": dict(sorted(result.fidelity_counts.items(), key=lambda kv: -kv[1])[:3]),
        "cpr": round(summary.cpr, 3),
        "ttfc_p50_s": round(float(np.percentile(ttfc, 50)), 3) if ttfc else math.nan,
        "ttfc_p95_s": round(float(np.percentile(ttfc, 95)), 3) if ttfc else math.nan,
        "stalls_per_stream": round(summary.stalls_per_stream, 2),
        "rehomes": summary.rehomes,
        "evictions": summary.evictions,
        "streams": summary.streams,
        "rejected": summary.rejected,
    }


def ttfcs(result: SimResult) -> list[float]:
    return [s.ttfc_s for s in result.streams if s.ttfc_s is not None]


# ---- the simulator ---------------------------------------------------------------------------------


def simulate(preset: str, profile: FidelityProfile, events: list[TraceEvent], max_batch: int) -> dict[str, Any]:
    policy = SlackPolicy(profile, live_policy_config(preset, max_batch, True, workers=WORKERS))
    # A live stream cannot run ahead of its camera: each chunk waits until its last input frame was
    # captured, as the live streams' assemblers do (the engine's first chunk is one frame).
    camera = Camera(profile.first_chunk_duration_s, profile.chunk_duration_s, 1 / FPS)
    sim = SimConfig(workers=WORKERS, nodes=1, state_slots=1 << 10, tick_s=0.5, camera=camera)
    result = Simulator(policy, profile, events, sim).run()
    return {**row(summarise(result), ttfcs(result), result), "failed": 0}


# ---- the live cluster --------------------------------------------------------------------------------


class QueuedAssembler(ChunkAssembler):
    """Oldest frames first, none skipped: like the simulator's, a stream that falls behind catches up
    later instead of skipping input (the server's own assembler plays the newest frames)."""

    def take(self, n: int) -> list[InputFrame]:
        if not self.ready(n):
            raise RuntimeError(f"take({n}) with only {len(self._frames)} frames buffered")
        return [self._frames.popleft() for _ in range(n)]


class LiveStream:
    """One trace stream on the live loop: a camera source pushing frames at the content rate."""

    def __init__(self, loop: ServingLoop, factory: RayFactory, pool: ThreadPoolExecutor, arrive: TraceEvent,
                 t0: float) -> None:
        self.loop, self.factory, self.pool, self.arrive, self.t0 = loop, factory, pool, arrive, t0
        self.record: StreamRecord | None = None
        self.rejected = ""  # the policy's admission refused it
        self.failed = ""  # the engine failed it mid-stream (not a refusal: counted apart)
        self.paused = False

    async def run(self, events: list[TraceEvent]) -> None:
        await asyncio.sleep(max(0.0, self.t0 + self.arrive.t - time.monotonic()))
        loop, factory = self.loop, self.factory
        try:
            sid = loop.admit(None)
        except AdmissionError as exc:
            self.rejected = str(exc)
            return
        settings = StreamSettings(prompt=PROMPTS[0], steps=4, seed=self.arrive.stream)
        processor = await asyncio.get_running_loop().run_in_executor(self.pool, factory.open, settings)
        size = factory.size
        assembler = QueuedAssembler(capacity=self.arrive.frames + processor.chunk_frames)
        playout = Playout(size, processor.chunk_frames, max_fps=FPS, min_fps=FPS)
        runner = StreamRunner(processor, assembler, playout, self.pool, size)
        loop.attach(sid, runner, playout, on_failure=self._failed)
        tasks = [asyncio.create_task(playout.run()), asyncio.create_task(self._control(runner, events))]
        rng = np.random.default_rng(self.arrive.stream)
        frames = self.arrive.frames
        start = time.monotonic()
        pushed = 0
        while pushed < frames:
            if not self.paused:
                assembler.push(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
                pushed += 1
            await asyncio.sleep(max(0.0, start + (pushed + 1) / FPS - time.monotonic()))
        # Every chunk is made (as in the simulator, where a stream lasts until its content is generated),
        # then the stream leaves.
        deadline = time.monotonic() + DRAIN_S
        core = loop.core
        while sid in core.ledger.entries and time.monotonic() < deadline and (
                runner.has_chunk() or sid in core.running() or core.ledger.entries[sid].inflight is not None):
            await asyncio.sleep(0.05)
        if sid in core.ledger.entries:
            self.record = self._record(sid)
        for task in tasks:
            task.cancel()
        loop.remove(sid)
        factory.controller.close(processor.stream_id)  # type: ignore[attr-defined]

    def _failed(self, exc: BaseException) -> None:
        log.error("stream %d failed: %r", self.arrive.stream, exc)
        self.failed = repr(exc)

    async def _control(self, runner: StreamRunner, events: list[TraceEvent]) -> None:
        for event in events:
            await asyncio.sleep(max(0.0, self.t0 + event.t - time.monotonic()))
            if event.kind is EventKind.PROMPT_SWITCH:
                await runner.update(prompt=PROMPTS[1])
            elif event.kind is EventKind.PAUSE:
                self.paused = True
                runner.pause()
            elif event.kind is EventKind.RESUME:
                self.paused = False
                runner.resume()

    def _record(self, sid: int) -> StreamRecord:
        entry = self.loop.core.ledger.entries[sid]
        tracker = entry.tracker
        return StreamRecord(sid=sid, arrival_t=entry.arrival_t, content_s=tracker.content_s,
                            ttfc_s=None if tracker.first_chunk_t is None else tracker.first_chunk_t - entry.arrival_t,
                            chunks_on_time=tracker.chunks_on_time, chunks_late=tracker.chunks_late,
                            stalls=list(tracker.stalls), mean_quality=None, left=True)


async def run_live(preset: str, controller: ClusterController, profile_path: Path, events: list[TraceEvent],
                   max_batch: int) -> dict[str, Any]:
    factory = RayFactory(controller)
    config = ServerConfig(model="tiny-random", max_fps=FPS, policy=preset, max_batch=max_batch,
                          profile=str(profile_path))
    pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="bench")
    loop = build_serving_loop(config, factory, pool)
    loop.executor.pad_to_profile = True
    loop.core.calibrate = False  # both sides plan with the same profile
    # The simulator's playout: the viewer starts one initial slack after arrival and plays at the content
    # rate (pausing when told). The server's own player starts at its first frame and adapts its rate,
    # so its cursor reports would measure another player: the ledger keeps the simulator's one.
    loop.report_cursors = lambda: None  # type: ignore[method-assign]
    runner = asyncio.create_task(loop.run())
    t0 = time.monotonic()
    arrivals = [e for e in events if e.kind is EventKind.ARRIVE]
    streams = [LiveStream(loop, factory, pool, a, t0) for a in arrivals]
    per_stream = {a.stream: [e for e in events if e.stream == a.stream and e.kind is not EventKind.ARRIVE]
                  for a in arrivals}
    jobs = [asyncio.create_task(s.run(per_stream[s.arrive.stream])) for s in streams]
    with tqdm(total=len(jobs), desc=f"live {preset}", unit="stream") as bar:
        for job in asyncio.as_completed(jobs):
            await job
            bar.update(1)
    runner.cancel()
    pool.shutdown(wait=False)
    counters = loop.counters()
    records = [s.record for s in streams if s.record is not None]
    result = SimResult(policy=preset, streams=records, rejected={s.arrive.stream: s.rejected for s in streams if s.rejected},
                       rehomes=counters["rehomes"], evictions=counters["evictions"], restores=counters["restores"],
                       preemptions=counters["preemptions"], timeline=[], fidelity_counts=dict(loop.core.fidelity_counts),
                       end_t=time.monotonic() - t0, worker_busy_s={})
    return {**row(summarise(result), ttfcs(result), result), "failed": sum(1 for s in streams if s.failed)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="slackserve,fifo-batch", help="comma-separated presets")
    parser.add_argument("--streams", type=int, default=30, help="streams in the trace")
    parser.add_argument("--rate", type=float, default=0.6, help="Poisson arrivals per second")
    parser.add_argument("--burst", type=int, default=6, help="streams arriving together")
    parser.add_argument("--burst-at", type=float, default=15.0, help="when the burst arrives (s)")
    parser.add_argument("--scale", type=float, default=30.0, help="profile latencies times this")
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    events = make_trace(args.streams, args.rate, args.burst, args.burst_at, args.seed)
    profile = scaled_profile(args.scale)
    out: dict[str, Any] = {"policies": {}, "trace": {"streams": args.streams, "rate": args.rate, "burst": args.burst,
                                                     "scale": args.scale, "workers": WORKERS, "fps": FPS}}
    controller = ClusterController.start(ClusterConfig(model="tiny-random", workers=WORKERS, threads_per_worker=1,
                                                       object_store_mb=200))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "profile.json"
            profile.save(path)
            for preset in args.policies.split(","):
                live = asyncio.run(run_live(preset, controller, path, events, args.max_batch))
                out["policies"][preset] = {"live": live, "sim": simulate(preset, profile, events, args.max_batch)}
    finally:
        controller.shutdown()
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.streams} streams, {WORKERS} Ray workers, profile x{args.scale:g}")
    print(f"{'policy':<12} {'side':<5} " + " ".join(f"{k:>17}" for k in KEYS))
    for preset, sides in out["policies"].items():
        for side in ("live", "sim"):
            print(f"{preset:<12} {side:<5} " + " ".join(f"{sides[side][k]:>17}" for k in KEYS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
