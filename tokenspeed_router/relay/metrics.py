"""Prometheus view of a relay, read from :meth:`EventRelay.statistics` at scrape time.

Nothing is updated per batch for metrics: the collector turns the relay's
counters into metric families when scraped (same approach as the server's
worker-state collector). Names: ``tokenspeed_relay_<thing>_<unit|total>``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenspeed_router.relay.relay import RelayStatistics

__all__ = ["RelayCollector", "relay_registry"]


class RelayCollector(Collector):
    def __init__(self, statistics: Callable[[], RelayStatistics]) -> None:
        self._statistics = statistics

    def collect(self) -> Iterator[Metric]:
        s = self._statistics()
        ring = s.ring
        counters = {
            "batches_in": ("engine batches received, in order", s.batches_in),
            "batches_out": ("batches published (relay seqs)", s.batches_out),
            "events_in": ("engine events received", s.events_in),
            "events_out": ("events published", s.events_out),
            "engine_restarts": ("engine restarts, republished as AllBlocksCleared", s.restarts),
            "engine_resyncs": ("unrecoverable engine gaps, republished as AllBlocksCleared", s.resyncs),
            "engine_gaps": ("engine seq gaps seen (most filled by the engine's replay)", s.gaps),
            "engine_malformed": ("engine messages skipped as malformed", s.malformed),
            "publish_errors": ("batches the relay could not publish", s.publish_errors),
            "replays_served": ("replay requests answered", ring.replays_served),
            "snapshots_served": ("replay requests answered with a snapshot", ring.snapshots_served),
            "snapshot_batches": ("snapshot batches sent", ring.snapshot_batches_sent),
            "curve_allowed": ("CURVE handshakes allowed", s.curve_allowed),
            "curve_rejected": ("CURVE handshakes refused (key not on the allow-list)", s.curve_rejected),
        }
        if s.hasher is not None:
            counters["hashed_blocks"] = ("blocks published as content hashes", s.hasher.blocks_hashed)
            counters["unhashable_blocks"] = ("blocks dropped: parent unknown", s.hasher.blocks_unhashable)
            counters["unsent_blocks"] = ("partial tails (and blocks under one) not sent", s.hasher.blocks_unsent)
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"tokenspeed_relay_{name}", doc, value=value)
        gauges: dict[str, tuple[str, float]] = {
            "ring_batches": ("batches in the replay ring", ring.ring_batches),
            "snapshot_blocks": ("blocks in the state before the ring (a snapshot's size)", ring.base_blocks),
            "engine_connected": ("1 when the engine's PUB socket is connected", int(s.engine_connected)),
            "next_seq": ("the relay's next sequence number", s.next_seq),
            "last_engine_seq": (
                "seq of the last engine batch relayed (-1: none yet)",
                -1 if s.last_engine_seq is None else s.last_engine_seq,
            ),
            "last_snapshot_encode_seconds": ("time to dump and encode the last snapshot", ring.last_snapshot_encode_s),
            "curve_rejected_keys": ("distinct refused CURVE client keys", s.curve_rejected_keys),
        }
        for name, (doc, level) in gauges.items():
            yield GaugeMetricFamily(f"tokenspeed_relay_{name}", doc, value=level)


def relay_registry(statistics: Callable[[], RelayStatistics]) -> CollectorRegistry:
    """A registry of its own holding one relay's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RelayCollector(statistics))
    return registry
