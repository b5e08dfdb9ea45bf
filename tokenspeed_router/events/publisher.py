"""ZmqEventPublisher: the worker side of the KV event stream (DESIGN §3).

Wire compatible with the vLLM/SGLang/TokenSpeed publishers: a PUB socket sends
``[topic, seq, payload]`` and an optional ROUTER socket replays the last
``buffer_steps`` batches in the vLLM reply framing. What differs is the
contract of :meth:`ZmqEventPublisher.publish`:

* the batch is encoded *first*, in the caller's thread, and only then given a
  sequence number (vLLM takes the seq before encoding, so an encoding error
  burns a number and every subscriber sees a phantom gap);
* ``publish`` returns only once the batch is encoded, numbered, queued and in
  the replay ring; otherwise it raises and the number is not consumed;
* the queue is bounded and a full queue follows an explicit, counted policy:
  ``"block"`` (wait up to ``queue_timeout_s``, then :class:`QueueFullError`)
  or ``"raise"`` (fail at once);
* bind or connect is a parameter (``bind=``), never guessed from the
  endpoint string; the replay ROUTER always binds, as in the engines;
* ``close()`` sends every queued batch before closing the sockets.

Two hooks serve the event relay (``tokenspeed_router.relay``): a
``replay_source`` answers replay requests in place of the built-in ring (the
relay adds a snapshot in front of its ring), and ``curve`` makes both sockets
CURVE servers (the ZAP allow-list is installed on the context by the caller).

Threading: zmq sockets are not thread safe, so one background thread creates,
owns and closes the PUB and ROUTER sockets. Callers only touch a
lock-protected deque and, when the thread is idle, a private inproc PAIR
socket that wakes it (also under the lock). Replay requests are served by the
same thread between chunks of live batches, from the same bytes that went out
live, so replayed payloads are byte-identical.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, Protocol

import msgspec
import zmq

from tokenspeed_router.errors import ConfigError, PublishError, QueueFullError
from tokenspeed_router.events.codec import WireFormat, encode_batch
from tokenspeed_router.events.curve import CurveServerKeys
from tokenspeed_router.events.frames import (
    END_SEQ,
    SEQ_BYTES,
    decode_seq,
    encode_seq,
    ipv6_endpoint,
    offset_endpoint_port,
)
from tokenspeed_router.events.schema import Event, KVEventBatch
from tokenspeed_router.ratelimit import RateLimitedLog

__all__ = ["PublisherStatistics", "QueueFullPolicy", "ReplaySource", "ZmqEventPublisher"]

logger = logging.getLogger(__name__)

QueueFullPolicy = Literal["block", "raise"]

#: Live batches sent per lock acquisition by the background thread.
_DRAIN_CHUNK = 256
#: Safety net for the background thread's poll; it is normally woken explicitly.
_IDLE_POLL_MS = 1000
_STARTUP_TIMEOUT_S = 10.0


class ReplaySource(Protocol):
    """Answers replay requests instead of the publisher's own ring.

    Called on the publisher's thread: must be thread safe and must not block
    for long (live batches wait meanwhile). Returns ``(seq, payload)`` pairs in
    increasing seq order, each ``>= start_seq``.
    """

    def replay_from(self, start_seq: int) -> Sequence[tuple[int, bytes]]: ...


@dataclass(frozen=True, slots=True)
class PublisherStatistics:
    """A consistent snapshot of a publisher's counters."""

    published: int
    """Batches accepted by publish() (numbered, queued and in the ring)."""
    sent: int
    """Batches handed to the PUB socket."""
    rejected: int
    """publish() calls refused because the queue stayed full (or the publisher closed)."""
    queue_full: int
    """Times publish() found the queue full (whether it then waited or raised)."""
    queue_depth: int
    """Batches accepted but not yet sent."""
    ring_size: int
    """Batches currently held for replay."""
    next_seq: int
    replay_requests: int
    """Replay requests answered (every batch sent; counted just before the end marker)."""
    replay_batches: int
    """Batches sent in replay replies."""
    bad_replay_requests: int
    """Malformed replay requests ignored."""
    replay_errors: int
    """Replay replies aborted by a socket error (peer gone, high-water mark)."""


class ZmqEventPublisher:
    """Publish :class:`KVEventBatch` es on ZeroMQ, with a replay ring.

    ``endpoint``/``replay_endpoint`` are offset for ``dp_rank`` (port + rank);
    a tcp port of ``0`` or ``*`` is chosen by the OS and read back, see
    :attr:`endpoint` and :attr:`replay_endpoint`. ``context`` is borrowed if
    given (never terminated here), otherwise created and terminated by
    :meth:`close`. Use as a context manager or call :meth:`close`.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        dp_rank: int = 0,
        bind: bool = True,
        wire_format: WireFormat = "map",
        buffer_steps: int = 10_000,
        max_queue_size: int = 100_000,
        queue_full: QueueFullPolicy = "block",
        queue_timeout_s: float = 5.0,
        hwm: int = 100_000,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        replay_source: ReplaySource | None = None,
        curve: CurveServerKeys | None = None,
    ) -> None:
        _validate(wire_format, buffer_steps, max_queue_size, queue_full, queue_timeout_s, hwm)
        self._configured_endpoint = offset_endpoint_port(endpoint, dp_rank) or endpoint
        self._configured_replay = offset_endpoint_port(replay_endpoint, dp_rank)
        self._topic = topic.encode()
        self._dp_rank = dp_rank
        self._bind = bind
        self._wire_format: WireFormat = wire_format
        self._buffer_steps = buffer_steps
        self._max_queue_size = max_queue_size
        self._queue_full: QueueFullPolicy = queue_full
        self._queue_timeout_s = queue_timeout_s
        self._hwm = hwm
        self._replay_source = replay_source
        self._curve = curve

        self._owns_context = context is None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = context if context is not None else zmq.Context()
        self._cond = threading.Condition()
        # Guarded by _cond:
        self._queue: deque[tuple[int, bytes]] = deque()
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._in_flight = 0
        self._closing = False
        self._idle = False
        self._published = 0
        self._sent = 0
        self._rejected = 0
        self._queue_full_count = 0
        self._replay_requests = 0
        self._replay_batches = 0
        self._bad_replay_requests = 0
        self._replay_errors = 0
        self._linger_ms = 1000

        self._wake_address = f"inproc://tokenspeed-publisher-wake-{uuid.uuid4().hex}"
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._endpoint = self._configured_endpoint
        self._replay_endpoint = self._configured_replay
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name=f"kv-publisher[{self._configured_endpoint}]", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(_STARTUP_TIMEOUT_S):
            self._abort_startup()
            raise PublishError(f"publisher thread did not start within {_STARTUP_TIMEOUT_S}s")
        if self._startup_error is not None:
            self._thread.join()
            self._abort_startup()
            raise PublishError(
                f"cannot set up publisher on {self._configured_endpoint!r} "
                f"(replay {self._configured_replay!r}): {self._startup_error}"
            ) from self._startup_error
        self._wake = self._ctx.socket(zmq.PAIR)
        self._wake.linger = 0
        self._wake.connect(self._wake_address)
        logger.info(
            "kv publisher started endpoint=%s replay=%s topic=%r dp_rank=%d bind=%s format=%s",
            self._endpoint, self._replay_endpoint, topic, dp_rank, bind, wire_format,
        )

    # ----------------------------------------------------------------- public

    @property
    def endpoint(self) -> str:
        """The PUB endpoint actually used (rank offset applied, OS port resolved)."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The replay ROUTER endpoint actually bound, or None without replay."""
        return self._replay_endpoint

    @property
    def topic(self) -> str:
        return self._topic.decode()

    def set_topic(self, topic: str) -> None:
        """Publish (and answer replays) under ``topic`` from now on.

        For a relay started without ``--topic``: it republishes under
        whatever topic its engine's messages carry, learnt from the first one.
        """
        self._topic = topic.encode()

    @property
    def dp_rank(self) -> int:
        return self._dp_rank

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def publish(self, batch: KVEventBatch) -> int:
        """Encode, number, queue and remember ``batch``; return its seq.

        A batch without ``data_parallel_rank`` gets this publisher's rank.
        Raises :class:`PublishError` (encoding failed, publisher closed) or
        :class:`QueueFullError` (queue full under the configured policy); in
        both cases no seq was consumed.
        """
        if not isinstance(batch, KVEventBatch):
            raise PublishError(f"publish() takes a KVEventBatch, got {type(batch).__name__}")
        if batch.data_parallel_rank is None:
            batch = msgspec.structs.replace(batch, data_parallel_rank=self._dp_rank)
        try:
            payload = encode_batch(batch, self._wire_format)
        except Exception as err:  # msgspec raises TypeError/OverflowError/EncodeError
            raise PublishError(f"cannot encode KV event batch: {err}") from err
        return self.publish_encoded(payload)

    def publish_encoded(self, payload: bytes) -> int:
        """:meth:`publish` for a batch the caller already encoded (the relay keeps
        the very bytes in its own replay ring); ``payload`` is not checked."""
        with self._cond:
            self._wait_for_room()
            seq = self._next_seq
            self._next_seq = seq + 1
            self._queue.append((seq, payload))
            self._ring.append((seq, payload))
            self._published += 1
            if self._idle:
                self._wake_sender()
        return seq

    def publish_events(self, events: Iterable[Event], ts: float | None = None) -> int:
        """Publish ``events`` as one batch stamped ``ts`` (default: now, wall clock)."""
        return self.publish(KVEventBatch(time.time() if ts is None else ts, list(events)))

    def wait_sent(self, timeout_s: float = 5.0) -> bool:
        """Wait until every accepted batch went to the PUB socket; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._queue and not self._in_flight, timeout=timeout_s
            )

    def statistics(self) -> PublisherStatistics:
        """A consistent snapshot of the counters (see :class:`PublisherStatistics`)."""
        with self._cond:
            return PublisherStatistics(
                published=self._published,
                sent=self._sent,
                rejected=self._rejected,
                queue_full=self._queue_full_count,
                queue_depth=len(self._queue) + self._in_flight,
                ring_size=len(self._ring),
                next_seq=self._next_seq,
                replay_requests=self._replay_requests,
                replay_batches=self._replay_batches,
                bad_replay_requests=self._bad_replay_requests,
                replay_errors=self._replay_errors,
            )

    def close(self, timeout_s: float = 5.0) -> None:
        """Send every queued batch, then close the sockets (idempotent).

        Pending socket output lingers at most ``timeout_s`` (capped at 5 s);
        batches still queued after ``timeout_s`` are abandoned with a warning.
        """
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._closing = True
            self._linger_ms = int(max(0.0, min(timeout_s, 5.0)) * 1000)
            self._cond.notify_all()
            if self._idle:
                self._wake_sender()
        self._thread.join(timeout_s)
        alive = self._thread.is_alive()
        if alive:
            logger.warning(
                "kv publisher %s: %d batches still queued after %.1fs; abandoning them",
                self._endpoint, len(self._queue), timeout_s,
            )
        self._wake.close(linger=0)
        if self._owns_context and not alive:
            self._ctx.term()
        stats = self.statistics()
        logger.info(
            "kv publisher closed endpoint=%s published=%d sent=%d rejected=%d replays=%d",
            self._endpoint, stats.published, stats.sent, stats.rejected, stats.replay_requests,
        )

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ZmqEventPublisher(endpoint={self._endpoint!r}, "
            f"replay_endpoint={self._replay_endpoint!r}, topic={self.topic!r})"
        )

    # ---------------------------------------------------------- caller side

    def _wait_for_room(self) -> None:
        """Called with the lock held; returns when a batch may be queued."""
        if self._closing:
            self._rejected += 1
            raise PublishError("publisher is closed")
        if len(self._queue) < self._max_queue_size:
            return
        self._queue_full_count += 1
        if self._queue_full == "raise":
            self._rejected += 1
            raise QueueFullError(f"publisher queue full ({self._max_queue_size} batches)")
        room = self._cond.wait_for(
            lambda: self._closing or len(self._queue) < self._max_queue_size,
            timeout=self._queue_timeout_s,
        )
        if self._closing:
            self._rejected += 1
            raise PublishError("publisher closed while waiting for queue room")
        if not room:
            self._rejected += 1
            raise QueueFullError(
                f"publisher queue stayed full ({self._max_queue_size} batches) "
                f"for {self._queue_timeout_s}s"
            )

    def _wake_sender(self) -> None:
        """Called with the lock held: wake the idle sender thread (never raises;
        the thread also polls on its own every second)."""
        self._idle = False
        try:
            self._wake.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError as err:
            logger.debug("kv publisher %s: wake-up not sent: %s", self._endpoint, err)

    def _abort_startup(self) -> None:
        self._closed = True
        if self._owns_context:
            self._ctx.term()

    # ------------------------------------------------------- thread side

    def _run(self) -> None:
        sockets: list[zmq.Socket[bytes]] = []
        try:
            pub = self._ctx.socket(zmq.PUB)
            sockets.append(pub)
            pub.setsockopt(zmq.SNDHWM, self._hwm)
            if self._curve is not None:
                self._curve.apply(pub)
            if ipv6_endpoint(self._configured_endpoint):
                pub.setsockopt(zmq.IPV6, 1)
            if self._bind:
                _bind_retrying(pub, self._configured_endpoint)
                self._endpoint = _resolved(pub, self._configured_endpoint)
            else:
                pub.connect(self._configured_endpoint)
            router: zmq.Socket[bytes] | None = None
            if self._configured_replay is not None:
                router = self._ctx.socket(zmq.ROUTER)
                sockets.append(router)
                router.setsockopt(zmq.ROUTER_MANDATORY, 1)
                # A reply must never be cut short: the ring (or a source's
                # snapshot, of unknown size) fits below the high-water mark.
                hwm = 0 if self._replay_source is not None else 2 * (self._buffer_steps + 1)
                router.setsockopt(zmq.SNDHWM, hwm)
                if self._curve is not None:
                    self._curve.apply(router)
                if ipv6_endpoint(self._configured_replay):
                    router.setsockopt(zmq.IPV6, 1)
                _bind_retrying(router, self._configured_replay)
                self._replay_endpoint = _resolved(router, self._configured_replay)
            wake = self._ctx.socket(zmq.PAIR)
            sockets.append(wake)
            wake.bind(self._wake_address)
        except BaseException as err:  # report any setup failure to the constructor
            self._startup_error = err
            for sock in sockets:
                sock.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(pub, router, wake)
        except Exception:
            logger.exception("kv publisher %s: background thread failed", self._endpoint)
            with self._cond:
                self._closing = True
                self._cond.notify_all()
        finally:
            with self._cond:
                linger_ms = self._linger_ms
            pub.close(linger=linger_ms)
            if router is not None:
                router.close(linger=min(linger_ms, 100))
            wake.close(linger=0)

    def _loop(
        self, pub: zmq.Socket[bytes], router: zmq.Socket[bytes] | None, wake: zmq.Socket[bytes]
    ) -> None:
        poller = zmq.Poller()
        poller.register(wake, zmq.POLLIN)
        if router is not None:
            poller.register(router, zmq.POLLIN)
        limiter = RateLimitedLog(logger)
        while True:
            with self._cond:
                self._idle = False
                items = [self._queue.popleft() for _ in range(min(_DRAIN_CHUNK, len(self._queue)))]
                if items:
                    self._in_flight = len(items)
                    self._cond.notify_all()  # room for blocked publishers
                elif self._closing:
                    return
                else:
                    self._idle = True
            if items:
                topic = self._topic  # read per drain: set_topic may change it
                for seq, payload in items:
                    pub.send_multipart((topic, encode_seq(seq), payload))
                with self._cond:
                    self._in_flight = 0
                    self._sent += len(items)
                    self._cond.notify_all()
                if router is not None:
                    self._serve_replays(router, limiter)
                continue
            ready = dict(poller.poll(_IDLE_POLL_MS))
            if wake in ready:
                _drain(wake)
            if router is not None and router in ready:
                self._serve_replays(router, limiter)

    def _serve_replays(self, router: zmq.Socket[bytes], limiter: RateLimitedLog) -> None:
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != SEQ_BYTES:
                with self._cond:
                    self._bad_replay_requests += 1
                limiter.log(
                    logging.WARNING, "bad-request",
                    "kv publisher %s: ignoring malformed replay request: expected "
                    "[identity, b'', 8-byte seq], got %d frames of sizes %s",
                    self._endpoint, len(frames), [len(f) for f in frames],
                )
                continue
            identity, _, start_frame = frames
            start_seq = decode_seq(start_frame)
            try:
                items = (
                    self._ring_from(start_seq)
                    if self._replay_source is None
                    else self._replay_source.replay_from(start_seq)
                )
            except Exception:
                with self._cond:
                    self._replay_errors += 1
                logger.exception("kv publisher %s: replay source failed from seq %d", self._endpoint, start_seq)
                continue
            try:
                for seq, payload in items:
                    router.send_multipart(
                        (identity, b"", self._topic, encode_seq(seq), payload), zmq.NOBLOCK
                    )
                # Counted before the end marker goes out, so that a client that
                # has seen the marker also sees the counters.
                with self._cond:
                    self._replay_requests += 1
                    self._replay_batches += len(items)
                router.send_multipart((identity, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
            except zmq.ZMQError as err:
                with self._cond:
                    self._replay_errors += 1
                limiter.log(
                    logging.WARNING, "replay-error",
                    "kv publisher %s: replay reply from seq %d aborted: %s",
                    self._endpoint, start_seq, err,
                )
                continue
            logger.debug(
                "kv publisher %s: replayed %d batches from seq %d",
                self._endpoint, len(items), start_seq,
            )

    def _ring_from(self, start_seq: int) -> list[tuple[int, bytes]]:
        """Buffered batches with seq >= start_seq (the ring holds consecutive seqs)."""
        with self._cond:
            ring = self._ring
            if not ring:
                return []
            offset = start_seq - ring[0][0]
            if offset <= 0:
                return list(ring)
            return list(itertools.islice(ring, offset, None))


def _validate(
    wire_format: str,
    buffer_steps: int,
    max_queue_size: int,
    queue_full: str,
    queue_timeout_s: float,
    hwm: int,
) -> None:
    if wire_format not in ("map", "array"):
        raise ConfigError(f"wire_format must be 'map' or 'array', got {wire_format!r}")
    if queue_full not in ("block", "raise"):
        raise ConfigError(f"queue_full must be 'block' or 'raise', got {queue_full!r}")
    if buffer_steps < 0:
        raise ConfigError(f"buffer_steps must be >= 0, got {buffer_steps}")
    if max_queue_size < 1:
        raise ConfigError(f"max_queue_size must be >= 1, got {max_queue_size}")
    if queue_timeout_s < 0:
        raise ConfigError(f"queue_timeout_s must be >= 0, got {queue_timeout_s}")
    if hwm < 0:
        raise ConfigError(f"hwm must be >= 0, got {hwm}")


def _resolved(sock: zmq.Socket[bytes], endpoint: str) -> str:
    """The bound endpoint, with an OS-chosen tcp port (``0`` or ``*``) read back."""
    if endpoint.startswith("tcp://") and endpoint.rpartition(":")[2] in ("0", "*"):
        last = sock.getsockopt(zmq.LAST_ENDPOINT)
        return last.decode() if isinstance(last, bytes) else str(last)
    return endpoint


def _drain(sock: zmq.Socket[bytes]) -> None:
    while True:
        try:
            sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return


#: How long a bind to an explicit port waits for the port to come free. A
#: restarted engine binds the endpoints its predecessor just closed; ZeroMQ
#: releases a closed listener asynchronously (its I/O thread), so the first
#: bind can see EADDRINUSE for a few milliseconds.
BIND_RETRY_S = 5.0


def _bind_retrying(sock: zmq.Socket[bytes], endpoint: str, retry_s: float = BIND_RETRY_S) -> None:
    """Bind, retrying EADDRINUSE on an explicit port until ``retry_s`` passes."""
    deadline = time.monotonic() + retry_s
    delay_s = 0.005
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as err:
            if err.errno != zmq.EADDRINUSE or time.monotonic() + delay_s > deadline:
                raise
            logger.debug("kv publisher: %s busy, retrying bind", endpoint)
            time.sleep(delay_s)
            delay_s = min(delay_s * 2, 0.2)

