"""Prometheus metrics of one router service, in a registry of its own.

Why a registry per service and not prometheus-client's global one: tests (and
``replay --serve`` beside a live router) run several services in one process;
a global registry would make the second one fail on duplicate names.

Two kinds of metrics, chosen for the cost of the hot paths:

* **Per-request** metrics (latency histograms, routing decisions, predicted
  hit tokens, releases) are plain counters in :class:`QueryStats`, updated
  under the service lock the query already holds and exported at scrape time
  (prometheus-client's own objects took ~15% of a ZMQ ``route``: a lock and
  label machinery per update). Rare events (API errors) use prometheus-client.
* **Per-worker ingestion state** (events applied/rejected, batches, resyncs,
  restarts, lag, blocks per tier, state) is *read at scrape time* from the
  ingestor and the index by :class:`WorkerStateCollector`; the ingestion loop
  therefore pays nothing per event for metrics (STYLE §8).

Names follow ``tokenspeed_<part>_<thing>_<unit|total>``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

__all__ = [
    "CONTENT_TYPE",
    "IngestQueueCollector",
    "LatencyHistogram",
    "QueryCollector",
    "QueryStats",
    "ServiceMetrics",
    "WorkerSample",
    "WorkerStateCollector",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: latency buckets for in-process match/route work (seconds): 5 µs .. 50 ms
_LATENCY_BUCKETS = (
    5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
)
#: publisher timestamp -> applied: 100 µs .. 5 s
_VISIBLE_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0, 5.0)


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
    malformed_by_cause: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    blocks_by_tier: dict[str, int] = field(default_factory=dict)
    #: this process's in-flight load on the worker (the router's own, not the peers')
    in_flight_requests: int = 0
    pending_prefill_tokens: int = 0
    active_tokens: int = 0
    shed_batches: int = 0
    queued: int = 0
    lagging: bool = False
    apply_delay_s: float | None = None


class IndexCoreCollector(Collector):
    """``tokenspeed_index_core_info{core="native"} 1``: which KV index core runs, read at scrape time.

    Read from the service's current index (a warm start may replace it), so a
    fall-back to the pure-Python core shows on a dashboard, not only in a log.
    """

    def __init__(self, core: Callable[[], str]) -> None:
        self._core = core

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        info = GaugeMetricFamily(
            "tokenspeed_index_core_info", "the KV index core running (native: compiled; reference: Python)",
            labels=["core"],
        )
        info.add_metric([self._core()], 1)
        yield info


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
            "duplicates": (
                "tokenspeed_ingest_duplicates",
                "batches received twice (duplicated or reordered frames, replay overlap), skipped",
            ),
            "replay_requests": ("tokenspeed_ingest_replay_requests", "replays asked of the publisher"),
            "replay_timeouts": ("tokenspeed_ingest_replay_timeouts", "replays the publisher did not answer in time"),
            "malformed": ("tokenspeed_ingest_malformed_frames", "frames skipped as malformed (bad seq, payload, topic)"),
            "shed_batches": (
                "tokenspeed_ingest_shed_batches",
                "batches dropped unapplied (checked first) because the stream fell more than ingest_max_lag_s behind (then resynced)",
            ),
        }
        for attr, (name, doc) in counters.items():
            fam = CounterMetricFamily(name, doc, labels=["worker"])
            for s in samples:
                fam.add_metric([s.name], float(getattr(s, attr)))
            yield fam
        by_cause = CounterMetricFamily(
            "tokenspeed_ingest_malformed_frames_by_cause",
            "frames skipped before sequencing, by cause (frame_count, seq_length, topic, payload_size, "
            "payload_decode, no_known_events, replay_frame): none of them moved the sequence state",
            labels=["worker", "cause"],
        )
        for s in samples:
            for cause, n in sorted(s.malformed_by_cause.items()):
                by_cause.add_metric([s.name, cause], float(n))
        yield by_cause
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
        load: dict[str, GaugeMetricFamily] = {
            "in_flight_requests": GaugeMetricFamily(
                "tokenspeed_worker_in_flight_requests", "requests this router has in flight on the worker",
                labels=["worker"]),
            "pending_prefill_tokens": GaugeMetricFamily(
                "tokenspeed_worker_pending_prefill_tokens",
                "uncached prompt tokens routed to the worker whose prefill has not finished", labels=["worker"]),
            "active_tokens": GaugeMetricFamily(
                "tokenspeed_worker_active_tokens", "context tokens of the requests in flight on the worker",
                labels=["worker"]),
        }
        for s in samples:
            for attr, gauge in load.items():
                gauge.add_metric([s.name], float(getattr(s, attr)))
        queued = GaugeMetricFamily(
            "tokenspeed_ingest_queued_items", "items received for the worker, not applied yet", labels=["worker"]
        )
        delay = GaugeMetricFamily(
            "tokenspeed_ingest_apply_delay_seconds",
            "publisher timestamp to applied for the worker's last live batch (host clock offset removed)",
            labels=["worker"],
        )
        lagging = GaugeMetricFamily(
            "tokenspeed_worker_lagging", "1 while the worker's events reach the index late", labels=["worker"]
        )
        for s in samples:
            queued.add_metric([s.name], float(s.queued))
            lagging.add_metric([s.name], 1.0 if s.lagging else 0.0)
            if s.apply_delay_s is not None:
                delay.add_metric([s.name], s.apply_delay_s)
            if s.lag_s is not None:
                lag.add_metric([s.name], s.lag_s)
            for tier, n in sorted(s.blocks_by_tier.items()):
                blocks.add_metric([s.name, tier], float(n))
            for st in self.STATES:
                state.add_metric([s.name, st], 1.0 if s.state == st else 0.0)
            info.add_metric([s.name, s.role], 1.0)
        yield from (lag, blocks, state, info, *load.values(), queued, delay, lagging)


class IngestQueueCollector(Collector):
    """Items between reading and applying (``server/ingest_loop.py``: a pass), at scrape time."""

    def __init__(self, sample: Callable[[], dict[str, float]]) -> None:
        self._sample = sample

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        q = self._sample()
        if not q:
            return
        yield GaugeMetricFamily(
            "tokenspeed_ingest_queue_depth", "items read and not applied yet (the pass being applied)",
            value=q["depth"],
        )
        yield GaugeMetricFamily(
            "tokenspeed_ingest_queue_capacity", "items one ingest pass reads at most before applying them",
            value=q["capacity"],
        )
        yield GaugeMetricFamily(
            "tokenspeed_ingest_queue_max_depth", "the most items one pass read", value=q["max_depth"]
        )


class LatencyHistogram:
    """A Prometheus-compatible histogram that costs one bisect and two adds per observation.

    prometheus-client's ``Histogram.observe`` takes a lock and walks label
    machinery (several µs; ~15% of a ZMQ ``route``). This one is plain data,
    updated under the service lock the caller already holds, and exported at
    scrape time by :class:`QueryCollector`.
    """

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last: above every bound (+Inf)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def samples(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        """Prometheus buckets: (upper bound, observations at or below it), ``+Inf`` last."""
        running = 0
        buckets: list[tuple[str, float]] = []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        return buckets

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        return HistogramMetricFamily(name, documentation, buckets=self.cumulative(), sum_value=self.total)

    def copy(self) -> LatencyHistogram:
        out = LatencyHistogram(self.bounds)
        out.counts = list(self.counts)
        out.total = self.total
        return out


class QueryStats:
    """Per-request counters; mutated only under the service lock (exact, ~1 µs per request)."""

    def __init__(self) -> None:
        self.match_latency = LatencyHistogram(_LATENCY_BUCKETS)
        self.route_latency = LatencyHistogram(_LATENCY_BUCKETS)
        self.visible_delay = LatencyHistogram(_VISIBLE_BUCKETS)
        self.decisions: dict[str, int] = {}
        self.hit_tokens: dict[str, int] = {}
        self.request_tokens = 0
        self.releases = {"released": 0, "unknown": 0}

    def observe_route(self, worker: str, matched_tokens: int, request_tokens: int) -> None:
        self.decisions[worker] = self.decisions.get(worker, 0) + 1
        self.hit_tokens[worker] = self.hit_tokens.get(worker, 0) + matched_tokens
        self.request_tokens += request_tokens

    def copy(self) -> QueryStats:
        out = QueryStats()
        out.match_latency = self.match_latency.copy()
        out.route_latency = self.route_latency.copy()
        out.visible_delay = self.visible_delay.copy()
        out.decisions = dict(self.decisions)
        out.hit_tokens = dict(self.hit_tokens)
        out.request_tokens = self.request_tokens
        out.releases = dict(self.releases)
        return out


class QueryCollector(Collector):
    """Exports a :class:`QueryStats` snapshot (taken under the service lock) at scrape time."""

    def __init__(self, snapshot: Callable[[], QueryStats]) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        q = self._snapshot()
        yield q.match_latency.family("tokenspeed_match_latency_seconds", "time to answer a match (in process)")
        yield q.route_latency.family(
            "tokenspeed_route_latency_seconds", "time to take a routing decision (in process)"
        )
        yield q.visible_delay.family(
            "tokenspeed_ingest_visible_delay_seconds",
            "batch timestamp (publisher clock) to applied in the index (meaningful on one host / NTP)",
        )
        decisions = CounterMetricFamily(
            "tokenspeed_route_decisions", "routing decisions per chosen worker", labels=["worker"]
        )
        hits = CounterMetricFamily(
            "tokenspeed_route_predicted_hit_tokens",
            "prompt tokens the chosen worker is predicted to hold", labels=["worker"],
        )
        for worker, n in sorted(q.decisions.items()):
            decisions.add_metric([worker], float(n))
            hits.add_metric([worker], float(q.hit_tokens.get(worker, 0)))
        yield decisions
        yield hits
        yield CounterMetricFamily("tokenspeed_route_request_tokens", "prompt tokens routed",
                                  value=float(q.request_tokens))
        releases = CounterMetricFamily("tokenspeed_route_releases", "release calls by outcome",
                                       labels=["outcome"])
        for outcome, n in sorted(q.releases.items()):
            releases.add_metric([outcome], float(n))
        yield releases


class ServiceMetrics:
    """The metrics of one service; ``render()`` gives the exposition text.

    ``queries`` is mutated under the service lock by the query and ingestion
    paths; rare events (API errors, ingest errors, log bytes) use ordinary
    prometheus-client counters.
    """

    def __init__(self, lock: Any, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self._lock = lock
        self.queries = QueryStats()
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
        r.register(QueryCollector(self._snapshot))

    def _snapshot(self) -> QueryStats:
        with self._lock:
            return self.queries.copy()

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    def render(self) -> bytes:
        return generate_latest(self.registry)
