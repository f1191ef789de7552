"""Soak benchmark: N synthetic WebRTC clients against a diffcast server for M minutes, with churn.

Starts `diffcast serve` in a subprocess (the embedded default model unless --model says otherwise;
--max-streams = --clients, so the engine runs at full load), or watches one given by
--server/--pid. Keeps --clients aiortc publishers connected with churn: each stays a random
--min-stay-s..--max-stay-s, then leaves and a new one takes its place. Clients alternate between the
page's way in (POST /api/offer with a data channel) and OBS's (WHIP); they leave in turn by saying
goodbye (the page: DELETE with its owner token; WHIP: DELETE on its session URL, no credential) and
by just closing their peer (the server must notice at once). Every --interval seconds it samples
the server process:

* RSS, threads, open file descriptors, UDP sockets (each peer connection holds ICE sockets), TCP
  sockets (HTTP keep-alives), live streams (/healthz);
* on-time ratio: of the playout ticks in the interval, the share that showed a new frame rather
  than repeating the last one (1.0 = the model kept up with every tick).

Phases: warm-up (clients run, then all leave: the idle baseline is taken), the measured run in
--segments parts, each ending with a drain (all leave: an idle checkpoint; the last one is the idle
end). Targets: RSS growth over the measured run < 5 %; the idle end equals the idle baseline in
fds, UDP and TCP sockets, with no stream left and the server counting exactly the streams the
clients opened; threads at the idle end equal the previous idle checkpoint's (a leak grows with
every segment's sessions; a lazily started bounded pool, such as asyncio's default executor that
aiortc encodes in, stops growing at its cap) and exceed the baseline by at most that cap.

    .venv/bin/python demos/soak.py --clients 4 --minutes 60 --out soak.json
    .venv/bin/python demos/soak.py --model tiny-random --clients 2 --minutes 1   # quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import re
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.client import CodedCamera, ProbeSession, WhipSession, http, open_session, open_whip_session  # noqa: E402
from app.server.media.ice import allow_loopback_candidates  # noqa: E402

log = logging.getLogger("soak")
MAX_RSS_GROWTH = 0.05
# asyncio's default executor (aiortc's encoders, asyncio.to_thread) starts its threads lazily, up
# to this many; after a quiet warm-up a busy run may add a few that then stay.
DEFAULT_EXECUTOR_CAP = min(32, (os.cpu_count() or 1) + 4)


@dataclass
class Sample:
    t: float
    phase: str
    rss_mb: float
    threads: int
    fds: int
    udp_sockets: int
    tcp_sockets: int
    streams: int
    clients: int
    on_time: float | None  # new frames / playout ticks over the interval, all streams


@dataclass
class Report:
    model: str
    clients: int
    minutes: float
    sessions_opened: int
    refused: int
    # How clients came and went: "webrtc"/"whip" opened; "delete"/"whip-delete"/"close" left.
    churn: dict[str, int]
    server_streams_opened: int  # the server's own count (diffcast_streams_opened_total)
    samples: list[Sample]
    baseline: Sample
    idle: list[Sample]  # the idle checkpoint after each segment of the run; the last is the end
    end: Sample
    rss_start_mb: float  # mean of the measured run's first quarter
    rss_end_mb: float  # mean of its last quarter
    rss_growth: float
    on_time_mean: float | None
    leaks: dict[str, int]  # idle end - idle baseline (streams: left at the end)
    last_segment_growth: dict[str, int]  # idle end - the idle checkpoint before it
    passed: bool


def start_server(port: int, clients: int, model: str | None, extra: list[str]) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "app.cli", "serve", *(["--model", model] if model else []),
               "--port", str(port), "--allow-loopback-candidates", "--threads", "1", "--max-streams", str(clients),
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
        tcp = len(p.net_connections(kind="tcp"))
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
        return Sample(round(t, 1), phase, round(rss / 2**20, 1), threads, fds, udp, tcp, len(streams), clients,
                      round(new / ticks, 3) if ticks else None)


class Clients:
    """Keeps ``n`` publishers connected, each for a random stay in [min_stay_s, max_stay_s], then
    replaces it; page-like (/api/offer) and WHIP publishers in turn."""

    def __init__(self, url: str, n: int, min_stay_s: float, max_stay_s: float, seed: int, retry_s: float) -> None:
        self.url = url
        self.n = n
        self.stays = (min_stay_s, max_stay_s)
        self.retry_s = retry_s
        self.retry_at = 0.0
        self.random = random.Random(seed)
        self.live: list[tuple[ProbeSession | WhipSession, float]] = []  # (session, when it leaves)
        self.opened = 0
        self.left = 0
        self.refused = 0
        self.events: Counter[str] = Counter()

    async def open_one(self) -> None:
        camera = CodedCamera((128, 128), fps=15, variant=self.opened % 4)
        whip = self.opened % 2 == 1
        try:
            session = await (open_whip_session(self.url, camera) if whip else open_session(self.url, camera))
        except RuntimeError as exc:  # refused: the server is full (admission) or still closing a stream
            log.info("%s", exc)
            self.refused += 1
            self.retry_at = time.monotonic() + self.retry_s  # as a client honouring Retry-After would
            return
        self.opened += 1
        self.events["whip" if whip else "webrtc"] += 1
        self.live.append((session, time.monotonic() + self.random.uniform(*self.stays)))

    async def leave(self, session: ProbeSession | WhipSession) -> None:
        self.left += 1
        if self.left % 2:  # half just drop the peer: the server must notice that at once
            self.events["close"] += 1
            await session.close()
        elif isinstance(session, WhipSession):  # RFC 9725: DELETE on the session URL
            self.events["whip-delete"] += 1
            if await session.end() != 200:
                log.warning("DELETE %s was refused", session.location)
        else:
            self.events["delete"] += 1
            await asyncio.to_thread(http, "DELETE", f"{self.url}/api/streams/{session.stream_id}", None,
                                    {"Authorization": f"Bearer {session.owner_token}"})
            await session.close()

    async def churn(self) -> None:
        now = time.monotonic()
        for item in [x for x in self.live if now > x[1]]:
            self.live.remove(item)
            await self.leave(item[0])
        if len(self.live) < self.n and time.monotonic() >= self.retry_at:
            await self.open_one()  # one per step

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


def streams_opened(url: str) -> int:
    metrics = http("GET", f"{url}/metrics")[2].decode()
    match = re.search(r"^diffcast_streams_opened_total (\S+)$", metrics, re.M)
    return int(float(match.group(1))) if match else -1


async def soak(url: str, process: psutil.Process, args: argparse.Namespace) -> Report:
    sampler = Sampler(url, process)
    clients = Clients(url, args.clients, args.min_stay_s, args.max_stay_s, args.seed, args.retry_s)
    samples: list[Sample] = []
    t0 = time.monotonic()
    total = args.warmup_s + 60 * args.minutes
    with tqdm(total=round(total), desc="soak", bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s {postfix}") as bar:
        await run_phase("warmup", args.warmup_s, clients, sampler, args.interval, t0, samples, bar)
        await clients.close_all()
        baseline = await idle_sample(sampler, t0, "baseline", args.settle_s)
        samples.append(baseline)
        idle: list[Sample] = []
        for segment in range(args.segments):
            await run_phase("run", 60 * args.minutes / args.segments, clients, sampler, args.interval, t0, samples, bar)
            await clients.close_all()
            last = segment == args.segments - 1
            idle.append(await idle_sample(sampler, t0, "end" if last else f"idle{segment + 1}", args.settle_s))
            samples.append(idle[-1])
        end, before_end = idle[-1], ([baseline, *idle])[-2]
    run = [s for s in samples if s.phase == "run" and s.clients > 0]
    if len(run) < 4:
        raise RuntimeError(f"only {len(run)} samples in the measured run: use a longer --minutes or --interval")
    # RSS at the start of the run (after warm-up and the first new clients) vs its last quarter.
    head = run[: max(2, len(run) // 4)]
    tail = run[-max(2, len(run) // 4):]
    start_rss = sum(s.rss_mb for s in head) / len(head)
    end_rss = sum(s.rss_mb for s in tail) / len(tail)
    growth = (end_rss - start_rss) / start_rss
    on_time = [s.on_time for s in run if s.on_time is not None]
    server_opened = await asyncio.to_thread(streams_opened, url)
    def growth_since(before: Sample) -> dict[str, int]:
        return {"threads": end.threads - before.threads, "fds": end.fds - before.fds,
                "udp_sockets": end.udp_sockets - before.udp_sockets,
                "tcp_sockets": end.tcp_sockets - before.tcp_sockets, "streams": end.streams}

    leaks, last_growth = growth_since(baseline), growth_since(before_end)
    passed = (
        growth < MAX_RSS_GROWTH
        and all(leaks[k] <= 0 for k in ("fds", "udp_sockets", "tcp_sockets", "streams"))
        and last_growth["threads"] <= 0 and leaks["threads"] <= DEFAULT_EXECUTOR_CAP
        and server_opened == clients.opened  # every stream the server opened is one a client got
    )
    return Report(args.model or "default", args.clients, args.minutes, clients.opened, clients.refused,
                  dict(clients.events), server_opened, samples, baseline, idle, end, round(start_rss, 1),
                  round(end_rss, 1), round(growth, 4), round(sum(on_time) / len(on_time), 3) if on_time else None,
                  leaks, last_growth, passed)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="`diffcast serve --model` (default: the embedded default)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent WebRTC clients = --max-streams (default 4)")
    parser.add_argument("--minutes", type=float, default=60.0, help="measured run length (default 60)")
    parser.add_argument("--warmup-s", type=float, default=60.0, help="warm-up before the baseline (default 60)")
    parser.add_argument("--min-stay-s", type=float, default=20.0, help="shortest stay of a client (default 20)")
    parser.add_argument("--max-stay-s", type=float, default=60.0, help="longest stay of a client (default 60)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random stays")
    parser.add_argument("--retry-s", type=float, default=2.0, help="wait after a refused offer (default 2)")
    parser.add_argument("--segments", type=int, default=3,
                        help="parts of the run, each ending with an idle checkpoint (default 3)")
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
        server = start_server(args.port, args.clients, args.model, args.serve_arg)
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
    # The table and the verdict are this command's output (stdout), not log records.
    print(f"{'t':>6} {'phase':>8} {'rss MB':>7} {'thr':>4} {'fds':>4} {'udp':>4} {'tcp':>4} {'str':>4} {'on-time':>7}")
    for s in report.samples:
        on_time = "-" if s.on_time is None else f"{s.on_time:.3f}"
        print(f"{s.t:6.0f} {s.phase:>8} {s.rss_mb:7.1f} {s.threads:4d} {s.fds:4d} {s.udp_sockets:4d} "
              f"{s.tcp_sockets:4d} {s.streams:4d} {on_time:>7}")
    print(f"model {report.model}: sessions opened {report.sessions_opened} (server: {report.server_streams_opened}; "
          f"refused {report.refused}; {report.churn}); RSS {report.rss_start_mb} -> {report.rss_end_mb} MB over the "
          f"run, {100 * report.rss_growth:+.2f} % (target < {100 * MAX_RSS_GROWTH:.0f} %); mean on-time ratio "
          f"{report.on_time_mean}; idle end - idle baseline: {report.leaks}; idle end - previous idle checkpoint: "
          f"{report.last_segment_growth}; {'PASS' if report.passed else 'FAIL'}")
    if args.out is not None:
        args.out.write_text(json.dumps(asdict(report), indent=1))
    return 0 if report.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
