"""Fold subscriber items and recorded batches into the index, with worker lifecycle.

The index only knows how to apply a batch atomically; this module decides what
to do when the stream is not clean, and says per worker whether its index
state can be trusted for routing.

States (DESIGN §5, STYLE §7):

``live``
    Every batch since the worker's last known-empty point (start, restart or
    ``AllBlocksCleared``) has been applied. Its blocks are scored.
``resyncing``
    Events were lost. Its entries were dropped; the index holds only what
    the engine stored since (and what was named from the router's own
    routes, ``router/recovery.py``), so it may miss blocks the worker holds.
    It is *cold*: the router does not score its index entries; it credits
    what it routed there itself since the loss (``Router``'s record, as the
    ``approx`` policy does) and routes on that and load. Later batches are
    still applied, so its entries rebuild in the background, and stores
    under unknown parents are held back as orphans until their chain is
    known (docs/faults.md, "What is trusted when").
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
  dropped, it goes ``resyncing``, and the batch is then taken event by event
  into the cleared state: events whose parent is known apply, stores under an
  unknown parent are held back as orphans (``router/recovery.py``).
* While a worker recovers (from a loss until no orphan is held back and no
  named parent is watched), its batches take the typed path event by event:
  orphans, the removals of their blocks and the stores under named parents
  must be seen one by one. A removal of a block the index does not know drops
  every block the router inferred for that worker (it may have been one).
* ``resyncing`` -> ``live``: at an ``AllBlocksCleared`` for all media (the
  index is exact from that point), or when all of these hold: no orphan is
  held back (every block stored since the loss chains from a known block);
  the last ``recovery_batches`` block-storing batches applied with every
  parent known (or named); and, when the engine's capacity is known
  (``capacity_blocks``, learnt by the router from its removals), the engine
  has stored at least that many blocks since the loss: anything it held
  before the loss and did not use since has been evicted (an LRU cache
  turned over), and what it used since was announced again or named. A
  worker that dumps its cache as BlockStored events from the root recovers
  this way too.

Decoding errors never reach this module (the subscriber drops bad frames).
Single owner, like the index: not thread safe. O(events) per batch.

The raw path: when the index has ``apply_raw`` (the native core), a live
batch is first offered undecoded (``BatchReceived.payload``): the common
case is applied in C without a Python object per block and without the GIL,
and everything else (another block grid, LoRA, a first batch, ...) comes
back untouched and takes the typed path below. The two are the same
semantics (tests/property/test_raw_ingest.py): same counters, same state
transitions, same handling of a refused batch (it is taken again on the typed
path, whose orphans are held back).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tokenspeed_router.errors import IndexConsistencyError, UnknownParentError, WireError
from tokenspeed_router.events.codec import only_unknown_events
from tokenspeed_router.events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
)
from tokenspeed_router.events.sequencing import SequenceTracker, VerdictKind
from tokenspeed_router.events.subscriber import (
    RESYNC_SHED,
    BatchReceived,
    PublisherRestarted,
    ResyncNeeded,
    SubscriberItem,
)
from tokenspeed_router.events.validation import DUMP_CONTENT_KEY
from tokenspeed_router.hashing import root_seed, tokens_to_bytes
from tokenspeed_router.router.index import ApplyStats, RawApplied, lora_key
from tokenspeed_router.router.recovery import OrphanPool, WorkerRecovery, content_store, inferred_id

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
    orphan_blocks: int = 0
    """Blocks held back now: stored under a block the index does not know (router/recovery.py)."""
    adopted_blocks: int = 0
    """Held-back blocks applied once their chain was known."""
    named_parents: int = 0
    """Unknown parents named from the router's own routes."""
    inferred_blocks: int = 0
    """Blocks the index holds now under inferred ids (ancestors of named parents)."""
    inferred_drops: int = 0
    """Times every inferred block was dropped (a removal the index could not place)."""

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
            "orphan_blocks": self.orphan_blocks,
            "adopted_blocks": self.adopted_blocks,
            "named_parents": self.named_parents,
            "inferred_blocks": self.inferred_blocks,
            "inferred_drops": self.inferred_drops,
        }


class _Track:
    __slots__ = (
        "adopted_blocks",
        "aliased_mark",
        "batches_applied",
        "batches_rejected",
        "batches_skipped",
        "clean_batches",
        "duplicates",
        "epoch",
        "events_applied",
        "events_rejected",
        "exact",
        "inferred",
        "inferred_drops",
        "last_batch_ts",
        "last_recv_time_s",
        "last_seq",
        "named_parents",
        "orphans_dropped",
        "recovery",
        "restarts",
        "resyncs",
        "state",
        "state_since_s",
        "tracker",
    )

    def __init__(self, now_s: float) -> None:
        self.state = WorkerState.LIVE
        self.state_since_s = now_s
        #: every batch since a known-empty point (start, restart, clear of every tier) applied
        self.exact = True
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
        #: from a loss until nothing is held back or watched (router/recovery.py)
        self.recovery: WorkerRecovery | None = None
        #: inferred ids the index holds for this worker now (router/recovery.py)
        self.inferred: set[bytes] = set()
        #: the worker's aliased ids when ``inferred`` last changed: more since is a store of an
        #: inferred block's content under an engine id, which would outlive that id's removal
        self.aliased_mark = 0
        self.adopted_blocks = 0
        self.named_parents = 0
        self.inferred_drops = 0
        self.orphans_dropped = 0


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

    Recovery after a loss (``router/recovery.py``): ``name_parent(worker,
    root, block_bytes)`` returns the content ids of the prefix that a block
    with those tokens (u64-LE bytes) extends on ``worker``, from what the
    router routed there (``Router.name_parent``), or None; ``capacity_blocks
    (worker)`` the engine's capacity in blocks when known. Without them,
    orphans are still held back until their parent is stored again, and
    recovery needs no turnover. ``max_orphan_blocks`` bounds the blocks held
    back per worker (the oldest chains go first, and the turnover count starts
    again, since what they held is unknown again).
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
        name_parent: Callable[[str, int, bytes], list[int] | None] | None = None,
        capacity_blocks: Callable[[str], int | None] | None = None,
        max_orphan_blocks: int = 262_144,
    ) -> None:
        if recovery_batches < 1:
            raise ValueError(f"recovery_batches must be >= 1, got {recovery_batches}")
        if max_orphan_blocks < 1:
            raise ValueError(f"max_orphan_blocks must be >= 1, got {max_orphan_blocks}")
        self._name_parent = name_parent
        self._capacity_blocks = capacity_blocks
        self._max_orphan_blocks = max_orphan_blocks
        self._block_size_of: Callable[[str], int | None] | None = getattr(index, "block_size_of", None)
        self._num_blocks: Callable[[str], int] | None = getattr(index, "num_blocks", None)
        self._worker_info: Callable[[str], object] | None = getattr(index, "worker_info", None)
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
            if self._raw is not None and item.payload and t.recovery is None and self._apply_raw(item.worker, t, item):
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
                    if not (isinstance(nxt, BatchReceived) and nxt.payload and self._raw_ok(nxt.worker)):
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

    def is_recovering(self, worker: str) -> bool:
        """True while ``worker`` is ``resyncing`` after lost events (the router bridges it)."""
        t = self._tracks.get(worker)
        return t is not None and t.state is WorkerState.RESYNCING

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
            orphan_blocks=t.recovery.pool.num_blocks if t.recovery is not None else 0,
            adopted_blocks=t.adopted_blocks,
            named_parents=t.named_parents,
            inferred_blocks=len(t.inferred),
            inferred_drops=t.inferred_drops,
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

    def _raw_ok(self, worker: str) -> bool:
        """Whether ``worker``'s batches may take the raw path (not while it recovers)."""
        t = self._tracks.get(worker)
        return t is None or t.recovery is None

    def _restart(self, worker: str, t: _Track) -> None:
        self._index.clear_worker(worker)
        if self._on_cleared is not None:
            self._on_cleared(worker)
        t.restarts += 1
        t.clean_batches = 0
        t.exact = True
        t.recovery = None  # a new engine: nothing it held before is held now
        t.inferred.clear()
        self._set_state(worker, t, WorkerState.LIVE)

    def _resync(self, worker: str, t: _Track, why: str) -> None:
        self._index.clear_worker(worker)
        if self._on_cleared is not None:
            self._on_cleared(worker)
        t.resyncs += 1
        t.clean_batches = 0
        t.exact = False
        t.inferred.clear()
        rec = t.recovery
        if rec is None:
            t.recovery = WorkerRecovery(OrphanPool(max_blocks=self._max_orphan_blocks))
        else:  # another loss: what was held back may have lost its removals; named chains stay true
            t.orphans_dropped += rec.pool.clear()
            rec.stored_since_loss = 0
        logger.warning("worker=%s resync: %s; its entries were dropped", worker, why)
        self._set_state(worker, t, WorkerState.RESYNCING)

    def _apply(self, worker: str, t: _Track, batch: KVEventBatch, recv_time_s: float) -> None:
        t.last_batch_ts = batch.ts
        t.last_recv_time_s = recv_time_s
        if t.recovery is not None:
            self._apply_recovering(worker, t, batch)
            return
        try:
            stats = self._index.apply(worker, batch)
        except IndexConsistencyError as err:
            t.batches_rejected += 1
            self._refused(worker, t, batch, f"batch rejected: {err}")
            return
        except WireError as err:
            # A malformed event (not a lost one): keep the entries, skip that event.
            t.batches_rejected += 1
            logger.debug("worker=%s malformed batch: %s", worker, err)
            self._salvage(worker, t, batch)
            return
        events = batch.events
        watch = t.state is not WorkerState.LIVE or not t.exact
        self._applied(
            worker, t, len(events), stats,
            clears=watch and any(_clears_everything(e) for e in events),
            stores=t.state is not WorkerState.LIVE and any(isinstance(e, BlockStored) for e in events),
        )

    def _refused(self, worker: str, t: _Track, batch: KVEventBatch, why: str) -> None:
        """The index refused a batch whole: a store under a parent it does not know.

        On a worker exact since its last known-empty point, that is a lost event
        the seq did not reveal (and the refused batch may hold removals): its
        entries are dropped (a resync). On one that lost events before, it is
        what the engine kept from then: the batch is taken event by event, its
        orphans held back, and its entries kept (nothing they claim is wrong).
        """
        if t.exact:
            self._resync(worker, t, why)
        else:
            self._incomplete(worker, t, "a store under a block from before a loss")
        self._apply_recovering(worker, t, batch)

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
        t.last_batch_ts = got.ts
        t.last_recv_time_s = item.recv_time_s
        if not got.unknown_parent:
            self._applied(worker, t, got.stats.events, got.stats, clears=got.clears_everything, stores=got.stores)
            return
        t.batches_rejected += 1
        self._refused(worker, t, item.batch, "batch rejected: a BlockStored's parent is not held")

    def _applied(
        self, worker: str, t: _Track, events: int, stats: object, *, clears: bool, stores: bool, clean: bool = True
    ) -> None:
        """A batch applied (``clears``: an AllBlocksCleared of every tier; ``stores``: a
        BlockStored; ``clean``: none of its blocks is held back): count it, drop the
        inferred blocks if a removal could have named one, and move the worker's state."""
        t.batches_applied += 1
        t.events_applied += events
        if t.inferred:
            self._check_inferred(worker, t, stats)
        if self._on_applied is not None:
            self._on_applied(worker, stats)
        if clears:
            t.exact = True
        if t.state is not WorkerState.LIVE:
            self._move_state(worker, t, clears=clears, stores=stores, clean=clean)
        rec = t.recovery
        if rec is not None and t.state is WorkerState.LIVE and rec.settled:
            t.recovery = None

    def _move_state(self, worker: str, t: _Track, *, clears: bool, stores: bool, clean: bool) -> None:
        """A batch applied to a worker that is not live: does it make it live?"""
        if clears:
            t.clean_batches = 0
            self._set_state(worker, t, WorkerState.LIVE)
        elif stores:
            t.clean_batches = t.clean_batches + 1 if clean else 0
            if t.state is WorkerState.STALE or self._recovered(worker, t):
                t.clean_batches = 0
                self._set_state(worker, t, WorkerState.LIVE)
        elif t.state is WorkerState.STALE:
            self._set_state(worker, t, WorkerState.LIVE)

    def _recovered(self, worker: str, t: _Track) -> bool:
        """The ``resyncing`` -> ``live`` rule (module docstring), clears aside."""
        if t.clean_batches < self._recovery_batches:
            return False
        rec = t.recovery
        if rec is None:
            return True
        if rec.pool:
            return False
        capacity = self._capacity_blocks(worker) if self._capacity_blocks is not None else None
        return capacity is None or rec.stored_since_loss >= capacity

    def _salvage(self, worker: str, t: _Track, batch: KVEventBatch) -> None:
        """Apply a batch with a malformed event one event at a time; count what still fails."""
        last_clear = last_reject = -1
        applied = 0
        for i, event in enumerate(batch.events):
            try:
                stats = self._index.apply(worker, KVEventBatch(batch.ts, [event], batch.data_parallel_rank))
            except (IndexConsistencyError, WireError) as err:
                t.events_rejected += 1
                last_reject = i
                logger.debug("worker=%s event %d rejected: %s", worker, i, err)
                continue
            applied += 1
            if t.inferred and _stat_fields(stats)[4]:
                self._drop_inferred(worker, t)
            if _clears_everything(event):
                last_clear = i
        t.events_applied += applied
        t.clean_batches = 0
        if last_clear > last_reject:
            t.exact = True
            if t.state is WorkerState.RESYNCING:
                self._set_state(worker, t, WorkerState.LIVE)

    # --- recovery (router/recovery.py) ------------------------------------------------

    def _apply_recovering(self, worker: str, t: _Track, batch: KVEventBatch) -> None:
        """One batch of a recovering worker, event by event: orphans held back, their
        removals and descendants with them, chains applied once known."""
        rec = t.recovery
        assert rec is not None
        ts, rank = batch.ts, batch.data_parallel_rank
        totals = [0, 0, 0, 0, 0, 0]  # events, stored, duplicate, removed, unknown, cleared
        applied = held = rejected = 0
        stores = clears = False
        for event in batch.events:
            if isinstance(event, BlockStored):
                stores = True
                rec.stored_since_loss += len(event.block_hashes)
                root = rec.pool.root_of(event.parent_block_hash)
                if root is not None:  # under a held-back block: held back with it
                    self._hold(worker, t, rec, event, root)
                    held += 1
                    first = rec.pool.first_store(root)  # routes since may name the root now
                    if first is not None:
                        self._name(worker, t, rec, first, ts, rank, totals)
                    continue
                self._readopt(worker, t, rec, rec.anchor_of(event.parent_block_hash), ts, rank, totals)
                try:
                    self._apply_one(worker, t, event, ts, rank, totals)
                except UnknownParentError:
                    if self._holdable(worker, event):
                        self._hold(worker, t, rec, event, event.parent_block_hash)
                        held += 1
                        self._name(worker, t, rec, event, ts, rank, totals)
                    else:
                        t.events_rejected += 1
                        rejected += 1
                    continue
                except (IndexConsistencyError, WireError) as err:
                    t.events_rejected += 1
                    rejected += 1
                    logger.debug("worker=%s event rejected: %s", worker, err)
                    continue
                applied += 1
                for h in event.block_hashes:  # a block chains were waiting on, stored again
                    if rec.pool.waits_on(h):
                        self._adopt(worker, t, rec, h, ts, rank, totals)
            elif isinstance(event, BlockRemoved):
                rest = rec.pool.split_removal(event)
                if rest is None:
                    held += 1
                    continue
                rec.forget_anchors(rest.block_hashes)
                if not self._try_apply(worker, t, rest, ts, rank, totals):
                    rejected += 1
                    continue
                applied += 1
            else:
                if not self._try_apply(worker, t, event, ts, rank, totals):
                    rejected += 1
                    continue
                applied += 1
                if event.medium is None:
                    clears = True
                    t.orphans_dropped += rec.pool.clear()  # the engine holds none of them now
                    t.inferred.clear()  # the clear dropped them from the index
                elif t.inferred:  # a tier cleared: the inferred blocks may have been on it
                    self._drop_inferred(worker, t)
        if rec.pool and t.state is WorkerState.LIVE:
            # Blocks under a block the index does not know (one it had inferred, or a lost
            # event): what it says is known incomplete. Every event was applied or held in
            # order, so what it holds is still right: no clear, no resync counted.
            self._incomplete(worker, t, "blocks held under unknown parents")
        blocks = self._num_blocks(worker) if self._num_blocks is not None else -1
        stats = ApplyStats(totals[0], totals[1], totals[2], totals[3], totals[4], totals[5], blocks)
        self._applied(
            worker, t, applied, stats, clears=clears, stores=stores,
            clean=held == 0 and not rejected and not rec.pool,
        )

    def _try_apply(
        self, worker: str, t: _Track, event: Event, ts: float, rank: int | None, totals: list[int]
    ) -> bool:
        """:meth:`_apply_one`, counting an event the index refuses instead (False)."""
        try:
            self._apply_one(worker, t, event, ts, rank, totals)
        except (IndexConsistencyError, WireError) as err:
            t.events_rejected += 1
            logger.debug("worker=%s event rejected: %s", worker, err)
            return False
        return True

    def _apply_one(self, worker: str, t: _Track, event: Event, ts: float, rank: int | None, totals: list[int]) -> int:
        """Apply one event to the index; add its stats to ``totals``; returns its unknown removals."""
        stats = self._index.apply(worker, KVEventBatch(ts, [event], rank))
        rec = t.recovery
        if rec is not None and isinstance(event, BlockStored) and not _is_content_store(event):
            rec.stored_under(event.parent_block_hash, event.block_hashes)
        fields = _stat_fields(stats)
        for i, v in enumerate(fields):
            totals[i] += v
        if t.inferred and not (isinstance(event, BlockStored) and _is_content_store(event)):
            self._check_inferred(worker, t, stats)
        return fields[4]

    def _check_inferred(self, worker: str, t: _Track, stats: object) -> None:
        """Drop every inferred block if a removal could have named one (an id the index could
        not place) or a store aliased one (an engine id for an inferred block's content)."""
        fields = _stat_fields(stats)
        if fields[4] or (fields[1] and self._aliased(worker) > t.aliased_mark):
            self._drop_inferred(worker, t)

    def _holdable(self, worker: str, event: BlockStored) -> bool:
        """Whether an orphan can ever be applied from its tokens (not a dump, not pre-hashed)."""
        xk = event.extra_keys
        return bool(event.token_ids) and not (type(xk) is dict and xk)

    def _hold(self, worker: str, t: _Track, rec: WorkerRecovery, event: BlockStored, root: object) -> None:
        dropped = rec.pool.hold_store(event, root)
        if dropped:
            t.orphans_dropped += len(dropped)
            rec.stored_since_loss = 0  # what they held is unknown again: the turnover starts over
            logger.info("worker=%s orphan pool full: dropped %d held-back chains", worker, len(dropped))

    def _name(
        self, worker: str, t: _Track, rec: WorkerRecovery, event: BlockStored, ts: float, rank: int | None,
        totals: list[int],
    ) -> None:
        """Try to name an orphan's unknown parent (an anchor, else the router's routes), and if
        named, store the parent's chain and apply what was held back under it."""
        parent = event.parent_block_hash
        chain = rec.anchor_chain(parent)
        if chain is None:
            chain = self._chain_from_routes(worker, event)
            if chain is None:
                return
            t.named_parents += 1
            rec.anchor(parent, chain)
        bs = self._block_size_of(worker) if self._block_size_of is not None else None
        if not bs:
            return
        self._store_chain(worker, t, parent, chain, bs, ts, rank, totals)
        self._adopt(worker, t, rec, parent, ts, rank, totals)

    def _chain_from_routes(self, worker: str, event: BlockStored) -> list[int] | None:
        if self._name_parent is None or self._block_size_of is None:
            return None
        bs = self._block_size_of(worker)
        if not bs or event.block_size != bs or len(event.token_ids) < bs:
            return None
        try:
            data = tokens_to_bytes(event.token_ids[:bs])
        except WireError:
            return None
        root = root_seed(lora_key(event.lora_id, event.lora_name), event.cache_salt)
        return self._name_parent(worker, root, data)

    def _store_chain(
        self, worker: str, t: _Track, parent: object, chain: list[int], bs: int, ts: float, rank: int | None,
        totals: list[int],
    ) -> None:
        """Hold a named parent's chain: the parent under its own id, its ancestors under inferred ids."""
        self._infer(worker, t, chain[:-1], bs, ts, rank, totals)
        alias = inferred_id(chain[-1])
        if alias in t.inferred:  # the parent was inferred itself: its engine id takes over
            t.inferred.discard(alias)
            self._index.apply(worker, KVEventBatch(ts, [BlockRemoved(block_hashes=[alias])], rank))
        self._apply_one(worker, t, content_store([parent], chain[-1:], bs), ts, rank, totals)
        t.aliased_mark = self._aliased(worker)

    def _infer(
        self, worker: str, t: _Track, contents: list[int], bs: int, ts: float, rank: int | None, totals: list[int]
    ) -> None:
        """Hold ``contents`` under inferred ids, except those the worker holds under an engine's id
        already: an inferred alias would outlive that id's removal (the index counts aliases)."""
        aliased = self._aliased(worker)
        for c in contents:
            ext = inferred_id(c)
            if ext in t.inferred:
                continue
            self._apply_one(worker, t, content_store([ext], [c], bs), ts, rank, totals)
            now = self._aliased(worker)
            if now > aliased:  # held already: take the alias back
                self._index.apply(worker, KVEventBatch(ts, [BlockRemoved(block_hashes=[ext])], rank))
            else:
                t.inferred.add(ext)
        t.aliased_mark = self._aliased(worker)

    def _aliased(self, worker: str) -> int:
        info = self._worker_info(worker) if self._worker_info is not None else None
        return int(getattr(info, "aliased", 0))

    def _readopt(
        self, worker: str, t: _Track, rec: WorkerRecovery, parent: object, ts: float, rank: int | None,
        totals: list[int],
    ) -> None:
        """A store under (a block below) a named parent proves its chain held again: re-hold
        dropped inferred blocks."""
        if parent is None:
            return
        chain = rec.anchor_chain(parent)
        if chain is None or len(chain) < 2:
            return
        if all(inferred_id(c) in t.inferred for c in chain[:-1]):
            return
        bs = self._block_size_of(worker) if self._block_size_of is not None else None
        if bs:
            self._infer(worker, t, chain[:-1], bs, ts, rank, totals)

    def _adopt(
        self, worker: str, t: _Track, rec: WorkerRecovery, root: object, ts: float, rank: int | None,
        totals: list[int],
    ) -> None:
        """``root`` is known now: apply what was held back under it, in its order."""
        pending = [root]
        while pending:
            ops = rec.pool.take(pending.pop())
            for op in ops:
                if not self._try_apply(worker, t, op, ts, rank, totals):
                    continue
                t.events_applied += 1
                if isinstance(op, BlockStored):
                    t.adopted_blocks += len(op.block_hashes)
                    pending.extend(h for h in op.block_hashes if rec.pool.waits_on(h))

    def _drop_inferred(self, worker: str, t: _Track) -> None:
        """A removal the index could not place (or an alias) may concern an inferred block: drop
        them all. The index then lacks blocks the engine likely holds: known incomplete, so the
        worker is ``resyncing`` again (entries kept) until its chains are re-adopted and its
        cache has turned over."""
        ids: list[int | bytes] = list(t.inferred)
        t.inferred.clear()
        t.inferred_drops += 1
        self._index.apply(worker, KVEventBatch(0.0, [BlockRemoved(block_hashes=ids)]))
        t.aliased_mark = self._aliased(worker)
        self._incomplete(worker, t, "inferred blocks dropped")

    def _incomplete(self, worker: str, t: _Track, why: str) -> None:
        """The index is known to lack blocks the worker may hold, though nothing it holds is wrong."""
        rec = t.recovery
        if rec is None:
            rec = t.recovery = WorkerRecovery(OrphanPool(max_blocks=self._max_orphan_blocks))
        rec.stored_since_loss = 0
        t.clean_batches = 0
        if t.state is WorkerState.LIVE:
            logger.info("worker=%s %s: resyncing (entries kept)", worker, why)
            self._set_state(worker, t, WorkerState.RESYNCING)


def _is_content_store(event: BlockStored) -> bool:
    """A store of given content ids (the router's own: a named parent or inferred blocks)."""
    xk = event.extra_keys
    return type(xk) is dict and DUMP_CONTENT_KEY in xk


def _stat_fields(stats: object) -> tuple[int, int, int, int, int, int]:
    """The counts of an ``ApplyStats`` (or of any object with those fields) as a tuple."""
    g = getattr
    return (
        g(stats, "events", 0), g(stats, "stored_blocks", 0), g(stats, "duplicate_blocks", 0),
        g(stats, "removed_blocks", 0), g(stats, "unknown_removals", 0), g(stats, "cleared", 0),
    )
