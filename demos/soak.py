"""Soak benchmark: N synthetic WebRTC clients against a diffcast server for M minutes, with churn.

Starts `diffcast serve` in a subprocess (or watches one given by --server/--pid), keeps --clients
aiortc publishers connected (each stays --session-s seconds, then leaves — alternately with a
DELETE with its owner token and by just closing its peer — and a new one takes its place), and
samples the server process every --interval seconds:

* RSS, threads, open file descriptors, UDP sockets (each peer connection holds ICE sockets),
  live streams (/healthz);
* on-time ratio: of the playout ticks in the interval, the share that showed a new frame rather
  than repeating the last one (1.0 = the model kept up with every tick).

Phases: warm-up (clients run, then all leave: the idle baseline is taken), the measured run, and a
final drain (all leave: the idle end). Targets: RSS growth over the measured run < 5 %, and the
idle end equals the idle baseline in threads, fds and UDP sockets, with no stream left.

    .venv/bin/python demos/soak.py --clients 3 --minutes 3 --out soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.client import CodedCamera, ProbeSession, http, open_session  # noqa: E402
from app.server.ice import allow_loopback_candidates  # noqa: E402

log = logging.getLogger("soak")
MAX_RSS_GROWTH = 0.05


@dataclass
class Sample:
    t: float
    phase: str
    rss_mb: float
    threads: int
    fds: int
    udp_sockets: int
    streams: int
    clients: int
    on_time: float | None  # new frames / playout ticks over the interval, all streams


@dataclass
class Report:
    clients: int
    minutes: float
    sessions_opened: int
    refused: int
    samples: list[Sample]
    baseline: Sample
    end: Sample
    rss_growth: float
    on_time_mean: float | None
    leaks: dict[str, int]
    passed: bool


def start_server(port: int, clients: int, extra: list[str]) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "app.cli", "serve", "--model", "tiny-random", "--port", str(port),
               "--allow-loopback-candidates", "--threads", "1", "--max-streams", str(clients),
               "--max-streams-per-client", str(clients), *extra]
    return subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if http("GET", f"{url}/healthz")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server at {url} did not come up in {timeout_s} s")


class Sampler:
    def __init__(self, url: str, process: psutil.Process) -> None:
        self.url = url
        self.process = process
        self._ticks: dict[str, tuple[int, int]] = {}  # stream -> (frames_out, repeated_frames)

    def sample(self, t: float, phase: str, clients: int) -> Sample:
        p = self.process
        with p.oneshot():
            rss, threads, fds = p.memory_info().rss, p.num_threads(), p.num_fds()
        udp = len(p.net_connections(kind="udp"))
        status, _, body = http("GET", f"{self.url}/api/streams")  # the operator's view: loopback
        streams = json.loads(body) if status == 200 else []
        new = ticks = 0
        seen = {}
        for s in streams:
            shown, repeats = int(s["frames_out"]), int(s["repeated_frames"])
            before = self._ticks.get(s["stream_id"], (0, 0))
            new += shown - before[0]
            ticks += shown - before[0] + repeats - before[1]
            seen[s["stream_id"]] = (shown, repeats)
        self._ticks = seen
        return Sample(round(t, 1), phase, round(rss / 2**20, 1), threads, fds, udp, len(streams), clients,
                      round(new / ticks, 3) if ticks else None)


class Clients:
    """Keeps ``n`` publishers connected, each for ``session_s`` seconds, then replaces it."""

    def __init__(self, url: str, n: int, session_s: float) -> None:
        self.url = url
        self.n = n
        self.session_s = session_s
        self.live: list[tuple[ProbeSession, float]] = []  # (session, when it leaves)
        self.opened = 0
        self.left = 0
        self.refused = 0

    async def open_one(self) -> None:
        try:
            session = await open_session(self.url, CodedCamera((128, 128), fps=15, variant=self.opened % 4))
        except RuntimeError as exc:  # refused (the server is still closing the one this replaces)
            log.warning("%s", exc)
            self.refused += 1
            return
        self.opened += 1
        # Staggered stays (1x to 2x --session-s), so clients do not all leave at once.
        stay = self.session_s * (1 + (self.opened % self.n) / self.n)
        self.live.append((session, time.monotonic() + stay))

    async def leave(self, session: ProbeSession) -> None:
        self.left += 1
        if self.left % 2 and session.owner_token:  # half say goodbye, half just drop the peer
            await asyncio.to_thread(http, "DELETE", f"{self.url}/api/streams/{session.stream_id}", None,
                                    {"Authorization": f"Bearer {session.owner_token}"})
        await session.close()

    async def churn(self) -> None:
        now = time.monotonic()
        for item in [x for x in self.live if now > x[1]]:
            self.live.remove(item)
            await self.leave(item[0])
        if len(self.live) < self.n:
            await self.open_one()  # one per step; a refused one is tried again at the next step

    async def close_all(self) -> None:
        while self.live:
            await self.leave(self.live.pop()[0])


async def run_phase(name: str, seconds: float, clients: Clients | None, sampler: Sampler, interval: float,
                    t0: float, samples: list[Sample], bar: tqdm) -> None:
    end = time.monotonic() + seconds
    next_sample = time.monotonic() + interval
    while (now := time.monotonic()) < end:
        if clients is not None:
            await clients.churn()
        if now >= next_sample:
            samples.append(await asyncio.to_thread(sampler.sample, now - t0, name,
                                                   len(clients.live) if clients else 0))
            next_sample += interval
            bar.set_postfix(phase=name, rss=samples[-1].rss_mb, streams=samples[-1].streams)
        bar.update(round(min(0.5, end - now), 2))
        await asyncio.sleep(0.5)


async def idle_sample(sampler: Sampler, t0: float, phase: str, settle_s: float) -> Sample:
    """After every client left: wait until the server has no stream, then let it settle."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if json.loads(http("GET", f"{sampler.url}/healthz")[2])["streams"] == 0:
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(settle_s)
    return await asyncio.to_thread(sampler.sample, time.monotonic() - t0, phase, 0)


async def soak(url: str, process: psutil.Process, args: argparse.Namespace) -> Report:
    sampler = Sampler(url, process)
    clients = Clients(url, args.clients, args.session_s)
    samples: list[Sample] = []
    t0 = time.monotonic()
    total = args.warmup_s + 60 * args.minutes
    with tqdm(total=round(total), desc="soak", bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s {postfix}") as bar:
        await run_phase("warmup", args.warmup_s, clients, sampler, args.interval, t0, samples, bar)
        await clients.close_all()
        baseline = await idle_sample(sampler, t0, "baseline", args.settle_s)
        samples.append(baseline)
        await run_phase("run", 60 * args.minutes, clients, sampler, args.interval, t0, samples, bar)
        await clients.close_all()
        end = await idle_sample(sampler, t0, "end", args.settle_s)
        samples.append(end)
    run = [s for s in samples if s.phase == "run" and s.clients > 0]
    if len(run) < 4:
        raise RuntimeError(f"only {len(run)} samples in the measured run: use a longer --minutes or --interval")
    # RSS at the start of the run (after warm-up and the first new clients) vs its last quarter.
    head = run[: max(2, len(run) // 4)]
    tail = run[-max(2, len(run) // 4):]
    start_rss = sum(s.rss_mb for s in head) / len(head)
    growth = (sum(s.rss_mb for s in tail) / len(tail) - start_rss) / start_rss
    on_time = [s.on_time for s in run if s.on_time is not None]
    leaks = {"threads": end.threads - baseline.threads, "fds": end.fds - baseline.fds,
             "udp_sockets": end.udp_sockets - baseline.udp_sockets, "streams": end.streams}
    passed = growth < MAX_RSS_GROWTH and all(v <= 0 for v in leaks.values())
    return Report(args.clients, args.minutes, clients.opened, clients.refused, samples, baseline, end,
                  round(growth, 4), round(sum(on_time) / len(on_time), 3) if on_time else None, leaks, passed)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=3, help="concurrent WebRTC clients (default 3)")
    parser.add_argument("--minutes", type=float, default=3.0, help="measured run length (default 3)")
    parser.add_argument("--warmup-s", type=float, default=20.0, help="warm-up before the baseline (default 20)")
    parser.add_argument("--session-s", type=float, default=20.0, help="how long each client stays (default 20)")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples (default 5)")
    parser.add_argument("--settle-s", type=float, default=3.0, help="idle wait before the idle samples")
    parser.add_argument("--server", default=None, help="URL of a running server (with --pid); default: start one")
    parser.add_argument("--pid", type=int, default=None, help="process id of the --server, to sample it")
    parser.add_argument("--port", type=int, default=8790, help="port of the server started here")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `diffcast serve` argument")
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    allow_loopback_candidates()
    server = None
    if args.server is None:
        server = start_server(args.port, args.clients, args.serve_arg)
        url, pid = f"http://127.0.0.1:{args.port}", server.pid
    else:
        if args.pid is None:
            raise SystemExit("--server needs --pid (the server process to sample)")
        url, pid = args.server.rstrip("/"), args.pid
    try:
        wait_ready(url)
        report = asyncio.run(soak(url, psutil.Process(pid), args))
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    print(f"{'t':>6} {'phase':>8} {'rss MB':>7} {'thr':>4} {'fds':>4} {'udp':>4} {'str':>4} {'on-time':>7}")
    for s in report.samples:
        on_time = "-" if s.on_time is None else f"{s.on_time:.3f}"
        print(f"{s.t:6.0f} {s.phase:>8} {s.rss_mb:7.1f} {s.threads:4d} {s.fds:4d} {s.udp_sockets:4d} "
              f"{s.streams:4d} {on_time:>7}")
    print(f"sessions opened {report.sessions_opened} (refused {report.refused}); RSS growth over the run "
          f"{100 * report.rss_growth:+.2f} % (target < {100 * MAX_RSS_GROWTH:.0f} %); mean on-time ratio "
          f"{report.on_time_mean}; idle end - idle baseline: {report.leaks}; {'PASS' if report.passed else 'FAIL'}")
    if args.out is not None:
        args.out.write_text(json.dumps(asdict(report), indent=1))
    return 0 if report.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
