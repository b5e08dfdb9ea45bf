"""The relay's replay ring, with a snapshot in front of it.

A stock publisher answers a replay request for seq ``s`` with the batches of
its ring from ``s`` on; whatever is older is gone. The relay keeps, beside
its ring of the last ``capacity`` relayed batches, the block set those older
batches added up to (:class:`~tokenspeed_router.relay.blockset.BlockSet`,
updated as batches leave the ring). A request older than the ring is
answered with that state as a snapshot, then the ring:

    ring holds seqs [R, N)      request from s < R
    answer: K snapshot batches numbered R-K .. R-1, then R .. N-1, then end

The snapshot starts with ``AllBlocksCleared`` and stores every block parents
first, so whatever the router held before, it ends with the engine's block
set as of seq N-1. The numbering keeps the reply wire compatible: a router's
subscriber merges replayed batches by seq like any other replay. When
``R - s`` is smaller than the snapshot's natural batch count (about
``blocks_per_batch`` blocks each), the snapshot is packed into ``R - s``
larger batches (every seq must be ``>= s``; a batch over 32 MiB is logged,
since a router drops payloads above its ``max_payload_bytes``, 64 MiB by
default). If the
snapshot does not reach back to ``s`` (``R - K > s``) the router sees seqs
``[s, R-K)`` as lost: a router that just joined ignores that (history before
its subscription); one that was following reports a resync and is made exact
again by the snapshot's ``AllBlocksCleared``.

Encoded snapshot batches are cached until the ring moves (several routers
joining at once pay for one dump).

Thread safety: :meth:`append` runs on the relay's thread, :meth:`replay_from`
on the publisher's (it is the publisher's
:class:`~tokenspeed_router.events.publisher.ReplaySource`); one lock guards
both. The lock is held while a snapshot is encoded, so a big snapshot delays
the relay's next batch by that long (figures in docs/relay.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from tokenspeed_router.events.codec import WireFormat, encode_batch
from tokenspeed_router.events.schema import BlockStored, Event, KVEventBatch
from tokenspeed_router.relay.blockset import BlockSet

__all__ = ["RingStatistics", "SnapshotRing"]

logger = logging.getLogger(__name__)

#: The router's default max_payload_bytes is 64 MiB: warn well before.
_LARGE_PAYLOAD_BYTES = 32 << 20


@dataclass(frozen=True, slots=True)
class RingStatistics:
    ring_batches: int
    first_seq: int | None
    base_blocks: int
    """Blocks in the state before the ring (what a snapshot sends)."""
    replays_served: int
    snapshots_served: int
    snapshot_batches_sent: int
    last_snapshot_blocks: int
    last_snapshot_orphans: int
    last_snapshot_encode_s: float


class SnapshotRing:
    """A ring of relayed batches plus the state before it (module docstring)."""

    def __init__(
        self,
        capacity: int,
        *,
        wire_format: WireFormat = "map",
        blocks_per_batch: int = 16_384,
        data_parallel_rank: int | None = 0,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if blocks_per_batch < 1:
            raise ValueError(f"blocks_per_batch must be >= 1, got {blocks_per_batch}")
        self._capacity = capacity
        self._wire_format: WireFormat = wire_format
        self._blocks_per_batch = blocks_per_batch
        self._dp_rank = data_parallel_rank
        self._lock = threading.Lock()
        self._ring: deque[tuple[int, bytes, KVEventBatch]] = deque()
        self._base = BlockSet()
        self._version = 0  # bumped whenever the base changes
        self._cache: tuple[int, list[bytes]] | None = None
        self._replays = 0
        self._snapshots = 0
        self._snapshot_batches = 0
        self._last_blocks = 0
        self._last_orphans = 0
        self._last_encode_s = 0.0

    def append(self, seq: int, payload: bytes, batch: KVEventBatch) -> None:
        """Remember a relayed batch; the oldest one beyond capacity folds into the base."""
        with self._lock:
            ring = self._ring
            if ring and seq != ring[-1][0] + 1:
                raise ValueError(f"ring seqs must be consecutive: {seq} after {ring[-1][0]}")
            ring.append((seq, payload, batch))
            while len(ring) > self._capacity:
                _, _, old = ring.popleft()
                self._base.apply(old)
                self._version += 1

    def replay_from(self, start_seq: int) -> list[tuple[int, bytes]]:
        """Batches with seq >= ``start_seq``: a snapshot first if the ring starts later."""
        with self._lock:
            ring = self._ring
            self._replays += 1
            if not ring:
                return []
            first = ring[0][0]
            if start_seq >= first:
                return [(seq, payload) for seq, payload, _ in ring if seq >= start_seq]
            snapshot = self._snapshot_payloads(first - start_seq)
            self._snapshots += 1
            self._snapshot_batches += len(snapshot)
            k = len(snapshot)
            out = [(first - k + i, payload) for i, payload in enumerate(snapshot)]
            out.extend((seq, payload) for seq, payload, _ in ring)
            return out

    def statistics(self) -> RingStatistics:
        with self._lock:
            return RingStatistics(
                ring_batches=len(self._ring),
                first_seq=self._ring[0][0] if self._ring else None,
                base_blocks=len(self._base),
                replays_served=self._replays,
                snapshots_served=self._snapshots,
                snapshot_batches_sent=self._snapshot_batches,
                last_snapshot_blocks=self._last_blocks,
                last_snapshot_orphans=self._last_orphans,
                last_snapshot_encode_s=self._last_encode_s,
            )

    def _snapshot_payloads(self, slots: int) -> list[bytes]:
        """The base as at most ``slots`` encoded batches (lock held)."""
        cached = self._cache
        if cached is not None and cached[0] == self._version and len(cached[1]) <= slots:
            return cached[1]
        t0 = time.perf_counter()
        dump = self._base.dump()
        groups = _group(dump.events, self._blocks_per_batch)
        natural = len(groups) <= slots
        if not natural:  # fewer seqs free than batches: fewer, larger batches
            total = sum(_weight(e) for e in dump.events)
            groups = _group(dump.events, -(-total // slots), max_groups=slots)
        now = time.time()
        payloads = [encode_batch(self._batch(now, g), self._wire_format) for g in groups]
        self._last_blocks = dump.blocks
        self._last_orphans = dump.orphans
        self._last_encode_s = time.perf_counter() - t0
        if natural:
            self._cache = (self._version, payloads)
        largest = max(len(p) for p in payloads)
        if largest > _LARGE_PAYLOAD_BYTES:
            logger.warning(
                "relay snapshot: a batch of %d bytes (%d blocks in %d seqs); routers must accept "
                "payloads this large (their max_payload_bytes)", largest, dump.blocks, len(payloads),
            )
        return payloads

    def _batch(self, ts: float, events: list[Event]) -> KVEventBatch:
        return KVEventBatch(ts, events, self._dp_rank)


def _weight(event: Event) -> int:
    return len(event.block_hashes) if isinstance(event, BlockStored) else 1


def _group(events: list[Event], blocks_per_batch: int, max_groups: int | None = None) -> list[list[Event]]:
    """Consecutive events in groups of about ``blocks_per_batch`` blocks (never
    more than ``max_groups`` groups: the last one takes the rest)."""
    groups: list[list[Event]] = []
    current: list[Event] = []
    weight = 0
    for event in events:
        w = _weight(event)
        if current and weight + w > blocks_per_batch and (max_groups is None or len(groups) < max_groups - 1):
            groups.append(current)
            current, weight = [], 0
        current.append(event)
        weight += w
    if current:
        groups.append(current)
    return groups
