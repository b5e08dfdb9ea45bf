"""Prometheus metrics of one router service, in a registry of its own.

Why a registry per service and not prometheus-client's global one: tests (and
``replay --serve`` beside a live router) run several services in one process;
a global registry would make the second one fail on duplicate names.

Two kinds of metrics, chosen for the cost of the hot paths:

* **Per-request** metrics (latency histograms, routing decisions, predicted
  hit tokens, API errors) are ordinary prometheus-client objects updated by
  the query path: a histogram ``observe`` costs about a microsecond, and label
  children are cached so no label lookup happens per request.
* **Per-worker ingestion state** (events applied/rejected, batches, resyncs,
  restarts, lag, blocks per tier, state) is *read at scrape time* from the
  ingestor and the index by :class:`WorkerStateCollector`; the ingestion loop
  therefore pays nothing per event for metrics (STYLE §8).

Names follow ``tokenspeed_<part>_<thing>_<unit|total>``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "ServiceMetrics", "WorkerSample", "WorkerStateCollector"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: latency buckets for in-process match/route work (seconds): 5 µs .. 50 ms
_LATENCY_BUCKETS = (
    5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
)


@dataclass(frozen=True)
class WorkerSample:
    """What the collector needs to know about one worker at scrape time."""

    name: str
    role: str
    state: str
    batches_applied: int
    events_applied: int
    events_rejected: int
    resyncs: int
    restarts: int
    replayed_batches: int
    gaps: int
    lag_s: float | None
    replay_requests: int = 0
    replay_timeouts: int = 0
    malformed: int = 0
    blocks_by_tier: dict[str, int] = field(default_factory=dict)


class WorkerStateCollector(Collector):
    """Exposes per-worker ingestion state, sampled from the service at scrape time."""

    STATES = ("live", "resyncing", "stale")

    def __init__(self, sample: Callable[[], Iterable[WorkerSample]]) -> None:
        self._sample = sample

    def describe(self) -> Iterable[Any]:
        return []  # dynamic label sets: let the registry call collect() instead

    def collect(self) -> Iterator[Any]:
        samples = list(self._sample())
        counters = {
            "batches_applied": ("tokenspeed_ingest_batches_applied", "KV event batches applied"),
            "events_applied": ("tokenspeed_ingest_events_applied", "KV events applied to the index"),
            "events_rejected": (
                "tokenspeed_ingest_events_rejected",
                "KV events rejected (unknown parent, malformed, ...)",
            ),
            "resyncs": ("tokenspeed_ingest_resyncs", "worker state dropped after an unhealable gap"),
            "restarts": ("tokenspeed_ingest_restarts", "publisher restarts detected (seq went back)"),
            "replayed_batches": (
                "tokenspeed_ingest_replayed_batches",
                "batches received through replay after a gap",
            ),
            "gaps": ("tokenspeed_ingest_gaps", "sequence gaps detected (healed by replay or not)"),
            "replay_requests": ("tokenspeed_ingest_replay_requests", "replays asked of the publisher"),
            "replay_timeouts": ("tokenspeed_ingest_replay_timeouts", "replays the publisher did not answer in time"),
            "malformed": ("tokenspeed_ingest_malformed_frames", "frames skipped as malformed (bad seq, payload, topic)"),
        }
        for attr, (name, doc) in counters.items():
            fam = CounterMetricFamily(name, doc, labels=["worker"])
            for s in samples:
                fam.add_metric([s.name], float(getattr(s, attr)))
            yield fam
        lag = GaugeMetricFamily(
            "tokenspeed_worker_lag_seconds",
            "now minus the timestamp of the newest batch applied for the worker",
            labels=["worker"],
        )
        blocks = GaugeMetricFamily(
            "tokenspeed_index_blocks", "blocks held in the index", labels=["worker", "tier"]
        )
        state = GaugeMetricFamily(
            "tokenspeed_worker_state", "1 for the worker's current state", labels=["worker", "state"]
        )
        info = GaugeMetricFamily("tokenspeed_worker_info", "configured role", labels=["worker", "role"])
        for s in samples:
            if s.lag_s is not None:
                lag.add_metric([s.name], s.lag_s)
            for tier, n in sorted(s.blocks_by_tier.items()):
                blocks.add_metric([s.name, tier], float(n))
            for st in self.STATES:
                state.add_metric([s.name, st], 1.0 if s.state == st else 0.0)
            info.add_metric([s.name, s.role], 1.0)
        yield from (lag, blocks, state, info)


class ServiceMetrics:
    """The metric objects of one service; ``render()`` gives the exposition text."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.match_latency = Histogram(
            "tokenspeed_match_latency_seconds", "time to answer a match (in process)",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.route_latency = Histogram(
            "tokenspeed_route_latency_seconds", "time to take a routing decision (in process)",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.route_decisions = Counter(
            "tokenspeed_route_decisions", "routing decisions per chosen worker", ["worker"], registry=r
        )
        self.predicted_hit_tokens = Counter(
            "tokenspeed_route_predicted_hit_tokens",
            "prompt tokens the chosen worker is predicted to hold", ["worker"], registry=r,
        )
        self.route_requests_tokens = Counter(
            "tokenspeed_route_request_tokens", "prompt tokens routed", registry=r
        )
        self.releases = Counter(
            "tokenspeed_route_releases", "release calls by outcome", ["outcome"], registry=r
        )
        self.api_errors = Counter(
            "tokenspeed_api_errors", "API requests answered with an error",
            ["transport", "status"], registry=r,
        )
        self.record_bytes = Counter(
            "tokenspeed_record_bytes", "payload bytes written to the event log", registry=r
        )
        self.ingest_errors = Counter(
            "tokenspeed_ingest_errors", "items the ingestion loop failed to apply", registry=r
        )
        self.workers = Gauge("tokenspeed_workers", "configured subscriber streams", registry=r)
        self.visible_delay = Histogram(
            "tokenspeed_ingest_visible_delay_seconds",
            "batch timestamp (publisher clock) to applied in the index (meaningful on one host / NTP)",
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0, 5.0),
            registry=r,
        )
        self._decisions: dict[str, Any] = {}
        self._hits: dict[str, Any] = {}

    def observe_route(self, worker: str, matched_tokens: int) -> None:
        """Count one decision (label children cached: no lookup per request)."""
        child = self._decisions.get(worker)
        if child is None:
            child = self._decisions[worker] = self.route_decisions.labels(worker)
            self._hits[worker] = self.predicted_hit_tokens.labels(worker)
        child.inc()
        if matched_tokens:
            self._hits[worker].inc(matched_tokens)

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    def render(self) -> bytes:
        return generate_latest(self.registry)
