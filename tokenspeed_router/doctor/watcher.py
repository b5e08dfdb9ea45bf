"""The engines' KV event streams, followed exactly as the router follows them.

One thread owns every :class:`~tokenspeed_router.events.EventSubscriber`
(the router's own: slow-joiner replay from 0, gaps, restarts) and a
:class:`~tokenspeed_router.router.KvIndex` fed with what they deliver, so
"what the router computes from these events" is the router's code, not a
re-implementation. Every ``BlockStored`` is also kept with the time it was
received (``time.monotonic()``) and the batch's DP rank, for the checks.

Raw view: the watcher also follows every endpoint with a plain unfiltered
SUB socket, outside the router's sequencing. ZeroMQ filters by topic prefix
without a word, so a spec whose ``topic=`` is not the engine's sees nothing:
the raw view counts the topics that do arrive. And a batch the engine
published but the router's subscriber never delivered (dropped as a
duplicate after a replay from another engine's ring, say) shows in the raw
view only: :meth:`Watcher.raw_stored` tells the checks what really went out.

Joining: ZeroMQ drops what a PUB sends before the SUB's connection and
subscription are up. The watcher reports a stream joined once its socket
monitor saw the handshake, plus :data:`SUBSCRIBE_GRACE_S` (ZeroMQ gives no
signal that the publisher applied the subscription); canaries are sent only
then. Streams with a replay endpoint also recover anything missed through
the subscriber's replay.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import zmq
from zmq.utils.monitor import recv_monitor_message

from tokenspeed_router.errors import TokenspeedError
from tokenspeed_router.events.codec import BatchDecoder
from tokenspeed_router.events.curve import CurveClientKeys
from tokenspeed_router.events.frames import SEQ_BYTES, decode_seq, ipv6_endpoint
from tokenspeed_router.events.schema import BlockStored
from tokenspeed_router.events.subscriber import (
    BatchReceived,
    EventSubscriber,
    PublisherRestarted,
    ResyncNeeded,
)
from tokenspeed_router.router.index import KvIndex, MatchDetail

__all__ = ["Seen", "StreamTarget", "Watcher"]

logger = logging.getLogger(__name__)

SUBSCRIBE_GRACE_S = 0.1
#: BlockStored events the raw view keeps per stream (a doctor run sends a few canaries)
_RAW_LIMIT = 200_000
_POLL_MS = 20
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StreamTarget:
    """One event stream to follow: a worker, or one DP rank of it."""

    name: str
    worker: str
    dp_rank: int
    events: str
    replay: str | None = None
    topic: str = ""
    curve: CurveClientKeys | None = None


@dataclass(frozen=True, slots=True)
class Seen:
    """One ``BlockStored`` as it arrived."""

    stream: str
    recv_s: float
    batch_rank: int | None
    event: BlockStored
    seq: int = -1
    """The seq of the batch that carried it."""


@dataclass(slots=True)
class _StreamState:
    target: StreamTarget
    subscriber: EventSubscriber
    monitor: zmq.Socket[bytes]
    sniffer: zmq.Socket[bytes]
    """An unfiltered SUB on the same endpoint (the raw view)."""
    joined_s: float | None = None
    batches: int = 0
    unknown_parents: list[object] = field(default_factory=list)
    resyncs: int = 0
    restarts: int = 0
    connected: bool = False
    reconnects: int = 0
    topics: dict[bytes, int] = field(default_factory=dict)
    raw: list[Seen] = field(default_factory=list)


class Watcher:
    """Follows ``targets`` in a background thread until :meth:`close`."""

    def __init__(self, targets: Sequence[StreamTarget]) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._lock = threading.Condition()
        self._index = KvIndex()
        self._seen: list[Seen] = []
        self._raw_decoder = BatchDecoder(validate=False)
        self._streams: dict[str, _StreamState] = {}
        self._stop = False
        try:
            for t in targets:
                sub = EventSubscriber(
                    t.name, t.events, replay_endpoint=t.replay, topic=t.topic, context=self._ctx, curve=t.curve,
                    monitor_events=zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
                monitor = sub.monitor
                assert monitor is not None
                try:
                    sniffer = self._sniffer(t)
                except BaseException:
                    sub.close()
                    raise
                self._streams[t.name] = _StreamState(t, sub, monitor, sniffer)
        except Exception:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="doctor-watcher", daemon=True)
        self._thread.start()

    def _sniffer(self, t: StreamTarget) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.SUB)
        sock.linger = 0
        if ipv6_endpoint(t.events):
            sock.setsockopt(zmq.IPV6, 1)
        if t.curve is not None:
            t.curve.apply(sock)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(t.events)
        return sock

    # ------------------------------------------------------------------ queries (any thread)

    def wait(self, predicate: Callable[[], T], timeout_s: float) -> T:
        """Wait until ``predicate()`` (called under the lock) is truthy, or the timeout; its last value."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                value = predicate()
                left = deadline - time.monotonic()
                if value or left <= 0:
                    return value
                self._lock.wait(min(left, 0.05))

    def target(self, stream: str) -> StreamTarget:
        return self._streams[stream].target

    def joined(self, stream: str) -> bool:
        st = self._streams[stream]
        return st.joined_s is not None and time.monotonic() - st.joined_s >= SUBSCRIBE_GRACE_S

    def stored(self, streams: Sequence[str], since_s: float) -> list[Seen]:
        """BlockStored events of ``streams`` received at or after ``since_s``."""
        names = set(streams)
        with self._lock:
            return [s for s in self._seen if s.stream in names and s.recv_s >= since_s]

    def restarts(self, stream: str) -> tuple[int, int]:
        """(publisher restarts the router's subscriber saw, reconnections) on ``stream``."""
        with self._lock:
            st = self._streams[stream]
            return st.restarts, st.reconnects

    def batches(self, stream: str) -> int:
        with self._lock:
            return self._streams[stream].batches

    def all_stored(self, since_s: float) -> list[Seen]:
        """BlockStored events of every stream received at or after ``since_s``."""
        with self._lock:
            return [s for s in self._seen if s.recv_s >= since_s]

    def raw_stored(self, stream: str, since_s: float) -> list[Seen]:
        """BlockStored events the raw view saw on ``stream``'s endpoint at or after ``since_s``.

        Under any topic and whether or not the router's subscriber delivered them.
        """
        with self._lock:
            return [s for s in self._streams[stream].raw if s.recv_s >= since_s]

    def topics(self, stream: str) -> dict[str, int]:
        """Messages per topic on the stream's endpoint, unfiltered (the raw view)."""
        with self._lock:
            return {t.decode(errors="replace"): n for t, n in self._streams[stream].topics.items()}

    def unknown_parents(self, stream: str) -> list[object]:
        with self._lock:
            return list(self._streams[stream].unknown_parents)

    def match(self, token_ids: list[int]) -> MatchDetail:
        """The router's index over everything received: its match for ``token_ids``."""
        with self._lock:
            return self._index.match_detail(token_ids)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        poller_cache: tuple[tuple[int, ...], zmq.Poller] | None = None
        while not self._stop:
            sockets: list[zmq.Socket[bytes]] = []
            for st in self._streams.values():
                sockets.append(st.monitor)
                sockets.extend(st.subscriber.poll_sockets())
                sockets.append(st.sniffer)
            key = tuple(id(s) for s in sockets)
            if poller_cache is None or poller_cache[0] != key:
                poller = zmq.Poller()
                for s in sockets:
                    poller.register(s, zmq.POLLIN)
                poller_cache = (key, poller)
            try:
                ready = dict(poller_cache[1].poll(_POLL_MS))
            except zmq.ZMQError:
                if self._stop:
                    return
                raise
            for st in self._streams.values():
                if st.monitor in ready:
                    self._on_monitor(st)
                if st.sniffer in ready:
                    self._on_sniffed(st, st.sniffer)
                try:
                    items = st.subscriber.process_ready()
                except zmq.ZMQError:
                    if self._stop:
                        return
                    raise
                if items:
                    self._on_items(st, items)

    def _on_monitor(self, st: _StreamState) -> None:
        while st.monitor.poll(0):
            event = recv_monitor_message(st.monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                st.connected = False
                continue
            if event not in (zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_CONNECTED) or st.connected:
                continue
            st.connected = True
            with self._lock:
                if st.joined_s is None:
                    st.joined_s = time.monotonic()
                else:
                    # As the router does: a new publisher process may have sent its
                    # first batches before we were back; the subscriber verifies.
                    st.reconnects += 1
                    st.subscriber.connection_reset()
                self._lock.notify_all()

    def _on_sniffed(self, st: _StreamState, sock: zmq.Socket[bytes]) -> None:
        now = time.monotonic()
        with self._lock:
            for _ in range(1000):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                topic = bytes(frames[0][:128]) if frames else b""
                if topic in st.topics or len(st.topics) < 16:
                    st.topics[topic] = st.topics.get(topic, 0) + 1
                if len(frames) != 3 or len(frames[1]) != SEQ_BYTES or len(st.raw) >= _RAW_LIMIT:
                    continue
                try:
                    batch = self._raw_decoder.decode(frames[2])
                except Exception:  # not ours to judge here: the subscriber counts malformed input
                    continue
                seq = decode_seq(frames[1])
                st.raw.extend(Seen(st.target.name, now, batch.data_parallel_rank, ev, seq)
                              for ev in batch.events if isinstance(ev, BlockStored))

    def _on_items(self, st: _StreamState, items: Sequence[object]) -> None:
        now = time.monotonic()
        name = st.target.name
        with self._lock:
            for item in items:
                if isinstance(item, BatchReceived):
                    st.batches += 1
                    for ev in item.batch.events:
                        if isinstance(ev, BlockStored):
                            self._seen.append(Seen(name, now, item.batch.data_parallel_rank, ev, item.seq))
                    try:
                        self._index.apply(name, item.batch)
                    except TokenspeedError as err:  # an unknown parent: the router would resync here
                        parent = getattr(err, "parent_hash", None)
                        st.unknown_parents.append(parent)
                        logger.debug("doctor: %s: %s", name, err)
                elif isinstance(item, PublisherRestarted):
                    st.restarts += 1
                    self._index.clear_worker(name)
                elif isinstance(item, ResyncNeeded):
                    st.resyncs += 1
                    self._index.clear_worker(name)
            self._lock.notify_all()

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=5.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for st in self._streams.values():
            st.sniffer.close(linger=0)
            st.subscriber.close()
        self._ctx.term()

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
