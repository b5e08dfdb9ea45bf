"""Hand a cache's KV events to a publisher as :class:`KVEventBatch` es.

The cache only queues events; an engine decides when a batch goes out
(normally once per scheduler step). :class:`KvEventSink` is that step for
callers without a scheduler: it wraps drained events into batches (at most
``max_events_per_batch`` events each, so one huge eviction does not make one
huge message) and calls ``publisher.publish(batch)``, which for
:class:`tokenspeed_router.events.publisher.ZmqEventPublisher` sequences and
sends it. The publisher fills ``data_parallel_rank`` when the batch leaves it
unset.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from tokenspeed_router.events.schema import Event, KVEventBatch

__all__ = ["BatchPublisher", "KvEventSink"]

logger = logging.getLogger(__name__)


class BatchPublisher(Protocol):
    """Anything with ``publish(batch) -> seq`` (e.g. ``ZmqEventPublisher``)."""

    def publish(self, batch: KVEventBatch) -> int: ...


class KvEventSink:
    """Publishes event lists as batches; the publisher's errors propagate unchanged."""

    def __init__(
        self,
        publisher: BatchPublisher,
        *,
        max_events_per_batch: int = 4096,
        data_parallel_rank: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_events_per_batch <= 0:
            raise ValueError(f"max_events_per_batch must be positive, got {max_events_per_batch}")
        self.publisher = publisher
        self.max_events_per_batch = max_events_per_batch
        self.data_parallel_rank = data_parallel_rank
        self._clock = clock
        self.num_batches = 0
        self.num_events = 0

    def split(self, events: Sequence[Event]) -> list[list[Event]]:
        """Cut ``events`` into batch-sized chunks, order kept."""
        step = self.max_events_per_batch
        return [list(events[i : i + step]) for i in range(0, len(events), step)]

    def publish_batch(self, events: list[Event]) -> int:
        """Publish one batch of ``events``; return the publisher's seq (its errors propagate)."""
        batch = KVEventBatch(
            ts=self._clock(), events=events, data_parallel_rank=self.data_parallel_rank
        )
        seq = self.publisher.publish(batch)
        self.num_batches += 1
        self.num_events += len(events)
        logger.debug("published seq=%d events=%d", seq, len(events))
        return seq
