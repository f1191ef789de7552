"""Markdown + PNG report over a set of simulation runs (matplotlib, Agg backend)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engine.serving.policy import ABLATION_LADDER
from engine.sim.runner import Run

DPI = 72


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grid(runs: Sequence[Run]) -> tuple[list[str], list[str]]:
    workloads = list(dict.fromkeys(r.workload for r in runs))
    policies = list(dict.fromkeys(r.policy for r in runs))
    return workloads, policies


def _bars(runs: Sequence[Run], metric: str, title: str, path: Path, log: bool = False,
          ylim: tuple[float, float] | None = None) -> None:
    plt = _plt()
    workloads, policies = _grid(runs)
    by = {(r.workload, r.policy): getattr(r.summary, metric) for r in runs}
    fig, ax = plt.subplots(figsize=(8, 3.2))
    width = 0.8 / len(policies)
    x = np.arange(len(workloads))
    cmap = plt.get_cmap("tab10")
    for i, p in enumerate(policies):
        vals = [by.get((w, p), np.nan) for w in workloads]
        ax.bar(x + i * width - 0.4 + width / 2, vals, width, label=p, color=cmap(i))
    ax.set_xticks(x, workloads)
    ax.set_title(title)
    if log:
        ax.set_yscale("log")
    if ylim:
        ax.set_ylim(*ylim)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _stall_durations(runs: Sequence[Run], workload: str, path: Path) -> None:
    plt = _plt()
    sel = [r for r in runs if r.workload == workload]
    data = [[st.duration_s for s in r.result.streams for st in s.stalls] or [0.0] for r in sel]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.boxplot(data, showfliers=False)
    ax.set_xticks(range(1, len(sel) + 1), [r.policy for r in sel], fontsize=7)
    ax.set_ylabel("stall duration (s)")
    ax.set_title(f"Stall durations ({workload}); whiskers 1.5 IQR, outliers hidden")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _worker_tiers(runs: Sequence[Run], workload: str, policies: Sequence[str], path: Path) -> None:
    plt = _plt()
    sel = [r for r in runs if r.workload == workload and r.policy in policies]
    fig, axes = plt.subplots(1, max(1, len(sel)), figsize=(8, 3.0), sharey=True, squeeze=False)
    for ax, r in zip(axes[0], sel, strict=False):
        tl = r.result.timeline
        t = np.array([row.t for row in tl])
        for field_name, label, color in (("urgent_workers", "URGENT", "tab:red"),
                                         ("normal_workers", "NORMAL", "tab:orange"),
                                         ("relaxed_workers", "RELAXED", "tab:green")):
            y = np.array([getattr(row, field_name) for row in tl], dtype=np.float64)
            k = min(10, len(y)) or 1
            ax.plot(t, np.convolve(y, np.ones(k) / k, mode="same"), label=label, color=color, lw=1)
        ax.set_title(r.policy, fontsize=9)
        ax.set_xlabel("time (s)")
    axes[0][0].set_ylabel("workers (moving avg)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Worker tiers over time ({workload}): a worker's tier is its most urgent stream's", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _autoscaler(runs: Sequence[Run], policy: str, path: Path) -> bool:
    sel = [r for r in runs if r.policy == policy and any(row.desired_workers is not None for row in r.result.timeline)]
    if not sel:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.0))
    for r in sel:
        tl = r.result.timeline
        ax.plot([row.t for row in tl], [row.desired_workers for row in tl], lw=1, label=f"{r.workload}: desired")
    n_workers = len(sel[0].result.worker_busy_s)
    ax.axhline(n_workers, color="k", ls="--", lw=1, label="actual (fixed)")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("GPUs")
    ax.set_title(f"Autoscaler's desired GPU count ({policy}, advisory: hysteresis band +-0.1 around 0.7)",
                 fontsize=9)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def _ablation(runs: Sequence[Run], workload: str, path: Path) -> None:
    plt = _plt()
    sel = {r.policy: r.summary for r in runs if r.workload == workload}
    ladder = [p for p in ABLATION_LADDER if p in sel]
    fig, axes = plt.subplots(1, 3, figsize=(8, 2.8))
    for ax, metric, label in zip(axes, ("cpr", "ttfc_s", "mean_quality"), ("CPR", "TTFC (s)", "quality"),
                                 strict=True):
        ax.plot(range(len(ladder)), [getattr(sel[p], metric) for p in ladder], marker="o")
        labels = ["+offload\n(slackserve)" if p == "slackserve" else p for p in ladder]
        ax.set_xticks(range(len(ladder)), labels, fontsize=7, rotation=20)
        ax.set_title(label, fontsize=9)
    fig.suptitle(f"Ablation ladder ({workload})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _table(runs: Sequence[Run]) -> list[str]:
    rows = [
        "| policy | CPR | TTFC mean (s) | TTFC p95 (s) | stalls/stream | stall mean (s) | stall p95 (s) | quality "
        "| re-homes | evictions | preemptions | rejected | GPU util |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        s = r.summary
        rows.append(
            f"| {r.policy} | {s.cpr:.3f} | {s.ttfc_s:.2f} | {s.ttfc_p95_s:.2f} | {s.stalls_per_stream:.2f} | "
            f"{s.stall_mean_s:.2f} | {s.stall_p95_s:.2f} | {s.mean_quality:.2f} | {s.rehomes} | {s.evictions} | "
            f"{s.preemptions} | {s.rejected} | {s.utilisation:.2f} |"
        )
    return rows


def write_report(runs: Sequence[Run], out: Path, header: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    workloads, policies = _grid(runs)
    _bars(runs, "cpr", "Continuous play ratio (higher is better)", out / "cpr.png", ylim=(0, 1.05))
    _bars(runs, "ttfc_s", "Mean time to first chunk, s (log scale, lower is better)", out / "ttfc.png", log=True)
    _bars(runs, "stalls_per_stream", "Stalls per stream (lower is better)", out / "stalls.png")
    _bars(runs, "mean_quality", "Mean chunk quality (modelled VBench-like score)", out / "quality.png",
          ylim=(80, 84.5))
    _bars(runs, "rehomes", "Re-homings per run", out / "rehomes.png")
    _bars(runs, "evictions", "Evictions (state offloaded to host) per run", out / "evictions.png")
    focus = workloads[0]
    _stall_durations(runs, focus, out / "stall_durations.png")
    tier_policies = [p for p in ("fifo-batch", "ts-chunk-lsf", "slackserve") if p in policies]
    _worker_tiers(runs, focus, tier_policies, out / "worker_tiers.png")
    has_autoscaler = _autoscaler(runs, "slackserve", out / "autoscaler.png")
    if any(p in policies for p in ABLATION_LADDER):
        for w in workloads:
            _ablation(runs, w, out / f"ablation_{w}.png")
    lines = ["# diffcast serving simulation report", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines += ["", "Metrics: CPR = on-time chunks / chunks, averaged over admitted streams; TTFC = arrival to first "
              "playable chunk; stalls counted and timed per stream; quality is the profile's modelled score, "
              "chunk-weighted. GPU util = busy GPU-seconds / (GPUs x makespan).", ""]
    for w in workloads:
        lines += [f"## {w}", ""] + _table([r for r in runs if r.workload == w]) + [""]
        if (out / f"ablation_{w}.png").exists():
            lines += [f"![ablation {w}](ablation_{w}.png)", ""]
    lines += ["## Plots", ""]
    for name, caption in (("cpr", "CPR"), ("ttfc", "TTFC"), ("stalls", "stalls per stream"),
                          ("stall_durations", f"stall durations ({focus})"), ("quality", "mean quality"),
                          ("rehomes", "re-homings"), ("evictions", "evictions"),
                          ("worker_tiers", f"worker tiers over time ({focus})"),
                          ("autoscaler", "autoscaler desired GPUs")):
        if name != "autoscaler" or has_autoscaler:
            lines += [f"![{caption}]({name}.png)", ""]
    top = {}
    for r in runs:
        if r.policy == "slackserve":
            counts = sorted(r.result.fidelity_counts.items(), key=lambda kv: -kv[1])[:5]
            total = max(1, sum(r.result.fidelity_counts.values()))
            top[r.workload] = [(k, round(v / total, 3)) for k, v in counts]
    if top:
        lines += ["## Fidelity configurations chosen by slackserve (top 5 share of chunks)", ""]
        for w, items in top.items():
            lines.append(f"- {w}: " + ", ".join(f"`{k}` {v:.1%}" for k, v in items))
        lines.append("")
    path = out / "report.md"
    path.write_text("\n".join(lines))
    (out / "summary.json").write_text(json.dumps(
        {w: {r.policy: r.summary.to_json() for r in runs if r.workload == w} for w in workloads}, indent=1) + "\n")
    return path
