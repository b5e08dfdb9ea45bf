"""Fold subscriber items and recorded batches into the index, with worker lifecycle.

The index only knows how to apply a batch atomically; this module decides what
to do when the stream is not clean, and says per worker whether its index
state can be trusted for routing.

States (DESIGN §5, STYLE §7):

``live``
    Every batch since the worker's last known-empty point (start, restart or
    ``AllBlocksCleared``) has been applied. Its blocks are scored.
``resyncing``
    Events were lost. Its entries were dropped, and the index may still miss
    blocks the worker holds (children of lost blocks are rejected until they
    are evicted or stored again). It is *cold*: the router scores it 0 and
    routes to it by load only. Later batches are still applied (to the
    cleared state), so its entries rebuild in the background.
``stale``
    Set from outside (:meth:`IndexIngestor.mark_stale`), e.g. by the server
    when a publisher has been silent for too long. Entries are kept but not
    trusted (cold). The next cleanly applied batch, or :meth:`mark_live`, makes
    it live again: the subscriber reports a gap (ResyncNeeded) before any batch
    that follows lost ones, so a clean batch proves nothing was lost.

Transitions:

* ``PublisherRestarted`` (or a seq going backwards in a log): clear the worker,
  count a restart, state ``live`` — a restarted engine starts with an empty
  cache, so the cleared index is exact again.
* ``ResyncNeeded`` (or a seq gap in a log): clear, count a resync, ``resyncing``.
* A batch that raises :class:`~tokenspeed_router.errors.UnknownParentError`
  (a lost event the seq did not reveal): the index applied nothing. Because the
  rejected batch may hold ``BlockRemoved`` events, keeping the old entries
  could claim blocks the worker no longer has, so the worker's entries are
  dropped, it goes ``resyncing``, and the batch is then salvaged event by event
  into the cleared state (events whose parent is known apply, the rest are
  counted as rejected).
* ``resyncing`` -> ``live``: at an ``AllBlocksCleared`` for all media (the
  index is exact from that point), or after ``recovery_batches`` consecutive
  batches that store blocks and apply without an unknown parent (the worker's
  cache has turned over enough that new content chains from known blocks; a
  worker that dumps its cache as BlockStored events from the root recovers
  this way too).

Decoding errors never reach this module (the subscriber drops bad frames).
Single owner, like the index: not thread safe. O(events) per batch.

The raw path: when the index has ``apply_raw`` (the native core), a live
batch is first offered undecoded (``BatchReceived.payload``): the common
case is applied in C without a Python object per block and without the GIL,
and everything else (another block grid, LoRA, a first batch, ...) comes
back untouched and takes the typed path below. The two are the same
semantics (tests/property/test_raw_ingest.py): same counters, same state
transitions, same salvage of a refused batch.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenspeed_router.errors import IndexConsistencyError, WireError
from tokenspeed_router.events.codec import only_unknown_events
from tokenspeed_router.events.schema import AllBlocksCleared, BlockStored, KVEventBatch
from tokenspeed_router.events.sequencing import SequenceTracker, VerdictKind
from tokenspeed_router.events.subscriber import (
    RESYNC_SHED,
    BatchReceived,
    PublisherRestarted,
    ResyncNeeded,
    SubscriberItem,
)
from tokenspeed_router.router.index import RawApplied

__all__ = ["IndexIngestor", "IngestTarget", "WorkerState", "WorkerStatus"]

logger = logging.getLogger(__name__)


class WorkerState(str, enum.Enum):
    """Trust in a worker's index state (compares equal to its string value)."""

    LIVE = "live"
    RESYNCING = "resyncing"
    STALE = "stale"


class IngestTarget(Protocol):
    """The part of :class:`~tokenspeed_router.router.index.KvIndex` the ingestor drives."""

    def apply(self, worker: str, batch: KVEventBatch) -> object: ...

    def clear_worker(self, worker: str) -> None: ...

    def remove_worker(self, worker: str) -> None: ...


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """A frozen snapshot of one worker's ingestion state (``GET /workers``).

    ``events_rejected``: events not applied (unknown parent, malformed).
    ``batches_rejected``: batches the index refused as a whole (then salvaged
    event by event). ``lag_s``: receive time minus the publisher's batch
    timestamp for the last batch (meaningful when both are wall-clock seconds;
    None when the batch had no timestamp). ``state_since_s``: the ingestor's
    clock when the current state began.
    """

    state: WorkerState
    last_seq: int | None
    epoch: int
    batches_applied: int
    events_applied: int
    events_rejected: int
    batches_rejected: int
    duplicates: int
    last_batch_ts: float | None
    last_recv_time_s: float | None
    lag_s: float | None
    resyncs: int
    restarts: int
    state_since_s: float
    batches_skipped: int = 0
    """Recorded batches whose events were all of unknown kinds (log replay; the live path
    counts them in the subscriber)."""

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "state": self.state.value,
            "last_seq": self.last_seq,
            "epoch": self.epoch,
            "batches_applied": self.batches_applied,
            "events_applied": self.events_applied,
            "events_rejected": self.events_rejected,
            "batches_rejected": self.batches_rejected,
            "duplicates": self.duplicates,
            "last_batch_ts": self.last_batch_ts,
            "last_recv_time_s": self.last_recv_time_s,
            "lag_s": self.lag_s,
            "resyncs": self.resyncs,
            "restarts": self.restarts,
            "state_since_s": self.state_since_s,
            "batches_skipped": self.batches_skipped,
        }


class _Track:
    __slots__ = (
        "batches_applied",
        "batches_rejected",
        "batches_skipped",
        "clean_batches",
        "duplicates",
        "epoch",
        "events_applied",
        "events_rejected",
        "last_batch_ts",
        "last_recv_time_s",
        "last_seq",
        "restarts",
        "resyncs",
        "state",
        "state_since_s",
        "tracker",
    )

    def __init__(self, now_s: float) -> None:
        self.state = WorkerState.LIVE
        self.state_since_s = now_s
        self.last_seq: int | None = None
        self.epoch = 0
        self.batches_applied = 0
        self.events_applied = 0
        self.events_rejected = 0
        self.batches_rejected = 0
        self.batches_skipped = 0
        self.duplicates = 0
        self.last_batch_ts: float | None = None
        self.last_recv_time_s: float | None = None
        self.resyncs = 0
        self.restarts = 0
        self.clean_batches = 0
        self.tracker: SequenceTracker | None = None  # log replay only


def _clears_everything(event: object) -> bool:
    return isinstance(event, AllBlocksCleared) and event.medium is None


class IndexIngestor:
    """Applies subscriber items (live) or log records (replay) to an index.

    ``recovery_batches``: consecutive clean block-storing batches that bring a
    ``resyncing`` worker back to ``live`` (see the module docstring).
    ``on_state_change(worker, state)`` is called after every state change; the
    server wires it to ``Router.set_cold(worker, state != "live")``.
    ``clock`` only timestamps state changes. ``raw=False`` never offers
    payloads to the index's ``apply_raw`` (the typed path only: the reference
    the raw path is tested against). ``on_applied(worker, stats)`` is called
    after each batch the index applied whole (``stats``: the ``ApplyStats`` of
    ``apply`` or ``apply_raw``) and ``on_cleared(worker)`` after a restart or
    resync dropped the worker's entries; the router's cost model v2 reads
    stores, removals and clears from them (``Router.on_index_applied`` /
    ``on_index_cleared``).
    """

    def __init__(
        self,
        index: IngestTarget,
        *,
        recovery_batches: int = 8,
        clock: Callable[[], float] = time.monotonic,
        on_state_change: Callable[[str, WorkerState], None] | None = None,
        raw: bool = True,
        on_applied: Callable[[str, object], None] | None = None,
        on_cleared: Callable[[str], None] | None = None,
    ) -> None:
        if recovery_batches < 1:
            raise ValueError(f"recovery_batches must be >= 1, got {recovery_batches}")
        self._index = index
        self._recovery_batches = recovery_batches
        self._clock = clock
        self._on_state_change = on_state_change
        self._on_applied = on_applied
        self._on_cleared = on_cleared
        self._tracks: dict[str, _Track] = {}
        self._raw: Callable[..., RawApplied | None] | None = getattr(index, "apply_raw", None) if raw else None
        self._raw_many: Callable[[Sequence[tuple[str, bytes]]], list[RawApplied | Exception | None]] | None = (
            getattr(index, "apply_raw_many", None) if raw else None
        )
        #: live batches applied through the raw path (the rest were decoded)
        self.raw_batches = 0

    # --- input ------------------------------------------------------------------

    def add_worker(self, worker: str) -> None:
        """Start tracking ``worker`` as live (no-op when already tracked)."""
        self._track(worker)

    def on_item(self, item: SubscriberItem) -> None:
        """Fold one subscriber item into the index (items must come in delivery order)."""
        if isinstance(item, BatchReceived):
            t = self._track(item.worker)
            t.epoch = item.epoch
            t.last_seq = item.seq
            if self._raw is not None and item.payload and self._apply_raw(item.worker, t, item):
                return
            self._apply(item.worker, t, item.batch, item.recv_time_s)
        elif isinstance(item, PublisherRestarted):
            t = self._track(item.worker)
            t.epoch = item.epoch
            self._restart(item.worker, t)
        elif isinstance(item, ResyncNeeded):
            t = self._track(item.worker)
            t.epoch = item.epoch
            if item.reason == RESYNC_SHED:
                t.last_seq = item.got_seq - 1  # consumed from the stream, on purpose not applied
            self._resync(
                item.worker, t, f"{item.reason} (expected {item.expected_seq}, got {item.got_seq})"
            )
        else:
            raise TypeError(f"not a subscriber item: {type(item).__name__}")

    def on_items(self, items: Sequence[SubscriberItem]) -> list[tuple[SubscriberItem, Exception]]:
        """Fold ``items`` in delivery order, as :meth:`on_item` one by one would.

        Runs of live batches the raw path may take go to the index in one
        ``apply_raw_many`` call (one GIL-free section for the run, not one per
        batch); whatever a batch needs beyond that (the typed path, a resync
        and a salvage) is done before the next one is tried. An item that
        raises does not stop the others: the pairs ``(item, error)`` are
        returned for the caller to count (``PassApplier`` counts one per item).
        """
        failed: list[tuple[SubscriberItem, Exception]] = []
        n = len(items)
        i = 0
        while i < n:
            item = items[i]
            run_end = i
            if self._raw_many is not None:
                while run_end < n:
                    nxt = items[run_end]
                    if not (isinstance(nxt, BatchReceived) and nxt.payload):
                        break
                    run_end += 1
            if run_end - i < 2:  # nothing to gain from a run of one
                try:
                    self.on_item(item)
                except Exception as err:
                    failed.append((item, err))
                i += 1
                continue
            i = self._apply_run(items, i, run_end, failed)
        return failed

    def _apply_run(
        self, items: Sequence[SubscriberItem], start: int, end: int, failed: list[tuple[SubscriberItem, Exception]]
    ) -> int:
        """``items[start:end]`` (live batches with payloads) through ``apply_raw_many``;
        returns the index of the first item not folded yet."""
        assert self._raw_many is not None
        run = items[start:end]
        try:
            results = self._raw_many([(b.worker, b.payload) for b in run])  # type: ignore[union-attr]
        except Exception:  # raised before applying anything (its contract): take the run one by one
            for item in run:
                try:
                    self.on_item(item)
                except Exception as err:
                    failed.append((item, err))
            return end
        for item, got in zip(run, results, strict=False):
            assert isinstance(item, BatchReceived)
            t = self._track(item.worker)
            t.epoch = item.epoch
            t.last_seq = item.seq
            try:
                if isinstance(got, Exception):  # out of memory: nothing of that batch applied
                    raise got
                if got is None:
                    self._apply(item.worker, t, item.batch, item.recv_time_s)
                else:
                    self.raw_batches += 1
                    self._raw_applied(item.worker, t, item, got)
            except Exception as err:
                failed.append((item, err))
        return start + max(1, len(results))

    def on_record(
        self,
        worker: str,
        seq: int,
        batch: KVEventBatch,
        recv_time_s: float,
        *,
        payload: bytes | None = None,
    ) -> None:
        """Fold one recorded batch (log replay), detecting restarts and gaps by seq.

        A seq going backwards is a publisher restart (clear, live); a jump
        forward is lost batches (clear, resyncing); a repeat is a duplicate
        (skipped). Pass the raw ``payload`` when available: it lets a lower seq
        with identical bytes count as a duplicate rather than a restart. The
        caller decodes and validates ``batch`` (a record that does not decode
        never comes here); one whose events were all of unknown kinds moves
        nothing (counted in ``batches_skipped``), as on the live path.
        """
        t = self._track(worker)
        if t.tracker is None:
            t.tracker = SequenceTracker()
        if only_unknown_events(batch, payload):
            # Nothing to apply is no evidence of a restart or a gap (events/sequencing.py).
            t.tracker.note_filler(seq)
            t.batches_skipped += 1
            return
        verdict = t.tracker.observe(seq, payload)
        if verdict.kind is VerdictKind.DUPLICATE:
            t.duplicates += 1
            return
        t.epoch = t.tracker.epoch
        if verdict.kind is VerdictKind.RESTART:
            self._restart(worker, t)
        elif verdict.kind is VerdictKind.GAP and not verdict.covered:
            self._resync(worker, t, f"seq gap (expected {verdict.expected}, got {seq})")
        t.last_seq = seq
        self._apply(worker, t, batch, recv_time_s)

    # --- lifecycle ----------------------------------------------------------------

    def mark_stale(self, worker: str) -> None:
        """Stop trusting ``worker``'s entries (kept) until it proves alive again."""
        t = self._track(worker)
        if t.state is WorkerState.LIVE:
            self._set_state(worker, t, WorkerState.STALE)

    def mark_live(self, worker: str) -> None:
        """Trust ``worker`` again (operator override, or after an external resync)."""
        t = self._track(worker)
        t.clean_batches = 0
        self._set_state(worker, t, WorkerState.LIVE)

    def remove_worker(self, worker: str) -> None:
        """Forget ``worker`` here and in the index."""
        self._tracks.pop(worker, None)
        self._index.remove_worker(worker)

    # --- queries ------------------------------------------------------------------

    def is_cold(self, worker: str) -> bool:
        """True when the router must not score ``worker``'s blocks (resyncing or stale)."""
        t = self._tracks.get(worker)
        return t is not None and t.state is not WorkerState.LIVE

    def state(self, worker: str) -> WorkerState:
        """The worker's state (KeyError if never seen)."""
        return self._get(worker).state

    def status(self, worker: str) -> WorkerStatus:
        """A snapshot of ``worker``'s counters (KeyError if never seen)."""
        t = self._get(worker)
        lag = None
        if t.last_recv_time_s is not None and t.last_batch_ts:
            lag = t.last_recv_time_s - t.last_batch_ts
        return WorkerStatus(
            state=t.state,
            last_seq=t.last_seq,
            epoch=t.epoch,
            batches_applied=t.batches_applied,
            events_applied=t.events_applied,
            events_rejected=t.events_rejected,
            batches_rejected=t.batches_rejected,
            duplicates=t.duplicates,
            last_batch_ts=t.last_batch_ts,
            last_recv_time_s=t.last_recv_time_s,
            lag_s=lag,
            resyncs=t.resyncs,
            restarts=t.restarts,
            state_since_s=t.state_since_s,
            batches_skipped=t.batches_skipped,
        )

    def statuses(self) -> dict[str, WorkerStatus]:
        """Every tracked worker's status."""
        return {w: self.status(w) for w in self._tracks}

    # --- internals ------------------------------------------------------------------

    def _get(self, worker: str) -> _Track:
        try:
            return self._tracks[worker]
        except KeyError:
            raise KeyError(f"unknown worker {worker!r}") from None

    def _track(self, worker: str) -> _Track:
        t = self._tracks.get(worker)
        if t is None:
            t = self._tracks[worker] = _Track(self._clock())
        return t

    def _set_state(self, worker: str, t: _Track, state: WorkerState) -> None:
        if t.state is state:
            return
        logger.info(
            "worker=%s state %s -> %s epoch=%d", worker, t.state.value, state.value, t.epoch
        )
        t.state = state
        t.state_since_s = self._clock()
        if self._on_state_change is not None:
            self._on_state_change(worker, state)

    def _restart(self, worker: str, t: _Track) -> None:
        self._index.clear_worker(worker)
        if self._on_cleared is not None:
            self._on_cleared(worker)
        t.restarts += 1
        t.clean_batches = 0
        self._set_state(worker, t, WorkerState.LIVE)

    def _resync(self, worker: str, t: _Track, why: str) -> None:
        self._index.clear_worker(worker)
        if self._on_cleared is not None:
            self._on_cleared(worker)
        t.resyncs += 1
        t.clean_batches = 0
        logger.warning("worker=%s resync: %s; its entries were dropped", worker, why)
        self._set_state(worker, t, WorkerState.RESYNCING)

    def _apply(self, worker: str, t: _Track, batch: KVEventBatch, recv_time_s: float) -> None:
        t.last_batch_ts = batch.ts
        t.last_recv_time_s = recv_time_s
        try:
            stats = self._index.apply(worker, batch)
        except IndexConsistencyError as err:
            t.batches_rejected += 1
            if t.state is not WorkerState.RESYNCING:
                self._resync(worker, t, f"batch rejected: {err}")
            self._salvage(worker, t, batch)
            return
        except WireError as err:
            # A malformed event (not a lost one): keep the entries, skip that event.
            t.batches_rejected += 1
            logger.debug("worker=%s malformed batch: %s", worker, err)
            self._salvage(worker, t, batch)
            return
        events = batch.events
        self._applied(
            worker, t, len(events), stats,
            clears=t.state is not WorkerState.LIVE and any(_clears_everything(e) for e in events),
            stores=t.state is not WorkerState.LIVE and any(isinstance(e, BlockStored) for e in events),
        )

    def _apply_raw(self, worker: str, t: _Track, item: BatchReceived) -> bool:
        """The raw path (module docstring): False when the batch must be decoded instead."""
        assert self._raw is not None
        got = self._raw(worker, item.payload)
        if got is None:
            return False
        self.raw_batches += 1
        self._raw_applied(worker, t, item, got)
        return True

    def _raw_applied(self, worker: str, t: _Track, item: BatchReceived, got: RawApplied) -> None:
        """The bookkeeping of a batch the raw path took (applied, or refused whole)."""
        assert self._raw is not None
        t.last_batch_ts = got.ts
        t.last_recv_time_s = item.recv_time_s
        if not got.unknown_parent:
            self._applied(worker, t, got.stats.events, got.stats, clears=got.clears_everything, stores=got.stores)
            return
        t.batches_rejected += 1
        if t.state is not WorkerState.RESYNCING:
            self._resync(worker, t, "batch rejected: a BlockStored's parent is not held")
        salvaged = self._raw(worker, item.payload, salvage=True)
        if salvaged is None:  # cannot be told apart from here: let the typed salvage decide
            self._salvage(worker, t, item.batch)
            return
        t.events_rejected += salvaged.rejected
        t.events_applied += salvaged.stats.events - salvaged.rejected
        t.clean_batches = 0
        if salvaged.last_clear > salvaged.last_reject and t.state is WorkerState.RESYNCING:
            self._set_state(worker, t, WorkerState.LIVE)

    def _applied(self, worker: str, t: _Track, events: int, stats: object, *, clears: bool, stores: bool) -> None:
        """A batch applied whole: count it and move the worker's state (``clears``:
        an AllBlocksCleared of every tier; ``stores``: a BlockStored)."""
        t.batches_applied += 1
        t.events_applied += events
        if self._on_applied is not None:
            self._on_applied(worker, stats)
        if t.state is WorkerState.LIVE:
            return
        if clears:
            t.clean_batches = 0
            self._set_state(worker, t, WorkerState.LIVE)
        elif stores:
            t.clean_batches += 1
            if t.state is WorkerState.STALE or t.clean_batches >= self._recovery_batches:
                t.clean_batches = 0
                self._set_state(worker, t, WorkerState.LIVE)
        elif t.state is WorkerState.STALE:
            self._set_state(worker, t, WorkerState.LIVE)

    def _salvage(self, worker: str, t: _Track, batch: KVEventBatch) -> None:
        """Apply a refused batch one event at a time; count what still fails."""
        last_clear = last_reject = -1
        applied = 0
        for i, event in enumerate(batch.events):
            try:
                self._index.apply(worker, KVEventBatch(batch.ts, [event], batch.data_parallel_rank))
            except (IndexConsistencyError, WireError) as err:
                t.events_rejected += 1
                last_reject = i
                logger.debug("worker=%s event %d rejected: %s", worker, i, err)
                continue
            applied += 1
            if _clears_everything(event):
                last_clear = i
        t.events_applied += applied
        t.clean_batches = 0
        if last_clear > last_reject and t.state is WorkerState.RESYNCING:
            self._set_state(worker, t, WorkerState.LIVE)
