"""The ingestion thread: owns every subscriber socket and applies what it reads.

One thread reads, sequences and applies: each pass waits on every stream's
socket at once, reads every ready frame of every stream (a pass reads at
most ``queue_capacity`` items), and hands the whole pass to the sink in one
call (``submit_many``: the routing core takes its locks once and the index
applies runs of batches in one native call). There is no queue and no
second thread in between: handing each batch to an applying thread cost
more than applying it (issue 33's profile, docs/service.md). While a pass is
applied the backlog stays in the SUB sockets, where it shows as lag; a
stream more than ``max_lag_s`` behind its publisher sheds its socket backlog
(``server/ingest_lag.py``).

Why a dedicated thread and not the HTTP event loop: receiving and applying
batches (and merging a replay answer, which may hold a whole ring) is CPU
work that would stall every request on the query loop; here it only delays
ingestion, and the index gives the GIL away while it applies. Replays
themselves are asynchronous (the subscribers never wait for a reply), so one
worker's replay does not hold up the others.

The thread is the *only* user of the subscriber sockets (ZeroMQ sockets are
not thread safe), so adding and removing workers at run time goes through a
command queue that this thread drains between passes; callers wait on a
:class:`concurrent.futures.Future`. A command runs between two passes, so
everything read before it was applied.

Staleness without heartbeats (engines send none, and an idle cache publishes
nothing): a ZeroMQ socket monitor on each SUB socket reports when the TCP
connection to the publisher drops and when it comes back. A stream that has
been *disconnected* for ``stale_after_s`` (or never connected since it was
added) is reported to the service as stale; an idle but connected worker
stays live. ``inproc://`` streams have no connection events and never go
stale this way.

A connection is not a working stream: a CURVE client given the wrong server
key connects over TCP every reconnect interval and fails the handshake every
time, so it never looked disconnected for long, and ``/health`` said ``ok``
for minutes while nothing arrived. With libzmq >= 4.3 the monitor (attached
before the socket connects, so nothing is missed) reports the ZMTP/CURVE
handshake, and a stream counts as connected only once its handshake
succeeded. A failed one names its cause (:meth:`IngestLoop.stream_problems`,
shown per worker in ``/workers`` and ``/health``):

* ``EVENT_HANDSHAKE_FAILED_AUTH``: the publisher refused our client key
  (ZAP status 400: not on the relay's allow-list);
* ``EVENT_HANDSHAKE_FAILED_PROTOCOL``: e.g. CURVE on one side only;
* ``EVENT_HANDSHAKE_FAILED_NO_DETAIL``: the publisher dropped the connection
  mid-handshake: what a CURVE server does with a client that holds the wrong
  server key (it cannot open the client's HELLO);
* no handshake within :data:`HANDSHAKE_DEADLINE_S` of connecting: a peer
  that does not speak ZMTP.

A wrong ``topic=`` cannot be seen on the stream itself: the publisher filters
by subscription and sends nothing. So a stream with a ``topic=`` that has
been connected for :data:`TOPIC_PROBE_AFTER_S` without one message gets a
probe: a second SUB socket subscribed to everything, open until its first
message. A message under another topic names the mismatch; one under ours
only means the worker was idle. An idle publisher sends the probe nothing
either, so it costs one idle connection while the stream stays silent, and a
wrong topic on a publisher that never publishes stays unseen ("connected but
silent").
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.events.frames import ipv6_endpoint
from tokenspeed_router.events.subscriber import (
    BatchReceived,
    EventSubscriber,
    SubscriberItem,
    SubscriberStatistics,
)
from tokenspeed_router.events.subscriber_group import SubscriberGroup
from tokenspeed_router.server.config import SubscriberSpec
from tokenspeed_router.server.ingest_lag import ApplyMany, IngestLag, LagStatus, PassApplier

__all__ = ["IngestLoop", "StreamState"]

logger = logging.getLogger(__name__)

#: libzmq >= 4.3 reports handshakes (pyzmq names the events whatever libzmq it runs on)
_HANDSHAKES = zmq.zmq_version_info() >= (4, 3)
_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
) if _HANDSHAKES else 0
_MONITOR_EVENTS = (
    zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
    | _HANDSHAKE_EVENTS
)
#: a TCP connection whose ZMTP handshake has not succeeded this long after it came up is named
HANDSHAKE_DEADLINE_S = 5.0
#: a stream with a topic= silent this long after its handshake gets a probe (module docstring)
TOPIC_PROBE_AFTER_S = 5.0
_POLL_MS = 20
#: a pass that applied something starts the next one no sooner than this after it began
PASS_INTERVAL_S = 0.005
_STALE_CHECK_S = 0.05
#: How long the loop blocks on its command queue while it holds no stream.
_IDLE_WAIT_S = 1.0


@dataclass
class StreamState:
    """One subscribed stream (a worker, or one DP rank of it) as the loop sees it."""

    spec: SubscriberSpec
    subscriber: EventSubscriber
    monitor: zmq.Socket[bytes] | None
    connected: bool = False
    down_since_s: float = field(default_factory=time.monotonic)
    reported_stale: bool = False
    #: the first TCP connection since the last successful handshake (None: none pending)
    handshake_wait_s: float | None = None
    #: why this stream delivers nothing (a failed handshake, a foreign topic); None when fine
    problem: str | None = None
    #: when the stream last handshook or delivered an item (the topic probe's clock)
    quiet_since_s: float | None = None
    #: the all-topics SUB socket of the topic probe, while it runs
    probe: zmq.Socket[bytes] | None = None
    #: a probe saw a message since the stream last handshook or delivered (no second probe)
    probed: bool = False


class IngestLoop:
    """Polls all subscribers and applies every item through ``submit`` (in delivery order).

    Each pass reads at most ``queue_capacity`` items and applies them on this
    thread: through ``submit_many`` in one call when given, else ``submit``
    item by item. ``on_stale(name)`` is called when a stream's endpoint has
    been gone for ``stale_after_s``. ``on_error`` counts items that failed to
    apply. A live batch received more than ``max_lag_s`` after its
    publisher's timestamp (offset-corrected) makes that stream shed its
    socket backlog; a worker whose batches reach the index more than
    ``max_lag_s / 4`` late is reported lagging (:meth:`lag`).
    """

    def __init__(
        self,
        *,
        context: zmq.Context[Any],
        submit: Callable[[SubscriberItem], None],
        on_stale: Callable[[str], None],
        on_error: Callable[[], None],
        stale_after_s: float,
        replay_timeout_s: float,
        max_payload_bytes: int = 64 << 20,
        max_lag_s: float = 1.0,
        queue_capacity: int = 4096,
        submit_many: ApplyMany | None = None,
        pass_interval_s: float = PASS_INTERVAL_S,
    ) -> None:
        if not max_lag_s > 0:
            raise ValueError(f"max_lag_s must be > 0, got {max_lag_s}")
        self._ctx = context
        if queue_capacity < 1:
            raise ValueError(f"queue_capacity must be >= 1, got {queue_capacity}")
        self._lag = IngestLag(lagging_after_s=max_lag_s / 4)
        self._apply = PassApplier(submit, on_error=on_error, apply_many=submit_many)
        self._capacity = queue_capacity
        self._pass_interval_s = pass_interval_s
        #: items read in the pass being applied (what /metrics calls the queue depth)
        self._pending = 0
        self._max_lag_s = max_lag_s
        self._on_stale = on_stale
        self._on_error = on_error
        self._stale_after_s = stale_after_s
        self._replay_timeout_s = replay_timeout_s
        self._max_payload_bytes = max_payload_bytes
        self._streams: dict[str, StreamState] = {}
        self._group = SubscriberGroup()
        self._by_monitor: dict[Any, StreamState] = {}
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_error_log = 0.0
        self._connected_snapshot: dict[str, bool] = {}
        self._problems_snapshot: dict[str, str] = {}
        self._by_probe: dict[Any, StreamState] = {}
        self._stats_snapshot: dict[str, SubscriberStatistics] = {}

    # --- lifecycle (any thread) ---------------------------------------------------

    def start(self, initial: list[SubscriberSpec], timeout_s: float = 10.0) -> None:
        """Start the thread and open the initial streams (errors raise here)."""
        self._thread = threading.Thread(target=self._run, name="tokenspeed-ingest", daemon=True)
        self._thread.start()
        self.call(lambda: self._open_all(initial), timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop polling, close every subscriber; returns when the thread exited (what it read is applied)."""
        self._stop.set()
        self._commands.put((lambda: None, Future()))  # wakes a loop idle on its queue
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.error("ingestion thread did not stop within %.1fs", timeout_s)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def call(self, fn: Callable[[], Any], timeout_s: float = 10.0) -> Any:
        """Run ``fn`` on the ingestion thread (between passes) and return its result."""
        if not self.running:
            raise RuntimeError("ingestion loop is not running")
        fut: Future[Any] = Future()
        self._commands.put((fn, fut))
        return fut.result(timeout_s)

    # --- stream management (ingestion thread only) ----------------------------------

    def open_streams(self, specs: list[SubscriberSpec], start_seqs: Mapping[str, int] | None = None) -> None:
        """Subscribe to each spec (from ``start_seqs[name]`` when given); all or nothing."""
        opened: list[str] = []
        try:
            for spec in specs:
                self._open(spec, (start_seqs or {}).get(spec.name))
                opened.append(spec.name)
        except BaseException:
            for name in opened:
                self.close_stream(name)
            raise

    def close_stream(self, name: str) -> bool:
        state = self._streams.pop(name, None)
        if state is None:
            return False
        # Everything read was applied in its pass (this runs between passes): a removed
        # worker is not re-created by its own late items, a leader stepping down hands all on.
        self._lag.forget(name)
        self._group.remove(name)
        if state.monitor is not None:
            self._by_monitor.pop(state.monitor, None)
        self._close_probe(state)
        state.subscriber.close()  # and its monitor
        self._connected_snapshot.pop(name, None)
        self._problems_snapshot.pop(name, None)
        self._stats_snapshot.pop(name, None)
        logger.info("worker=%s unsubscribed", name)
        return True

    def stream_names(self) -> list[str]:
        return list(self._streams)

    def connected(self) -> dict[str, bool]:
        """Connection state per stream (a copy, safe to read from any thread)."""
        return dict(self._connected_snapshot)

    def stream_problems(self) -> dict[str, str]:
        """Why a stream delivers nothing, per stream that has a named cause (any thread)."""
        return dict(self._problems_snapshot)

    def statistics(self) -> dict[str, SubscriberStatistics]:
        """Each stream's subscriber counters, refreshed by the loop every 50 ms (any thread)."""
        return dict(self._stats_snapshot)

    def lag(self) -> dict[str, LagStatus]:
        """Each stream's ingest lag, queued items and shedding (any thread)."""
        return self._lag.status()

    def queue_stats(self) -> dict[str, float]:
        """Items read and not applied yet (the pass being applied), the most a pass reads, the largest pass."""
        return {
            "depth": float(self._pending),
            "capacity": float(self._capacity),
            "max_depth": float(self._apply.max_pass),
        }

    def _open_all(self, specs: list[SubscriberSpec]) -> None:
        self.open_streams(specs)

    def _probe(self, spec: SubscriberSpec) -> None:
        """Check that ZeroMQ accepts the stream's endpoints before subscribing.

        A throwaway socket tries each ``connect`` and is closed with linger 0
        whatever happens: if the subscriber's own connect failed instead, its
        half-built socket would stay open on the shared context (and block
        ``Context.term`` at shutdown). The check is local (libzmq connects
        asynchronously): an unreachable worker is not an error, only an
        endpoint ZeroMQ cannot use.
        """
        for what, endpoint, kind in (("events", spec.events, zmq.SUB), ("replay", spec.replay, zmq.DEALER)):
            if endpoint is None:
                continue
            probe = self._ctx.socket(kind)
            try:
                probe.setsockopt(zmq.LINGER, 0)
                if ipv6_endpoint(endpoint):
                    probe.setsockopt(zmq.IPV6, 1)
                probe.connect(endpoint)
            except zmq.ZMQError as err:
                raise ConfigError(
                    f"worker {spec.name!r}: cannot connect to its {what} endpoint {endpoint}: {err}"
                ) from None
            finally:
                probe.close(linger=0)

    def _open(self, spec: SubscriberSpec, start_seq: int | None = None) -> None:
        self._probe(spec)
        sub = EventSubscriber(
            spec.name,
            spec.events,
            replay_endpoint=spec.replay,
            topic=spec.topic,
            context=self._ctx,
            replay_timeout_s=self._replay_timeout_s,
            max_payload_bytes=self._max_payload_bytes,
            start_seq=start_seq,
            curve=spec.curve,
            # attached before the SUB connects: the first handshake's outcome is never missed
            monitor_events=0 if spec.events.startswith("inproc://") else _MONITOR_EVENTS,
        )
        monitor = sub.monitor
        # Start optimistic (as a connection that has not failed yet) and let
        # EVENT_CONNECT_RETRIED (sent every reconnect interval while the endpoint is
        # unreachable), EVENT_DISCONNECTED or a failed handshake say otherwise.
        state = StreamState(spec=spec, subscriber=sub, monitor=monitor, connected=True,
                            quiet_since_s=time.monotonic())
        self._streams[spec.name] = state
        self._group.add(sub)
        if monitor is not None:
            self._by_monitor[monitor] = state
        self._connected_snapshot[spec.name] = state.connected
        logger.info("worker=%s subscribed events=%s replay=%s", spec.name, spec.events, spec.replay)

    # --- the loop ----------------------------------------------------------------------

    def _run(self) -> None:
        next_stale_check = 0.0
        try:
            while not self._stop.is_set():
                self._run_commands()
                started = time.monotonic()
                if self._poll_once():
                    # Coalesce: a pass that applied something is followed by a short rest, so
                    # the next one finds several batches waiting rather than one (each pass
                    # costs a poll, a wake-up and cold caches: docs/service.md).
                    rest = self._pass_interval_s - (time.monotonic() - started)
                    if rest > 0:
                        self._stop.wait(rest)
                now = time.monotonic()
                if now >= next_stale_check:
                    next_stale_check = now + _STALE_CHECK_S
                    self._check_stale(now)
                    self._check_handshakes(now)
                    self._stats_snapshot = {n: st.subscriber.statistics() for n, st in self._streams.items()}
        except Exception:
            logger.exception("ingestion loop crashed")
        finally:
            self._run_commands()
            for name in list(self._streams):
                try:
                    self.close_stream(name)
                except Exception:  # closing is best effort at shutdown
                    logger.exception("worker=%s close failed", name)

    def _poll_once(self) -> bool:
        """One pass: wait for any stream, read every ready frame, apply them all, shed the late.
        True when it applied anything."""
        if not self._streams:
            self._idle_wait()
            return False
        items, ready_monitors = self._group.poll_with(
            _POLL_MS / 1000.0,
            watch=self._watched,
            on_error=lambda sub: self._error(f"worker={sub.worker} receive failed"),
            max_items=self._capacity,
        )
        seen: set[str] = set()
        if items:
            behind = self._lag.received(items, self._max_lag_s)
            arrived: set[str] = set()
            for item in items:
                name = item.worker
                seen.add(name)
                # a resync can be the subscriber's own verdict (a replay unanswered): no proof of a link
                if name not in arrived and type(item) is BatchReceived:
                    arrived.add(name)
                    stream = self._streams.get(name)
                    if stream is not None:
                        if not stream.connected:
                            self._set_connected(stream, True)
                        self._delivered(stream)
            self._apply_pass(items)
            for name in behind:
                self._shed(name)
        self._lag.caught_up([name for name in self._streams if name not in seen])  # their sockets were empty
        for sock in ready_monitors:
            monitored = self._by_monitor.get(sock)
            if monitored is not None:
                self._monitor_events(monitored)
            elif (probed := self._by_probe.get(sock)) is not None:
                self._probe_message(probed)
        return bool(items)

    def _apply_pass(self, items: list[SubscriberItem]) -> None:
        """Apply one pass's items (counted as received by the lag), then time their arrival."""
        self._pending = len(items)
        try:
            self._apply(items)
        finally:
            self._pending = 0
            self._lag.applied(items, time.time())

    @property
    def _watched(self) -> list[Any]:
        """The sockets a pass waits on beside the streams': connection monitors, topic probes."""
        return [*self._by_monitor, *self._by_probe]

    def _shed(self, name: str) -> None:
        """``name`` is more than max_lag_s behind: drop its socket backlog (counted)."""
        stream = self._streams.get(name)
        if stream is None:
            return
        before = stream.subscriber.statistics().shed
        out = stream.subscriber.shed_backlog()
        dropped = stream.subscriber.statistics().shed - before
        if dropped:
            self._lag.shed(name, dropped)
            logger.warning(
                "worker=%s more than %.2fs behind its publisher: shed %d queued batches; "
                "it resyncs (cold until consistent)", name, self._max_lag_s, dropped,
            )
        if out:
            self._lag.received(out, float("inf"))
            self._apply_pass(out)

    def _idle_wait(self) -> None:
        """Block on the command queue while no stream is open.

        A zmq poll over no sockets returns at once, so a loop with nothing
        subscribed (a ``--state`` follower) would spin a core. The next thing
        that can change anything here is a command (open a stream, stop),
        and :meth:`stop` enqueues one, so waiting on the queue loses nothing.
        """
        try:
            fn, fut = self._commands.get(timeout=_IDLE_WAIT_S)
        except queue.Empty:
            return
        self._run_one(fn, fut)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            self._run_one(fn, fut)

    @staticmethod
    def _run_one(fn: Callable[[], Any], fut: Future[Any]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as err:
            fut.set_exception(err)

    def _error(self, what: str) -> None:
        self._on_error()
        now = time.monotonic()
        if now - self._last_error_log >= 5.0:  # rate limited: one traceback per 5 s
            self._last_error_log = now
            logger.exception("%s", what)

    def _monitor_events(self, stream: StreamState) -> None:
        assert stream.monitor is not None
        while True:
            try:
                msg = recv_monitor_message(stream.monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            event = msg.get("event")
            if event in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                if not _HANDSHAKES:
                    self._set_connected(stream, True)
                elif stream.handshake_wait_s is None:
                    stream.handshake_wait_s = time.monotonic()  # connected only once it handshakes
            elif _HANDSHAKES and event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                stream.handshake_wait_s = None
                stream.quiet_since_s = time.monotonic()
                if stream.problem is not None and not stream.probed:
                    self._set_problem(stream, None)
                if stream.problem is None:
                    stream.probed = False  # a new connection may be a new publisher: probe it again if silent
                self._set_connected(stream, True)
            elif _HANDSHAKES and event in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                                           zmq.EVENT_HANDSHAKE_FAILED_AUTH):
                self._set_problem(stream, _handshake_failure(stream.spec, int(event), int(msg.get("value", 0))))
            elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CONNECT_RETRIED):
                self._set_connected(stream, False)

    def _set_connected(self, stream: StreamState, connected: bool) -> None:
        if stream.connected == connected:
            return
        stream.connected = connected
        self._connected_snapshot[stream.spec.name] = connected
        if connected:
            stream.reported_stale = False
            logger.info("worker=%s connected to %s", stream.spec.name, stream.spec.events)
            # A reconnection may be a new publisher process whose first batches
            # went out before we were back: let the subscriber verify through replay.
            stream.subscriber.connection_reset()
        else:
            stream.down_since_s = time.monotonic()
            logger.warning("worker=%s not connected to %s (retrying)", stream.spec.name, stream.spec.events)

    def _check_stale(self, now: float) -> None:
        for stream in self._streams.values():
            if stream.connected or stream.reported_stale:
                continue
            if now - stream.down_since_s >= self._stale_after_s:
                stream.reported_stale = True
                logger.warning(
                    "worker=%s stale: endpoint %s unreachable for %.1fs",
                    stream.spec.name, stream.spec.events, now - stream.down_since_s,
                )
                try:
                    self._on_stale(stream.spec.name)
                except Exception:
                    self._error(f"worker={stream.spec.name} mark stale failed")

    # --- handshakes and topics (module docstring) ------------------------------------------

    def _set_problem(self, stream: StreamState, problem: str | None) -> None:
        if stream.problem == problem:
            return
        stream.problem = problem
        name = stream.spec.name
        if problem is None:
            self._problems_snapshot.pop(name, None)
            logger.info("worker=%s stream works again", name)
        else:
            self._problems_snapshot[name] = problem
            logger.warning("worker=%s %s", name, problem)

    def _delivered(self, stream: StreamState) -> None:
        """An item came: the stream works, whatever the probe thought."""
        stream.quiet_since_s = None
        if stream.probed or stream.probe is not None:
            stream.probed = False
            self._close_probe(stream)
        if stream.problem is not None:
            self._set_problem(stream, None)

    def _check_handshakes(self, now: float) -> None:
        for stream in self._streams.values():
            waited = stream.handshake_wait_s
            if waited is not None and now - waited >= HANDSHAKE_DEADLINE_S and stream.problem is None:
                curve = " (or a wrong curve_server_key)" if stream.spec.curve is not None else ""
                self._set_problem(stream, f"connected to {stream.spec.events}, but no ZeroMQ handshake completed "
                                          f"within {HANDSHAKE_DEADLINE_S:g} s: not a ZeroMQ publisher{curve}?")
            quiet = stream.quiet_since_s
            if (stream.spec.topic and stream.connected and waited is None and quiet is not None
                    and not stream.probed and stream.probe is None and now - quiet >= TOPIC_PROBE_AFTER_S):
                self._open_probe(stream)

    def _open_probe(self, stream: StreamState) -> None:
        spec = stream.spec
        probe = self._ctx.socket(zmq.SUB)
        try:
            probe.setsockopt(zmq.LINGER, 0)
            probe.setsockopt(zmq.RCVHWM, 16)
            if ipv6_endpoint(spec.events):
                probe.setsockopt(zmq.IPV6, 1)
            if spec.curve is not None:
                spec.curve.apply(probe)
            probe.setsockopt(zmq.SUBSCRIBE, b"")
            probe.connect(spec.events)
        except zmq.ZMQError:
            probe.close(linger=0)
            self._error(f"worker={spec.name} topic probe failed")
            stream.probed = True  # not again
            return
        stream.probe = probe
        self._by_probe[probe] = stream
        logger.info("worker=%s silent for %.0f s under topic %r: watching which topics %s publishes",
                    spec.name, TOPIC_PROBE_AFTER_S, spec.topic, spec.events)

    def _probe_message(self, stream: StreamState) -> None:
        assert stream.probe is not None
        try:
            frames = stream.probe.recv_multipart(zmq.NOBLOCK)
        except zmq.ZMQError:
            return
        spec = stream.spec
        topic = frames[0] if len(frames) == 3 else b""
        stream.probed = True
        self._close_probe(stream)
        if not topic.startswith(spec.topic.encode()):
            self._set_problem(stream, f"{spec.events} publishes under topic {topic.decode(errors='replace')!r}, "
                                      f"not under the spec's topic={spec.topic!r}: nothing it publishes arrives")
        # else: ours; the stream was only idle, and its own socket receives this message too

    def _close_probe(self, stream: StreamState) -> None:
        if stream.probe is not None:
            self._by_probe.pop(stream.probe, None)
            stream.probe.close(linger=0)
            stream.probe = None


#: libzmq's ZMTP protocol error codes by value (EVENT_HANDSHAKE_FAILED_PROTOCOL's value)
_PROTOCOL_ERRORS = {int(getattr(zmq, n)): n for n in dir(zmq) if n.startswith("PROTOCOL_ERROR_")}


def _handshake_failure(spec: SubscriberSpec, event: int, value: int) -> str:
    """The cause of a failed ZMTP/CURVE handshake with ``spec``'s events endpoint, in words."""
    where = spec.events
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"{where} refused our CURVE client key (ZAP status {value}): add the router's public key "
                "(the .key file of curve_key=) to the relay's --curve-allow")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH):
            side = ("the spec has curve_server_key=/curve_key=, the publisher is not a CURVE server"
                    if spec.curve is not None else "the publisher requires CURVE: give curve_server_key= and "
                    "curve_key= in the worker spec")
            return f"security mechanism mismatch with {where}: {side}"
        return f"ZeroMQ handshake with {where} failed: {_PROTOCOL_ERRORS.get(value, hex(value))}"
    if spec.curve is not None:
        return (f"CURVE handshake with {where} failed: the publisher dropped the connection (what a CURVE "
                "server does to a client holding the wrong server key: check curve_server_key=)")
    return f"ZeroMQ handshake with {where} failed: the peer dropped the connection (is it a ZeroMQ publisher?)"
