"""The native drain and sender (csrc/zmq_drain.c) read and write what pyzmq does (real ZeroMQ)."""

from __future__ import annotations

import msgspec
import pytest
import zmq
from support import wait_until
from support.raw_stream import BAD_PAYLOADS, RawStream, bad_frames
from support.server import batch, stored, tokens

from tokenspeed_router.events.subscriber import BatchReceived, EventSubscriber, SubscriberItem
from tokenspeed_router.events.zmq_native import MAX_FRAMES, drainer, sender
from tokenspeed_router.router.index import NATIVE_AVAILABLE

pytestmark = pytest.mark.skipif(not NATIVE_AVAILABLE, reason="the compiled core is not built")


def _key(item: SubscriberItem) -> tuple[object, ...]:
    if isinstance(item, BatchReceived):
        return ("batch", item.seq, item.payload, item.topic, item.epoch, item.replayed)
    return (type(item).__name__, *vars(item).values()) if hasattr(item, "__dict__") else (repr(item),)


def test_the_native_drain_reads_whole_messages_of_any_shape_and_nothing_when_empty() -> None:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://drain")
        b.connect("inproc://drain")
        drain = drainer(b)
        assert drain is not None, "pyzmq's libzmq was not found in /proc/self/maps"
        assert drain(10) == []
        a.send_multipart([b"t", b"12345678", b"x" * 5000])
        a.send(b"")
        a.send_multipart([b"%d" % i for i in range(40)])  # more frames than any batch: kept to 16
        a.send(b"last")
        got = drain(3)
        assert got[:2] == [[b"t", b"12345678", b"x" * 5000], [b""]]
        assert got[2] == [b"%d" % i for i in range(MAX_FRAMES)]
        assert drain(3) == [[b"last"]] and drain(3) == []
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


def test_the_native_sender_sends_each_message_whole_and_stops_where_libzmq_refuses() -> None:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    lonely = ctx.socket(zmq.PAIR)  # no peer: libzmq refuses a send that must not wait (EAGAIN)
    try:
        a.bind("inproc://send")
        b.connect("inproc://send")
        send = sender(a)
        assert send is not None
        messages = [[b"id", b"", b"x" * 5000], [b"one"], [b"%d" % i for i in range(20)]]
        assert send(messages) == 3
        assert [b.recv_multipart() for _ in messages] == messages
        assert send([]) == 0
        lonely.bind("inproc://nobody")
        lonely_send = sender(lonely)
        assert lonely_send is not None and lonely_send([[b"a"], [b"b"]]) == 0
        with pytest.raises(TypeError):
            send([[b"a", "not bytes"]])  # type: ignore[list-item]
    finally:
        for sock in (a, b, lonely):
            sock.close(linger=0)
        ctx.term()


def test_a_subscriber_delivers_the_same_items_through_the_native_drain_as_through_pyzmq() -> None:
    encode = msgspec.msgpack.Encoder().encode
    good = [encode(batch(stored(tokens(300 + k, 1)))) for k in range(60)]
    with RawStream(replay=False) as stream, \
            EventSubscriber("w", stream.endpoint) as native, \
            EventSubscriber("w", stream.endpoint, native_drain=False) as plain:
        assert native._drain is not None and plain._drain is None
        got: dict[str, list[SubscriberItem]] = {"native": [], "plain": []}
        subs = {"native": native, "plain": plain}
        seq = 0

        def both_joined() -> bool:  # publish until each has a first batch (their SUB connections are up)
            nonlocal seq
            stream.publish(seq, good[seq])
            seq += 1
            for name, sub in subs.items():
                got[name].extend(sub.poll(0.02))
            return all(any(isinstance(i, BatchReceived) for i in items) for items in got.values())

        stream.wait_subscribed()
        wait_until(both_joined, 10, what="both subscribers joined")

        def caught_up(last: int) -> bool:
            for name, sub in subs.items():
                got[name].extend(sub.poll(0.02))
            return all(sub.last_seq == last for sub in subs.values())

        wait_until(lambda: caught_up(seq - 1), 10, what="both at the same seq")
        before = {name: dict(sub.statistics().malformed) for name, sub in subs.items()}
        for items in got.values():
            items.clear()
        for k in range(seq, seq + 30):  # bad frames of every class under the seq due next, then the batch
            for frames in bad_frames(stream.topic, k):
                stream.send_frames(frames)
            for payload in BAD_PAYLOADS.values():
                stream.send_frames([stream.topic, k.to_bytes(8, "big"), payload])
            stream.publish(k, good[k])
        wait_until(lambda: caught_up(seq + 29), 20, what="both read everything")
        assert [_key(i) for i in got["native"]] == [_key(i) for i in got["plain"]]
        assert [i.seq for i in got["native"] if isinstance(i, BatchReceived)] == list(range(seq, seq + 30))
        after = {name: sub.statistics().malformed for name, sub in subs.items()}
        grew = {name: {k: v - before[name].get(k, 0) for k, v in after[name].items()} for name in subs}
        assert grew["native"] == grew["plain"] and sum(grew["native"].values()) > 0
