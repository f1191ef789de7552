"""`diffcast simulate`: trace-driven simulation of the serving policy against baselines and ablations."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

NAME = "simulate"
HELP = "simulate the playout-slack serving policy vs. baselines on synthetic workloads or a trace"

log = logging.getLogger(__name__)
WORKLOAD_CHOICES = ("steady", "burst", "prompt-switch", "pause", "all")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=WORKLOAD_CHOICES, default="all",
                        help="SlackServe appendix-B workload, or all four (default)")
    parser.add_argument("--trace", type=Path, help="replay a JSONL trace instead of a synthetic workload")
    parser.add_argument("--write-trace", type=Path, help="write the generated workload as a JSONL trace and exit")
    parser.add_argument("--workers", type=int, default=16, help="GPUs in the cluster (default 16)")
    parser.add_argument("--nodes", type=int, default=2, help="nodes the GPUs are spread over (default 2)")
    parser.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate, streams/s (default 1)")
    parser.add_argument("--streams", type=int, default=946, help="streams per workload (default 946)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--state-slots", type=int, default=4,
                        help="stream states a GPU holds before evicting to host (default 4)")
    parser.add_argument("--jitter", type=float, default=0.03, help="latency jitter CV (default 0.03)")
    parser.add_argument("--policies", default="all",
                        help="comma-separated policy names, or 'all' (baselines + ablation ladder)")
    parser.add_argument("--profile", type=Path,
                        help="fidelity profile JSON (default: bundled 1.3B H100 480p); points the engine cannot run "
                             "on the profile's device (fp8 today) are left out")
    parser.add_argument("--out", type=Path, help="write the markdown report and PNGs to this directory")
    parser.add_argument("--json", action="store_true", help="print one JSON object with the results to stdout")
    parser.add_argument("--tick-bench", action="store_true", help="benchmark the policy's control tick")
    parser.add_argument("--ticks", type=int, default=300, help="ticks to time in --tick-bench (default 300)")


def run(args: argparse.Namespace) -> int:
    from engine.sim.runner import ALL_POLICIES, run_suite, simulation_profile
    from engine.sim.simulator import SimConfig
    from engine.sim.workload import WORKLOADS, WorkloadSpec, read_trace, write_trace

    try:
        profile = simulation_profile(args.profile)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.tick_bench:
        from engine.sim.tickbench import run_tick_bench

        bench = run_tick_bench(profile, streams=args.streams, workers=args.workers, ticks=args.ticks)
        if args.json:
            print(json.dumps(asdict(bench)))
        else:
            print(f"control tick at {bench.streams} streams / {bench.workers} workers: median {bench.tick_ms:.2f} ms, "
                  f"p95 {bench.tick_p95_ms:.2f} ms over {bench.ticks} ticks")
        return 0

    names = ALL_POLICIES if args.policies == "all" else tuple(p.strip() for p in args.policies.split(",") if p.strip())
    unknown = [p for p in names if p not in ALL_POLICIES]
    if unknown:
        print(f"error: unknown policies {unknown}; choose from {', '.join(ALL_POLICIES)}", file=sys.stderr)
        return 2
    workloads = WORKLOADS if args.workload == "all" else (args.workload,)
    try:
        specs = [WorkloadSpec(w, streams=args.streams, rate=args.rate, seed=args.seed) for w in workloads]
        sim = SimConfig(workers=args.workers, nodes=args.nodes, state_slots=args.state_slots,
                        jitter_cv=args.jitter, seed=args.seed)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.write_trace:
        from engine.sim.runner import workload_events

        if len(specs) != 1:
            print("error: --write-trace needs a single --workload", file=sys.stderr)
            return 2
        write_trace(workload_events(specs[0], profile), args.write_trace)
        log.info("wrote %s", args.write_trace)
        return 0
    trace = read_trace(args.trace) if args.trace else None
    runs = run_suite(None if trace is not None else specs, names, profile, sim, trace=trace,
                     progress=not args.json)
    if args.out:
        from engine.sim.report import write_report

        header = {
            "workloads": ", ".join(dict.fromkeys(r.workload for r in runs)),
            "streams per workload": args.streams if trace is None else "from trace",
            "arrival rate (streams/s)": args.rate,
            "GPUs": f"{args.workers} over {args.nodes} nodes",
            "state slots per GPU": args.state_slots,
            "latency jitter CV": args.jitter,
            "seed": args.seed,
            "profile": f"{profile.model} on {profile.device}, {profile.resolution[0]}x{profile.resolution[1]} "
                       f"({profile.source})",
            "command": (f"diffcast simulate --workload {args.workload} --streams {args.streams} --rate {args.rate} "
                        f"--workers {args.workers} --seed {args.seed} --state-slots {args.state_slots} "
                        f"--out {args.out}" + (f" --trace {args.trace}" if args.trace else "")),
        }
        path = write_report(runs, args.out, header)
        log.info("report written to %s", path)
    by_workload: dict[str, dict[str, dict[str, float | int | str]]] = {}
    for r in runs:
        by_workload.setdefault(r.workload, {})[r.policy] = r.summary.to_json()
    first = next(iter(by_workload))
    if args.json:
        print(json.dumps({"workload": first, "policies": by_workload[first], "workloads": by_workload}))
    else:
        for w, table in by_workload.items():
            print(f"== {w}")
            for p, s in table.items():
                print(f"  {p:14s} CPR {s['cpr']:.3f}  TTFC {s['ttfc_s']:.2f}s  stalls/stream "
                      f"{s['stalls_per_stream']:.2f}  quality {s['mean_quality']:.2f}  re-homes {s['rehomes']}  "
                      f"evictions {s['evictions']}  rejected {s['rejected']}")
    return 0
