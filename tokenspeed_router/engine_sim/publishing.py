"""Where the simulated engine's KV events go: a real ``ZmqEventPublisher``, plus the event fault knobs.

* Normal: the engine's :class:`~tokenspeed_router.cache.PrefixCache` is
  attached to a :class:`ZmqEventPublisher` (map or array wire format, DP rank
  on ``port + rank``). Events are held until :meth:`EventOutlet.flush`, which
  the engine calls once per scheduler step: one batch per step, as vLLM
  publishes (and one publisher wake-up per step rather than per operation).
* ``drop_ratio`` (``--fault-drop-events``): that fraction of batches is thrown
  away *before* the publisher numbers them (deterministic RNG), so the seq
  stays contiguous and a subscriber cannot see the loss — events lost inside
  an engine, the failure only a truth loop catches.
* ``publish_block_size`` (``--fault-publish-block-size``): a misconfigured
  engine. The real cache (the one that decides hits) publishes nothing; a
  shadow cache of the same capacity with that block size admits every cached
  prompt and publishes its events instead.
* :meth:`EventOutlet.restart` (``--fault-restart-after-requests``): close the
  publisher and bind a fresh one on the same endpoints, its seq back at 0, as
  a restarted engine does; the caller swaps in a fresh cache.

Single owner: the engine loop (one asyncio task) calls everything here.
"""

from __future__ import annotations

import dataclasses
import logging
import random

from tokenspeed_router.cache import KvEventSink, PrefixCache
from tokenspeed_router.events.publisher import ZmqEventPublisher
from tokenspeed_router.events.schema import KVEventBatch

__all__ = ["EventOutlet", "OutletConfig"]

#: flush_every for attached caches: never flush by count, only through EventOutlet.flush.
_HOLD = 1 << 62

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutletConfig:
    events_endpoint: str
    replay_endpoint: str | None = None
    dp_rank: int = 0
    wire_format: str = "map"
    drop_ratio: float = 0.0
    publish_block_size: int | None = None
    seed: int = 0


class _DroppingPublisher:
    """Forwards batches to the live publisher, dropping ``ratio`` of them unnumbered."""

    def __init__(self, outlet: EventOutlet, ratio: float, rng: random.Random) -> None:
        self._outlet = outlet
        self._ratio = ratio
        self._rng = rng
        self.num_dropped = 0

    def publish(self, batch: KVEventBatch) -> int:
        publisher = self._outlet.publisher
        if self._ratio > 0 and self._rng.random() < self._ratio:
            self.num_dropped += 1
            return publisher.statistics().next_seq - 1
        return publisher.publish(batch)


class EventOutlet:
    """Owns the publisher (and the fault wrappers); see the module docstring."""

    def __init__(self, config: OutletConfig) -> None:
        self.config = config
        self.publisher = ZmqEventPublisher(
            config.events_endpoint,
            replay_endpoint=config.replay_endpoint,
            dp_rank=config.dp_rank,
            wire_format="array" if config.wire_format == "array" else "map",
        )
        self._dropper = _DroppingPublisher(self, config.drop_ratio, random.Random(config.seed))
        self._shadow: PrefixCache | None = None
        self.num_restarts = 0

    @property
    def endpoint(self) -> str:
        return self.publisher.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint

    @property
    def num_dropped(self) -> int:
        return self._dropper.num_dropped

    def attach(self, cache: PrefixCache, capacity_tokens: int) -> None:
        """Publish ``cache``'s events (or, with the block-size fault, a shadow cache's)."""
        sink = KvEventSink(self._dropper, data_parallel_rank=self.config.dp_rank)
        bs = self.config.publish_block_size
        if bs is None or bs == cache.page_size:
            self._shadow = None
            cache.attach_publisher(sink, flush_every=_HOLD)
            return
        self._shadow = PrefixCache.with_capacity(max(1, capacity_tokens // bs), page_size=bs)
        self._shadow.attach_publisher(sink, flush_every=_HOLD)

    def flush(self, cache: PrefixCache) -> None:
        """Publish what ``cache`` (or the shadow) queued since the last flush, as one batch."""
        (self._shadow if self._shadow is not None else cache).flush_events()

    def prompt_cached(self, tokens: list[int]) -> None:
        """The real cache just cached ``tokens``: the shadow (block-size fault) caches them too."""
        if self._shadow is not None:
            self._shadow.admit(tokens)

    def restart(self) -> None:
        """Close the publisher and bind a fresh one on the same endpoints (seq back to 0)."""
        old = self.publisher
        old.close()
        # The resolved endpoints already carry the rank's port offset: rank 0 here,
        # the batches keep their rank through the sink.
        self.publisher = ZmqEventPublisher(
            old.endpoint,
            replay_endpoint=old.replay_endpoint,
            wire_format="array" if self.config.wire_format == "array" else "map",
        )
        self.num_restarts += 1
        logger.warning("engine-sim restart fault: publisher %s rebound, seq back to 0", old.endpoint)

    def close(self) -> None:
        self.publisher.close()
