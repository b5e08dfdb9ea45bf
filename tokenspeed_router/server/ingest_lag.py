"""How late each stream's batches are, and applying a pass of them with the failures counted.

The ingestion thread (``server/ingest_loop.py``) reads every ready frame of
every stream, then applies what it read in one call: there is no queue and
no second thread between receiving and applying. The backlog therefore
stays in the SUB sockets while the thread applies, where it shows as *lag*:
the time from a batch's publisher timestamp to its receipt. Past
``max_lag_s`` the thread sheds that stream's socket backlog
(:meth:`EventSubscriber.shed_backlog`): the worker is reported resyncing
(its entries dropped, cold for routing) rather than served ever staler, and
the backlog stays bounded. Queries are never shed; ingest is.

Why one thread (issue 33's profile, docs/service.md): with a queue and an
applying thread of their own, every batch woke the other thread (a futex
wake, a context switch and a GIL hand-over on two busy cores), and the two
threads' Python around the batch cost about five times the batch's own
work. Applied where it is read, a pass of batches costs one call.

Lag is measured against the publisher's clock, corrected for a constant
offset between the hosts: per worker, the smallest receive delay seen in
the last one or two :data:`OFFSET_WINDOW_S` windows is taken as "on time"
(clock offset plus network floor), and only the excess counts. A worker is
``lagging`` (``GET /workers``) while its last applied batch arrived more
than ``lagging_after_s`` late; it clears once its socket is found empty.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tokenspeed_router.events.subscriber import BatchReceived, ResyncNeeded, SubscriberItem

__all__ = ["OFFSET_WINDOW_S", "ApplyMany", "IngestLag", "LagStatus", "PassApplier"]

logger = logging.getLogger(__name__)

#: length of one window of the clock-offset estimate (the minimum over the last one or two)
OFFSET_WINDOW_S = 30.0

#: ``apply_many(items) -> [(item, error), ...]``: apply in order, report the items that failed
ApplyMany = Callable[[Sequence[SubscriberItem]], Sequence[tuple[SubscriberItem, Exception]]]


@dataclass(frozen=True, slots=True)
class LagStatus:
    """One worker's ingest lag, as ``/workers`` and ``/metrics`` report it.

    ``apply_delay_s``: publisher timestamp to applied, for the last live batch
    (offset-corrected, seconds). ``queued``: its items read and not applied yet
    (the pass being applied). ``shed_batches`` / ``sheds``: batches dropped
    unapplied (checked first), and how many times.
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
    """Per-worker lag bookkeeping: written by the ingestion thread a pass at a time, read by
    any thread (:meth:`status`); every method takes the lock once."""

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

    def _excess(self, item: BatchReceived) -> float:
        """Seconds this live batch arrived later than the stream's on-time floor (0 if unknown)."""
        ts = item.batch_ts
        if item.replayed or not ts > 0:
            return 0.0
        delay = item.recv_time_s - ts
        floor = self._get(item.worker).offset.update(delay, item.recv_time_s)
        return max(0.0, delay - floor)

    def received(self, items: Iterable[SubscriberItem], max_lag_s: float) -> set[str]:
        """A pass read ``items`` (not applied yet): count them queued; the workers with a live
        batch more than ``max_lag_s`` behind their on-time floor come back (to shed)."""
        behind: set[str] = set()
        with self._lock:
            for item in items:
                self._get(item.worker).queued += 1
                if type(item) is BatchReceived and self._excess(item) > max_lag_s:
                    behind.add(item.worker)
        return behind

    def applied(self, items: Iterable[SubscriberItem], now: float) -> None:
        """``items`` (counted by :meth:`received`) reached the index at ``now`` (wall clock)."""
        with self._lock:
            for item in items:
                w = self._get(item.worker)
                w.queued -= 1
                if type(item) is BatchReceived and not item.replayed and item.batch_ts > 0:
                    floor = min(w.offset.cur, w.offset.prev)
                    delay = now - item.batch_ts
                    w.apply_delay_s = max(0.0, delay - floor) if floor != float("inf") else max(0.0, delay)
                    w.behind = w.apply_delay_s > self._lagging_after_s

    def shed(self, worker: str, batches: int) -> None:
        with self._lock:
            w = self._get(worker)
            w.shed_batches += batches
            w.sheds += 1

    def caught_up(self, workers: Iterable[str]) -> None:
        """These streams' sockets were empty and nothing of them is pending: they are on time."""
        with self._lock:
            for worker in workers:
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


class PassApplier:
    """Applies one pass of items in order, through ``apply_many`` (one call for the pass) or
    ``apply`` item by item; a failure is counted through ``on_error`` and logged (rate
    limited: one traceback per 5 s), never fatal, and the other items still apply."""

    def __init__(
        self,
        apply: Callable[[SubscriberItem], None],
        *,
        on_error: Callable[[], None],
        apply_many: ApplyMany | None = None,
    ) -> None:
        self._apply = apply
        self._apply_many = apply_many
        self._on_error = on_error
        self._last_error_log = 0.0
        #: items applied so far, and the largest pass
        self.applied = 0
        self.max_pass = 0

    def __call__(self, items: Sequence[SubscriberItem]) -> None:
        if not items:
            return
        self.applied += len(items)
        if len(items) > self.max_pass:
            self.max_pass = len(items)
        if self._apply_many is None:
            for item in items:
                try:
                    self._apply(item)
                except Exception:
                    self._error(item)
            return
        try:
            failed = self._apply_many(items)
        except Exception:  # the call itself broke: nothing tells which items landed
            self._error(items[0])
            return
        for item, err in failed:
            self._error(item, err)

    def _error(self, item: SubscriberItem, err: BaseException | None = None) -> None:
        """Count one failed item; log it (rate limited). ``err``: the error when it was caught
        elsewhere (``apply_many``), else the one being handled."""
        self._on_error()
        now = time.monotonic()
        if now - self._last_error_log >= 5.0:
            self._last_error_log = now
            kind = "resync" if isinstance(item, ResyncNeeded) else type(item).__name__
            logger.error("worker=%s applying a %s failed", item.worker, kind,
                         exc_info=err if err is not None else True)
