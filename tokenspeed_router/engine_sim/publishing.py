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
* ``hash_seed`` (``--fault-hash-seed``): the published block ids are
  re-hashed with that seed while parent links keep the cache's own ids, as
  an engine whose processes hash with different seeds does (vLLM without one
  ``PYTHONHASHSEED`` for every process): a continuation's parent is an id the
  engine never published.
* ``dp_rank_override`` (``--fault-dp-rank``): batches claim that DP rank
  instead of their own (an engine whose ``--data-parallel-rank`` disagrees
  with the port it publishes on).
* ``lora_id`` (``--fault-lora-id``): every ``BlockStored`` is tagged with
  that LoRA id although no request named one (a LoRA naming mismatch).
* ``delay_s`` (``--fault-event-delay``): batches leave that many seconds
  after the step that made them (a slow or backed-up publisher).
* :meth:`EventOutlet.restart` (``--fault-restart-after-requests``): close the
  publisher and bind a fresh one on the same endpoints, its seq back at 0, as
  a restarted engine does; the caller swaps in a fresh cache.

Single owner: the engine loop (one asyncio task) calls everything here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random

import msgspec
import xxhash

from tokenspeed_router.cache import KvEventSink, PrefixCache
from tokenspeed_router.events.publisher import ZmqEventPublisher
from tokenspeed_router.events.schema import (
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
)

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
    hash_seed: int | None = None
    dp_rank_override: int | None = None
    lora_id: int | None = None
    delay_s: float = 0.0


def _seeded(block_hash: BlockHash, seed: int) -> BlockHash:
    """``block_hash`` as a differently seeded hasher would have named it."""
    if isinstance(block_hash, int):
        return xxhash.xxh3_64_intdigest(block_hash.to_bytes(8, "little", signed=block_hash < 0), seed)
    return xxhash.xxh3_64_intdigest(bytes(block_hash), seed)


def _misconfigured(batch: KVEventBatch, config: OutletConfig) -> KVEventBatch:
    """The batch as the misconfigured engine of ``config`` publishes it (the fault knobs)."""
    seed, lora = config.hash_seed, config.lora_id
    if seed is None and lora is None and config.dp_rank_override is None:
        return batch
    events: list[Event] = []
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            changes: dict[str, object] = {}
            if seed is not None:
                changes["block_hashes"] = [_seeded(h, seed) for h in ev.block_hashes]
            if lora is not None:
                changes["lora_id"] = lora
            ev = msgspec.structs.replace(ev, **changes)
        elif isinstance(ev, BlockRemoved) and seed is not None:
            ev = msgspec.structs.replace(ev, block_hashes=[_seeded(h, seed) for h in ev.block_hashes])
        events.append(ev)
    rank = config.dp_rank_override if config.dp_rank_override is not None else batch.data_parallel_rank
    return KVEventBatch(ts=batch.ts, events=events, data_parallel_rank=rank)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # set-up, before the engine loop runs: nothing to delay yet
        return None


class _DroppingPublisher:
    """Forwards batches to the live publisher: drops ``ratio`` of them unnumbered, applies the
    misconfiguration knobs, and holds each for ``delay_s`` when asked."""

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
        batch = _misconfigured(batch, self._outlet.config)
        delay = self._outlet.config.delay_s
        loop = _running_loop()
        if delay > 0 and loop is not None:
            # the engine loop owns the publisher: the late send runs on that same loop
            loop.call_later(delay, self._late, batch)
            return publisher.statistics().next_seq - 1
        return publisher.publish(batch)

    def _late(self, batch: KVEventBatch) -> None:
        try:
            self._outlet.publisher.publish(batch)
        except Exception:  # closed while the batch waited: the engine is stopping
            logger.debug("engine-sim: delayed batch not published (publisher closed)", exc_info=True)


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
