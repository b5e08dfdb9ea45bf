"""PrefixCache events through a real ZmqEventPublisher and EventSubscriber (loopback).

The worker side (cache + publisher) and the router side (subscriber + a
reference event folder + the real KvIndex) must agree on the cache's content
after a workload with shared prefixes and evictions. No sleeps: the slow
joiner is handled by publishing probe requests until the subscriber sees one,
and replay from 0 brings back whatever the SUB missed before that.
"""

from __future__ import annotations

import random

import pytest
import zmq
from support import wait_until
from support.cache_reference import EventFolder

from tokenspeed_router.cache import PrefixCache
from tokenspeed_router.events import (
    BatchReceived,
    EventSubscriber,
    SubscriberItem,
    ZmqEventPublisher,
)
from tokenspeed_router.events.codec import WireFormat
from tokenspeed_router.router import KvIndex

Ctx = zmq.Context[zmq.Socket[bytes]]
PAGE_SIZE = 4


def workload(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(4 * PAGE_SIZE)] for _ in range(3)]
    out = []
    for _ in range(60):
        head = rng.choice(systems)[: PAGE_SIZE * rng.randint(0, 4)]
        out.append(head + [rng.randrange(1000) for _ in range(rng.randint(1, 5 * PAGE_SIZE))])
    return out


@pytest.mark.parametrize("wire_format", ["map", "array"])
def test_cache_events_round_trip_through_zmq(ctx: Ctx, wire_format: WireFormat) -> None:
    cache = PrefixCache.with_capacity(24, page_size=PAGE_SIZE, medium="GPU")
    publisher = ZmqEventPublisher(
        "tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        wire_format=wire_format,
        context=ctx,
    )
    subscriber = EventSubscriber(
        "w0", publisher.endpoint, replay_endpoint=publisher.replay_endpoint, context=ctx
    )
    items: list[SubscriberItem] = []
    try:
        sink = cache.attach_publisher(publisher)
        probe = iter(range(10_000, 20_000))

        def seen_something() -> bool:
            cache.admit([next(probe)] * PAGE_SIZE)  # one new block: one batch
            items.extend(subscriber.poll(0.02))
            return any(isinstance(x, BatchReceived) for x in items)

        wait_until(seen_something, timeout_s=10, what="first batch through the subscriber")
        for tokens in workload(seed=7):
            cache.admit(tokens)
        cache.evict(8 * PAGE_SIZE)
        cache.flush_events()
        last_seq = sink.num_batches - 1

        def caught_up() -> bool:
            items.extend(subscriber.poll(0.02))
            return subscriber.last_seq == last_seq

        wait_until(caught_up, timeout_s=10, what=f"seq {last_seq} at the subscriber")
    finally:
        subscriber.close()
        publisher.close()

    batches = [x for x in items if isinstance(x, BatchReceived)]
    assert [b.seq for b in batches] == list(range(last_seq + 1)), "every batch, in order, once"
    assert cache.statistics().evicted_tokens > 0, "the workload must evict"
    folder = EventFolder(PAGE_SIZE)
    index = KvIndex()
    for b in batches:
        folder.apply(b.batch.events)
        index.apply("w0", b.batch)
    assert set(folder.chains()) == set(cache.cached_chains())
    folder.check_content_hashes()
    # The router's own index, fed the same batches, sees exactly what the cache holds.
    for tokens in workload(seed=7):
        cached_tokens = cache.match_prefix(tokens).device_prefix_length
        assert index.match(tokens).get("w0", 0) == cached_tokens // PAGE_SIZE
    assert index.num_blocks("w0") == cache.total_size() // PAGE_SIZE
