"""Publisher restarts whose new sequence numbers collide with the old ones.

A restarted engine numbers its batches from 0 again. When it publishes as many
batches as the old process did (or its first ones are lost to the slow joiner),
its first seq seen equals -- or is below -- the last seq the subscriber
delivered, so only the payload bytes tell a restart from a duplicate. These
tests use a real ZmqEventPublisher closed and rebound on the same endpoints,
and a fake engine for the exact-loss cases. No sleeps: every wait has a deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import zmq
from support import wait_until
from zmq.utils.monitor import recv_monitor_message

from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.errors import PublishError
from tokenspeed_router.events import (
    BatchReceived,
    BlockStored,
    EventSubscriber,
    KVEventBatch,
    PublisherRestarted,
    ResyncNeeded,
    SubscriberItem,
    ZmqEventPublisher,
    encode_batch,
)
from tokenspeed_router.events.frames import END_SEQ, decode_seq, encode_seq

Ctx = zmq.Context[zmq.Socket[bytes]]
LOOPBACK = "tcp://127.0.0.1:*"


def _batch(i: int) -> KVEventBatch:
    return KVEventBatch(1000.0 + i, [BlockStored([i + 1], None, list(range(i, i + 16)), 16)], 0)


class _Items:
    def __init__(self, poll: Callable[[float], list[SubscriberItem]]) -> None:
        self.poll = poll
        self.items: list[SubscriberItem] = []

    @property
    def batches(self) -> list[BatchReceived]:
        return [x for x in self.items if isinstance(x, BatchReceived)]

    def until(self, pred: Callable[[], bool], each: Callable[[], object] | None = None) -> None:
        def ready() -> bool:
            if each is not None:
                each()
            self.items.extend(self.poll(0.01))
            return pred()

        wait_until(ready, 10.0, interval_s=0.0, what="subscriber items")


# ------------------------------------------------------------ real publisher


def _bind(ctx: Ctx, endpoint: str, replay: str) -> ZmqEventPublisher:
    """A publisher process on fixed endpoints (zmq frees old ports asynchronously)."""

    def start() -> ZmqEventPublisher | None:
        try:
            return ZmqEventPublisher(endpoint, replay_endpoint=replay, topic="kv", context=ctx)
        except PublishError:
            return None

    pub = wait_until(start, 10.0, what="binding the publisher's ports")
    assert pub is not None
    return pub


def _wait_connected(ctx: Ctx, monitor: zmq.Socket[bytes], replay: str, col: _Items) -> None:
    """Wait for the SUB socket's handshake with a (new) publisher process.

    The SUB sends its subscription when its own thread next touches the socket
    (the subscriber is polled meanwhile) and the PUB side learns it about a
    round trip later; one replay round trip to the same process covers that,
    so no batch is lost to the slow joiner (the point here is the seq
    collision itself).
    """

    def handshake() -> bool:
        col.items.extend(col.poll(0))
        return bool(monitor.poll(10)) and (
            recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        )

    wait_until(handshake, 10.0, interval_s=0.0, what="the SUB socket connecting")
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(replay)
    dealer.send_multipart([b"", encode_seq(0)])

    def ended() -> bool:
        col.items.extend(col.poll(0))
        return bool(dealer.poll(10)) and dealer.recv_multipart()[2] == END_SEQ

    wait_until(ended, 10.0, interval_s=0.0, what="a replay round trip")
    dealer.close(0)


def _publish(pub: ZmqEventPublisher, batches: list[KVEventBatch], col: _Items,
             sub: EventSubscriber) -> None:
    for batch in batches:  # polled in between: the batches are not sent in one burst
        pub.publish(batch)
        assert pub.wait_sent(5)
        col.items.extend(sub.poll(0.02))


@pytest.mark.parametrize(
    ("n_old", "n_new"),
    [(1, 1), (3, 3), (1, 2), (3, 1), (2, 5)],
    ids=["one_each", "same_count", "more_after_one", "fewer", "more"],
)
def test_restarted_publisher_with_colliding_seqs(ctx: Ctx, n_old: int, n_new: int) -> None:
    # Fixed ports, so that the subscriber (and its monitor) exist before the
    # publisher binds and no handshake event can be missed.
    endpoint = f"tcp://127.0.0.1:{free_tcp_port()}"
    replay = f"tcp://127.0.0.1:{free_tcp_port()}"
    sub = EventSubscriber("w0", endpoint, replay_endpoint=replay, topic="kv", context=ctx)
    monitor = sub.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    col = _Items(sub.poll)
    first = _bind(ctx, endpoint, replay)
    # The join replay (from 0, empty ring) completes first, so that the old
    # batches arrive live, as they do from a long-running engine.
    col.until(lambda: sub.statistics().replay_requests == 1 and not sub.statistics().replaying)
    _wait_connected(ctx, monitor, replay, col)
    old = [_batch(i) for i in range(n_old)]
    _publish(first, old, col, sub)
    col.until(lambda: [b.seq for b in col.batches] == list(range(n_old)))
    assert [b.batch for b in col.batches] == old
    assert not any(b.replayed for b in col.batches)
    first.close()

    second = _bind(ctx, endpoint, replay)  # the same endpoints, a new process
    _wait_connected(ctx, monitor, replay, col)
    new = [_batch(500 + i) for i in range(n_new)]
    _publish(second, new, col, sub)
    col.until(lambda: col.batches[-1].epoch == 1 and col.batches[-1].seq == n_new - 1
              and not sub.statistics().replaying)

    restarts = [x for x in col.items if isinstance(x, PublisherRestarted)]
    assert len(restarts) == 1
    restart = restarts[0]
    assert (restart.last_seq, restart.new_seq, restart.epoch) == (n_old - 1, 0, 1)
    assert col.items[: col.items.index(restart)] == col.batches[:n_old]
    after = col.items[col.items.index(restart) + 1 :]
    assert all(isinstance(x, BatchReceived) and x.epoch == 1 for x in after)
    assert [(b.seq, b.batch) for b in after if isinstance(b, BatchReceived)] == list(
        enumerate(new)
    )
    assert sub.epoch == 1 and sub.statistics().restarts == 1
    assert sub.statistics().resyncs == 0
    sub.socket.disable_monitor()
    monitor.close(0)
    sub.close()
    second.close()


# -------------------------------------------------------------- fake engine


class _Engine:
    """A raw PUB plus a replay ROUTER answered from ``ring`` in the test thread."""

    def __init__(self, ctx: Ctx) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.linger = 0
        self.pub.bind(LOOPBACK)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        self.router.bind(LOOPBACK)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.ring: dict[int, bytes] = {}
        self.requests: list[int] = []

    def send(self, seq: int, payload: bytes, *, remember: bool = True) -> None:
        if remember:
            self.ring[seq] = payload
        self.pub.send_multipart([b"kv", encode_seq(seq), payload])

    def serve(self) -> None:
        while self.router.poll(0):
            identity, _, start_frame = self.router.recv_multipart()
            start = decode_seq(start_frame)
            self.requests.append(start)
            for seq, payload in sorted(self.ring.items()):
                if seq >= start:
                    self.router.send_multipart([identity, b"", b"kv", encode_seq(seq), payload])
            self.router.send_multipart([identity, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self.pub.close(0)
        self.router.close(0)


@pytest.fixture
def engine(ctx: Ctx) -> Iterator[_Engine]:
    fake = _Engine(ctx)
    yield fake
    fake.close()


def _old_life(engine: _Engine, col: _Items, sub: EventSubscriber, count: int) -> None:
    """Deliver seqs 0..count-1 of the first process (seq 0 repeated until seen live)."""
    col.until(
        lambda: sub.statistics().received > 0 and [b.seq for b in col.batches] == [0],
        each=lambda: (engine.send(0, encode_batch(_batch(0))), engine.serve()),
    )
    for seq in range(1, count):
        engine.send(seq, encode_batch(_batch(seq)))
    col.until(lambda: col.batches[-1].seq == count - 1, each=engine.serve)


def test_repeat_of_last_seq_with_other_bytes_is_a_restart(ctx: Ctx, engine: _Engine) -> None:
    sub = EventSubscriber("w", engine.endpoint, topic="kv", context=ctx)  # no replay
    col = _Items(sub.poll)
    _old_life(engine, col, sub, 1)
    engine.send(0, encode_batch(_batch(0)))  # the same bytes again: a duplicate
    col.until(lambda: sub.statistics().duplicates >= 1)
    assert len(col.batches) == 1
    engine.send(0, encode_batch(_batch(100)))  # new process, one batch, seq 0 reused
    col.until(lambda: col.batches[-1].epoch == 1)
    restart = col.items[-2]
    assert isinstance(restart, PublisherRestarted)
    assert (restart.last_seq, restart.new_seq, restart.epoch) == (0, 0, 1)
    assert col.batches[-1].batch == _batch(100) and col.batches[-1].seq == 0
    engine.send(1, encode_batch(_batch(101)))
    col.until(lambda: col.batches[-1].seq == 1)
    assert not any(isinstance(x, ResyncNeeded) for x in col.items)
    assert sub.statistics().restarts == 1
    sub.close()


def test_collision_without_replay_endpoint_reports_the_loss(ctx: Ctx, engine: _Engine) -> None:
    sub = EventSubscriber("w", engine.endpoint, topic="kv", context=ctx)  # no replay
    col = _Items(sub.poll)
    _old_life(engine, col, sub, 3)
    engine.send(2, encode_batch(_batch(102)))  # new process; its 0 and 1 were lost
    col.until(lambda: col.batches[-1].epoch == 1)
    kinds = [type(x).__name__ for x in col.items[3:]]
    assert kinds == ["PublisherRestarted", "ResyncNeeded", "BatchReceived"]
    resync = col.items[4]
    assert isinstance(resync, ResyncNeeded)
    assert (resync.expected_seq, resync.got_seq, resync.reason) == (0, 2, "no_replay_endpoint")
    assert col.batches[-1].batch == _batch(102)
    sub.close()


def test_slow_joiner_after_restart_replays_new_process_from_zero(
    ctx: Ctx, engine: _Engine
) -> None:
    sub = EventSubscriber("w", engine.endpoint, replay_endpoint=engine.replay_endpoint,
                          topic="kv", context=ctx)
    col = _Items(sub.poll)
    _old_life(engine, col, sub, 4)
    # The new process published 0..3; the reconnecting SUB lost 0..2 and sees
    # 3 first: the last seq it delivered, with other bytes.
    engine.ring = {seq: encode_batch(_batch(200 + seq)) for seq in range(4)}
    requests_before = len(engine.requests)
    engine.send(3, engine.ring[3])
    col.until(lambda: col.batches[-1].epoch == 1 and col.batches[-1].seq == 3
              and not sub.statistics().replaying, each=engine.serve)
    assert engine.requests[requests_before:] == [0]
    restart = next(x for x in col.items if isinstance(x, PublisherRestarted))
    assert (restart.last_seq, restart.new_seq, restart.epoch) == (3, 3, 1)
    after = col.items[col.items.index(restart) + 1 :]
    assert [b.batch for b in after if isinstance(b, BatchReceived)] == [
        _batch(200 + seq) for seq in range(4)
    ]
    assert not any(isinstance(x, ResyncNeeded) for x in col.items)
    # Live copies of what the replay brought are still duplicates.
    engine.send(1, engine.ring[1])
    col.until(lambda: sub.statistics().duplicates >= 1)
    assert len(col.batches) == 8 and sub.epoch == 1
    sub.close()


def test_slow_joiner_below_last_seq_after_restart(ctx: Ctx, engine: _Engine) -> None:
    sub = EventSubscriber("w", engine.endpoint, replay_endpoint=engine.replay_endpoint,
                          topic="kv", context=ctx)
    col = _Items(sub.poll)
    _old_life(engine, col, sub, 5)
    engine.ring = {seq: encode_batch(_batch(300 + seq)) for seq in range(3)}
    engine.send(2, engine.ring[2])  # seqs 0 and 1 of the new process were lost
    col.until(lambda: col.batches[-1].epoch == 1 and col.batches[-1].seq == 2
              and not sub.statistics().replaying, each=engine.serve)
    epoch1 = [b for b in col.batches if b.epoch == 1]
    assert [(b.seq, b.batch) for b in epoch1] == [(s, _batch(300 + s)) for s in range(3)]
    assert sub.statistics().restarts == 1
    sub.close()


def test_connection_reset_finds_restart_hidden_by_in_order_seq(
    ctx: Ctx, engine: _Engine
) -> None:
    sub = EventSubscriber("w", engine.endpoint, replay_endpoint=engine.replay_endpoint,
                          topic="kv", context=ctx)
    col = _Items(sub.poll)
    _old_life(engine, col, sub, 2)
    # The new process published 0..2 before the connection was back; the first
    # seq seen live, 2, is the one expected next: only a replay can tell.
    engine.ring = {seq: encode_batch(_batch(400 + seq)) for seq in range(3)}
    requests_before = len(engine.requests)
    sub.connection_reset()
    assert sub.needs_processing()
    engine.send(2, engine.ring[2])
    col.until(lambda: col.batches[-1].epoch == 1 and col.batches[-1].seq == 2
              and not sub.statistics().replaying, each=engine.serve)
    # verified from the last seq delivered (1), then the new process's batches from 0
    assert engine.requests[requests_before:] == [1, 0]
    after_old = col.items[2:]
    restart = after_old[0]
    assert isinstance(restart, PublisherRestarted)
    assert (restart.last_seq, restart.new_seq, restart.epoch) == (1, 1, 1)  # new_seq: first seen of it
    assert [(b.seq, b.batch) for b in after_old[1:] if isinstance(b, BatchReceived)] == [
        (seq, _batch(400 + seq)) for seq in range(3)
    ]
    assert len(after_old) == 4 and sub.statistics().restarts == 1
    sub.close()


def test_connection_reset_to_the_same_process_changes_nothing(
    ctx: Ctx, engine: _Engine
) -> None:
    sub = EventSubscriber("w", engine.endpoint, replay_endpoint=engine.replay_endpoint,
                          topic="kv", context=ctx)
    col = _Items(sub.poll)
    _old_life(engine, col, sub, 2)
    requests_before = len(engine.requests)
    sub.connection_reset()  # a network blip: the ring still holds our batches
    engine.send(2, encode_batch(_batch(2)))
    col.until(lambda: col.batches[-1].seq == 2 and not sub.statistics().replaying,
              each=engine.serve)
    assert engine.requests[requests_before:] == [1]  # from the last seq delivered
    assert all(isinstance(x, BatchReceived) and x.epoch == 0 for x in col.items)
    assert [b.seq for b in col.batches] == [0, 1, 2]
    assert sub.statistics().restarts == 0 and sub.statistics().resyncs == 0
    sub.close()

    no_replay = EventSubscriber("w", engine.endpoint, topic="kv", context=ctx)
    no_replay.connection_reset()  # nothing to verify with
    assert not no_replay.needs_processing()
    no_replay.close()
