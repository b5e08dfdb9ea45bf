"""EventSubscriber: the router side of one worker's KV event stream (DESIGN §3).

One subscriber follows one publisher (one worker, or one data-parallel rank):
a SUB socket connected to its events endpoint and, when it has one, a DEALER
connected to its replay ROUTER. It turns the raw stream into an ordered list
of :data:`SubscriberItem` s:

* :class:`BatchReceived` for every batch, strictly in sequence order, each
  exactly once (live or replayed);
* :class:`PublisherRestarted` when the sequence goes backwards (engines
  restart from 0 and say nothing else): drop the worker's state, then apply
  the batches that follow. Every delivered batch is fingerprinted, so a seq
  already delivered -- the last one included -- arriving with other bytes is
  a restart too (a new process that published as many batches as the old
  one, or whose first ones the reconnecting SUB lost); with the same bytes it
  is a duplicate;
* :class:`ResyncNeeded` when batches were lost and replay could not bring
  them back: drop the worker's state and treat it as resyncing. A hole is
  never delivered silently.

Gap handling. On a gap (seq above the expected one) the subscriber asks the
replay ROUTER for everything from the expected seq (``[b"", start_seq]``),
holds the live messages that keep arriving, and merges both by seq (a seq
present in both is delivered once; a live copy arriving after the replay is
recognised by its bytes and dropped). Seqs that neither the replay nor the
live stream supplied are lost only if the live stream has already passed
them; a ring that ran ahead of a lagging SUB socket is not a loss, the live
stream still brings those batches. That merge is one pure function
(``replay_merge.merge_replay``: replayed and held messages in, deliveries and
losses out);
why a replay was asked for (:class:`ReplayPurpose`) decides only how its
first hole and an empty answer are read.
Both reply framings are accepted: vLLM/SGLang ``[b"", topic, seq, payload]``
and TokenSpeed ``[b"", seq, payload]``, each with its end marker. Replays are
asynchronous: ``poll``/``process_ready`` never wait for a reply longer than
they were asked to, and a replay that is not answered within
``replay_timeout_s`` counts as failed (the DEALER is then recreated, so a
late answer can never be mistaken for the next one).

Joining. ZeroMQ drops what a PUB sends before the SUB connection is up (the
"slow joiner"), and an idle publisher sends nothing at all. So, with a replay
endpoint, the first ``process_ready`` asks for replay from 0 at once (the
worker's current state arrives without waiting for its next event), and if
the first live seq is still not the next one expected, the gap is replayed
like any other. A join replay nobody answered (the engine still binding its
replay socket, or too busy to answer in time) is asked again while the stream
stays silent, backing off from ``replay_timeout_s`` to 30 s, so an idle worker
does not stay invisible until it next publishes. If the publisher's ring no longer holds seq 0, this is a
fresh subscription to a long-running publisher: batches are delivered from
the oldest one the ring still has, and *no* ResyncNeeded is reported for this
very first connection (the caller starts from an empty view of the worker
anyway, and reporting a resync every time a router starts would make every
worker look broken; blocks whose parents precede the ring surface later as
unknown parents in the index). Without a replay endpoint delivery starts at
the first seq seen. Later gaps are always reported.

Resuming. ``start_seq`` says "I already applied everything before this seq"
(leader failover in the Redis backend): the subscriber replays from there at
once, and reports ResyncNeeded if the ring has moved past it.

Bad input. A frame list that is not ``[topic, 8-byte seq, payload]``, a topic
other than the subscribed one, a payload above ``max_payload_bytes`` or one
the decoder rejects (undecodable, not a batch, an event that does not
validate) is counted by reason (:meth:`statistics`), logged at most once per
reason per interval, and skipped *before* its seq is looked at: whatever seq
it carries, it cannot declare a gap, fake a restart or count as a duplicate.
A well-formed batch whose every event is of a kind we do not know is skipped
too and only noted as a filler seq (``sequencing.py``). Only the batch decoder's :class:`WireError` is
expected there; nothing malformed stops the stream or changes what is
delivered.

Threading: a subscriber and its sockets belong to one thread (zmq sockets are
not thread safe). Limits: a publisher that restarts and whose first batch we
see is at or above our expected seq looks like an in-order batch or a gap, not
a restart (nothing on the wire tells the difference; vLLM-compatible
publishers carry no epoch) -- unless the caller, watching the SUB socket,
calls :meth:`EventSubscriber.connection_reset` when the connection comes
back: the publisher's ring is then replayed from 0 and compared with what was
delivered.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from types import MappingProxyType, TracebackType

import zmq

from tokenspeed_router.events.curve import CurveClientKeys
from tokenspeed_router.events.frame_reader import FrameReader
from tokenspeed_router.events.frames import ipv6_endpoint
from tokenspeed_router.events.items import (
    BatchReceived,
    PublisherRestarted,
    ResyncNeeded,
    SubscriberItem,
    SubscriberStatistics,
)
from tokenspeed_router.events.replay_client import PendingReplay, ReplayClient
from tokenspeed_router.events.replay_merge import (
    RESYNC_NO_REPLAY,
    RESYNC_REPLAY_INCOMPLETE,
    RESYNC_REPLAY_TIMEOUT,
    RESYNC_RING_EXHAUSTED,
    RESYNC_SHED,
    Message,
    ReplayPurpose,
    merge_replay,
)
from tokenspeed_router.events.sequencing import SequenceTracker, VerdictKind
from tokenspeed_router.events.zmq_native import drainer

# The items are defined in events/items.py; they are named here too, where every
# consumer has always imported them from.
__all__ = [
    "RESYNC_NO_REPLAY",
    "RESYNC_REPLAY_INCOMPLETE",
    "RESYNC_REPLAY_TIMEOUT",
    "RESYNC_RING_EXHAUSTED",
    "RESYNC_SHED",
    "BatchReceived",
    "EventSubscriber",
    "PublisherRestarted",
    "ResyncNeeded",
    "SubscriberItem",
    "SubscriberStatistics",
]

logger = logging.getLogger(__name__)

#: Messages handled per process_ready() call: bounds the memory held by one
#: returned list (decoded batches are large) and keeps a group's polling fair.
_MAX_MESSAGES_PER_CALL = 256
#: Messages one shed_backlog() call drops at most (a publisher flooding faster
#: than we can even read must not keep the receiving thread in one call forever).
_MAX_SHED_PER_CALL = 100_000
_TRACKER_WINDOW = 16_384
# A join replay nobody answered is asked again, backing off from replay_timeout_s up to this.
_JOIN_RETRY_MAX_S = 30.0
_EVENTS, _POLLIN, _RCVMORE, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVMORE), int(zmq.NOBLOCK)


class _Fillers:
    """The tracker's filler seqs as a container (``merge_replay`` asks ``seq in fillers``)."""

    __slots__ = ("_tracker",)

    def __init__(self, tracker: SequenceTracker) -> None:
        self._tracker = tracker

    def __contains__(self, seq: object) -> bool:
        return isinstance(seq, int) and self._tracker.is_filler(seq)


class EventSubscriber:
    """Follow one publisher; see the module docstring for the guarantees.

    ``curve`` makes the SUB and replay DEALER sockets CURVE clients of a
    publisher that is a CURVE server (the relay's ``--curve-*``).
    ``monitor_events`` (``zmq.EVENT_*`` flags) attaches a socket monitor
    before the SUB connects, so no connection event is missed (:attr:`monitor`).
    ``native_drain=False`` reads the SUB socket through pyzmq even when the
    compiled drain is available (``events/zmq_native.py``; tests compare the two).

    ``poll(timeout_s)`` waits up to ``timeout_s`` and returns the items ready
    (possibly none); ``process_ready()`` never waits. ``context`` is borrowed
    if given, otherwise created here and terminated by :meth:`close`.
    """

    def __init__(
        self,
        worker: str,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        replay_timeout_s: float = 2.0,
        max_payload_bytes: int = 64 << 20,
        start_seq: int | None = None,
        curve: CurveClientKeys | None = None,
        monitor_events: int = 0,
        native_drain: bool = True,
    ) -> None:
        if replay_timeout_s <= 0:
            raise ValueError(f"replay_timeout_s must be > 0, got {replay_timeout_s}")
        if max_payload_bytes <= 0:
            raise ValueError(f"max_payload_bytes must be > 0, got {max_payload_bytes}")
        if start_seq is not None and start_seq < 0:
            raise ValueError(f"start_seq must be >= 0, got {start_seq}")
        self._worker = worker
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._owns_context = context is None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = context if context is not None else zmq.Context()

        self._sub: zmq.Socket[bytes] = self._ctx.socket(zmq.SUB)
        self._sub.linger = 0
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        if ipv6_endpoint(endpoint):
            self._sub.setsockopt(zmq.IPV6, 1)
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        if curve is not None:
            curve.apply(self._sub)
        # A monitor attached after connect() can miss a quick EVENT_CONNECTED.
        self._monitor: zmq.Socket[bytes] | None = (
            self._sub.get_monitor_socket(monitor_events) if monitor_events else None
        )
        self._sub.connect(endpoint)
        #: the native drain of the SUB socket (None: pyzmq's recv), see _read_live
        self._drain = drainer(self._sub) if native_drain else None
        self._tracker = SequenceTracker(start_seq, window=_TRACKER_WINDOW)
        self._frames = FrameReader(worker, self._topic, max_payload_bytes, self._tracker.note_filler)
        self._replays = ReplayClient(
            worker, replay_endpoint, self._ctx, self._frames, timeout_s=replay_timeout_s, curve=curve
        )

        self._start_seq = start_seq
        self._joined = start_seq is not None
        self._started = False
        self._held: deque[Message] = deque()
        self._closed = False
        self._verify_pending = False
        self._join_retry_at: float | None = None  # time.monotonic() of the next join replay
        self._join_backoff_s = replay_timeout_s

        self._delivered = 0
        self._replayed = 0
        self._duplicates = 0
        self._gaps = 0
        self._resyncs = 0
        self._restarts = 0
        self._shed = 0

    # ----------------------------------------------------------------- public

    @property
    def worker(self) -> str:
        return self._worker

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self._replay_endpoint

    @property
    def monitor(self) -> zmq.Socket[bytes] | None:
        """The SUB socket's monitor (``monitor_events`` given), attached before it connected.

        Read it from the subscriber's thread; :meth:`close` closes it.
        """
        return self._monitor

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The SUB socket, for an external poller (see also :meth:`poll_sockets`)."""
        return self._sub

    @property
    def last_seq(self) -> int | None:
        """Seq of the last delivered batch (None before the first)."""
        return self._tracker.last_seq

    @property
    def epoch(self) -> int:
        """Publisher restarts seen (the epoch of the items being delivered)."""
        return self._tracker.epoch

    def poll_sockets(self) -> list[zmq.Socket[bytes]]:
        """Sockets an external poller must watch (SUB, plus DEALER during a replay)."""
        dealer = self._replays.socket
        return [self._sub] if dealer is None else [self._sub, dealer]

    def timeout_hint_s(self) -> float | None:
        """How long an external poller may wait before calling :meth:`process_ready`.

        0 when work is pending, the time left until the replay deadline
        during a replay, None when only new input matters.
        """
        if self.needs_processing():
            return 0.0
        replay = self._replays.pending
        if replay is not None:
            return max(0.0, replay.deadline - time.monotonic())
        if self._join_retry_at is not None and not self._joined:  # a join replay is due then
            return max(0.0, self._join_retry_at - time.monotonic())
        return None

    def needs_processing(self) -> bool:
        """True when :meth:`process_ready` has work even without new input."""
        if self._closed:
            return False
        if not self._started and self._replay_endpoint is not None:
            return True
        replay = self._replays.pending
        if replay is None:
            return bool(self._held) or self._verify_pending or self._join_retry_due()
        return time.monotonic() >= replay.deadline

    def connection_reset(self) -> None:
        """Say that the SUB connection was re-established (for a caller that
        monitors :attr:`socket`: EVENT_CONNECTED after EVENT_DISCONNECTED).

        The publisher may be a new process whose first batches went out before
        the connection was back; if its first seq seen is above the last one
        delivered, the stream alone cannot show the restart. So, with a replay
        endpoint, the next :meth:`process_ready` replays from the last seq
        delivered (not from 0: a relay whose ring has wrapped answers that
        with its snapshot, under seqs delivered before with other bytes; only
        when nothing comes back from there, as from a new process still below
        that seq, from 0) and compares the batches the publisher holds with
        those delivered under the same seqs: different bytes mean a restart
        (PublisherRestarted, then the new process's batches, replayed from 0); the same bytes (a network blip) or nothing
        to compare change nothing. Without a replay endpoint this is a no-op.
        """
        if self._replay_endpoint is not None and not self._closed:
            self._verify_pending = True

    def poll(self, timeout_s: float) -> list[SubscriberItem]:
        """Wait up to ``timeout_s`` for input, then return what is ready."""
        out = self.process_ready()
        if out or self._closed:
            return out
        hint = self.timeout_hint_s()
        wait_s = timeout_s if hint is None else min(timeout_s, hint)
        poller = zmq.Poller()
        for sock in self.poll_sockets():
            poller.register(sock, zmq.POLLIN)
        poller.poll(max(0, int(wait_s * 1000)))
        return self.process_ready()

    def process_ready(self, max_messages: int = _MAX_MESSAGES_PER_CALL) -> list[SubscriberItem]:
        """Handle what is already received (at most ``max_messages`` live messages read), without waiting."""
        out: list[SubscriberItem] = []
        if self._closed:
            return out
        if not self._started:
            self._started = True
            self._catch_up(out)
        elif self._replays.pending is None and not self._held and self._join_retry_due():
            self._join_retry_at = None
            self._start_join(out)
        if self._verify_pending and self._replays.pending is None:
            self._verify_pending = False
            last = self._tracker.last_seq
            if self._joined and last is not None:
                self._start_replay(last, ReplayPurpose.VERIFY, None, out)  # see connection_reset
        self._pump_replay(out)
        self._drain_held(out)
        now = time.time()  # one receipt time for what this call reads (microseconds apart)
        parse, held, replays = self._frames.parse_live, self._held, self._replays
        for frames in self._read_live(min(max_messages, _MAX_MESSAGES_PER_CALL)):
            message = parse(frames, now)
            if message is None:
                continue
            if held or replays.pending is not None:
                held.append(message)
                self._drain_held(out)
            else:  # what _drain_held would do with it, without the round trip through the deque
                self._on_live(message, out)
        if self._replays.pending is not None:
            self._pump_replay(out)
            self._drain_held(out)
        return out

    def shed_backlog(self) -> list[SubscriberItem]:
        """Drop the live batches waiting in the SUB socket, unapplied; report them lost.

        For a caller that finds this stream too far behind its publisher to
        catch up (``server/ingest_lag.py``): reading, checking (the native
        scan) and fingerprinting a message costs a few microseconds, decoding
        and applying it tens. Only batches that pass the frame checks are
        dropped (a malformed frame is counted and skipped, as on the normal
        path, and moves nothing). The dropped batches are in order (anything
        else -- a gap, a restart, a duplicate -- stops the drop and takes the
        normal path), so they are remembered as delivered and never replayed, and one ResyncNeeded
        (reason ``RESYNC_SHED``) covers them: the consumer drops the worker's
        entries and treats it as resyncing, exactly as for a loss on the wire.
        Does nothing while a replay is in flight or before the stream joined.
        Returns the items to hand on (the ResyncNeeded, then whatever the
        message that stopped the drop led to).
        """
        out: list[SubscriberItem] = []
        if self._closed or self._replays.pending is not None or not self._joined or self._held:
            return out
        first: int | None = None
        last = -1
        left = _MAX_SHED_PER_CALL
        stopped = False
        while left > 0 and not stopped:
            chunk = self._read_live(min(left, _MAX_MESSAGES_PER_CALL))
            if not chunk:
                break
            left -= len(chunk)
            now = time.time()
            for frames in chunk:
                # Checked like any live frame (the native scan vouches for the common
                # payloads without building objects): a frame that does not decode and
                # validate must not move the sequence state here either -- a bad frame
                # under the next seq would otherwise be "shed" as that batch, and the
                # real batch, arriving after it, taken for a restart.
                message = self._frames.parse_live(frames, now)
                if message is None:
                    continue  # counted and logged by cause (malformed, or a filler)
                if stopped or not self._tracker.advance_if_next(message.seq, message.payload):
                    # this one and the rest of the chunk take the normal path, in order
                    self._held.append(message)
                    stopped = True
                    continue
                self._shed += 1
                if first is None:
                    first = message.seq
                last = message.seq
        if first is not None:
            self._resync(out, first, last + 1, RESYNC_SHED)
        self._drain_held(out)
        return out

    def statistics(self) -> SubscriberStatistics:
        return SubscriberStatistics(
            worker=self._worker,
            received=self._frames.received,
            delivered=self._delivered,
            replayed=self._replayed,
            duplicates=self._duplicates,
            malformed=MappingProxyType(dict(self._frames.malformed)),
            gaps=self._gaps,
            replay_requests=self._replays.requests,
            replay_timeouts=self._replays.timeouts,
            resyncs=self._resyncs,
            restarts=self._restarts,
            last_seq=self._tracker.last_seq,
            epoch=self._tracker.epoch,
            replaying=self._replays.pending is not None,
            held=len(self._held),
            last_recv_time_s=self._frames.last_recv_time_s,
            shed=self._shed,
        )

    def close(self) -> None:
        """Close the sockets (idempotent); terminate the context if we created it."""
        if self._closed:
            return
        self._closed = True
        if self._monitor is not None:
            try:
                self._sub.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(linger=0)
        self._sub.close(linger=0)
        self._replays.reset()
        if self._owns_context:
            self._ctx.term()

    def __enter__(self) -> EventSubscriber:
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
            f"EventSubscriber(worker={self._worker!r}, endpoint={self._endpoint!r}, "
            f"replay_endpoint={self._replay_endpoint!r})"
        )

    # ------------------------------------------------------------ sequencing

    def _read_live(self, max_messages: int) -> list[list[bytes]]:
        """Up to ``max_messages`` whole messages waiting on the SUB socket, each as its frames.

        One native call when the extension can reach pyzmq's libzmq
        (``events/zmq_native.py``); else pyzmq's ``recv`` unrolled with plain int
        flags, ``EVENTS`` saying whether a message is waiting (``recv_multipart``
        ORs Enum flags per frame and ends every drain by raising ``Again``, whose
        construction alone cost more than reading a message: docs/service.md).
        """
        if self._drain is not None:
            return self._drain(max_messages)
        sock = self._sub
        out: list[list[bytes]] = []
        while len(out) < max_messages and int(sock.getsockopt(_EVENTS)) & _POLLIN:
            frames = [sock.recv(_NOBLOCK)]
            while sock.getsockopt(_RCVMORE):
                frames.append(sock.recv(_NOBLOCK))
            out.append(frames)
        return out

    def _drain_held(self, out: list[SubscriberItem]) -> None:
        while self._replays.pending is None and self._held:
            self._on_live(self._held.popleft(), out)

    def _on_live(self, message: Message, out: list[SubscriberItem]) -> None:
        if not self._joined:
            self._on_first_live(message, out)
            return
        if self._tracker.advance_if_next(message.seq, message.payload):  # the common case, committed
            self._emit(message, out)
            return
        verdict = self._tracker.classify(message.seq, message.payload)  # not IN_ORDER: committed above
        kind = verdict.kind
        if kind is VerdictKind.DUPLICATE:
            self._duplicates += 1
        elif kind is VerdictKind.GAP and verdict.covered and self._replay_endpoint is None:
            self._deliver(message, out)  # only filler seqs were skipped: no loss (sequencing.py)
        elif kind is VerdictKind.GAP:
            self._gaps += 1
            expected = verdict.expected if verdict.expected is not None else message.seq
            self._replay_or_resync(message, expected, ReplayPurpose.GAP, out)
        else:  # RESTART
            self._on_restart(message, verdict.last, verdict.expected, out)

    def _on_first_live(self, message: Message, out: list[SubscriberItem]) -> None:
        """The first message of a stream not joined yet (no catch-up replay answered)."""
        self._joined = True
        self._join_retry_at = None  # the stream itself now says where to start
        if message.seq == 0:
            self._deliver(message, out)
        elif self._replay_endpoint is not None:
            self._held.appendleft(message)
            self._start_replay(0, ReplayPurpose.JOIN, message.seq, out)
        else:
            logger.info(
                "kv subscriber worker=%s: first seq seen is %d and there is no replay "
                "endpoint; starting there", self._worker, message.seq,
            )
            self._tracker.jump_to(message.seq)
            self._deliver(message, out)

    def _replay_or_resync(
        self, message: Message, expected: int, purpose: ReplayPurpose, out: list[SubscriberItem]
    ) -> None:
        """Seqs ``[expected, message.seq)`` are missing: replay them (holding
        ``message``), or without a replay endpoint report them lost and go on."""
        if self._replay_endpoint is not None:
            self._held.appendleft(message)
            self._start_replay(expected, purpose, message.seq, out)
            return
        self._resync(out, expected, message.seq, RESYNC_NO_REPLAY)
        self._tracker.jump_to(message.seq)
        self._deliver(message, out)

    def _on_restart(
        self,
        message: Message,
        last: int | None,
        expected: int | None,
        out: list[SubscriberItem],
    ) -> None:
        self._restarts += 1
        epoch = self._tracker.new_epoch()
        last_seq = last if last is not None else (expected or 1) - 1
        logger.warning(
            "kv subscriber worker=%s: publisher restarted (seq %d after %d), epoch=%d",
            self._worker, message.seq, last_seq, epoch,
        )
        out.append(PublisherRestarted(self._worker, last_seq, message.seq, epoch))
        self._tracker.jump_to(0)
        if message.seq == 0:
            self._deliver(message, out)
        else:
            self._replay_or_resync(message, 0, ReplayPurpose.RESTART, out)

    def _deliver(self, message: Message, out: list[SubscriberItem]) -> None:
        # Every delivered batch (live or replayed) is remembered by fingerprint:
        # a later copy of it (a live message that also came through replay) is a
        # duplicate, while different bytes under a seq already delivered can only
        # come from a restarted publisher reusing the number.
        if not self._tracker.advance_if_next(message.seq, message.payload):
            self._tracker.observe(message.seq, message.payload)
        self._emit(message, out)

    def _emit(self, message: Message, out: list[SubscriberItem]) -> None:
        """Hand on a message the tracker has accepted."""
        self._delivered += 1
        if message.replayed:
            self._replayed += 1
        out.append(
            BatchReceived(
                self._worker, message.seq, message.batch, message.payload, message.topic,
                message.recv_time_s, self._tracker.epoch, message.replayed, message.ts,
            )
        )

    def _resync(self, out: list[SubscriberItem], expected: int, got: int, reason: str) -> None:
        self._resyncs += 1
        self._frames.limiter.log(
            logging.WARNING, ("resync", reason),
            "kv subscriber worker=%s: batches %d..%d lost (%s); worker needs resync",
            self._worker, expected, got - 1, reason,
        )
        out.append(ResyncNeeded(self._worker, expected, got, reason, self._tracker.epoch))

    # --------------------------------------------------------------- replay

    def _catch_up(self, out: list[SubscriberItem]) -> None:
        """First call: fetch what the publisher already holds, without waiting for
        live traffic (an idle worker would otherwise stay invisible until it
        next publishes): from ``start_seq`` when resuming, else from 0."""
        if self._replay_endpoint is None:
            return
        if self._start_seq is not None:
            self._start_replay(self._start_seq, ReplayPurpose.RESUME, None, out)
        else:
            self._start_join(out)

    def _start_join(self, out: list[SubscriberItem]) -> None:
        """Ask for everything from seq 0; live messages are held meanwhile, then merged."""
        self._joined = True
        self._start_replay(0, ReplayPurpose.JOIN, None, out)

    def _join_retry_due(self) -> bool:
        return (
            not self._joined and self._join_retry_at is not None
            and time.monotonic() >= self._join_retry_at
        )

    def _start_replay(
        self, start_seq: int, purpose: ReplayPurpose, target_seq: int | None, out: list[SubscriberItem]
    ) -> None:
        if not self._replays.start(start_seq, purpose, target_seq):
            self._finish_replay(out, RESYNC_REPLAY_TIMEOUT)

    def _pump_replay(self, out: list[SubscriberItem]) -> None:
        outcome = self._replays.pump()
        if outcome == "done":
            self._finish_replay(out, None)
        elif outcome == "timeout":
            self._finish_replay(out, RESYNC_REPLAY_TIMEOUT)

    def _finish_replay(self, out: list[SubscriberItem], failure: str | None) -> None:
        """Merge the replayed batches with the live ones held meanwhile, deliver
        them in seq order, and report whatever neither could supply."""
        replay = self._replays.take()
        if replay.purpose is ReplayPurpose.VERIFY:
            if replay.start_seq > 0 and failure is None and not replay.items:
                # it holds nothing from our last seq on: a new process still below it? compare from 0
                self._start_replay(0, ReplayPurpose.VERIFY, None, out)
                return
            if not self._verified_restart(replay, failure, out):
                return  # same process (or nothing to tell): held messages go the live way
            if replay.start_seq > 0:
                # the new process's batches from 0 (the verify asked from the last seq delivered)
                self._start_replay(0, ReplayPurpose.RESTART, None, out)
                return
        plan = merge_replay(
            replay.start_seq, replay.items, self._held,
            fresh=replay.purpose is ReplayPurpose.JOIN,  # very first connection: old history is no loss
            failure=failure,
            fillers=_Fillers(self._tracker),
        )
        for _ in range(plan.held_consumed):
            self._held.popleft()
        self._duplicates += plan.duplicates
        if replay.purpose is ReplayPurpose.JOIN and not plan.steps:
            # Nothing yet (empty ring, or no answer): the first live seq decides.
            self._joined = False
            self._tracker.reset()
            if failure is not None and replay.target_seq is None and not self._held:
                # Unanswered and the stream is silent: ask again later rather than wait for
                # the worker's next event (an idle worker would stay invisible until then).
                self._join_retry_at = time.monotonic() + self._join_backoff_s
                logger.info("kv subscriber worker=%s: join replay unanswered; asking again in %.1fs",
                            self._worker, self._join_backoff_s)
                self._join_backoff_s = min(2 * self._join_backoff_s, _JOIN_RETRY_MAX_S)
            return
        self._tracker.jump_to(replay.start_seq)
        for step in plan.steps:
            if isinstance(step, Message):
                self._deliver(step, out)
                continue
            if step.reason is None:
                logger.info(
                    "kv subscriber worker=%s: history before seq %d is gone "
                    "(fresh subscription to a running publisher; replay: %s)",
                    self._worker, step.got, failure or "answered",
                )
            else:
                self._resync(out, step.expected, step.got, step.reason)
            self._tracker.jump_to(step.got)

    def _verified_restart(
        self, replay: PendingReplay, failure: str | None, out: list[SubscriberItem]
    ) -> bool:
        """After a reconnect: do the publisher's batches differ from those delivered
        under the same seqs? If so, report the restart and expect seq 0 next."""
        tracker = self._tracker
        last = tracker.last_seq
        if failure is not None or last is None:
            return False
        differ = next(
            (m for m in replay.items if m.seq <= last and tracker.matches(m.seq, m.payload) is False),
            None,
        )
        if differ is None:
            return False
        self._restarts += 1
        first_seq = replay.items[0].seq
        epoch = tracker.new_epoch()
        logger.warning(
            "kv subscriber worker=%s: publisher restarted while disconnected (its seq %d "
            "differs from the one delivered), epoch=%d", self._worker, differ.seq, epoch,
        )
        out.append(PublisherRestarted(self._worker, last, first_seq, epoch))
        tracker.jump_to(0)
        return True
