"""Shared in-flight work: router replicas see each other's requests and predictions.

Why: each replica counts only the requests *it* routed and remembers only
the prefixes *it* sent, so two gateways splitting traffic both see an idle
worker and pile onto it (sglang#14305, dynamo#7836), and the second one
sends a repeat of a prefix elsewhere before the engine's ``BlockStored``
arrives. With :class:`SharedLoad` every replica's router adds what the other
replicas have in flight on each worker (requests, predicted uncached prefill
tokens, context tokens) and remembers their routes' prefixes as its own
predictions (``router/peer_work.py``): the replicas decide as one router.

What goes through Redis: one message per change, pushed, never polled. A
replica publishes, whenever its load changes (route, prefill done, release,
expiry; coalesced to at most one message per ``load_min_interval_s``) and as
a heartbeat every ``load_refresh_s``: its **per-worker totals** (absolute, not
deltas, so a lost message is repaired by the next one and a replica that
joins late knows everyone after one heartbeat) and the prefix hashes of the
routes it made since its last message. The per-request bookkeeping
(release, first token, ``inflight_timeout_s``) stays in the replica's own
router, which already does it exactly.

Transport (``flight_transport``): Redis **Pub/Sub** by default (one PUBLISH
per message on ``tsr:{cluster}:flight``), or a Redis **Stream**
(``streams``: XADD MAXLEN ~ to ``tsr:{cluster}:flightlog``, XREAD BLOCK).
Measured on loopback, Pub/Sub delivers a little sooner at the median (p99
about the same; docs/benchmarks.md, "In-flight sharing transport") and keeps
nothing in Redis; nothing here needs the stream's history: totals are
absolute and heartbeats repeat them.

Threads: the routing thread reads a cached mapping (:meth:`peers`, swapped
whole, so no lock), sets an event (:meth:`changed`) and appends to deques
(:meth:`routed`, :meth:`take_predictions`): routing never waits on Redis.
``state-load-pub`` publishes; ``state-load-sub`` receives, keeps the view and
expires it.

Dead replica: its messages stop; the receivers drop it once its last message
is ``load_ttl_s`` old (their own monotonic clock: host clocks may disagree).
A clean shutdown publishes a goodbye, and the peers drop it at once.

Redis down: publishes and receives fail, are counted (``sync_errors``) and
logged (rate limited); the view of the peers ages out after ``load_ttl_s``
as above, then the router routes on its local load alone, shown as
``fallback`` (and ``degraded`` in ``/health`` and ``/workers``) until Redis
answers again. Nothing is queued for later: the next message after
recovery carries the current totals.

Requests must be released on the replica that routed them (the gateway does
that by construction); a ``/release`` sent to another replica is answered as
an unknown id there and the routing replica expires the request after
``inflight_timeout_s``.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import msgspec

from tokenspeed_router.percentiles import percentile
from tokenspeed_router.ratelimit import RateLimitedLog
from tokenspeed_router.router.peer_work import PeerEnded, PeerEvent, PeerPrediction, PeerPrefillDone
from tokenspeed_router.router.scoring import WorkerLoad
from tokenspeed_router.state._client import Backoff, connect, transient_errors
from tokenspeed_router.state.config import RedisStateConfig

__all__ = ["SharedLoad", "SharedLoadStatistics"]

logger = logging.getLogger(__name__)

#: Route predictions kept for the next message (and received, for the router)
#: at most: beyond it the oldest are dropped (a prediction only bridges seconds).
_MAX_PREDICTIONS = 4096
#: Receive-latency samples kept for the percentiles in ``/health``.
_LAG_SAMPLES = 2048
#: Approximate length bound of the Streams transport's key.
_STREAM_MAXLEN = 10_000

_UPDATE, _BYE = 0, 1


class _Message(msgspec.Struct, array_like=True):
    """One replica's in-flight state, pushed to the others."""

    replica: str
    boot: int
    """Random per process: a restarted replica with the same id starts its seq anew."""
    seq: int
    kind: int
    sent_s: float
    """Sender's wall clock (receive latency on one host; informative only)."""
    load: dict[str, tuple[int, int, int]]
    """worker -> (requests, pending prefill tokens, context tokens): absolute totals."""
    routes: list[tuple[list[str], list[int]]]
    """(workers, prefix hashes) of the routes made since the last message."""
    flights: list[tuple[int, str, int]] = []
    """This replica's requests since the last message, in order: (kind, request id,
    uncached tokens); kind 0 = routed (the i-th route of ``routes``, in order),
    1 = first token, 2 = ended. A receiver of an older release ignores it."""
    histories: list[bool] = []
    """Per route of ``routes``, in order: whether its prompt carried a session's own history
    (the cost model's share, ``router/cost.py``). Older senders omit it: False."""


_ROUTED, _DONE, _ENDED = 0, 1, 2

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Message)


class FlightTransport(Protocol):
    """Where the messages go: Redis Pub/Sub or a Redis Stream."""

    def publish(self, payload: bytes) -> None: ...

    def receive(self, timeout_s: float) -> list[bytes]:
        """Wait up to ``timeout_s`` for messages; raises Redis's transient errors."""

    def reset(self) -> None:
        """Forget the receiving connection after an error (the next receive reconnects)."""

    def close(self) -> None: ...


class PubSubTransport:
    """PUBLISH / SUBSCRIBE on one channel: fire and forget, delivered in about an RTT."""

    def __init__(self, config: RedisStateConfig) -> None:
        self._channel = config.keys.flight
        self._config = config
        self._pub = connect(config)
        self._sub_client = connect(config, block_ms=int(config.load_refresh_s * 1000) + 100)
        self._sub: Any = None

    def publish(self, payload: bytes) -> None:
        self._pub.publish(self._channel, payload)

    def receive(self, timeout_s: float) -> list[bytes]:
        if self._sub is None:
            sub = self._sub_client.pubsub(ignore_subscribe_messages=True)
            try:
                sub.subscribe(self._channel)
            except BaseException:
                sub.close()
                raise
            self._sub = sub
        out: list[bytes] = []
        msg = self._sub.get_message(timeout=timeout_s)
        while msg is not None:
            if msg.get("type") == "message":
                out.append(msg["data"])
            if len(out) >= 1024:
                break
            msg = self._sub.get_message(timeout=0.0)
        return out

    def reset(self) -> None:
        if self._sub is not None:
            try:
                self._sub.close()
            except Exception:  # the connection is already broken
                pass
            self._sub = None

    def close(self) -> None:
        self.reset()
        self._pub.close()
        self._sub_client.close()


class StreamTransport:
    """XADD MAXLEN ~ / XREAD BLOCK on one stream key: ordered, kept for a while."""

    def __init__(self, config: RedisStateConfig) -> None:
        self._key = config.keys.flight_stream
        self._pub = connect(config)
        self._block_ms = max(1, int(config.load_refresh_s * 1000))
        self._sub = connect(config, block_ms=self._block_ms + 100)
        self._last: bytes | None = None

    def publish(self, payload: bytes) -> None:
        self._pub.xadd(self._key, {b"m": payload}, maxlen=_STREAM_MAXLEN, approximate=True)

    def receive(self, timeout_s: float) -> list[bytes]:
        if self._last is None:
            # from the current end: what came before is history (totals are absolute)
            last: Any = self._sub.xrevrange(self._key, count=1)
            self._last = last[0][0] if last else b"0-0"
        reply: Any = self._sub.xread({self._key: self._last}, count=1024,
                                     block=max(1, int(timeout_s * 1000)))
        out: list[bytes] = []
        for _key, entries in reply or ():
            for entry_id, fields in entries:
                self._last = entry_id
                payload = fields.get(b"m")
                if payload is not None:
                    out.append(payload)
        return out

    def reset(self) -> None:
        self._last = None

    def close(self) -> None:
        self._pub.close()
        self._sub.close()


def make_transport(config: RedisStateConfig) -> FlightTransport:
    if config.flight_transport == "streams":
        return StreamTransport(config)
    return PubSubTransport(config)


@dataclass(frozen=True)
class SharedLoadStatistics:
    """What ``/health`` and ``/metrics`` show about sharing in-flight work."""

    peers: int
    """Other live replicas (a message within ``load_ttl_s``)."""
    peer_requests: int
    """Requests the other replicas have in flight (all workers)."""
    syncs: int
    """Messages published."""
    sync_errors: int
    """Publishes and receives that failed."""
    fallback: bool
    """True while Redis has not answered for ``load_ttl_s``: local view only."""
    age_s: float | None
    """Seconds since Redis last answered (None: never)."""
    last_error: str | None
    transport: str = "pubsub"
    received: int = 0
    """Messages received from other replicas."""
    malformed: int = 0
    """Messages skipped as unreadable (counted, logged)."""
    predictions_sent: int = 0
    predictions_received: int = 0
    lag_p50_ms: float | None = None
    """Publish -> received here, sender's wall clock to ours (meaningful on one host)."""
    lag_p99_ms: float | None = None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class _Peer:
    boot: int
    seq: int
    deadline_s: float
    load: dict[str, tuple[int, int, int]]


class SharedLoad:
    """Publishes this replica's in-flight work and keeps the others' (see the module docstring).

    ``local_load()`` returns this replica's per-worker load; it is called from
    the publishing thread, so it must do its own locking (the router service
    passes a function that holds its lock around ``router.load()``).
    Implements :class:`~tokenspeed_router.router.router.PeerLoad` and
    :class:`~tokenspeed_router.router.peer_work.PeerPredictions`.
    """

    def __init__(
        self,
        config: RedisStateConfig,
        local_load: Callable[[], Mapping[str, Any]],
        *,
        clock: Callable[[], float] = time.monotonic,
        transport: FlightTransport | None = None,
    ) -> None:
        self._config = config
        self._local_load = local_load
        self._clock = clock
        self._errors = transient_errors()
        self._transport = transport if transport is not None else make_transport(config)
        self._boot = random.getrandbits(48)
        self._seq = 0
        self._peers: Mapping[str, WorkerLoad] = {}
        self._view: dict[str, _Peer] = {}  # receiving thread only
        #: (route, flight) to send, in order: a route (workers, hashes) with its flight
        #: (kind 0), or a first token / an end (no route)
        self._outgoing: deque[tuple[tuple[list[str], list[int], bool] | None, tuple[int, str, int]]] = deque(
            maxlen=_MAX_PREDICTIONS)
        self._incoming: deque[PeerEvent] = deque(maxlen=_MAX_PREDICTIONS)
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._last_ok: float | None = None
        #: when each direction last worked (a broken subscription with working
        #: publishes must still end in fallback: the peers' view ages out)
        self._last_pub_ok: float | None = None
        self._last_sub_ok: float | None = None
        self._pub_ok = True
        self._sub_ok = True
        self._fallback = False
        self._syncs = 0
        self._sync_errors = 0
        self._received = 0
        self._malformed = 0
        self._predictions_sent = 0
        self._predictions_received = 0
        self._lags: deque[float] = deque(maxlen=_LAG_SAMPLES)
        self._last_error: str | None = None
        self._limited = RateLimitedLog(logger, 10.0)

    # ------------------------------------------------------------ routing thread

    def peers(self) -> Mapping[str, WorkerLoad]:
        """Other replicas' load per worker, as last received (empty in fallback)."""
        return self._peers

    def changed(self) -> None:
        """This replica's load changed: publish it soon.

        ``is_set`` first: a plain read, where ``set`` takes a lock and notifies;
        between two messages (``load_min_interval_s``) only the first change pays.
        """
        if not self._dirty.is_set():
            self._dirty.set()

    def routed(self, workers: tuple[str, ...], hashes: Sequence[int], request: str = "",
               uncached: int = 0, *, history: bool = False) -> None:
        """A route this replica made: its prefix and prefill go out with the next message."""
        self._outgoing.append(((list(workers), list(hashes), bool(history)), (_ROUTED, request, int(uncached))))
        self.changed()

    def prefill_done(self, request: str) -> None:
        """The first token of one of this replica's requests: its prefill left the queue."""
        self._outgoing.append((None, (_DONE, request, 0)))
        self.changed()

    def ended(self, request: str) -> None:
        """One of this replica's requests finished."""
        self._outgoing.append((None, (_ENDED, request, 0)))
        self.changed()

    def take_predictions(self) -> list[PeerEvent]:
        """The peers' events received since the last call, oldest first."""
        incoming = self._incoming
        out: list[PeerEvent] = []
        while incoming:
            try:
                out.append(incoming.popleft())
            except IndexError:  # emptied meanwhile (one consumer: cannot happen)
                break
        return out

    @property
    def degraded(self) -> bool:
        """True while routing on the local view only (Redis unreachable)."""
        return self._fallback

    # ------------------------------------------------------------ lifecycle

    def start(self) -> SharedLoad:
        """Subscribe and announce this replica (when Redis is up), then run the threads."""
        self._receive_once(0.0)
        self.sync_now()
        for target, name in ((self._run_publish, "state-load-pub"), (self._run_receive, "state-load-sub")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def close(self) -> None:
        """Stop and say goodbye, so the peers stop counting this replica's load at once."""
        self._halt()
        try:
            self._transport.publish(self._message(_BYE, {}, []))
        except self._errors as err:
            logger.info("state: could not announce this replica's exit (%s); its load expires in %.1fs",
                        err, self._config.load_ttl_s)
        self._transport.close()

    def crash(self) -> None:
        """Stop without a goodbye, as a killed process would (tests, fault drills)."""
        self._halt()
        self._transport.close()

    def _halt(self) -> None:
        self._stop.set()
        self._dirty.set()
        for thread in self._threads:
            thread.join(5.0)

    # ------------------------------------------------------------ publishing

    def _message(self, kind: int, load: dict[str, tuple[int, int, int]],
                 routes: list[tuple[list[str], list[int]]], flights: list[tuple[int, str, int]] | None = None,
                 histories: list[bool] | None = None) -> bytes:
        self._seq += 1
        return _encoder.encode(_Message(self._config.replica_id, self._boot, self._seq, kind,
                                        time.time(), load, routes, flights or [], histories or []))

    def sync_now(self) -> bool:
        """Publish this replica's totals and new routes now. False when Redis did not answer."""
        load = {w: (max(0, x.active_requests), max(0, x.pending_prefill_tokens), max(0, x.active_tokens))
                for w, x in self._local_load().items()}
        routes: list[tuple[list[str], list[int]]] = []
        histories: list[bool] = []
        flights: list[tuple[int, str, int]] = []
        outgoing = self._outgoing
        while outgoing and len(flights) < 1024:
            route, flight = outgoing.popleft()
            if route is not None:
                routes.append((route[0], route[1]))
                histories.append(route[2])
            flights.append(flight)
        try:
            self._transport.publish(self._message(_UPDATE, load, routes, flights, histories))
        except self._errors as err:
            self._pub_ok = False
            self._failed(err)
            return False
        self._syncs += 1
        self._predictions_sent += len(routes)
        self._pub_ok = True
        self._last_pub_ok = self._clock()
        self._answered()
        if outgoing:
            self._dirty.set()  # more routes than one message carries
        return True

    def _run_publish(self) -> None:
        cfg = self._config
        backoff = Backoff(cfg.backoff_min_s, cfg.backoff_max_s, self._stop)
        while not self._stop.is_set():
            self._dirty.wait(cfg.load_refresh_s)
            if self._stop.is_set():
                return
            self._dirty.clear()
            try:
                ok = self.sync_now()
            except Exception as err:  # a bug must not end sharing silently
                logger.exception("state: publishing in-flight work crashed")
                self._failed(err)
                ok = False
            if ok:
                backoff.reset()
                if cfg.load_min_interval_s and self._stop.wait(cfg.load_min_interval_s):
                    return
            elif backoff.wait():
                return

    # ------------------------------------------------------------ receiving

    def _run_receive(self) -> None:
        cfg = self._config
        backoff = Backoff(cfg.backoff_min_s, cfg.backoff_max_s, self._stop)
        wait_s = min(cfg.load_refresh_s, cfg.load_ttl_s / 4)
        while not self._stop.is_set():
            try:
                ok = self._receive_once(wait_s)
            except Exception as err:  # a bug must not end sharing silently
                logger.exception("state: receiving in-flight work crashed")
                self._failed(err)
                ok = False
            if ok:
                backoff.reset()
            elif backoff.wait():
                return

    def receive_now(self, wait_s: float = 0.0) -> bool:
        """Take in what the peers sent (waiting up to ``wait_s``), without the threads.

        For drivers on their own clock (the simulator's replicas in
        ``benchmarks/bench_shared_load.py``); ``start`` runs this in a thread.
        False when Redis did not answer.
        """
        return self._receive_once(wait_s)

    def _receive_once(self, wait_s: float) -> bool:
        try:
            payloads = self._transport.receive(wait_s)
        except self._errors as err:
            self._transport.reset()
            self._sub_ok = False
            self._failed(err)
            self._expire()
            return False
        self._sub_ok = True
        self._last_sub_ok = self._clock()
        self._answered()
        changed = False
        now_wall = time.time()
        for payload in payloads:
            changed |= self._apply(payload, now_wall)
        changed |= self._expire()
        if changed:
            self._publish_view()
        return True

    def _apply(self, payload: bytes, now_wall: float) -> bool:
        try:
            msg = _decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            self._malformed += 1
            self._limited.log(logging.WARNING, "malformed", "state: skipped an unreadable in-flight "
                              "message (%s)", err)
            return False
        if msg.replica == self._config.replica_id:
            return False
        self._received += 1
        if msg.kind == _BYE:
            return self._view.pop(msg.replica, None) is not None
        peer = self._view.get(msg.replica)
        if peer is not None and peer.boot == msg.boot and msg.seq <= peer.seq:
            return False  # older than what we hold (a reconnect may reorder)
        self._lags.append(max(0.0, now_wall - msg.sent_s))
        self._view[msg.replica] = _Peer(msg.boot, msg.seq, self._clock() + self._config.load_ttl_s,
                                        msg.load)
        prefix = f"{msg.replica}/{msg.boot:x}/"
        at = self._clock()  # the router applies each event as of its arrival here
        routes = iter(msg.routes)
        histories = iter(msg.histories)
        if not msg.flights:  # a peer of an older release: predictions only
            for workers, hashes in routes:
                self._incoming.append(PeerPrediction(tuple(workers), tuple(hashes), at=at))
        for kind, request, uncached in msg.flights:
            key = prefix + request
            if kind == _ROUTED:
                route = next(routes, None)
                history = bool(next(histories, False))
                if route is not None:
                    self._incoming.append(
                        PeerPrediction(tuple(route[0]), tuple(route[1]), key, max(0, uncached), at, history))
            elif kind == _DONE:
                self._incoming.append(PeerPrefillDone(key, at))
            elif kind == _ENDED:
                self._incoming.append(PeerEnded(key, at))
        self._predictions_received += len(msg.routes)
        return True

    def _expire(self) -> bool:
        now = self._clock()
        dead = [name for name, p in self._view.items() if p.deadline_s <= now]
        for name in dead:
            del self._view[name]
            logger.info("state: replica %s stopped sharing its in-flight work (nothing for %.1fs)",
                        name, self._config.load_ttl_s)
        if dead:
            self._publish_view()
        self._check_fallback()
        return False

    def _publish_view(self) -> None:
        if self._fallback:  # the local view only, until Redis answers both ways
            self._peers = {}
            return
        sums: dict[str, list[int]] = {}
        for p in list(self._view.values()):  # one C-level copy: the other thread may change it
            for worker, (r, q, a) in p.load.items():
                s = sums.setdefault(worker, [0, 0, 0])
                s[0] += r
                s[1] += q
                s[2] += a
        self._peers = {w: WorkerLoad(s[0], s[1], s[2]) for w, s in sums.items()}

    # ------------------------------------------------------------ health

    def _answered(self) -> None:
        self._last_ok = self._clock()
        if self._pub_ok and self._sub_ok:
            if self._fallback or self._last_error is not None:
                logger.warning("state: load sharing back (Redis answers again); %d peer replica(s)",
                               len(self._view))
            was_fallback = self._fallback
            self._fallback = False
            self._last_error = None
            if was_fallback:
                self._publish_view()

    def _failed(self, err: BaseException) -> None:
        self._sync_errors += 1
        self._last_error = f"{type(err).__name__}: {err}"
        if not self._check_fallback():
            self._limited.log(logging.WARNING, "sync", "state: sharing in-flight work failed (%s)",
                              self._last_error)

    def _check_fallback(self) -> bool:
        """Enter fallback once Redis has not answered for ``load_ttl_s``; True when in it."""
        if self._fallback:
            return True
        if self._pub_ok and self._sub_ok:
            return False
        failing = [t for ok, t in ((self._pub_ok, self._last_pub_ok), (self._sub_ok, self._last_sub_ok))
                   if not ok]
        last = None if any(t is None for t in failing) else min(t for t in failing if t is not None)
        age = None if last is None else self._clock() - last
        if age is not None and age < self._config.load_ttl_s:
            return False
        self._fallback = True
        self._peers = {}
        logger.warning("state: Redis unreachable for load sharing (%s): routing on this "
                       "replica's load only until it answers", self._last_error)
        return True

    def statistics(self) -> SharedLoadStatistics:
        peers = self._peers
        lags = sorted(self._lags)
        return SharedLoadStatistics(
            peers=0 if self._fallback else len(self._view),
            peer_requests=sum(p.active_requests for p in peers.values()),
            syncs=self._syncs,
            sync_errors=self._sync_errors,
            fallback=self._fallback,
            age_s=None if self._last_ok is None else round(self._clock() - self._last_ok, 3),
            last_error=self._last_error,
            transport=self._config.flight_transport,
            received=self._received,
            malformed=self._malformed,
            predictions_sent=self._predictions_sent,
            predictions_received=self._predictions_received,
            lag_p50_ms=round(percentile(lags, 50) * 1000, 3) if lags else None,
            lag_p99_ms=round(percentile(lags, 99) * 1000, 3) if lags else None,
        )
