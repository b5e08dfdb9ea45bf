"""The bounded queue between receiving event batches and applying them, and its lag.

Why two threads and a queue: the receiving thread (``server/ingest_loop.py``)
reads the sockets, sequences the stream and decides what is lost; the
applying thread folds batches into the index, which with the native core
runs without the GIL (``KvIndex.apply_raw``). Decoupled, a burst of events
waits here, counted, instead of in a socket where nobody can see it; and the
HTTP loop competes with at most one Python thread at a time for the GIL.

Back-pressure: the queue holds at most ``capacity`` items. A full queue
makes :meth:`ApplyQueue.put` wait, so the receiving thread stops reading and
the backlog builds up in the SUB sockets -- where it shows as *lag* (the
time from a batch's publisher timestamp to its receipt). Past
``max_lag_s`` the receiving thread sheds that stream's socket backlog
(:meth:`EventSubscriber.shed_backlog`): the worker is reported resyncing (its
entries dropped, cold for routing) rather than served ever staler, and the
backlog stays bounded. Queries are never shed; ingest is.

Lag is measured against the publisher's clock, corrected for a constant
offset between the hosts: per worker, the smallest receive delay seen in
the last one or two :data:`OFFSET_WINDOW_S` windows is taken as "on time"
(clock offset plus network floor), and only the excess counts. A worker is
``lagging`` (``GET /workers``) while its last applied batch arrived more
than ``lagging_after_s`` late, or it has items queued and the oldest is
that late; it clears once the stream is caught up.

Items of one worker are applied in the order received (one FIFO, one
applying thread). ``flush`` waits until everything queued so far is
applied: closing a stream flushes first, so a worker removed at run time is
not re-created by its own late items, and a leader stepping down hands on
everything it received.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenspeed_router.events.subscriber import BatchReceived, ResyncNeeded, SubscriberItem

__all__ = ["OFFSET_WINDOW_S", "ApplyQueue", "IngestLag", "LagStatus"]

logger = logging.getLogger(__name__)

#: length of one window of the clock-offset estimate (the minimum over the last one or two)
OFFSET_WINDOW_S = 30.0
#: items handed to ``apply_many`` at most per call (bounds the time the receiver waits for room)
_DRAIN_MAX = 512

#: ``apply_many(items) -> [(item, error), ...]``: apply in order, report the items that failed
ApplyMany = Callable[[Sequence[SubscriberItem]], Sequence[tuple[SubscriberItem, Exception]]]


@dataclass(frozen=True, slots=True)
class LagStatus:
    """One worker's ingest lag, as ``/workers`` and ``/metrics`` report it.

    ``apply_delay_s``: publisher timestamp to applied, for the last live batch
    (offset-corrected, seconds). ``queued``: its items waiting to be applied.
    ``shed_batches`` / ``sheds``: batches dropped unapplied (checked first), and how many times.
    """

    apply_delay_s: float | None
    queued: int
    lagging: bool
    shed_batches: int
    sheds: int


class _Offset:
    """Minimum receive delay over the current and the previous window."""

    __slots__ = ("cur", "prev", "since")

    def __init__(self, now: float) -> None:
        self.cur = float("inf")
        self.prev = float("inf")
        self.since = now

    def update(self, delay: float, now: float) -> float:
        if now - self.since >= OFFSET_WINDOW_S:
            self.prev, self.cur, self.since = self.cur, float("inf"), now
        if delay < self.cur:
            self.cur = delay
        return min(self.cur, self.prev)


class _Worker:
    __slots__ = ("apply_delay_s", "behind", "offset", "queued", "shed_batches", "sheds")

    def __init__(self, now: float) -> None:
        self.offset = _Offset(now)
        self.apply_delay_s: float | None = None
        self.behind = False
        self.queued = 0
        self.shed_batches = 0
        self.sheds = 0


class IngestLag:
    """Per-worker lag bookkeeping shared by the two threads (all methods lock)."""

    def __init__(self, *, lagging_after_s: float, clock: Callable[[], float] = time.time) -> None:
        self._lagging_after_s = lagging_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._workers: dict[str, _Worker] = {}

    def _get(self, worker: str) -> _Worker:
        w = self._workers.get(worker)
        if w is None:
            w = self._workers[worker] = _Worker(self._clock())
        return w

    def receive_excess(self, item: BatchReceived) -> float:
        """Seconds this live batch arrived later than the stream's on-time floor (0 if unknown)."""
        ts = item.batch_ts
        if item.replayed or not ts > 0:
            return 0.0
        delay = item.recv_time_s - ts
        with self._lock:
            floor = self._get(item.worker).offset.update(delay, item.recv_time_s)
        return max(0.0, delay - floor)

    def queued(self, worker: str, n: int) -> None:
        with self._lock:
            self._get(worker).queued += n

    def applied(self, item: SubscriberItem, now: float) -> None:
        with self._lock:
            w = self._get(item.worker)
            w.queued -= 1
            if isinstance(item, BatchReceived) and not item.replayed and item.batch_ts > 0:
                floor = min(w.offset.cur, w.offset.prev)
                delay = now - item.batch_ts
                w.apply_delay_s = max(0.0, delay - floor) if floor != float("inf") else max(0.0, delay)
                w.behind = w.apply_delay_s > self._lagging_after_s

    def shed(self, worker: str, batches: int) -> None:
        with self._lock:
            w = self._get(worker)
            w.shed_batches += batches
            w.sheds += 1

    def caught_up(self, worker: str) -> None:
        """The stream's socket was empty and nothing of it is queued: it is on time."""
        with self._lock:
            w = self._workers.get(worker)
            if w is not None and w.queued == 0:
                w.behind = False

    def forget(self, worker: str) -> None:
        with self._lock:
            self._workers.pop(worker, None)

    def status(self) -> dict[str, LagStatus]:
        with self._lock:
            return {
                name: LagStatus(
                    apply_delay_s=w.apply_delay_s,
                    queued=w.queued,
                    lagging=w.behind,
                    shed_batches=w.shed_batches,
                    sheds=w.sheds,
                )
                for name, w in self._workers.items()
            }


class ApplyQueue:
    """FIFO of subscriber items, applied by a thread of its own through ``apply``.

    ``apply(item)`` is the ingest sink's ``submit``; an exception there is
    counted through ``on_error`` and logged (rate limited), never fatal.
    With ``apply_many`` the thread takes everything queued (up to 512 items)
    at each wake-up and hands it over in one call, which applies the items
    in order and reports those that failed (counted the same way): one
    wake-up, one lock round and (with the native core) one GIL-free section
    per drain instead of per batch.
    """

    def __init__(
        self,
        apply: Callable[[SubscriberItem], None],
        *,
        capacity: int,
        lag: IngestLag,
        on_error: Callable[[], None],
        clock: Callable[[], float] = time.time,
        apply_many: ApplyMany | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._apply = apply
        self._apply_many = apply_many
        self._capacity = capacity
        self._lag = lag
        self._on_error = on_error
        self._clock = clock
        self._items: deque[SubscriberItem] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._put_total = 0
        self._done_total = 0
        self._thread: threading.Thread | None = None
        self._last_error_log = 0.0
        #: how often and how long the receiving thread waited for room (back-pressure)
        self.full_waits = 0
        self.full_wait_s = 0.0
        self.max_depth = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tokenspeed-apply", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Apply what is queued, then stop the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.error("apply thread did not stop within %.1fs", timeout_s)
            self._thread = None

    @property
    def depth(self) -> int:
        return len(self._items)

    @property
    def capacity(self) -> int:
        return self._capacity

    def put(self, items: list[SubscriberItem]) -> None:
        """Queue ``items`` in order; waits while the queue is full (back-pressure)."""
        if not items:
            return
        counts: dict[str, int] = {}
        for item in items:
            counts[item.worker] = counts.get(item.worker, 0) + 1
        for worker, n in counts.items():
            self._lag.queued(worker, n)
        with self._cond:
            for item in items:
                if len(self._items) >= self._capacity and not self._stop:
                    self._cond.notify_all()  # the applier must know what is already queued
                    t0 = time.monotonic()
                    self.full_waits += 1
                    while len(self._items) >= self._capacity and not self._stop:
                        self._cond.wait(0.05)
                    self.full_wait_s += time.monotonic() - t0
                self._items.append(item)
                self._put_total += 1
            if len(self._items) > self.max_depth:
                self.max_depth = len(self._items)
            self._cond.notify_all()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every item queued before this call is applied (False on timeout)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            target = self._put_total
            while self._done_total < target:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def _run(self) -> None:
        take = _DRAIN_MAX if self._apply_many is not None else 1
        while True:
            with self._cond:
                while not self._items and not self._stop:
                    self._cond.wait()
                if not self._items:
                    return
                queued = self._items
                batch = [queued.popleft() for _ in range(min(take, len(queued)))]
                self._cond.notify_all()  # room for a waiting put
            self._apply_batch(batch)
            now = self._clock()
            for item in batch:
                self._lag.applied(item, now)
            with self._cond:
                self._done_total += len(batch)
                if self._done_total == self._put_total:
                    self._cond.notify_all()  # a flush may be waiting

    def _apply_batch(self, batch: list[SubscriberItem]) -> None:
        if self._apply_many is None:
            for item in batch:
                try:
                    self._apply(item)
                except Exception:
                    self._error(item)
            return
        try:
            failed = self._apply_many(batch)
        except Exception:  # the call itself broke: nothing tells which items landed
            self._error(batch[0])
            return
        for item, err in failed:
            self._error(item, err)

    def _error(self, item: SubscriberItem, err: BaseException | None = None) -> None:
        """Count one failed item; log it (rate limited: one traceback per 5 s). ``err``:
        the error when it was caught elsewhere (``apply_many``), else the one being handled."""
        self._on_error()
        now = time.monotonic()
        if now - self._last_error_log >= 5.0:
            self._last_error_log = now
            kind = "resync" if isinstance(item, ResyncNeeded) else type(item).__name__
            logger.error("worker=%s applying a %s failed", item.worker, kind,
                         exc_info=err if err is not None else True)
