"""The leader's side of the stream: buffer subscriber items, append them, fenced.

``submit(item)`` is the ingestion seam (``IngestSink``): the server's
ingestion loop hands every subscriber item to it and returns at once; a
writer thread appends buffered entries in batches through the fenced script.

Why a buffer: while Redis is unreachable the leader keeps receiving from the
workers. It holds up to ``buffer_size`` entries and appends them when Redis
answers again. (While Redis answers, a full buffer only means a burst outran
the writer: ``submit`` then waits for room, up to the socket timeout.) Beyond
that it drops, counts what it dropped, and for each
affected worker appends a ``resync`` entry before that worker's next item,
so every replica clears the worker and marks it resyncing instead of
applying batches on top of a hole.

Why a window: entries appended but not yet applied by this replica's own
follower are kept. If Redis then loses the stream (restart without
persistence), the re-seeded generation starts from this replica's snapshot,
and those entries are appended again after it, so no replica loses them;
replicas that had already applied them skip them by position.

Epochs: a subscriber numbers publisher restarts from 0 in each process, so
the stream epoch of a worker is ``base + subscriber epoch``, where ``base``
is the epoch the stream already holds for that worker when this replica took
the lease. Positions therefore keep increasing across leaders.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from itertools import islice

from tokenspeed_router.events.subscriber import (
    BatchReceived,
    PublisherRestarted,
    ResyncNeeded,
    SubscriberItem,
)
from tokenspeed_router.state._client import Backoff, connect, transient_errors
from tokenspeed_router.state.config import RedisStateConfig
from tokenspeed_router.state.stream import (
    EntryMeta,
    FencedError,
    GenerationError,
    StreamAppender,
    encode_meta,
    parse_id,
)

__all__ = ["RESYNC_LEADER_BUFFER_FULL", "LeaderWriter"]

logger = logging.getLogger(__name__)

RESYNC_LEADER_BUFFER_FULL = "state_leader_buffer_full"

_Pending = tuple[str, bytes, bytes]  # worker, meta, payload


def _position_seq(item: SubscriberItem) -> int:
    """The seq an item accounts for up to (see ``stream.entry_position``)."""
    if isinstance(item, BatchReceived):
        return item.seq
    if isinstance(item, PublisherRestarted):
        return item.new_seq - 1
    return item.got_seq - 1


class LeaderWriter:
    """Buffers and appends entries while this replica leads; idle otherwise."""

    def __init__(self, config: RedisStateConfig, *, on_fenced: Callable[[int], None]) -> None:
        self._config = config
        self._on_fenced = on_fenced
        self._client = connect(config)
        self._appender = StreamAppender(self._client, config.keys, config.maxlen)
        self._errors = transient_errors()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._buffer: deque[_Pending] = deque()
        self._window: deque[tuple[str, tuple[int, int], _Pending]] = deque()
        self._fence: int | None = None
        self._generation: str | None = None
        self._accepting = False
        self._base: dict[str, int] = {}
        self._pending_resync: dict[str, tuple[int, int, int]] = {}  # epoch, first, last pos seq
        self._thread: threading.Thread | None = None
        self._in_flight = 0
        # status
        self.appended = 0
        self.dropped = 0
        self.dropped_workers: set[str] = set()
        self.discarded_on_stepdown = 0
        self.ignored_not_leader = 0
        self.window_overflow = 0
        self.connected = True
        self.last_error: str | None = None

    # --------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="state-writer", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._client.close()

    @property
    def fence(self) -> int | None:
        return self._fence

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def prepare(self, fence: int) -> None:
        """We hold the lease with ``fence``; not accepting items until :meth:`activate`."""
        with self._cond:
            self._fence = fence

    def set_fence(self, fence: int) -> None:
        """Re-acquired the lease without anyone in between: keep everything, new token."""
        with self._cond:
            self._fence = fence
            self._cond.notify_all()

    def activate(self, generation: str | None, base_epochs: Mapping[str, int]) -> None:
        """Start accepting items (after the follower caught up to the stream end)."""
        with self._cond:
            self._generation = generation
            self._base = dict(base_epochs)
            self._accepting = True
            self._cond.notify_all()

    def deactivate(self) -> int:
        """Step down: stop accepting and discard what was not appended; return that count.

        Discarding is safe: the next leader resumes each worker from the last
        seq the stream holds, through the workers' replay rings.
        """
        with self._cond:
            discarded = len(self._buffer)
            self._buffer.clear()
            self._window.clear()
            self._pending_resync.clear()
            self._fence = None
            self._generation = None
            self._accepting = False
            self.discarded_on_stepdown += discarded
            self._cond.notify_all()
        return discarded

    def wait_flushed(self, timeout_s: float) -> bool:
        """Block until the buffer is empty (clean shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._buffer or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    # ----------------------------------------------------------------- seeding

    def on_seeded(self, generation: str) -> None:
        """A new generation was seeded from our index: re-append our unconfirmed window first."""
        with self._cond:
            window = [pending for _gen, _sid, pending in self._window]
            self._window.clear()
            self._buffer.extendleft(reversed(window))
            self._generation = generation
            self._cond.notify_all()
        if window:
            logger.info("state leader: re-appending %d unconfirmed entries after re-seed", len(window))

    def on_progress(self, generation: str, last_id: bytes) -> None:
        """Our follower applied up to ``last_id``: those entries need no keeping."""
        applied = parse_id(last_id)
        with self._cond:
            window = self._window
            while window and window[0][0] == generation and window[0][1] <= applied:
                window.popleft()

    # --------------------------------------------------------------- the seam

    def submit(self, item: SubscriberItem) -> None:
        """Queue one subscriber item for the stream (IngestSink; never blocks on Redis)."""
        now = time.time()
        worker = item.worker
        with self._cond:
            if not self._accepting:
                self.ignored_not_leader += 1
                return
            epoch = self._base.get(worker, 0) + item.epoch
            if len(self._buffer) >= self._config.buffer_size and self.connected:
                # Redis answers: a burst (a replay) outran the writer; wait for room
                # (backpressure on the ingestion thread) rather than drop.
                deadline = time.monotonic() + self._config.socket_timeout_s
                while (len(self._buffer) >= self._config.buffer_size and self.connected
                       and self._accepting and time.monotonic() < deadline):
                    self._cond.wait(0.01)
                if not self._accepting:
                    self.ignored_not_leader += 1
                    return
            room = self._config.buffer_size - len(self._buffer)
            if worker in self._pending_resync and room >= 2:
                pending = self._pending_resync.pop(worker)
                if not isinstance(item, PublisherRestarted):  # a restart clears anyway
                    self._buffer.append(_resync_marker(worker, pending, now))
                    room -= 1
            if room <= 0 or worker in self._pending_resync:
                self._drop(worker, epoch, _position_seq(item))
                return
            self._buffer.append(_encode(item, epoch, now))
            self._cond.notify()

    def _flush_pending_resyncs(self) -> None:
        """Queue the resync markers of workers that sent nothing since their drop (lock held)."""
        now = time.time()
        while self._pending_resync and len(self._buffer) < self._config.buffer_size:
            worker, pending = next(iter(self._pending_resync.items()))
            del self._pending_resync[worker]
            self._buffer.append(_resync_marker(worker, pending, now))

    def _drop(self, worker: str, epoch: int, pos_seq: int) -> None:
        if self.dropped == 0 or worker not in self.dropped_workers:
            logger.warning(
                "state leader: buffer full (%d entries, Redis unreachable?); dropping items of "
                "worker=%s, it will be resynced", self._config.buffer_size, worker,
            )
        self.dropped += 1
        self.dropped_workers.add(worker)
        prev = self._pending_resync.get(worker)
        first = prev[1] if prev is not None else pos_seq
        self._pending_resync[worker] = (epoch, first, pos_seq)

    # -------------------------------------------------------------------- loop

    def _run(self) -> None:
        backoff = Backoff(self._config.backoff_min_s, self._config.backoff_max_s, self._stop)
        while True:
            with self._cond:
                while not self._stop.is_set() and not (
                    self._buffer and self._fence is not None and self._generation is not None
                ):
                    self._cond.wait(0.5)
                if self._stop.is_set():
                    return
                chunk = list(islice(self._buffer, self._config.append_batch))
                fence, generation = self._fence, self._generation
                assert fence is not None and generation is not None
                self._in_flight = len(chunk)
            try:
                ids = self._appender.append(fence, generation, [(m, p) for _w, m, p in chunk])
            except self._errors as err:
                self._set_in_flight(0)
                if self.connected:
                    logger.warning("state leader: Redis unreachable (%s); buffering", err)
                self.connected = False
                self.last_error = f"{type(err).__name__}: {err}"
                if backoff.wait():
                    return
                continue
            except GenerationError as err:
                self._set_in_flight(0)
                self.last_error = str(err)
                with self._cond:
                    if self._generation == generation:
                        self._generation = None  # wait for our follower to (re)seed
                logger.warning("state leader: stream generation changed (%s); waiting for seed", err)
                continue
            except FencedError as err:
                self._set_in_flight(0)
                self.last_error = str(err)
                current = err.current
                if current is None:
                    # Fence key gone (Redis lost its data): the lease loop re-acquires.
                    if backoff.wait():
                        return
                    continue
                with self._cond:
                    if self._fence == fence:
                        self._fence = None
                logger.info("state leader: append fenced off (%s)", err)
                self._on_fenced(current)
                continue
            except Exception as err:  # StateBackendError or a bug: keep the entries, retry
                self._set_in_flight(0)
                self.last_error = f"{type(err).__name__}: {err}"
                logger.exception("state leader: append failed")
                if backoff.wait():
                    return
                continue
            self.connected = True
            backoff.reset()
            with self._cond:
                self._in_flight = 0
                if self._fence == fence and self._generation == generation:
                    for _ in chunk:
                        self._buffer.popleft()
                    for stream_id, pending in zip(ids, chunk, strict=True):
                        self._window.append((generation, parse_id(stream_id), pending))
                    overflow = len(self._window) - self._config.buffer_size
                    for _ in range(max(0, overflow)):
                        self._window.popleft()
                        self.window_overflow += 1
                    self.appended += len(chunk)
                    self._flush_pending_resyncs()
                self._cond.notify_all()

    def _set_in_flight(self, value: int) -> None:
        with self._cond:
            self._in_flight = value
            self._cond.notify_all()


def _resync_marker(worker: str, pending: tuple[int, int, int], now: float) -> _Pending:
    """A resync entry covering the dropped positions ``first..last`` of ``worker``."""
    epoch, first, last = pending
    meta = EntryMeta("resync", worker, epoch, last + 1, now, a=first, b=last + 1,
                     reason=RESYNC_LEADER_BUFFER_FULL, leader_time_s=now)
    return worker, encode_meta(meta), b""


def _encode(item: SubscriberItem, epoch: int, now: float) -> _Pending:
    if isinstance(item, BatchReceived):
        meta = EntryMeta("batch", item.worker, epoch, item.seq, item.recv_time_s, item.topic,
                         replayed=item.replayed, leader_time_s=now)
        return item.worker, encode_meta(meta), item.payload
    if isinstance(item, PublisherRestarted):
        meta = EntryMeta("restart", item.worker, epoch, item.new_seq, now, a=item.last_seq,
                         b=item.new_seq, leader_time_s=now)
        return item.worker, encode_meta(meta), b""
    if isinstance(item, ResyncNeeded):
        meta = EntryMeta("resync", item.worker, epoch, item.got_seq, now, a=item.expected_seq,
                         b=item.got_seq, reason=item.reason, leader_time_s=now)
        return item.worker, encode_meta(meta), b""
    raise TypeError(f"not a subscriber item: {type(item).__name__}")
