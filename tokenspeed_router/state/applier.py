"""Fold stream entries into the in-memory index, each (worker, epoch, seq) once.

This is the only code that mutates a replica's index in Redis mode: the
follower thread calls it, and it holds the replica's index lock while it
mutates, so query threads that take the same lock never see half a batch.
It also turns the index into a snapshot envelope and back, including the
dedupe positions, so that "snapshot + stream from its id" reproduces exactly
the state of a replica that read the whole stream.

Single owner (the follower thread), except :meth:`positions_copy` and the
plain counters, which other threads may read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

from tokenspeed_router.errors import TokenspeedError, WireError
from tokenspeed_router.events.codec import BatchDecoder
from tokenspeed_router.events.subscriber import (
    BatchReceived,
    PublisherRestarted,
    ResyncNeeded,
    SubscriberItem,
)
from tokenspeed_router.percentiles import percentile
from tokenspeed_router.state.snapshot import SNAPSHOT_FORMAT, SnapshotEnvelope
from tokenspeed_router.state.stream import Position, StreamEntry, entry_position

if TYPE_CHECKING:
    from tokenspeed_router.router.index import KvIndex
    from tokenspeed_router.router.ingest import IndexIngestor

__all__ = ["IndexHost", "LocalIndexHost", "StreamApplier"]

logger = logging.getLogger(__name__)

#: Reason carried by the ResyncNeeded items this module makes up.
RESYNC_STREAM_TRIMMED = "state_stream_trimmed"
RESYNC_SNAPSHOT_STATE = "restored_from_snapshot"



class IndexHost(Protocol):
    """Who owns the index a replica feeds: the router service, or :class:`LocalIndexHost`.

    ``apply_item`` and ``replace_index`` take the host's lock themselves;
    ``locked()`` (re-entrant) is for the multi-step work (snapshot, restore)
    done here. ``index`` and ``ingestor`` are read under ``locked()``: a
    restore may swap them. ``RouterService`` fits.
    """

    @property
    def index(self) -> KvIndex: ...

    @property
    def ingestor(self) -> IndexIngestor: ...

    def apply_item(self, item: SubscriberItem) -> None: ...

    def locked(self) -> AbstractContextManager[None]: ...

    def replace_index(self, index: KvIndex) -> None:
        """Adopt a restored index outright (the warm start, before serving)."""

    def ensure_worker_locked(self, name: str) -> None:
        """Make a worker restored from a snapshot known to whatever routes (under ``locked()``)."""


class LocalIndexHost:
    """A routing core on its own: the host for tests, benchmarks and embedding.

    Everything is the core's (``router/core.py``: the same wiring ``serve``
    runs); this adds :meth:`match` answering plain per-worker block counts.
    """

    def __init__(self, index: KvIndex | None = None) -> None:
        from tokenspeed_router.router.core import RoutingCore

        self.core = RoutingCore(index=index)

    @property
    def index(self) -> KvIndex:
        return self.core.index

    @property
    def ingestor(self) -> IndexIngestor:
        return self.core.ingestor

    def apply_item(self, item: SubscriberItem) -> None:
        self.core.apply_item(item)

    def locked(self) -> AbstractContextManager[None]:
        return self.core.locked()

    def replace_index(self, index: KvIndex) -> None:
        """Adopt a restored index outright (the fast warm start)."""
        self.core.replace_index(index)

    def ensure_worker_locked(self, name: str) -> None:
        self.core.ensure_worker(name)

    def match(self, token_ids: list[int], lora_id: int | None = None,
              salt: str | None = None) -> dict[str, int]:
        return self.core.index.match(token_ids, lora_id=lora_id, salt=salt)


class StreamApplier:
    """Applies entries in stream order; remembers where each worker stands."""

    def __init__(self, host: IndexHost, *, lag_window: int = 4096) -> None:
        self.host = host
        self._pos_lock = threading.Lock()
        self.positions: dict[str, Position] = {}
        #: Stream generation being read (None: not bootstrapped yet).
        self.generation: str | None = None
        self.n = 0
        self.last_id: bytes = b"0-0"
        self.max_fence = 0
        self.entries_applied = 0
        self.duplicates = 0
        self.undecodable = 0
        self.since_snapshot = 0
        self.last_leader_time_s = 0.0
        self._lags: deque[float] = deque(maxlen=lag_window)
        self._lags_lock = threading.Lock()
        self._decoder = BatchDecoder()
        #: Workers cleared because stream entries were lost (trimmed) before we read them.
        self.gap_workers: set[str] = set()
        self._gap_reason: str | None = None

    # ------------------------------------------------------------------ apply

    def advance(self, entry: StreamEntry) -> bool:
        """Apply ``entry`` (the caller checked generation and ``n`` continuity).

        Returns False when it was a duplicate (already applied) and skipped.
        """
        self.n = entry.n
        self.last_id = entry.stream_id
        self.since_snapshot += 1
        if entry.fence > self.max_fence:
            self.max_fence = entry.fence
        meta = entry.meta
        position = entry_position(meta)
        last = self.positions.get(meta.worker)
        if last is not None and position <= last:
            self.duplicates += 1
            return False
        if last is None and self._gap_reason is not None and meta.kind != "restart":
            # First seen after lost entries: its history may be among them.
            self.gap_workers.add(meta.worker)
            self.host.apply_item(
                ResyncNeeded(meta.worker, 0, max(0, meta.seq), self._gap_reason, meta.epoch))
        item = self._item(entry)
        if item is not None:
            try:
                self.host.apply_item(item)
            except TokenspeedError as err:  # the ingestor handles consistency; be safe
                logger.warning("state: entry %r for worker=%s not applied: %s",
                               entry.stream_id, meta.worker, err)
        with self._pos_lock:
            self.positions[meta.worker] = position
        self.entries_applied += 1
        if meta.leader_time_s:
            self.last_leader_time_s = meta.leader_time_s
            with self._lags_lock:
                self._lags.append(max(0.0, time.time() - meta.leader_time_s))
        return True

    def _item(self, entry: StreamEntry) -> SubscriberItem | None:
        meta = entry.meta
        if meta.kind == "batch":
            try:
                batch = self._decoder.decode(entry.payload)
            except WireError as err:
                self.undecodable += 1
                logger.warning("state: undecodable payload in entry %r (worker=%s): %s",
                               entry.stream_id, meta.worker, err)
                return None
            return BatchReceived(meta.worker, meta.seq, batch, entry.payload, meta.topic,
                                 meta.recv_time_s, meta.epoch, meta.replayed)
        if meta.kind == "restart":
            return PublisherRestarted(meta.worker, meta.a, meta.b, meta.epoch)
        if meta.kind == "resync":
            return ResyncNeeded(meta.worker, meta.a, meta.b, meta.reason, meta.epoch)
        logger.warning("state: unknown entry kind %r in %r; skipped", meta.kind, entry.stream_id)
        return None

    def mark_all_resyncing(self, reason: str) -> list[str]:
        """Entries were lost for unknown workers: clear every worker and mark it resyncing."""
        self._gap_reason = reason
        with self.host.locked():
            workers = sorted(set(self.host.index.workers()) | set(self.positions))
        self.gap_workers.update(workers)
        for worker in workers:
            epoch, seq = self.positions.get(worker, (0, -1))
            self.host.apply_item(ResyncNeeded(worker, seq + 1, seq + 1, reason, epoch))
        return workers

    # --------------------------------------------------------------- snapshots

    def positions_copy(self) -> dict[str, Position]:
        with self._pos_lock:
            return dict(self.positions)

    def make_envelope(
        self,
        replica_id: str,
        *,
        generation: str | None = None,
        n: int | None = None,
        stream_id: str | None = None,
    ) -> tuple[SnapshotEnvelope, int]:
        """Snapshot the index at the current stream point (or a given one); also its block count."""
        host = self.host
        with host.locked():
            data = host.index.snapshot()
            num_blocks = host.index.num_blocks()
            states = {w: str(getattr(s.state, "value", s.state))
                      for w, s in host.ingestor.statuses().items()}
            positions = {w: (p[0], p[1]) for w, p in self.positions.items()}
        envelope = SnapshotEnvelope(
            format=SNAPSHOT_FORMAT,
            generation=generation if generation is not None else (self.generation or ""),
            n=self.n if n is None else n,
            stream_id=self.last_id.decode() if stream_id is None else stream_id,
            created_s=time.time(),
            replica_id=replica_id,
            positions=positions,
            worker_states=states,
            max_fence=self.max_fence,
            index=data,
        )
        return envelope, num_blocks

    def install(self, envelope: SnapshotEnvelope, *, fresh: bool) -> None:
        """Make the index equal to ``envelope`` and resume reading after it.

        ``fresh`` (the warm start, before serving): the host adopts the
        restored index object outright (``replace_index``), the fast path. Otherwise (a reload while serving, after Redis lost the stream
        or entries were trimmed) the live index is rewritten in place from
        the snapshot's events, so what the router holds stays valid.
        """
        from tokenspeed_router.router.index import KvIndex

        restored = KvIndex.restore(envelope.index)
        host = self.host
        with host.locked():
            if fresh:
                host.replace_index(restored)
            else:
                self._rewrite_live(restored)
            self._restore_states(envelope, restored)
            for worker in envelope.worker_states:
                host.ensure_worker_locked(worker)
        with self._pos_lock:
            self.positions = envelope.position_map()
        self.gap_workers.clear()
        self._gap_reason = None
        self.generation = envelope.generation
        self.n = envelope.n
        self.last_id = envelope.stream_id.encode()
        self.max_fence = max(self.max_fence, envelope.max_fence)
        self.since_snapshot = 0

    def _rewrite_live(self, restored: KvIndex) -> None:
        index, ingestor = self.host.index, self.host.ingestor
        dumped = restored.dump_events()
        for worker in list(index.workers()):
            if worker not in dumped:
                ingestor.remove_worker(worker)
        for worker, batches in dumped.items():
            index.clear_worker(worker)
            for batch in batches:
                index.apply(worker, batch)

    def _restore_states(self, envelope: SnapshotEnvelope, restored: KvIndex) -> None:
        index, ingestor = self.host.index, self.host.ingestor
        positions = envelope.position_map()
        resyncing = [w for w, s in envelope.worker_states.items() if s == "resyncing"]
        dumped = restored.dump_events() if resyncing else {}
        for worker, state in envelope.worker_states.items():
            ingestor.add_worker(worker)
            if state == "resyncing":
                # The ingestor has no "set state" door: a ResyncNeeded sets it
                # (and clears the worker), then its snapshot entries go back in.
                epoch, seq = positions.get(worker, (0, -1))
                ingestor.on_item(
                    ResyncNeeded(worker, seq + 1, seq + 1, RESYNC_SNAPSHOT_STATE, epoch)
                )
                for batch in dumped.get(worker, ()):
                    index.apply(worker, batch)
            elif state == "stale":
                ingestor.mark_stale(worker)
            else:
                ingestor.mark_live(worker)

    # ------------------------------------------------------------------- stats

    @property
    def gap_reason(self) -> str | None:
        """Set once entries were lost to trimming (until a snapshot is installed)."""
        return self._gap_reason

    def still_resyncing(self, workers: set[str]) -> list[str]:
        """Those of ``workers`` the ingestor does not consider live yet."""
        if not workers:
            return []
        with self.host.locked():
            statuses = self.host.ingestor.statuses()
        return sorted(w for w in workers
                      if w in statuses and str(getattr(statuses[w].state, "value", "")) != "live")

    def apply_lag_percentiles(self) -> tuple[float | None, float | None]:
        """p50 and p99 of (apply time - leader accept time) over recent entries."""
        with self._lags_lock:
            lags = list(self._lags)
        if not lags:
            return None, None
        return percentile(lags, 50), percentile(lags, 99)
