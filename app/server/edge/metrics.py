"""Prometheus metrics, collected from the live sessions at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app.server.serving.session import SessionManager

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SessionCollector(Collector):
    def __init__(self, manager: SessionManager) -> None:
        self._manager = manager

    def collect(self) -> Iterator[Metric]:
        sessions = list(self._manager.sessions.values())
        labels = ["stream_id", "kind"]
        active = GaugeMetricFamily("diffcast_streams", "Active streams")
        active.add_metric([], len(sessions))
        capacity = GaugeMetricFamily("diffcast_streams_max", "Stream capacity (--max-streams)")
        capacity.add_metric([], self._manager.config.max_streams)
        fps = GaugeMetricFamily("diffcast_stream_output_fps", "Output frames per second", labels=labels)
        latency = GaugeMetricFamily(
            "diffcast_stream_latency_seconds",
            "Input frame arrival to output playout, over the last 5 s",
            labels=[*labels, "quantile"],
        )
        slack = GaugeMetricFamily("diffcast_stream_playout_slack_seconds", "Generated output not yet played", labels=labels)
        viewers = GaugeMetricFamily("diffcast_stream_viewers", "WHEP viewers", labels=labels)
        frames_in = CounterMetricFamily("diffcast_stream_input_frames", "Input frames received", labels=labels)
        frames_out = CounterMetricFamily("diffcast_stream_output_frames", "New output frames played", labels=labels)
        dropped = CounterMetricFamily(
            "diffcast_stream_dropped_frames", "Input frames skipped and output frames discarded", labels=labels
        )
        # The slack policy's view of each stream (absent under --policy fifo).
        steps = GaugeMetricFamily("diffcast_stream_fidelity_steps", "Denoising steps of the last chunk", labels=labels)
        credit = GaugeMetricFamily("diffcast_stream_credit_seconds", "Service credit C = P - (R + T)", labels=labels)
        tier = GaugeMetricFamily("diffcast_stream_tier", "Policy tier (0 urgent, 1 normal, 2 relaxed)", labels=labels)
        downshifts = CounterMetricFamily(
            "diffcast_stream_fidelity_downshifts", "Chunks at lower quality than the chunk before", labels=labels
        )
        tiers = {"urgent": 0, "normal": 1, "relaxed": 2}
        for s in sessions:
            key = [s.id, s.kind]
            policy = s.policy_stats() if s.policy_stats is not None else {}
            if policy.get("fidelity_steps") is not None:
                steps.add_metric(key, policy["fidelity_steps"])
                downshifts.add_metric(key, policy["downshifts"])
            if policy.get("tier") in tiers:
                tier.add_metric(key, tiers[policy["tier"]])
                credit.add_metric(key, policy["credit_s"])
            fps.add_metric(key, s.playout.output_fps())
            for quantile, name in (("0.5", "p50"), ("0.95", "p95")):
                value = s.playout.latency_s().get(name)
                if value is not None:
                    latency.add_metric([*key, quantile], value)
            slack.add_metric(key, s.playout.slack_s)
            viewers.add_metric(key, s.viewers)
            frames_in.add_metric(key, s.assembler.received)
            frames_out.add_metric(key, s.playout.frames_shown)
            dropped.add_metric(key, s.dropped_frames)
        totals = self._manager.totals()
        opened = CounterMetricFamily("diffcast_streams_opened", "Streams opened since start")
        opened.add_metric([], totals["streams_opened"])
        all_out = CounterMetricFamily("diffcast_output_frames", "New output frames played, all streams ever")
        all_out.add_metric([], totals["output_frames"])
        all_dropped = CounterMetricFamily("diffcast_dropped_frames", "Frames dropped, all streams ever")
        all_dropped.add_metric([], totals["dropped_frames"])
        yield from (active, capacity, opened, all_out, all_dropped)
        # The engine core's actions (engine/serving/core.py), as counters over the server's life.
        loop = self._manager.serving
        counts = loop.counters() if loop is not None else {}
        for name, doc in (("evictions", "Stream states parked in host memory by the policy"),
                          ("restores", "Parked stream states brought back to the engine"),
                          ("preemptions", "Chunks paused at a denoising-step boundary for a more urgent stream"),
                          ("admissions_refused", "New streams the policy refused (first chunk would miss its slack)"),
                          ("rehomes", "Streams moved to another worker by the policy")):
            counter = CounterMetricFamily(f"diffcast_{name}", doc)
            counter.add_metric([], counts.get(name, 0))
            yield counter
        # The engine's workers (one in process; one per Ray worker actor) and the autoscaler's actions.
        workers = GaugeMetricFamily("diffcast_workers", "Engine workers serving streams")
        workers.add_metric([], len(loop.executor.worker_views()) if loop is not None else 1)
        scale = CounterMetricFamily("diffcast_scale_events", "Workers added (up) and removed (down) by the autoscaler",
                                    labels=["direction"])
        events = loop.executor.scale_events if loop is not None else {}
        for direction in ("up", "down"):
            scale.add_metric([direction], events.get(direction, 0))
        yield from (workers, scale)
        # The in-process engine's lanes: the threads each ran its last step on, and the cores other
        # programs left this process, which those threads follow (engine/streaming/thread_budget.py).
        lanes = getattr(loop.executor, "lanes", None) if loop is not None else None
        if lanes is not None:
            threads = GaugeMetricFamily("diffcast_engine_threads", "Intra-op threads of each engine lane's last step",
                                        labels=["worker"])
            for lane, count in sorted(lanes.last_threads.items()):
                threads.add_metric([str(lane)], count)
            yield threads
            if lanes.budget is not None and lanes.budget.cores_left is not None:
                left = GaugeMetricFamily("diffcast_engine_cores_left",
                                         "Cores of this process's affinity that other programs left it")
                left.add_metric([], lanes.budget.cores_left)
                yield left
        yield from (fps, latency, slack, viewers, frames_in, frames_out, dropped)
        yield from (steps, credit, tier, downshifts)


def build_registry(manager: SessionManager) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(SessionCollector(manager))
    return registry
