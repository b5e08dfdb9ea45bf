"""Ingest off the query path: passes read and applied on one thread, lag and shedding (real ZeroMQ)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import msgspec
import zmq
from support import wait_until
from support.raw_stream import BAD_PAYLOADS, RawStream, bad_frames
from support.server import batch, stored, tokens

from tokenspeed_router.events.publisher import ZmqEventPublisher
from tokenspeed_router.events.schema import AllBlocksCleared, KVEventBatch
from tokenspeed_router.events.subscriber import (
    RESYNC_SHED,
    BatchReceived,
    EventSubscriber,
    PublisherRestarted,
    ResyncNeeded,
    SubscriberItem,
)
from tokenspeed_router.router.router import WorkerRole
from tokenspeed_router.server import RouterService, ServerConfig, WorkerSpec
from tokenspeed_router.server.ingest_lag import IngestLag, PassApplier
from tokenspeed_router.server.ingest_loop import IngestLoop
from tokenspeed_router.server.worker_spec import SubscriberSpec


def _item(worker: str, seq: int, ts: float) -> BatchReceived:
    b = KVEventBatch(ts, [stored(tokens(seq, 1))])
    return BatchReceived(worker, seq, b, b"", b"", time.time(), 0, False)


def test_a_pass_reads_at_most_queue_capacity_items_and_applies_them_in_order_in_one_call() -> None:
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", hwm=100_000)  # no replay: the first seq seen starts
    gate = threading.Event()
    calls: list[list[int]] = []

    def apply_many(items: Sequence[SubscriberItem]) -> list[tuple[SubscriberItem, Exception]]:
        calls.append([item.seq for item in items if isinstance(item, BatchReceived)])
        gate.wait(10)  # the thread applies: nothing more is read meanwhile
        return []

    def apply(item: SubscriberItem) -> None:
        raise AssertionError("apply_many takes every pass")

    ctx = zmq.Context()
    loop = IngestLoop(context=ctx, submit=apply, submit_many=apply_many, on_stale=lambda name: None,
                      on_error=lambda: None, stale_after_s=60, replay_timeout_s=1, queue_capacity=2)
    spec = SubscriberSpec(name="w", worker="w", dp_rank=0, events=pub.endpoint, replay=None, topic="",
                          role=WorkerRole.BOTH)
    loop.start([spec])
    try:
        def first_pass() -> bool:  # the slow joiner drops what is published before it is connected
            if not calls:
                pub.publish(KVEventBatch(time.time(), []))
                pub.wait_sent(5)
            return bool(calls)

        wait_until(first_pass, 10, interval_s=0.05, what="a first pass")
        first = calls[0][0]
        assert loop.queue_stats()["depth"] == len(calls[0]) and loop.lag()["w"].queued == len(calls[0])
        end = pub.statistics().published + 5
        for _ in range(5):  # waiting in the SUB socket while the pass applies
            pub.publish(KVEventBatch(time.time(), []))
        pub.wait_sent(5)
        gate.set()
        wait_until(lambda: calls and calls[-1] and calls[-1][-1] == end - 1, 10, what="every batch applied")
        assert all(1 <= len(c) <= 2 for c in calls)
        assert [seq for c in calls for seq in c] == list(range(first, end))
        assert loop.queue_stats() == {"depth": 0.0, "capacity": 2.0, "max_depth": 2.0}
        assert loop.lag()["w"].queued == 0
    finally:
        gate.set()
        loop.stop()
        pub.close()
        ctx.term()


def test_apply_errors_are_counted_not_fatal() -> None:
    errors: list[int] = []
    seen: list[int] = []

    def apply(item: SubscriberItem) -> None:
        assert isinstance(item, BatchReceived)
        if item.seq == 1:
            raise RuntimeError("boom")
        seen.append(item.seq)

    applier = PassApplier(apply, on_error=lambda: errors.append(1))
    applier([_item("w", i, time.time()) for i in range(3)])
    assert seen == [0, 2] and errors == [1]
    assert applier.applied == 3 and applier.max_pass == 3


def test_a_pass_goes_over_in_one_call_in_order_and_failures_are_counted() -> None:
    calls: list[list[int]] = []
    errors: list[int] = []

    def apply_many(items: Sequence[SubscriberItem]) -> list[tuple[SubscriberItem, Exception]]:
        calls.append([item.seq for item in items if isinstance(item, BatchReceived)])
        return [(item, RuntimeError("boom")) for item in items if isinstance(item, BatchReceived) and item.seq == 2]

    def apply(item: SubscriberItem) -> None:
        raise AssertionError("apply_many takes every item")

    applier = PassApplier(apply, on_error=lambda: errors.append(1), apply_many=apply_many)
    now = time.time()
    applier([_item("w", 0, now)])
    applier([_item("w", i, now) for i in range(1, 5)])
    assert calls == [[0], [1, 2, 3, 4]] and errors == [1]

    def broken(items: Sequence[SubscriberItem]) -> list[tuple[SubscriberItem, Exception]]:
        raise RuntimeError("the call itself")

    PassApplier(apply, on_error=lambda: errors.append(1), apply_many=broken)([_item("w", 5, now)])
    assert errors == [1, 1]


def test_lag_is_measured_against_the_streams_own_clock_offset() -> None:
    lag = IngestLag(lagging_after_s=0.25)
    now = time.time()
    skewed = now + 100.0  # a publisher whose clock runs 100 s ahead: every delay looks like -100 s

    def received(seq: int, ts: float, max_lag_s: float) -> set[str]:
        return lag.received([BatchReceived("w", seq, KVEventBatch(ts, []), b"", b"", now + 0.001, 0, False)],
                            max_lag_s)

    assert received(0, skewed, 0.0) == set()  # on time: the stream's floor, whatever the clocks say
    assert received(1, skewed - 3.0, 3.1) == set()  # 3 s later than the floor: not past 3.1 s
    assert received(2, skewed - 3.0, 2.9) == {"w"}  # past 2.9 s: shed
    assert lag.status()["w"].queued == 3
    lag.caught_up(["w"])
    assert lag.status()["w"].queued == 3  # items pending: not caught up
    late = BatchReceived("w", 2, KVEventBatch(skewed - 3.0, []), b"", b"", now + 0.001, 0, False)
    lag.applied([late, late, late], now + 0.002)
    st = lag.status()["w"]
    assert st.lagging and st.apply_delay_s is not None and st.apply_delay_s > 2.9 and st.queued == 0
    lag.caught_up(["w"])
    assert not lag.status()["w"].lagging


def test_subscriber_sheds_its_socket_backlog_without_replaying_it() -> None:
    with ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*") as pub, \
            EventSubscriber("w", pub.endpoint, replay_endpoint=pub.replay_endpoint) as sub:
        got: list[SubscriberItem] = []

        def live_batch() -> bool:  # the SUB connection is up once a batch arrives live, not replayed
            pub.publish(batch(stored(tokens(1, 1))))
            got.extend(sub.poll(0.05))
            return any(isinstance(i, BatchReceived) and not i.replayed for i in got) and not sub.statistics().replaying

        wait_until(live_batch, 10, what="a live batch")
        first = pub.statistics().published - 1
        wait_until(lambda: got.extend(sub.poll(0.05)) or sub.last_seq == first, 10, what="all received")
        requests = sub.statistics().replay_requests
        for k in range(20):
            pub.publish(batch(stored(tokens(10 + k, 1))))
        pub.wait_sent(5)
        shed: list[SubscriberItem] = []
        wait_until(lambda: shed.extend(sub.shed_backlog()) or sub.statistics().shed == 20, 10, what="all 20 shed")
        resyncs = [i for i in shed if isinstance(i, ResyncNeeded)]
        assert resyncs and all(r.reason == RESYNC_SHED for r in resyncs)
        assert (resyncs[0].expected_seq, resyncs[-1].got_seq) == (first + 1, first + 21)
        assert not any(isinstance(i, BatchReceived) for i in shed)
        pub.publish(batch(stored(tokens(99, 1))))
        after: list[SubscriberItem] = []
        wait_until(lambda: after.extend(sub.poll(0.05)) or after, 10, what="the next batch")
        assert [(type(i), getattr(i, "seq", None)) for i in after] == [(BatchReceived, first + 21)]
        stats = sub.statistics()
        assert stats.replay_requests == requests and stats.gaps == 0  # nothing asked again


def test_shedding_skips_bad_frames_without_moving_the_sequence() -> None:
    """A bad frame under the seq due next is skipped by cause, not shed as that batch (issue 28).

    Shedding used to read only the seq: the bad frame was taken as batch k+1,
    and the real k+1 after it for a publisher restart that dropped the engine.
    """
    encode = msgspec.msgpack.Encoder().encode
    good = [encode(batch(stored(tokens(100 + k, 1)))) for k in range(40)]
    with RawStream(replay=False) as stream, EventSubscriber("w", stream.endpoint) as sub:
        got: list[SubscriberItem] = []
        seq = 0

        def joined() -> bool:  # publish seq 0, 1, ... until one arrives (the SUB connection is up)
            nonlocal seq
            stream.publish(seq, good[seq])
            seq += 1
            got.extend(sub.poll(0.05))
            return any(isinstance(i, BatchReceived) for i in got)

        stream.wait_subscribed()
        wait_until(joined, 10, what="a first batch")
        wait_until(lambda: got.extend(sub.poll(0.05)) or sub.last_seq == seq - 1, 10, what="all received")
        start = seq
        for k in range(start, start + 20):  # every bad frame under the seq due next, then the batch itself
            for payload in BAD_PAYLOADS.values():
                stream.send_frames([stream.topic, k.to_bytes(8, "big"), payload])
            for frames in bad_frames(stream.topic, k):
                stream.send_frames(frames)
            stream.publish(k, good[k])
        received = sub.statistics().received
        sent = 20 * (len(BAD_PAYLOADS) + len(bad_frames(stream.topic, 0)) + 1)
        shed: list[SubscriberItem] = []
        wait_until(lambda: shed.extend(sub.shed_backlog()) or sub.statistics().received - received >= sent, 10,
                   what="the backlog read")
        stats = sub.statistics()
        assert stats.shed == 20 and stats.restarts == 0 and sub.epoch == 0
        assert not any(isinstance(i, (PublisherRestarted, BatchReceived)) for i in shed)
        assert [(r.expected_seq, r.got_seq) for r in shed if isinstance(r, ResyncNeeded)] == [(start, start + 20)]
        stream.publish(start + 20, good[start + 20])
        after: list[SubscriberItem] = []
        wait_until(lambda: after.extend(sub.poll(0.05)) or after, 10, what="the next batch")
        assert [(type(i), getattr(i, "seq", None)) for i in after] == [(BatchReceived, start + 20)]


def test_service_sheds_a_stream_that_fell_behind_and_recovers() -> None:
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", hwm=100_000)
    config = ServerConfig(
        http=None, ingest_max_lag_s=0.5, ingest_queue=1,
        workers=(WorkerSpec(name="w0", events=pub.endpoint, replay=pub.replay_endpoint),),
    )
    service = RouterService(config)
    service.start()
    try:
        first = tokens(1, 2)
        pub.publish(KVEventBatch(time.time(), [stored(first)]))
        wait_until(lambda: service.match(first).scores.get("w0") == 2, 10, what="first batch applied")

        def on_time_live_batch() -> bool:  # the join may deliver the first one through replay
            pub.publish(KVEventBatch(time.time(), []))
            pub.wait_sent(5)
            return service.workers()["w0"]["apply_delay_s"] is not None

        wait_until(on_time_live_batch, 10, interval_s=0.05, what="a live batch sets the stream's clock floor")
        base = service.workers()["w0"]["batches_applied"]
        late = 800
        with service.locked():  # the ingestion thread cannot apply: the late batches wait in its socket
            for k in range(late):
                pub.publish(KVEventBatch(time.time() - 5.0, [stored(tokens(100 + k, 1))]))
            pub.wait_sent(10)

        def accounted() -> bool:
            w = service.workers()["w0"]
            return bool(w["batches_applied"] + w["shed_batches"] >= base + late and w["resyncs"] >= 1)

        wait_until(accounted, 20, what="every late batch applied or shed")
        w = service.workers()["w0"]
        assert w["shed_batches"] > 0 and w["resyncs"] >= 1 and w["state"] == "resyncing"
        assert b"tokenspeed_ingest_shed_batches_total" in service.metrics_text()
        assert service.match(first).scores.get("w0", 0) == 0  # entries dropped, never stale
        assert isinstance(service.health()["lagging"], list)
        pub.publish(KVEventBatch(time.time(), [AllBlocksCleared()]))  # exact again from here
        wait_until(lambda: service.workers()["w0"]["state"] == "live", 10, what="live again")
        wait_until(lambda: not service.workers()["w0"]["lagging"], 10, what="caught up")
    finally:
        service.stop()
        pub.close()
