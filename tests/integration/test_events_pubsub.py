"""Publisher -> subscriber end to end on loopback (real sockets, OS-chosen ports).

No sleeps: slow joiners are handled by publishing probes until one is seen,
or by asserting that replay fills the gap; every wait has a deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from support import wait_until
from zmq.utils.monitor import recv_monitor_message

from tokenspeed_router.errors import PublishError
from tokenspeed_router.events import (
    BatchReceived,
    BlockStored,
    EventSubscriber,
    KVEventBatch,
    PublisherRestarted,
    ResyncNeeded,
    SubscriberGroup,
    SubscriberItem,
    ZmqEventPublisher,
    decode_batch,
    encode_batch,
    read_kvcap,
)
from tokenspeed_router.events.frames import END_SEQ, decode_seq, encode_seq

Ctx = zmq.Context[zmq.Socket[bytes]]
LOOPBACK = "tcp://127.0.0.1:*"


def _batch(i: int) -> KVEventBatch:
    return KVEventBatch(1000.0 + i, [BlockStored([i + 1], None, list(range(i, i + 16)), 16)], 0)


def _payload(i: int) -> bytes:
    return encode_batch(_batch(i))


class Collector:
    """Accumulate a subscriber's items; wait for a condition on them."""

    def __init__(self, poll: Callable[[float], list[SubscriberItem]]) -> None:
        self.poll = poll
        self.items: list[SubscriberItem] = []

    @property
    def batches(self) -> list[BatchReceived]:
        return [x for x in self.items if isinstance(x, BatchReceived)]

    @property
    def seqs(self) -> list[int]:
        return [x.seq for x in self.batches]

    def step(self, timeout_s: float = 0.01) -> None:
        self.items.extend(self.poll(timeout_s))

    def until(
        self, pred: Callable[[], bool], timeout_s: float = 10.0, each: Callable[[], object] | None = None
    ) -> None:
        def ready() -> bool:
            if each is not None:
                each()
            self.step()
            return pred()

        wait_until(ready, timeout_s, interval_s=0.0, what="subscriber items")


class FakeEngine:
    """A raw PUB plus a replay ROUTER the test controls (engines' framing on demand).

    A helper thread owns the ROUTER and answers each request from ``ring``
    (vLLM or TokenSpeed framing), or with ``canned`` frames, or not at all.
    """

    def __init__(self, ctx: Ctx, *, topic: bytes = b"kv", framing: str = "vllm") -> None:
        self.topic = topic
        self.framing = framing
        self.pub = ctx.socket(zmq.PUB)
        self.pub.linger = 0
        self.pub.bind(LOOPBACK)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        self.router.bind(LOOPBACK)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.ring: dict[int, bytes] = {}
        self.canned: dict[int, list[tuple[bytes, ...]]] = {}
        self.answer = True
        self.requests: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def send(self, seq: int, payload: bytes | None = None, *, remember: bool = True) -> None:
        payload = _payload(seq) if payload is None else payload
        if remember:
            with self._lock:
                self.ring[seq] = payload
        self.pub.send_multipart([self.topic, encode_seq(seq), payload])

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            identity, _, start = self.router.recv_multipart()
            with self._lock:
                self.requests.append(decode_seq(start))
                if not self.answer:
                    continue
                if self.canned:
                    replies = self.canned.get(decode_seq(start), [self._frame(None, b"")])
                else:
                    replies = [self._frame(s, p) for s, p in sorted(self.ring.items())
                               if s >= decode_seq(start)]
                    replies.append(self._frame(None, b""))
            for frames in replies:
                self.router.send_multipart([identity, *frames])

    def _frame(self, seq: int | None, payload: bytes) -> tuple[bytes, ...]:
        seq_frame = END_SEQ if seq is None else encode_seq(seq)
        if self.framing == "tokenspeed":
            return (b"", seq_frame, payload)
        return (b"", b"" if seq is None else self.topic, seq_frame, payload)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pub.close(0)
        self.router.close(0)


@pytest.fixture
def engine(ctx: Ctx) -> Iterator[FakeEngine]:
    fake = FakeEngine(ctx)
    yield fake
    fake.close()


def _subscriber(ctx: Ctx, fake: FakeEngine, **kwargs: object) -> EventSubscriber:
    kwargs.setdefault("replay_endpoint", fake.replay_endpoint)
    return EventSubscriber("w", fake.endpoint, topic="kv", context=ctx, **kwargs)  # type: ignore[arg-type]


def _live(sub: EventSubscriber) -> bool:
    """The SUB connection is up: a live message came in (not just a replay)."""
    return sub.statistics().received > 0


def _settle(
    pub: ZmqEventPublisher, col: Collector, sub: EventSubscriber, each: Callable[[], object]
) -> None:
    """Wait until everything published so far was delivered and no replay is in flight."""
    assert pub.wait_sent(5)
    last = pub.statistics().next_seq - 1
    col.until(lambda: col.seqs[-1:] == [last] and not sub.statistics().replaying, each=each)


def _probe_seq0(fake: FakeEngine, col: Collector, sub: EventSubscriber) -> None:
    """Handshake: publish seq 0 until it arrives live (repeats are dropped as duplicates)."""
    col.until(lambda: 0 in col.seqs and _live(sub), each=lambda: fake.send(0))


# --------------------------------------------------------------- real publisher


def test_in_order_delivery_real_publisher(ctx: Ctx) -> None:
    with ZmqEventPublisher("tcp://127.0.0.1:0", replay_endpoint=LOOPBACK, topic="kv",
                           context=ctx) as pub:
        sub = EventSubscriber("w0", pub.endpoint, replay_endpoint=pub.replay_endpoint,
                              topic="kv", context=ctx)
        col = Collector(sub.poll)
        published: list[KVEventBatch] = []

        def probe() -> None:
            published.append(_batch(len(published)))
            pub.publish(published[-1])

        col.until(lambda: _live(sub), each=probe)
        for _ in range(300):
            probe()
        col.until(lambda: len(col.seqs) == len(published))
        assert col.seqs == list(range(len(published)))
        assert [b.batch for b in col.batches] == published
        assert all(isinstance(x, BatchReceived) for x in col.items)
        assert all(b.payload == encode_batch(b.batch) and b.topic == b"kv" for b in col.batches)
        stats = sub.statistics()
        assert stats.resyncs == stats.restarts == stats.malformed_total == 0
        assert stats.delivered == len(published) and stats.last_seq == len(published) - 1
        sub.close()


class DroppingProxy:
    """SUB -> PUB forwarder that drops chosen seqs (a lossy network, in the test thread)."""

    def __init__(self, ctx: Ctx, upstream: str) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(upstream)
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(LOOPBACK)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.drop: set[int] = set()

    def pump(self) -> None:
        while self.sub.poll(0):
            frames = self.sub.recv_multipart()
            if decode_seq(frames[1]) not in self.drop:
                self.pub.send_multipart(frames)

    def close(self) -> None:
        self.sub.close(0)
        self.pub.close(0)


def test_gap_healed_by_real_replay(ctx: Ctx) -> None:
    with ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, topic="kv", context=ctx) as pub:
        proxy = DroppingProxy(ctx, pub.endpoint)
        sub = EventSubscriber("w0", proxy.endpoint, replay_endpoint=pub.replay_endpoint,
                              topic="kv", context=ctx)
        col = Collector(sub.poll)
        def probe() -> None:
            pub.publish(_batch(0))
            proxy.pump()

        col.until(lambda: _live(sub), each=probe)
        _settle(pub, col, sub, proxy.pump)
        first = pub.statistics().next_seq
        proxy.drop = {first + 2, first + 3, first + 4}
        for i in range(10):
            pub.publish(_batch(first + i))
        last = first + 9
        col.until(lambda: bool(col.seqs) and col.seqs[-1] == last, each=proxy.pump)
        assert col.seqs == list(range(last + 1))
        replayed = {b.seq for b in col.batches if b.replayed}
        assert proxy.drop <= replayed
        stats = sub.statistics()
        assert stats.gaps >= 1 and stats.resyncs == 0
        assert pub.statistics().replay_requests >= 1
        sub.close()
        proxy.close()


def test_gap_older_than_ring_needs_resync(ctx: Ctx) -> None:
    with ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, topic="kv", context=ctx,
                           buffer_steps=3) as pub:
        proxy = DroppingProxy(ctx, pub.endpoint)
        sub = EventSubscriber("w0", proxy.endpoint, replay_endpoint=pub.replay_endpoint,
                              topic="kv", context=ctx)
        col = Collector(sub.poll)
        def probe() -> None:
            pub.publish(_batch(0))
            proxy.pump()

        col.until(lambda: _live(sub), each=probe)
        _settle(pub, col, sub, proxy.pump)
        n = pub.statistics().next_seq
        proxy.drop = set(range(n, n + 6))
        for i in range(10):
            pub.publish(_batch(n + i))
        assert pub.wait_sent(5)
        col.until(lambda: bool(col.seqs) and col.seqs[-1] == n + 9, each=proxy.pump)
        # (The handshake before seq n went through a 3-batch ring too and may
        # have had its own losses; only what follows n is under test.)
        resyncs = [x for x in col.items if isinstance(x, ResyncNeeded) and x.expected_seq >= n]
        assert [(r.expected_seq, r.got_seq, r.reason) for r in resyncs] == [
            (n, n + 6, "replay_ring_exhausted")
        ]
        # Never a hole without a ResyncNeeded before it.
        assert [s for s in col.seqs if s >= n - 1] == [n - 1, *range(n + 6, n + 10)]
        index = col.items.index(resyncs[0])
        after = col.items[index + 1]
        assert isinstance(after, BatchReceived) and after.seq == n + 6
        sub.close()
        proxy.close()


def test_publisher_restart_detected(ctx: Ctx) -> None:
    first = ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, topic="kv", context=ctx)
    endpoint, replay = first.endpoint, first.replay_endpoint
    assert replay is not None
    sub = EventSubscriber("w0", endpoint, replay_endpoint=replay, topic="kv", context=ctx)
    col = Collector(sub.poll)
    col.until(lambda: _live(sub), each=lambda: first.publish(_batch(0)))
    for i in range(30):
        first.publish(_batch(i))
    total = first.statistics().next_seq
    col.until(lambda: len(col.seqs) == total)
    first.close()

    # Same endpoints, new process: seq starts again at 0. zmq releases the old
    # listening sockets asynchronously, so the new bind may need a few tries.
    def start_again() -> ZmqEventPublisher | None:
        try:
            return ZmqEventPublisher(endpoint, replay_endpoint=replay, topic="kv", context=ctx)
        except PublishError:
            return None

    second_or_none = wait_until(start_again, 10.0, what="rebinding the publisher's ports")
    assert second_or_none is not None
    second = second_or_none
    col.until(
        lambda: any(isinstance(x, PublisherRestarted) for x in col.items),
        each=lambda: second.publish(_batch(1000)),
    )
    restart = next(x for x in col.items if isinstance(x, PublisherRestarted))
    assert (restart.last_seq, restart.epoch) == (total - 1, 1)
    second.publish(_batch(2000))
    target = second.statistics().next_seq - 1
    col.until(lambda: col.batches[-1].seq == target and col.batches[-1].epoch == 1)
    after = col.items[col.items.index(restart) + 1 :]
    assert [b.seq for b in after if isinstance(b, BatchReceived)] == list(range(target + 1))
    assert not any(isinstance(x, ResyncNeeded) for x in col.items)
    assert sub.epoch == 1 and sub.statistics().restarts == 1
    sub.close()
    second.close()


def test_resume_from_start_seq(ctx: Ctx) -> None:
    with ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, context=ctx,
                           buffer_steps=5) as pub:
        for i in range(10):
            pub.publish(_batch(i))
        assert pub.wait_sent(5)
        ok = EventSubscriber("a", pub.endpoint, replay_endpoint=pub.replay_endpoint,
                             context=ctx, start_seq=7)
        col = Collector(ok.poll)
        col.until(lambda: col.seqs == [7, 8, 9])  # replayed at once, no live traffic needed
        assert all(b.replayed for b in col.batches)
        late = EventSubscriber("b", pub.endpoint, replay_endpoint=pub.replay_endpoint,
                               context=ctx, start_seq=2)
        col2 = Collector(late.poll)
        col2.until(lambda: col2.seqs == [5, 6, 7, 8, 9])
        resync = col2.items[0]
        assert isinstance(resync, ResyncNeeded)
        assert (resync.expected_seq, resync.got_seq, resync.reason) == (2, 5, "replay_ring_exhausted")
        ok.close()
        late.close()


def test_fresh_subscription_to_long_running_publisher(ctx: Ctx) -> None:
    with ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, context=ctx,
                           buffer_steps=4) as pub:
        for i in range(50):
            pub.publish(_batch(i))
        assert pub.wait_sent(5)
        sub = EventSubscriber("w", pub.endpoint, replay_endpoint=pub.replay_endpoint, context=ctx)
        col = Collector(sub.poll)
        col.until(lambda: len(col.seqs) >= 3, each=lambda: pub.publish(_batch(0)))
        seqs = col.seqs
        assert seqs[0] >= 50 - 4 and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert not any(isinstance(x, ResyncNeeded) for x in col.items)
        sub.close()


def test_subscriber_group_polls_many(ctx: Ctx) -> None:
    pubs = [ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, context=ctx) for _ in range(3)]
    group = SubscriberGroup(
        EventSubscriber(f"w{i}", p.endpoint, replay_endpoint=p.replay_endpoint, context=ctx)
        for i, p in enumerate(pubs)
    )
    col = Collector(group.poll)

    def publish_all() -> None:
        for p in pubs:
            p.publish(_batch(0))

    col.until(lambda: {b.worker for b in col.batches} == {"w0", "w1", "w2"}, each=publish_all)
    for worker in ("w0", "w1", "w2"):
        seqs = [b.seq for b in col.batches if b.worker == worker]
        assert seqs == list(range(len(seqs)))
    duplicate = EventSubscriber("w0", pubs[0].endpoint, context=ctx)
    with pytest.raises(ValueError):
        group.add(duplicate)
    duplicate.close()
    assert set(group.statistics()) == {"w0", "w1", "w2"}
    group.close()
    for p in pubs:
        p.close()


# ------------------------------------------------------------------ fake engine


def test_gap_filled_by_replay_and_duplicates_dropped(ctx: Ctx, engine: FakeEngine) -> None:
    sub = _subscriber(ctx, engine)
    col = Collector(sub.poll)
    _probe_seq0(engine, col, sub)
    for seq in (1, 2):
        engine.send(seq)
    for seq in (3, 4, 5):
        with engine._lock:
            engine.ring[seq] = _payload(seq)  # published, lost on the way
    for seq in (6, 7):
        engine.send(seq)
    col.until(lambda: col.seqs[-1:] == [7])
    assert col.seqs == list(range(8))
    assert [b.seq for b in col.batches if b.replayed and b.seq > 0] == [3, 4, 5, 6, 7]
    assert [b.batch for b in col.batches] == [_batch(i) for i in range(8)]
    assert engine.requests == [0, 3]
    # Live copies of 6 and 7 arrive after the replay: dropped as duplicates.
    engine.send(8)
    col.until(lambda: col.seqs[-1:] == [8])
    assert col.seqs == list(range(9))
    sub.close()


def test_replay_timeout_reports_resync(ctx: Ctx, engine: FakeEngine) -> None:
    sub = _subscriber(ctx, engine, replay_timeout_s=0.5)
    col = Collector(sub.poll)
    _probe_seq0(engine, col, sub)
    timeouts_before = sub.statistics().replay_timeouts  # the join replay may have timed out
    engine.answer = False
    engine.send(5)
    engine.send(6)
    col.until(lambda: col.seqs[-1:] == [6])
    resync = [x for x in col.items if isinstance(x, ResyncNeeded)]
    assert [(r.expected_seq, r.got_seq, r.reason) for r in resync] == [(1, 5, "replay_timeout")]
    assert sub.statistics().replay_timeouts == timeouts_before + 1
    # The DEALER was recreated: the next gap is answered normally.
    engine.answer = True
    with engine._lock:
        engine.ring[7] = _payload(7)
    engine.send(8)
    col.until(lambda: col.seqs[-1:] == [8])
    assert col.seqs == [0, 5, 6, 7, 8]
    sub.close()


def test_unanswered_join_replay_is_asked_again_while_the_stream_is_silent(
    ctx: Ctx, engine: FakeEngine
) -> None:
    """An idle worker whose replay socket did not answer the router's first request
    (still starting, or too busy) becomes visible without publishing anything new."""
    with engine._lock:
        engine.ring.update({seq: _payload(seq) for seq in range(3)})  # published before we joined
        engine.answer = False
    sub = _subscriber(ctx, engine, replay_timeout_s=0.2)
    col = Collector(sub.poll)
    col.until(lambda: sub.statistics().replay_timeouts >= 1)
    assert col.seqs == [] and sub.timeout_hint_s() is not None  # a retry is scheduled, not forgotten
    engine.answer = True
    col.until(lambda: col.seqs == [0, 1, 2])
    assert not [x for x in col.items if isinstance(x, ResyncNeeded)]
    assert engine.requests[0] == 0 and set(engine.requests) == {0}  # every request was the join's
    # Once joined, the live stream goes on from there and nothing more is asked.
    engine.send(3)
    col.until(lambda: col.seqs[-1:] == [3])
    asked = len(engine.requests)
    col.step(0.3)
    assert len(engine.requests) == asked and col.seqs == [0, 1, 2, 3]
    sub.close()


def test_no_replay_endpoint(ctx: Ctx, engine: FakeEngine) -> None:
    sub = _subscriber(ctx, engine, replay_endpoint=None)
    col = Collector(sub.poll)
    col.until(lambda: bool(col.seqs), each=lambda: engine.send(3))  # starts at the first seen
    engine.send(4)
    engine.send(9)
    col.until(lambda: col.seqs[-1:] == [9])
    assert col.seqs == [3, 4, 9]
    resync = [x for x in col.items if isinstance(x, ResyncNeeded)]
    assert [(r.expected_seq, r.got_seq, r.reason) for r in resync] == [(5, 9, "no_replay_endpoint")]
    sub.close()


def test_restart_to_nonzero_seq_replays_new_epoch(ctx: Ctx, engine: FakeEngine) -> None:
    sub = _subscriber(ctx, engine)
    col = Collector(sub.poll)
    _probe_seq0(engine, col, sub)
    for seq in (1, 2, 3):
        engine.send(seq)
    col.until(lambda: col.seqs[-1:] == [3])
    with engine._lock:  # the new process: different batches, seq restarts
        engine.ring = {0: _payload(100)}
    engine.send(1, _payload(101))
    col.until(lambda: col.batches[-1].epoch == 1 and col.seqs[-1] == 1)
    kinds = [type(x).__name__ for x in col.items[4:]]
    assert kinds == ["PublisherRestarted", "BatchReceived", "BatchReceived"]
    assert [b.batch for b in col.batches[-2:]] == [_batch(100), _batch(101)]
    sub.close()


def test_bad_frames_are_skipped_and_counted(ctx: Ctx, engine: FakeEngine) -> None:
    sub = _subscriber(ctx, engine, max_payload_bytes=4096)
    col = Collector(sub.poll)
    _probe_seq0(engine, col, sub)
    bad = [
        [b"kv", encode_seq(1)],  # frame_count
        [b"kv", encode_seq(1), _payload(1), b"extra"],  # frame_count
        [b"kv", b"\x00\x01", _payload(1)],  # seq_length
        [b"kvx", encode_seq(1), _payload(1)],  # topic (passes the SUB prefix filter)
        [b"kv", encode_seq(1), b"\xc1garbage"],  # payload_decode
        [b"kv", encode_seq(1), encode_batch(KVEventBatch(1.0, []))[:-1]],  # payload_decode
        [b"kv", encode_seq(1), b"\x93" + b"\x00" * 5000],  # payload_size
    ]
    for frames in bad:
        engine.pub.send_multipart(frames)
    engine.send(1)
    engine.send(2)
    col.until(lambda: col.seqs[-1:] == [2])
    assert col.seqs == [0, 1, 2]
    stats = sub.statistics()
    assert dict(stats.malformed) == {
        "frame_count": 2, "seq_length": 1, "topic": 1, "payload_decode": 2, "payload_size": 1,
    }
    assert stats.gaps == 0 and stats.resyncs == 0
    sub.close()


@pytest.mark.parametrize(
    "capture", ["tokenspeed-0.1.1", "vllm-0.33.0", "vllm-0.33.0-bytes-hashes", "sglang-0.5.23"]
)
def test_engine_replay_framing_accepted(ctx: Ctx, captures: Path, capture: str) -> None:
    """Replay the engine's own recorded reply frames (TokenSpeed has no topic frame)."""
    folder = captures / capture
    live = [r.frames for r in read_kvcap(folder / "dp1.sub.kvcap")]
    replies = [r.frames for r in read_kvcap(folder / "dp1.replay.kvcap")]
    engine = FakeEngine(ctx, framing="tokenspeed" if "tokenspeed" in capture else "vllm")
    engine.canned = {2: replies}  # anything else (the join request from 0): empty ring
    try:
        sub = _subscriber(ctx, engine)
        col = Collector(sub.poll)
        col.until(lambda: 0 in col.seqs and _live(sub), each=lambda: engine.pub.send_multipart(live[0]))
        for frames in live[1:]:
            engine.pub.send_multipart(frames)
        col.until(lambda: col.seqs[-1:] == [4])
        assert col.seqs == [0, 1, 2, 3, 4]
        assert engine.requests == [0, 2]
        expected = {decode_seq(f[-2]): f[-1] for f in live + replies if f[-2] != END_SEQ}
        assert [b.payload for b in col.batches] == [expected[s] for s in range(5)]
        assert [b.batch for b in col.batches] == [decode_batch(expected[s]) for s in range(5)]
        assert [b.replayed for b in col.batches] == [False, False, True, True, False] or \
            [b.replayed for b in col.batches] == [False, False, True, True, True]
        assert sub.statistics().malformed_total == 0
        sub.close()
    finally:
        engine.close()


def test_poll_returns_within_timeout(ctx: Ctx, engine: FakeEngine) -> None:
    sub = _subscriber(ctx, engine)
    start = time.monotonic()
    assert sub.poll(0.05) == []
    assert time.monotonic() - start < 2.0
    sub.close()
    assert sub.poll(0.01) == []


def test_ring_ahead_of_lagging_live_stream_is_not_a_loss(ctx: Ctx, engine: FakeEngine) -> None:
    sub = _subscriber(ctx, engine)
    col = Collector(sub.poll)
    _probe_seq0(engine, col, sub)
    with engine._lock:  # a tiny ring that already moved on to 5..7
        engine.ring = {s: _payload(s) for s in (5, 6, 7)}
    engine.send(2, remember=False)  # gap: 1 is lost for good, 3..7 not sent live yet
    col.until(lambda: col.seqs[-1:] == [2])
    for seq in range(3, 8):
        engine.send(seq, remember=False)
    col.until(lambda: col.seqs[-1:] == [7])
    assert col.seqs == [0, 2, 3, 4, 5, 6, 7]
    resyncs = [(r.expected_seq, r.got_seq) for r in col.items if isinstance(r, ResyncNeeded)]
    assert resyncs == [(1, 2)]  # 3..4 were never reported lost: they came live
    sub.close()


def test_resume_without_replay_endpoint(ctx: Ctx, engine: FakeEngine) -> None:
    sub = _subscriber(ctx, engine, replay_endpoint=None, start_seq=5)
    col = Collector(sub.poll)
    col.until(lambda: bool(col.items), each=lambda: engine.send(7))
    first = col.items[0]
    assert isinstance(first, ResyncNeeded)
    assert (first.expected_seq, first.got_seq, first.reason) == (5, 7, "no_replay_endpoint")
    engine.send(8)
    engine.send(2)  # below the resume point: a restarted publisher
    col.until(lambda: any(isinstance(x, PublisherRestarted) for x in col.items))
    col.until(lambda: col.batches[-1].epoch == 1)
    assert [(b.seq, b.epoch) for b in col.batches] == [(7, 0), (8, 0), (2, 1)]
    sub.close()


def test_monitor_attached_before_connect_sees_every_connection(ctx: Ctx) -> None:
    """``monitor_events``: the monitor exists before connect(), so a quick EVENT_CONNECTED is never lost."""
    pub = ctx.socket(zmq.PUB)
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    for _ in range(5):  # the race it prevents is rare: try it a few times
        sub = EventSubscriber("w0", endpoint, context=ctx, monitor_events=zmq.EVENT_CONNECTED)
        monitor = sub.monitor
        assert monitor is not None
        events: list[int] = []

        def connected(m: zmq.Socket[bytes] = monitor, seen: list[int] = events) -> bool:
            if m.poll(10):
                seen.append(recv_monitor_message(m)["event"])
            return zmq.EVENT_CONNECTED in seen

        wait_until(connected, 10, interval_s=0.0, what="EVENT_CONNECTED on the monitor")
        sub.close()
        assert monitor.closed
    plain = EventSubscriber("w1", endpoint, context=ctx)
    assert plain.monitor is None
    plain.close()
    pub.close(linger=0)
