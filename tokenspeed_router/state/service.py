"""``serve --state redis://...``: plug a replica into the router service.

The router service (``tokenspeed_router.server.app``) calls
:func:`create_ingest_sink` once from ``RouterService.start``. The sink:

* warm-starts the service's index from the latest snapshot + stream tail
  (before the service serves, through ``replace_index``);
* is the service's ``IngestSink``: what the service's subscribers receive
  goes to the stream (only the leader subscribes: ``manages_ingestion``);
* applies the stream back into the service (``apply_item``, under its lock);
* subscribes (``start_ingestion`` from the stream's last seqs) when this
  replica takes the lease, unsubscribes when it loses it;
* reports role, degradation and lag (``health()``; a Prometheus collector on
  the service's registry for ``/metrics``);
* shares this replica's in-flight load with the other replicas and adds
  theirs to its router (:mod:`.load`; ``share_load=0`` in the URL turns it
  off), through ``local_load`` and ``attach_peer_load`` of the service.

The service is typed by :class:`ServiceHost` (what this backend needs of it:
the :class:`~tokenspeed_router.state.applier.IndexHost` seam plus ingestion
control, load sharing and a metrics registry), so this package does not
import the server.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

from tokenspeed_router.events.subscriber import SubscriberItem
from tokenspeed_router.router.router import PeerLoad
from tokenspeed_router.router.scoring import WorkerLoad
from tokenspeed_router.state.applier import IndexHost
from tokenspeed_router.state.config import RedisStateConfig
from tokenspeed_router.state.load import SharedLoad
from tokenspeed_router.state.replica import RedisStateReplica

__all__ = [
    "DirectIngestSink", "RedisIngestSink", "ServiceHost", "SharingCollector", "StateCollector",
    "create_ingest_sink",
]

logger = logging.getLogger(__name__)

#: how long a new leader waits for the service's ingestion loop to start
_LOOP_WAIT_S = 30.0


class CollectorRegistry(Protocol):
    """Where scrape-time Prometheus collectors go (the service's ``metrics``)."""

    def add_collector(self, collector: Any) -> None: ...


class ServiceHost(IndexHost, Protocol):
    """What the Redis backend needs from the router service (``RouterService`` fits).

    Ingestion control is called from the replica's lease thread: the lease
    may be won while the service is still starting, so it first waits (on an
    event the service sets, no polling) for the service's ingestion loop.
    """

    @property
    def metrics(self) -> CollectorRegistry: ...

    @property
    def ingest_loop_running(self) -> bool: ...

    def wait_ingest_loop(self, timeout_s: float) -> bool:
        """Block until the ingestion loop runs (True), or the service stops or the time is up (False)."""

    def start_ingestion(self, start_seqs: Mapping[str, int] | None = None, timeout_s: float = 10.0) -> None: ...

    def stop_ingestion(self, timeout_s: float = 10.0) -> None: ...

    def local_load(self) -> Mapping[str, WorkerLoad]:
        """This replica's own in-flight load per worker (any thread: the host locks)."""

    def attach_peer_load(self, peer_load: PeerLoad | None) -> None:
        """Add (None: stop adding) the other replicas' in-flight load to routing."""


class RedisIngestSink:
    """The service's ingest sink in Redis mode (see the module docstring)."""

    #: The service starts with no subscription; we subscribe while we lead.
    manages_ingestion = True

    def __init__(self, replica: RedisStateReplica, service: ServiceHost) -> None:
        self.replica = replica
        self._service = service
        self._stop = threading.Event()
        #: Load sharing with the other replicas (None when ``share_load`` is off).
        self.shared_load: SharedLoad | None = None

    def submit(self, item: SubscriberItem) -> None:
        self.replica.submit(item)

    def close(self) -> None:
        self._stop.set()
        if self.shared_load is not None:
            self._service.attach_peer_load(None)
            self.shared_load.close()
        self.replica.close()

    def health(self) -> dict[str, object]:
        """The ``state`` part of ``/health``."""
        out = self.replica.health().to_dict()
        out["ingest"] = "stream"
        _add_sharing(out, self.shared_load)
        return out

    # ingestion control, called from the replica's lease thread

    def start_ingestion(self, start_seqs: Mapping[str, int]) -> None:
        # The lease may be won while the service is still starting its loop.
        if not self._service.wait_ingest_loop(_LOOP_WAIT_S) and self._stop.is_set():
            return
        self._service.start_ingestion(start_seqs)

    def stop_ingestion(self) -> None:
        if self._service.ingest_loop_running:
            self._service.stop_ingestion()


class DirectIngestSink:
    """The service's ingest sink with ``ingest=direct`` (active-active, the default).

    Every replica subscribes to every engine (or relay) itself and applies
    what it receives in this process, exactly as a single router does: the
    index is a pure function of the event streams, so replicas converge with
    no leader hop. Redis carries only the shared in-flight work.
    """

    #: The service subscribes to every worker at start, as without ``--state``.
    manages_ingestion = False

    def __init__(self, config: RedisStateConfig, service: ServiceHost) -> None:
        self.config = config
        self._apply = service.apply_item
        self._service = service
        self.shared_load: SharedLoad | None = None

    def submit(self, item: SubscriberItem) -> None:
        self._apply(item)

    def close(self) -> None:
        if self.shared_load is not None:
            self._service.attach_peer_load(None)
            self.shared_load.close()

    def health(self) -> dict[str, object]:
        """The ``state`` part of ``/health``: no leader, no stream; the sharing status."""
        out: dict[str, object] = {
            "backend": "redis", "ingest": "direct", "replica_id": self.config.replica_id,
            "role": "replica", "degraded": False, "reason": None,
        }
        _add_sharing(out, self.shared_load)
        return out


def _add_sharing(out: dict[str, object], shared: SharedLoad | None) -> None:
    """The in-flight sharing status in ``/health``'s ``state`` (degraded: local view only)."""
    if shared is None:
        out["sharing"] = "off"
        return
    stats = shared.statistics()
    out["shared_load"] = stats.to_dict()
    out["sharing"] = "degraded" if stats.fallback else "shared"
    if stats.fallback:
        out["degraded"] = True
        why = "in-flight sharing: Redis unreachable, routing on this replica's view only"
        out["reason"] = f"{out['reason']}; {why}" if out.get("reason") else why


def create_ingest_sink(url: str, service: ServiceHost) -> RedisIngestSink | DirectIngestSink:
    """Build and run the Redis state backend for ``service`` (SinkFactory).

    ``ingest=direct`` (default): subscribe here, share in-flight work.
    ``ingest=stream``: warm-start from the snapshot + stream, subscribe only
    while holding the lease.
    """
    config = RedisStateConfig.from_url(url)
    if config.ingest == "direct":
        direct = DirectIngestSink(config, service)
        if config.share_load:
            direct.shared_load = SharedLoad(config, service.local_load).start()
            service.attach_peer_load(direct.shared_load)
        service.metrics.add_collector(SharingCollector(lambda: direct.shared_load))
        logger.info("state: replica %s on %s (cluster %s): direct ingestion, in-flight sharing %s "
                    "over %s", config.replica_id, _redact(config.url), config.cluster,
                    "on" if config.share_load else "off", config.flight_transport)
        return direct
    replica = RedisStateReplica(config, service)
    sink = RedisIngestSink(replica, service)
    replica.set_ingestion((sink.start_ingestion, sink.stop_ingestion))
    service.metrics.add_collector(StateCollector(replica))
    service.metrics.add_collector(SharingCollector(lambda: sink.shared_load))
    report = replica.start()
    if config.share_load:
        # after the warm start: it may replace the service's router
        sink.shared_load = SharedLoad(config, service.local_load).start()
        service.attach_peer_load(sink.shared_load)
    logger.info("state: replica %s on %s (cluster %s): warm start %s in %.3fs, %d blocks",
                config.replica_id, _redact(config.url), config.cluster, report.source,
                report.total_s, report.num_blocks)
    return sink


def _redact(url: str) -> str:
    """The URL without a password, for logs."""
    head, sep, tail = url.partition("@")
    if not sep:
        return url
    scheme, _, _creds = head.partition("://")
    return f"{scheme}://***@{tail}"


class StateCollector:
    """Prometheus metrics of the state backend, sampled at scrape time."""

    def __init__(self, replica: RedisStateReplica) -> None:
        self._replica = replica

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        h = self._replica.health()
        role = GaugeMetricFamily("tokenspeed_state_role", "1 for this replica's current role",
                                 labels=["role"])
        for name in ("leader", "follower", "starting", "stopped"):
            role.add_metric([name], 1.0 if h.role == name else 0.0)
        yield role
        gauges = {
            "tokenspeed_state_degraded": ("1 while Redis is unreachable or state is incomplete",
                                          float(h.degraded)),
            "tokenspeed_state_connected": ("1 while Redis answers", float(h.connected)),
            "tokenspeed_state_stream_lag_entries": ("stream entries not yet applied here",
                                                    float(h.stream_lag_entries)),
            "tokenspeed_state_stream_lag_seconds": ("age of the oldest unapplied entry",
                                                    h.stream_lag_s),
            "tokenspeed_state_leader_buffered": ("entries the leader holds for Redis",
                                                 float(h.buffered)),
            "tokenspeed_state_fence": ("fencing token while leading (0 otherwise)",
                                       float(h.fence or 0)),
        }
        if h.apply_lag_p99_s is not None:
            gauges["tokenspeed_state_apply_lag_p99_seconds"] = (
                "leader accept -> applied here, p99 of recent entries", h.apply_lag_p99_s)
        if h.warm_start is not None:
            gauges["tokenspeed_state_warm_start_seconds"] = (
                "time to warm at start (snapshot + stream tail)", h.warm_start.total_s)
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "tokenspeed_state_entries_applied": ("stream entries applied", h.entries_applied),
            "tokenspeed_state_duplicates_skipped": ("stream entries skipped as already applied",
                                                    h.duplicates_skipped),
            "tokenspeed_state_stream_gaps": ("times entries were trimmed before being read",
                                             h.stream_gaps),
            "tokenspeed_state_stream_resets": ("times the stream generation changed",
                                               h.resets_detected),
            "tokenspeed_state_snapshots_written": ("snapshots written", h.snapshots_written),
            "tokenspeed_state_appended": ("entries appended as leader", h.appended),
            "tokenspeed_state_dropped": ("entries dropped: leader buffer full, Redis down",
                                         h.dropped),
            "tokenspeed_state_takeovers": ("times this replica became the leader", h.takeovers),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=float(value))


class SharingCollector:
    """Prometheus metrics of the shared in-flight work, sampled at scrape time."""

    def __init__(self, shared: Callable[[], SharedLoad | None]) -> None:
        self._shared = shared

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        shared = self._shared()
        if shared is None:
            return
        s = shared.statistics()
        gauges = {
            "tokenspeed_state_load_peers": ("other live replicas sharing in-flight work", s.peers),
            "tokenspeed_state_load_peer_requests": ("requests in flight on other replicas",
                                                    s.peer_requests),
            "tokenspeed_state_load_fallback": ("1 while routing on the local view only (Redis down)",
                                               float(s.fallback)),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=float(value))
        counters = {
            "tokenspeed_state_load_syncs": ("in-flight messages published", s.syncs),
            "tokenspeed_state_load_sync_errors": ("in-flight publishes and receives that failed",
                                                  s.sync_errors),
            "tokenspeed_state_load_received": ("in-flight messages received from other replicas",
                                               s.received),
            "tokenspeed_state_load_malformed": ("unreadable in-flight messages skipped", s.malformed),
            "tokenspeed_state_load_predictions_received": ("peer route predictions received",
                                                           s.predictions_received),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=float(value))
