"""EventRelay: follow one engine's KV events and republish them (DESIGN §12).

One relay runs beside one engine (one publisher; a data-parallel engine gets
one relay per rank). It is a router-side subscriber and a worker-side
publisher glued by a ring:

* the engine is followed with the router's own
  :class:`~tokenspeed_router.events.subscriber.EventSubscriber` (gaps replayed,
  restarts detected, a socket monitor to verify reconnections), so the relay
  sees exactly what a router would;
* every delivered batch is republished, in order, under the relay's own
  sequence numbers, through :class:`~tokenspeed_router.events.publisher.ZmqEventPublisher`
  (same wire format), and kept in a :class:`~tokenspeed_router.relay.ring.SnapshotRing`
  whose replay answers start with a snapshot when a router asks for more
  than the ring holds;
* an engine restart or an unrecoverable gap is republished as one
  ``AllBlocksCleared`` batch; the engine's state then rebuilds from the
  batches that follow, like a router's would;
* with ``hashes_only``, batches are rewritten by
  :class:`~tokenspeed_router.relay.hashes_only.ContentHasher` before they are
  numbered: no token id is published;
* with CURVE keys, both relay sockets are CURVE servers and only the
  allow-listed router keys may connect (:mod:`tokenspeed_router.events.curve`).

Threads: the relay's own (:meth:`EventRelay.run` or repeated
:meth:`EventRelay.step`) owns the engine subscriber; the publisher's thread
sends and answers replays from the ring; pyzmq's authenticator thread runs
the allow-list. Limits: the relay can only be as complete as what it saw: if
the engine's own ring had already wrapped when the relay started, blocks
stored before that are unknown to it (start the relay with the engine).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from types import TracebackType

import zmq
from zmq.utils.monitor import recv_monitor_message

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.events.codec import WireFormat, encode_batch
from tokenspeed_router.events.curve import CurveAllowList, CurveServerKeys
from tokenspeed_router.events.publisher import ZmqEventPublisher
from tokenspeed_router.events.schema import AllBlocksCleared, KVEventBatch
from tokenspeed_router.events.subscriber import (
    BatchReceived,
    EventSubscriber,
    PublisherRestarted,
    ResyncNeeded,
    SubscriberItem,
)
from tokenspeed_router.relay.hashes_only import ContentHasher, HasherStatistics
from tokenspeed_router.relay.ring import RingStatistics, SnapshotRing

__all__ = ["EventRelay", "RelayConfig", "RelayStatistics"]

logger = logging.getLogger(__name__)

_MONITOR_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


@dataclass(frozen=True, kw_only=True)
class RelayConfig:
    """Everything one relay needs; validated on construction."""

    engine: str
    """The engine's PUB endpoint (we connect)."""
    publish: str
    """Our PUB endpoint (we bind; port 0 or * lets the OS choose)."""
    replay: str
    """Our replay ROUTER endpoint (we bind)."""
    engine_replay: str | None = None
    topic: str = ""
    """Topic of the engine's messages; republished under the same topic. Empty:
    any topic, republished under the one the engine's messages carry."""
    buffer_steps: int = 10_000
    """Batches the relay's ring keeps (older ones live on in the snapshot)."""
    wire_format: WireFormat = "map"
    hashes_only: bool = False
    curve_secret_key: str | None = None
    """The relay's secret certificate file (``NAME.key_secret``)."""
    curve_allow: tuple[str, ...] = ()
    """Public certificate files of the routers allowed to connect."""
    replay_timeout_s: float = 2.0
    snapshot_blocks_per_batch: int = 16_384
    """Blocks per snapshot batch (about 1 MiB with 16-token blocks)."""

    def __post_init__(self) -> None:
        if self.buffer_steps < 1:
            raise ConfigError(f"buffer_steps must be >= 1, got {self.buffer_steps}")
        if self.wire_format not in ("map", "array"):
            raise ConfigError(f"wire_format must be 'map' or 'array', got {self.wire_format!r}")
        if self.snapshot_blocks_per_batch < 1:
            raise ConfigError("snapshot_blocks_per_batch must be >= 1")
        if self.replay_timeout_s <= 0:
            raise ConfigError("replay_timeout_s must be > 0")
        if self.curve_allow and self.curve_secret_key is None:
            raise ConfigError("--curve-allow needs --curve-secret-key (the relay's own key pair)")
        if self.curve_secret_key is not None and not self.curve_allow:
            raise ConfigError(
                "--curve-secret-key needs at least one --curve-allow PUBKEY_FILE "
                "(CURVE without an allow-list would accept any client)"
            )
        if self.publish == self.replay and not self.publish.endswith((":0", ":*")):
            raise ConfigError(f"--publish and --replay must differ ({self.publish})")


@dataclass(frozen=True, slots=True)
class RelayStatistics:
    """A snapshot of the relay's counters (``statistics()``, ``/metrics``)."""

    batches_in: int
    batches_out: int
    events_in: int
    events_out: int
    restarts: int
    """Engine restarts seen (each republished as AllBlocksCleared)."""
    resyncs: int
    """Unrecoverable engine gaps (each republished as AllBlocksCleared)."""
    gaps: int
    """Engine gaps seen (most filled by the engine's replay)."""
    malformed: int
    """Engine messages skipped as malformed."""
    engine_connected: bool
    last_engine_seq: int | None
    """Seq of the last engine batch relayed (published and in the ring)."""
    next_seq: int
    ring: RingStatistics
    curve_allowed: int
    curve_rejected: int
    curve_rejected_keys: int
    hasher: HasherStatistics | None
    publish_errors: int


class EventRelay:
    """One engine in, one relayed stream out (module docstring)."""

    def __init__(
        self, config: RelayConfig, *, context: zmq.Context[zmq.Socket[bytes]] | None = None
    ) -> None:
        self.config = config
        self._closed = False
        self._lock = threading.Lock()  # guards the counters read by statistics()
        self._hasher = ContentHasher() if config.hashes_only else None
        self._connected = False
        self._batches_in = 0
        self._batches_out = 0
        self._events_in = 0
        self._events_out = 0
        self._restarts = 0
        self._resyncs = 0
        self._publish_errors = 0
        self._last_engine_seq: int | None = None
        self._lost_output = False  # a batch could not be published: clear before the next
        self._owns_context = context is None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = context if context is not None else zmq.Context()
        self._allow: CurveAllowList | None = None
        self._publisher: ZmqEventPublisher | None = None
        self._subscriber: EventSubscriber | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        try:
            curve: CurveServerKeys | None = None
            if config.curve_secret_key is not None:
                if not zmq.has("curve"):
                    raise ConfigError("this libzmq was built without CURVE support")
                curve = CurveServerKeys.from_file(config.curve_secret_key)
                self._allow = CurveAllowList.from_files(config.curve_allow)
                self._allow.start(self._ctx)  # the ZAP handler must exist before binding
            self._ring = SnapshotRing(
                config.buffer_steps,
                wire_format=config.wire_format,
                blocks_per_batch=config.snapshot_blocks_per_batch,
            )
            self._publisher = ZmqEventPublisher(
                config.publish,
                replay_endpoint=config.replay,
                topic=config.topic,
                wire_format=config.wire_format,
                buffer_steps=0,  # the ring below answers replays
                context=self._ctx,
                replay_source=self._ring,
                curve=curve,
            )
            self._subscriber = EventSubscriber(
                "engine",
                config.engine,
                replay_endpoint=config.engine_replay,
                topic=config.topic,
                context=self._ctx,
                replay_timeout_s=config.replay_timeout_s,
            )
            if not config.engine.startswith("inproc://"):
                self._monitor = self._subscriber.socket.get_monitor_socket(_MONITOR_EVENTS)
        except BaseException:
            self.close()
            raise
        logger.info(
            "relay engine=%s engine_replay=%s -> publish=%s replay=%s hashes_only=%s curve=%s",
            config.engine, config.engine_replay, self.endpoint, self.replay_endpoint,
            config.hashes_only, self._allow is not None,
        )

    @property
    def endpoint(self) -> str:
        """Our PUB endpoint (OS port resolved)."""
        assert self._publisher is not None
        return self._publisher.endpoint

    @property
    def replay_endpoint(self) -> str:
        assert self._publisher is not None and self._publisher.replay_endpoint is not None
        return self._publisher.replay_endpoint

    def step(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for the engine, relay what arrived; returns batches published."""
        sub = self._subscriber
        assert sub is not None
        if self._monitor is not None:
            self._watch_connection(self._monitor)
        published = 0
        for item in sub.poll(timeout_s):
            published += self._relay(item)
        return published

    def run(self, stop: threading.Event, poll_s: float = 0.05) -> None:
        """Relay until ``stop`` is set (the CLI's loop)."""
        while not stop.is_set():
            self.step(poll_s)

    def statistics(self) -> RelayStatistics:
        sub = self._subscriber
        assert sub is not None and self._publisher is not None
        sub_stats = sub.statistics()
        allow = self._allow
        with self._lock:
            return RelayStatistics(
                batches_in=self._batches_in,
                batches_out=self._batches_out,
                events_in=self._events_in,
                events_out=self._events_out,
                restarts=self._restarts,
                resyncs=self._resyncs,
                gaps=sub_stats.gaps,
                malformed=sub_stats.malformed_total,
                engine_connected=self._connected,
                last_engine_seq=self._last_engine_seq,
                next_seq=self._publisher.statistics().next_seq,
                ring=self._ring.statistics(),
                curve_allowed=allow.allowed if allow is not None else 0,
                curve_rejected=allow.rejected if allow is not None else 0,
                curve_rejected_keys=len(allow.rejected_keys) if allow is not None else 0,
                hasher=self._hasher.statistics() if self._hasher is not None else None,
                publish_errors=self._publish_errors,
            )

    def close(self) -> None:
        """Close everything (idempotent); queued batches are sent first."""
        if self._closed:
            return
        self._closed = True
        if self._monitor is not None and self._subscriber is not None:
            try:
                self._subscriber.socket.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(linger=0)
            self._monitor = None
        if self._subscriber is not None:
            self._subscriber.close()
        if self._publisher is not None:
            self._publisher.close()
        if self._allow is not None:
            self._allow.stop()
        if self._owns_context:
            self._ctx.term()

    def __enter__(self) -> EventRelay:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _relay(self, item: SubscriberItem) -> int:
        if isinstance(item, BatchReceived):
            self._follow_topic(item.topic)
            batch = item.batch
            out = self._hasher.translate(batch) if self._hasher is not None else batch
            published = self._publish(out)
            with self._lock:
                self._batches_in += 1
                self._events_in += len(batch.events)
                self._last_engine_seq = item.seq
            return published
        if isinstance(item, PublisherRestarted):
            logger.warning("relay: engine restarted (seq %d after %d); clearing", item.new_seq, item.last_seq)
            with self._lock:
                self._restarts += 1
        elif isinstance(item, ResyncNeeded):
            logger.warning(
                "relay: engine batches %d..%d lost (%s); clearing",
                item.expected_seq, item.got_seq - 1, item.reason,
            )
            with self._lock:
                self._resyncs += 1
        if self._hasher is not None:
            self._hasher.clear()
        return self._publish(KVEventBatch(time.time(), [AllBlocksCleared()]))

    def _follow_topic(self, topic: bytes) -> None:
        """Republish under the engine's own topic (a router's worker spec names that one)."""
        publisher = self._publisher
        assert publisher is not None
        if self.config.topic or topic == publisher.topic.encode():
            return
        try:
            name = topic.decode()
        except UnicodeDecodeError:
            logger.warning("relay: engine topic %r is not UTF-8; republishing under %r",
                           topic[:64], publisher.topic)
            return
        logger.info("relay: republishing under the engine's topic %r", name)
        publisher.set_topic(name)

    def _publish(self, batch: KVEventBatch) -> int:
        """Number, send and remember ``batch``. If that fails the routers would
        miss it for good, so the next batch is preceded by AllBlocksCleared."""
        if self._lost_output:
            if self._send(KVEventBatch(time.time(), [AllBlocksCleared()])) == 0:
                return 0
            self._lost_output = False
            if batch.events and isinstance(batch.events[0], AllBlocksCleared) and len(batch.events) == 1:
                return 1
        return self._send(batch)

    def _send(self, batch: KVEventBatch) -> int:
        assert self._publisher is not None
        if batch.data_parallel_rank is None:
            batch = KVEventBatch(batch.ts, batch.events, 0)
        payload = encode_batch(batch, self.config.wire_format)
        try:
            seq = self._publisher.publish_encoded(payload)
        except Exception:
            with self._lock:
                self._publish_errors += 1
            self._lost_output = True
            logger.exception("relay: cannot publish a batch; the next one goes after AllBlocksCleared")
            return 0
        self._ring.append(seq, payload, batch)
        with self._lock:
            self._batches_out += 1
            self._events_out += len(batch.events)
        return 1

    def _watch_connection(self, monitor: zmq.Socket[bytes]) -> None:
        """A reconnection may hide an engine restart: let the subscriber verify it."""
        sub = self._subscriber
        assert sub is not None
        while True:
            try:
                msg = recv_monitor_message(monitor, flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # Again included
                return
            event = msg.get("event")
            if event == zmq.EVENT_CONNECTED and not self._connected:
                self._connected = True
                sub.connection_reset()
            elif event == zmq.EVENT_DISCONNECTED:
                self._connected = False
