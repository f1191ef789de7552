"""Live-service benchmark: 1, 2 and 4 concurrent streams through a real `diffcast serve` process,
under each serving policy side by side (slack and fifo by default: one server process per policy).

For each stream count it starts synthetic WebRTC clients (streams the server's admission control
refuses are counted, the rest measured) (app.client: moving frames with
frame IDs drawn into the pixels), lets them run, and reports per stream, averaged over streams:
output FPS (new frames per second at the client), TTFF (offer sent -> first stylized frame
decoded), glass-to-glass latency p50/p95 (client capture -> client decode, via the server's trace
stamp) beside the server's part of it (server p50: input frame arrival -> its output frame played,
from the stream's stats) and the dropped-frame ratio (frames the server skipped or discarded / frames it received).

Throughput against the engine alone, in the same run: the aggregate delivered FPS (every stream's
new frames per second at the clients) beside the engine-only FPS: the same engine code the live
executor calls (engine.streaming.step_processor.run_step on the server's engine lanes, the streams
spread over them, each lane's streams in one batched step) in a process of its own with the
server's threads, at the ladder points the policy chose
(from the stats each stream receives about once a second, weighted by how often each was chosen),
with no media, network or policy. The run takes it after the live rows, when the server has stopped.

CPU per delivered frame (robust on a shared machine, where wall-clock FPS is noisy): the server
process's CPU seconds (all its threads: codecs, event loop, engine) and the clients' (this process:
their VP8 encode and decode) over the measured window, divided by the frames delivered in it, beside
the engine-only CPU per frame.

    .venv/bin/python demos/bench_live.py                    # default model (tiny-random until the embedded one exists)
    .venv/bin/python demos/bench_live.py --streams 1 --seconds 30 --json
    .venv/bin/python demos/bench_live.py --streams 1 4 --policies slack   # one policy only
    .venv/bin/python demos/bench_live.py --streams 2 --busy 1   # quiet rows, then the same beside 1 busy process
    .venv/bin/python demos/bench_live.py --streams 1 --viewers 1 4 --policies slack   # 1, then 4 WHEP viewers

``--viewers N [N ...]``: every stream count with N WHEP viewers per stream besides its publisher (real
aiortc peers in this process, each reading the stream's output), one row per N; server CPU per
delivered frame (the publishers' new frames) then shows what each viewer costs the server.

``--busy N``: every stream count again beside N busy processes (CPU spinners, app/busy_neighbours.py,
a stand-in for OBS or a browser on a creator's laptop), on the same server after its quiet rows; the
engine-only figures of loaded rows are measured beside them too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.busy_neighbours import BusyNeighbours  # noqa: E402
from app.client import CodedCamera, OutputProbe, http, open_session, open_whep_viewer  # noqa: E402
from app.server.media.framecode import MAX_ID  # noqa: E402
from app.server.media.ice import allow_loopback_candidates  # noqa: E402
from engine.serving.live import bundled_live_profile  # noqa: E402

WARMUP_S = 3.0  # excluded from FPS and latency: the first chunk and the playout clock settling
ENGINE_WARMUP_CHUNKS = 3  # engine-only: chunks run before the clock starts (first chunk, caches filling)
ENGINE_CHUNKS = 8  # engine-only: chunks per stream measured at each ladder point


@dataclass
class Result:
    policy: str
    streams: int
    admitted: int
    fps: float
    ttff_s: float
    latency_p50_ms: float
    latency_p95_ms: float
    dropped_ratio: float
    server_chunk_ms: float
    input_dropped_ratio: float = float("nan")  # of dropped_ratio: camera frames the engine never took
    aggregate_fps: float = float("nan")  # new frames per second at the clients, all streams together
    server_cpu_ms_per_frame: float = float("nan")  # server process CPU / frames delivered
    client_cpu_ms_per_frame: float = float("nan")  # the clients' CPU (this process) / frames delivered
    server_cores: float = float("nan")  # server CPU seconds per second: the share of the machine it got
    points: dict[str, float] = field(default_factory=dict)  # fidelity label -> share of the policy's choices
    engine_fps: float = float("nan")  # the engine alone at those points, the admitted streams batched
    engine_cpu_ms_per_frame: float = float("nan")
    camera_fps: float = float("nan")  # what the admitted cameras sent: admitted x their frame rate
    busy: int = 0  # busy processes (CPU spinners) beside the server and clients
    viewers: int = 0  # WHEP viewers per stream besides its publisher
    viewer_fps: float = float("nan")  # new frames per second at each viewer, averaged over viewers
    # The server's part of glass-to-glass: input frame arrival -> its output frame played (the stream's
    # stats, latency_p50_ms), averaged over streams; the rest is codecs, network and the client.
    server_latency_p50_ms: float = float("nan")

    @property
    def camera_ratio(self) -> float:
        """Aggregate delivered FPS over what the cameras sent: the ceiling of any server."""
        return self.aggregate_fps / self.camera_fps if self.camera_fps > 0 else float("nan")

    @property
    def engine_ratio(self) -> float:
        """Aggregate delivered FPS over the engine-only FPS at the same points (target >= 0.85)."""
        return self.aggregate_fps / self.engine_fps if self.engine_fps > 0 else float("nan")

    @property
    def ratio_ceiling(self) -> float:
        """The highest ``engine_ratio`` any server reaches here: the cameras' frames over the engine-only
        FPS, capped at 1 (where the engine is faster than the cameras, the ratio is camera-bound)."""
        return min(1.0, self.camera_fps / self.engine_fps) if self.engine_fps > 0 else float("nan")


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) a process has used so far; NaN where /proc is missing."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def default_model() -> str:
    from engine.pipeline import DEFAULT_MODEL

    return "default" if DEFAULT_MODEL.is_file() else "tiny-random"


@contextmanager
def server_process(model: str, port: int, threads: int, max_streams: int, device: str = "cpu",
                   profile: str | None = None) -> Iterator[str]:
    """A running `diffcast serve`: its URL."""
    with served(model, port, threads, max_streams, device, profile) as (url, _):
        yield url


@contextmanager
def served(model: str, port: int, threads: int, max_streams: int, device: str = "cpu",
           profile: str | None = None, policy: str | None = None,
           extra: tuple[str, ...] = ()) -> Iterator[tuple[str, int]]:
    """A running `diffcast serve` (with ``extra`` flags): its URL and process id (for its CPU time)."""
    command = [
        sys.executable, "-m", "app.cli", "serve", "--model", model, "--port", str(port),
        "--allow-loopback-candidates", "--trace-stamp", "--max-streams", str(max_streams),
        "--max-streams-per-client", str(max_streams),  # every client here comes from 127.0.0.1
        "--threads", str(threads), "--device", device,
    ]
    if profile is not None:
        command += ["--profile", profile]
    if policy is not None:
        command += ["--policy", policy]
    command += extra
    # The server's log goes to a file, not a pipe: a pipe nobody reads fills up on a long run and then
    # blocks the server's every log call, which the benchmark would measure as a slow server.
    log_file = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log_file, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if process.poll() is not None:
                log_file.seek(0)
                raise RuntimeError(f"server exited: {log_file.read()[-4000:]}")
            try:
                if http("GET", f"{url}/healthz")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not come up within 180 s")
            time.sleep(0.5)
        yield url, process.pid
    finally:
        process.terminate()
        process.wait(timeout=20)
        log_file.close()


async def run_streams(url: str, count: int, seconds: float, fps: float, policy: str = "slack",
                      server_pid: int | None = None, viewers: int = 0) -> Result:
    config = json.loads(http("GET", f"{url}/api/config")[2])
    size = (config["width"], config["height"])
    cameras = [CodedCamera(size, fps=fps, variant=i, id_offset=i * MAX_ID // count) for i in range(count)]
    sessions, refusals = [], []
    for camera in cameras:
        try:
            sessions.append(await open_session(url, camera, prompt="oil painting"))
        except RuntimeError as exc:  # admission control (capacity, serving policy) said no
            refusals.append(str(exc))
    if refusals:
        logging.warning("%d of %d streams refused: %s", len(refusals), count, refusals[0])
    if not sessions:
        raise RuntimeError(f"every stream was refused: {refusals[0]}")
    # Viewers read the publisher's frame IDs, so their records are the stream's new frames too.
    watching = [await open_whep_viewer(url, s.stream_id, OutputProbe(s.camera), s.viewer_token)
                for s in sessions for _ in range(viewers)]
    window: list[float] = []  # [start, end] of the CPU window, after the warm-up
    cpu: list[tuple[float, float]] = []  # (server, clients) CPU seconds at its start and end
    replies_before = [0] * len(sessions)
    for second in tqdm(range(int(seconds)), desc=f"{policy}: {count} stream(s)", unit="s", leave=False):
        if second == int(WARMUP_S) + 1 or second == int(seconds) - 1:
            window.append(time.monotonic())
            cpu.append((process_cpu_s(server_pid) if server_pid else float("nan"), time.process_time()))
            if len(window) == 1:
                replies_before = [len(s.replies) for s in sessions]
        await asyncio.sleep(1)
    # The ladder point of each stream's last chunk, from the stats the server sends every stream about
    # once a second on its data channel (polling the HTTP API would add work to the server measured).
    chosen = Counter(reply["fidelity"] for session, before in zip(sessions, replies_before, strict=True)
                     for reply in session.replies[before:] if reply.get("type") == "stats" and reply.get("fidelity"))
    stats = [json.loads((await asyncio.to_thread(http, "GET", f"{url}/api/streams/{s.stream_id}"))[2]) for s in sessions]
    await asyncio.gather(*(v.close() for v in watching), *(s.close() for s in sessions))
    await asyncio.sleep(1.0)  # let the server notice and free the slots

    fps_values: list[float] = []
    ttffs: list[float] = []
    latencies: list[float] = []
    for session in sessions:
        probe = session.probe
        if probe.first_frame_at is None:
            raise RuntimeError(f"stream {session.stream_id} produced no frame in {seconds} s")
        ttffs.append(probe.first_frame_at - session.started)
        since = probe.first_frame_at + WARMUP_S
        steady = [t for t, _, _ in probe.records if t >= since]
        span = (steady[-1] - steady[0]) if len(steady) > 1 else float("nan")
        fps_values.append((len(steady) - 1) / span if span > 0 else 0.0)
        latencies.extend(probe.latencies(since))
    received = sum(s["frames_in"] for s in stats)
    dropped = sum(s["dropped_frames"] for s in stats)
    lat = np.array(latencies) * 1000
    delivered = sum(1 for s in sessions for t, _, _ in s.probe.records if len(window) == 2 and window[0] <= t < window[1])
    server_cpu, client_cpu = (np.subtract(cpu[1], cpu[0]) if len(cpu) == 2 else (float("nan"), float("nan")))
    seen = [sum(1 for t, _, _ in v.probe.records if window[0] <= t < window[1]) / (window[1] - window[0])
            for v in watching if len(window) == 2]
    total = sum(chosen.values())
    return Result(
        policy=policy,
        streams=count,
        admitted=len(sessions),
        fps=float(np.mean(fps_values)),
        ttff_s=float(np.mean(ttffs)),
        latency_p50_ms=float(np.percentile(lat, 50)) if lat.size else float("nan"),
        latency_p95_ms=float(np.percentile(lat, 95)) if lat.size else float("nan"),
        dropped_ratio=dropped / received if received else float("nan"),
        input_dropped_ratio=sum(s["dropped_input_frames"] for s in stats) / received if received else float("nan"),
        server_chunk_ms=float(np.mean([s["chunk_ms"] for s in stats])),
        aggregate_fps=float(np.sum(fps_values)),
        server_cpu_ms_per_frame=1000 * float(server_cpu) / delivered if delivered else float("nan"),
        client_cpu_ms_per_frame=1000 * float(client_cpu) / delivered if delivered else float("nan"),
        server_cores=float(server_cpu) / (window[1] - window[0]) if len(window) == 2 else float("nan"),
        points={label: n / total for label, n in chosen.most_common()},
        camera_fps=len(sessions) * fps,
        viewers=viewers,
        viewer_fps=float(np.mean(seen)) if seen else float("nan"),
        server_latency_p50_ms=float(np.mean([s["latency_p50_ms"] for s in stats if s.get("latency_p50_ms") is not None]
                                            or [float("nan")])),
    )


def same_point(a: str, b: str) -> bool:
    """Whether two fidelity labels name one ladder point, whatever their stream batch."""
    return re.sub(r"/b\d+", "", a) == re.sub(r"/b\d+", "", b)


def engine_only(model: str, profile: str | None, labels: list[str], streams: int, threads: int,
                device: str) -> dict[str, tuple[float, float]]:
    """In this process: ``streams`` streams of ``model`` on the server's engine lanes, as the live
    executor runs them (the streams spread over the lanes, each lane's streams in one `run_step` per
    chunk, the lanes side by side), at each ladder point of ``labels``: {label: (frames per second,
    CPU ms per frame)}."""
    import threading

    import torch

    from app.server.serving.engine_bridge import InProcessFactory, StreamSettings
    from engine.serving.profile import load_profile
    from engine.streaming.step_processor import StepProcessor

    if threads > 0:
        torch.set_num_threads(threads)
    factory = InProcessFactory.load(None if model == "default" else model, device, lanes=0)  # as serve
    lanes = factory.lanes
    ladder = (load_profile(profile) if profile else bundled_live_profile(model, factory.size)).points
    measured = {}
    for label in labels:
        # A policy's label names its cross-user batch (".../b4"); the engine runs the ladder point with
        # each lane's streams batched by run_step, as the live executor does.
        config = next(p.config for p in ladder if same_point(p.config.label(), label))
        processors = [p for _ in range(streams) if isinstance(p := factory.open(StreamSettings(steps=config.steps)),
                                                                StepProcessor)]
        homes = [h for h in (processors[k::lanes.lanes] for k in range(lanes.lanes)) if h]  # spread evenly
        start = threading.Barrier(len(homes) + 1)
        workers = [threading.Thread(target=engine_lane, args=(factory, config, group, k, len(homes), start))
                   for k, group in enumerate(homes)]
        for worker in workers:
            worker.start()
        start.wait()  # every lane warmed up: the clock starts
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for worker in workers:
            worker.join()
        cpu1, wall1 = time.process_time(), time.perf_counter()
        frames = streams * ENGINE_CHUNKS * processors[0].chunk_frames
        measured[label] = (frames / (wall1 - wall0), 1000 * (cpu1 - cpu0) / frames)
    return measured


def engine_lane(factory: Any, config: Any, group: list[Any], lane: int, lanes: int, start: Any) -> None:
    """One lane of `engine_only`: its streams' first chunk and warm-up chunks, then (once every lane is
    warm) the timed chunks, each chunk of all its streams in one `run_step`."""
    from app.client import pattern_frame
    from engine.streaming.step_processor import StepRow, run_step

    chunk_frames = group[0].chunk_frames

    def chunk(index: int, frames: int) -> list[np.ndarray]:
        return [np.stack([pattern_frame(index + t, factory.size, lane + v * lanes) for t in range(frames)])
                for v in range(len(group))]

    def step(chunks: list[np.ndarray]) -> None:
        with factory.lanes.step():
            run_step([StepRow(p, config, frames) for p, frames in zip(group, chunks, strict=True)])

    step(chunk(0, 1))
    for i in range(ENGINE_WARMUP_CHUNKS):
        step(chunk(1 + i * chunk_frames, chunk_frames))
    timed = [chunk(1 + (ENGINE_WARMUP_CHUNKS + i) * chunk_frames, chunk_frames) for i in range(ENGINE_CHUNKS)]
    start.wait()
    for chunks in timed:
        step(chunks)


def with_engine_only(results: list[Result], model: str, profile: str | None, threads: int, device: str) -> None:
    """Fill in each result's engine-only FPS and CPU per frame at the points its policy chose (a child
    process with the server's threads and OpenMP setting, so the engine runs as it does in the server;
    beside as many busy processes as the result had)."""
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}  # as `serve` sets it
    for count, busy in sorted({(r.admitted, r.busy) for r in results}):
        mine = [r for r in results if (r.admitted, r.busy) == (count, busy) and r.points]
        labels = sorted({label for r in mine for label in r.points})
        if not labels:
            continue
        command = [sys.executable, str(Path(__file__).resolve()), "--engine-only", *labels, "--model", model,
                   "--threads", str(threads), "--device", device, "--streams", str(count)]
        if profile is not None:
            command += ["--profile", profile]
        with BusyNeighbours(busy):
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            logging.warning("engine-only measurement of %d stream(s) failed: %s", count, done.stderr[-2000:])
            continue
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        for r in mine:
            # The chosen mix: each point's share of the frames at its own speed.
            r.engine_fps = 1.0 / sum(share / measured[label][0] for label, share in r.points.items())
            r.engine_cpu_ms_per_frame = sum(share * measured[label][1] for label, share in r.points.items())


def table(results: list[Result], model: str) -> str:
    lines = [
        f"model: {model}",
        "policy | busy | streams | viewers | admitted | fps/stream | viewer fps | TTFF s | g2g p50 ms | g2g p95 ms | server p50 ms | dropped | chunk ms | "
        "aggregate fps | of cameras | engine-only fps | ratio | ceiling | server CPU ms/frame | client CPU ms/frame | "
        "engine-only CPU ms/frame | server cores",
        "------ | ---- | ------- | ------- | -------- | ---------- | ---------- | ------ | ---------- | ---------- | ------------- | ------- | -------- | "
        "------------- | ---------- | --------------- | ----- | ------- | ------------------- | ------------------- | "
        "------------------------ | ------------",
    ]
    for r in results:
        lines.append(
            f"{r.policy:6s} | {r.busy:4d} | {r.streams:7d} | {r.viewers:7d} | {r.admitted:8d} | {r.fps:10.1f} | "
            f"{r.viewer_fps:10.1f} | {r.ttff_s:6.2f} | "
            f"{r.latency_p50_ms:10.0f} | {r.latency_p95_ms:10.0f} | {r.server_latency_p50_ms:13.0f} | {r.dropped_ratio:7.1%} | {r.server_chunk_ms:8.0f} | "
            f"{r.aggregate_fps:13.1f} | {r.camera_ratio:10.0%} | {r.engine_fps:15.1f} | {r.engine_ratio:5.0%} | {r.ratio_ceiling:7.0%} | "
            f"{r.server_cpu_ms_per_frame:19.1f} | {r.client_cpu_ms_per_frame:19.1f} | {r.engine_cpu_ms_per_frame:24.1f} | "
            f"{r.server_cores:12.2f}"
        )
    lines.append("ladder points the policy chose (share of per-second samples):")
    for r in results:
        chosen = ", ".join(f"{label} {share:.0%}" for label, share in r.points.items())
        lines.append(f"  {r.policy} x{r.streams}{f' beside {r.busy} busy' if r.busy else ''}: {chosen}; dropped at the input {r.input_dropped_ratio:.1%}, "
                     f"at the output {r.dropped_ratio - r.input_dropped_ratio:.1%}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model for the server (default: embedded, else tiny-random)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4], help="stream counts to run")
    parser.add_argument("--seconds", type=float, default=20.0, help="run time per stream count")
    parser.add_argument("--fps", type=float, default=30.0, help="camera frame rate of each client")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in the server")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--device", default="cpu", help="the server's torch device (default cpu)")
    parser.add_argument("--no-playground", action="store_true",
                        help="serve without the Gradio playground (a GPU machine carrying the media wheels "
                             "has no Gradio: demos/gpu_wheels.sh)")
    parser.add_argument("--profile", default=None, help="fidelity profile for the server's policy (default: bundled)")
    parser.add_argument("--policies", nargs="+", default=["slack", "fifo"],
                        help="serving policies run side by side, one server each (default: slack fifo)")
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="run every stream count again beside N busy processes (CPU spinners): quiet rows, "
                             "then loaded ones")
    parser.add_argument("--viewers", type=int, nargs="+", default=[0], metavar="N",
                        help="WHEP viewers per stream besides its publisher, one row per N (default 0)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--engine-only", nargs="+", metavar="LABEL", default=None,
                        help="(internal) measure the engine alone at these ladder points, print JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model = args.model or default_model()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.engine_only is not None:
        measured = engine_only(model, args.profile, args.engine_only, args.streams[0], args.threads, args.device)
        print(json.dumps(measured))
        return 0
    allow_loopback_candidates()  # the clients run on the same machine as the server
    results = []
    for policy in args.policies:
        extra = ("--no-playground",) if args.no_playground else ()
        with served(model, args.port, args.threads, max(args.streams), args.device, args.profile, policy,
                    extra) as (url, pid):
            for count in args.streams:
                for viewers in args.viewers:
                    results.append(asyncio.run(run_streams(url, count, args.seconds, args.fps, policy, pid, viewers)))
            if args.busy:
                with BusyNeighbours(args.busy):
                    for count in args.streams:
                        for viewers in args.viewers:
                            loaded = asyncio.run(run_streams(url, count, args.seconds, args.fps, policy, pid, viewers))
                            results.append(replace(loaded, busy=args.busy))
    with_engine_only(results, model, args.profile, args.threads, args.device)
    if args.json:
        rows = [{**asdict(r), "engine_ratio": r.engine_ratio, "camera_ratio": r.camera_ratio,
                 "ratio_ceiling": r.ratio_ceiling} for r in results]
        print(json.dumps({"model": model, "results": rows}, indent=2))
    else:
        print(table(results, model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
