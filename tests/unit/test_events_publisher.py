"""ZmqEventPublisher contract: seq only for accepted batches, queue policy, flush, endpoints."""

from __future__ import annotations

import threading

import msgspec
import pytest
import zmq
from support import wait_until

from tokenspeed_router.errors import ConfigError, PublishError, QueueFullError
from tokenspeed_router.events import (
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
    decode_batch,
)
from tokenspeed_router.events.frames import END_SEQ, decode_seq, encode_seq

Ctx = zmq.Context[zmq.Socket[bytes]]
LOOPBACK = "tcp://127.0.0.1:*"


def _batch(i: int = 0, rank: int | None = None) -> KVEventBatch:
    return KVEventBatch(float(i), [BlockStored([i], None, [1, 2, 3, 4], 4)], rank)


class StalledPublisher(ZmqEventPublisher):
    """The background thread waits for ``go`` before sending anything (test seam)."""

    go: threading.Event

    def _loop(self, *args: zmq.Socket[bytes] | None) -> None:  # type: ignore[override]
        self.go.wait(10)
        super()._loop(*args)  # type: ignore[arg-type]


def _stalled(ctx: Ctx, **kwargs: object) -> StalledPublisher:
    StalledPublisher.go = threading.Event()
    return StalledPublisher(LOOPBACK, context=ctx, **kwargs)  # type: ignore[arg-type]


def test_queue_full_raise_does_not_consume_seq(ctx: Ctx) -> None:
    pub = _stalled(ctx, max_queue_size=2, queue_full="raise")
    assert [pub.publish(_batch(i)) for i in range(2)] == [0, 1]
    with pytest.raises(QueueFullError):
        pub.publish(_batch(2))
    stats = pub.statistics()
    assert (stats.published, stats.rejected, stats.queue_full, stats.next_seq) == (2, 1, 1, 2)
    assert stats.queue_depth == 2 and stats.ring_size == 2
    pub.go.set()
    assert pub.wait_sent(5)
    assert pub.publish(_batch(2)) == 2  # the refused batch did not burn seq 2
    pub.close()


def test_queue_full_block_times_out(ctx: Ctx) -> None:
    pub = _stalled(ctx, max_queue_size=1, queue_full="block", queue_timeout_s=0.05)
    pub.publish(_batch())
    with pytest.raises(QueueFullError, match="stayed full"):
        pub.publish(_batch())
    assert pub.statistics().rejected == 1
    pub.go.set()
    pub.close()


def test_queue_full_block_waits_for_room(ctx: Ctx) -> None:
    pub = _stalled(ctx, max_queue_size=1, queue_full="block", queue_timeout_s=10)
    pub.publish(_batch())
    threading.Timer(0.05, pub.go.set).start()  # frees room while publish() waits
    assert pub.publish(_batch(1)) == 1
    stats = pub.statistics()
    assert stats.queue_full == 1 and stats.rejected == 0
    pub.close()


def test_encode_failure_raises_and_keeps_seq(ctx: Ctx) -> None:
    with ZmqEventPublisher(LOOPBACK, context=ctx) as pub:
        bad = KVEventBatch(0.0, [BlockStored([1], None, [1], 1, extra_keys=object())])
        with pytest.raises(PublishError, match="cannot encode"):
            pub.publish(bad)
        with pytest.raises(PublishError):
            pub.publish("not a batch")  # type: ignore[arg-type]
        assert pub.publish(_batch()) == 0
        assert pub.statistics().published == 1


def test_close_flushes_queued_batches(ctx: Ctx) -> None:
    sink = ctx.socket(zmq.SUB)
    sink.setsockopt(zmq.SUBSCRIBE, b"")
    pub = ZmqEventPublisher(LOOPBACK, context=ctx)
    sink.connect(pub.endpoint)
    # Handshake: probe until the SUB connection is up.
    wait_until(lambda: pub.publish(_batch(-1)) is not None and sink.poll(10), 10, what="probe")
    assert pub.wait_sent(5)
    while sink.poll(100):
        sink.recv_multipart()
    first = pub.statistics().next_seq
    with pub._cond:  # white box: hold the queue lock so the sender cannot drain yet
        for i in range(200):
            pub.publish(_batch(i))
        assert pub.statistics().queue_depth == 200
    pub.close()
    assert pub.closed
    stats = pub.statistics()
    assert stats.sent == stats.published and stats.queue_depth == 0
    seqs = []
    while sink.poll(1000):
        seqs.append(decode_seq(sink.recv_multipart()[1]))
        if seqs[-1] == first + 199:
            break
    assert seqs == list(range(first, first + 200))
    sink.close(0)
    with pytest.raises(PublishError, match="closed"):
        pub.publish(_batch())
    pub.close()  # idempotent


def test_endpoints_resolved_and_rank_filled(ctx: Ctx) -> None:
    with ZmqEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:*",
                           dp_rank=3, topic="kv", context=ctx) as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":0")
        assert pub.replay_endpoint is not None and not pub.replay_endpoint.endswith("*")
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        pub.publish(_batch(7))
        pub.publish(_batch(8, rank=1))
        dealer.send_multipart([b"", encode_seq(0)])
        replies = []
        while dealer.poll(5000):
            frames = dealer.recv_multipart()
            replies.append(frames)
            if frames[2] == END_SEQ:
                break
        assert [len(f) for f in replies] == [4, 4, 4]
        assert replies[-1] == [b"", b"", END_SEQ, b""]
        assert [decode_batch(f[3]).data_parallel_rank for f in replies[:2]] == [3, 1]
        assert all(f[1] == b"kv" for f in replies[:2])
        dealer.close(0)
        assert pub.statistics().replay_requests == 1


def test_inproc_rank_suffix_and_connect_mode(ctx: Ctx) -> None:
    sink = ctx.socket(zmq.SUB)
    sink.setsockopt(zmq.SUBSCRIBE, b"")
    sink.bind("inproc://events_dp2")
    with ZmqEventPublisher("inproc://events", dp_rank=2, bind=False, context=ctx,
                           wire_format="array") as pub:
        assert pub.endpoint == "inproc://events_dp2"
        wait_until(lambda: pub.publish(_batch()) is not None and sink.poll(10), 10, what="probe")
        topic, seq, payload = sink.recv_multipart()
        assert topic == b"" and len(seq) == 8
        assert isinstance(msgspec.msgpack.decode(payload)[1][0], list)  # array form
    sink.close(0)


def test_bad_replay_requests_are_ignored(ctx: Ctx) -> None:
    with ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, context=ctx) as pub:
        assert pub.replay_endpoint is not None
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", b"short"])
        dealer.send_multipart([b"", encode_seq(0), b"extra"])
        dealer.send_multipart([b"", encode_seq(0)])
        assert dealer.poll(5000)
        assert dealer.recv_multipart() == [b"", b"", END_SEQ, b""]  # empty ring
        stats = pub.statistics()
        assert stats.bad_replay_requests == 2 and stats.replay_requests == 1
        dealer.close(0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"wire_format": "json"},
        {"queue_full": "drop"},
        {"max_queue_size": 0},
        {"buffer_steps": -1},
        {"queue_timeout_s": -1.0},
    ],
)
def test_invalid_config(ctx: Ctx, kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        ZmqEventPublisher(LOOPBACK, context=ctx, **kwargs)  # type: ignore[arg-type]


def test_ipc_rank_and_bad_bind(ctx: Ctx) -> None:
    with pytest.raises(ValueError):
        ZmqEventPublisher("ipc:///tmp/never", dp_rank=1, context=ctx)
    with ZmqEventPublisher(LOOPBACK, context=ctx) as pub, pytest.raises(PublishError):
        ZmqEventPublisher(pub.endpoint, context=ctx)  # address in use


class _Source:
    """A ReplaySource that fails on request from seq 0 and answers otherwise."""

    def replay_from(self, start_seq: int) -> list[tuple[int, bytes]]:
        if start_seq == 0:
            raise RuntimeError("source broken")
        return [(start_seq, b"payload")]


def test_replay_source_answers_and_its_failure_is_counted(ctx: Ctx) -> None:
    with ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, context=ctx, buffer_steps=0,
                           replay_source=_Source()) as pub:
        assert pub.replay_endpoint is not None
        assert pub.publish_encoded(b"raw") == 0 and pub.statistics().ring_size == 0
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", encode_seq(0)])  # the source raises: no answer, counted
        dealer.send_multipart([b"", encode_seq(5)])
        assert dealer.poll(5000)
        assert dealer.recv_multipart() == [b"", b"", encode_seq(5), b"payload"]
        assert dealer.recv_multipart() == [b"", b"", END_SEQ, b""]
        stats = pub.statistics()
        assert stats.replay_errors == 1 and stats.replay_requests == 1
        dealer.close(0)
