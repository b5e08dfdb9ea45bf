"""What an :class:`~tokenspeed_router.events.subscriber.EventSubscriber` hands on, and its counters.

A subscriber turns one publisher's raw stream into an ordered list of
:data:`SubscriberItem` s (the guarantees are in ``subscriber.py``'s
docstring): :class:`BatchReceived` for every batch, in sequence order and
exactly once; :class:`PublisherRestarted` and :class:`ResyncNeeded` for what
the consumer must drop. Everything downstream -- the ingestor, the apply
queue, the state backends, the relay -- speaks these types, never the
subscriber's sockets.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tokenspeed_router.events.codec import decode_batch
from tokenspeed_router.events.schema import KVEventBatch

__all__ = ["BatchReceived", "PublisherRestarted", "ResyncNeeded", "SubscriberItem", "SubscriberStatistics"]


class BatchReceived:
    """One batch, delivered in sequence order (``replayed``: it came through replay).

    ``batch`` is decoded on first use when the subscriber did not need to:
    a payload the native scanner (``_native.scan_batch``) proved well formed
    is handed on undecoded, with its timestamp in ``batch_ts``, so the index
    can apply it without a Python object per block (``KvIndex.apply_raw``).
    Treat it as immutable (equality and hashing are by value).
    """

    __slots__ = ("_batch", "batch_ts", "epoch", "payload", "recv_time_s", "replayed", "seq", "topic", "worker")

    def __init__(
        self,
        worker: str,
        seq: int,
        batch: KVEventBatch | None,
        payload: bytes,
        topic: bytes,
        recv_time_s: float,
        epoch: int,
        replayed: bool,
        batch_ts: float | None = None,
    ) -> None:
        if batch is None and batch_ts is None:
            raise ValueError("an undecoded BatchReceived needs its batch_ts")
        self.worker = worker
        self.seq = seq
        self._batch = batch
        self.payload = payload
        self.topic = topic
        self.recv_time_s = recv_time_s
        self.epoch = epoch
        self.replayed = replayed
        #: the publisher's timestamp of the batch (its wall clock, seconds)
        self.batch_ts: float = batch.ts if batch is not None else batch_ts  # type: ignore[assignment]

    @property
    def batch(self) -> KVEventBatch:
        """The decoded batch (decoded now if it was handed on undecoded)."""
        b = self._batch
        if b is None:
            b = self._batch = decode_batch(self.payload)  # proved decodable by the scanner
        return b

    @property
    def decoded(self) -> bool:
        """Whether ``batch`` is already decoded."""
        return self._batch is not None

    def _key(self) -> tuple[object, ...]:
        return (self.worker, self.seq, self.payload, self.topic, self.recv_time_s, self.epoch, self.replayed)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BatchReceived):
            return NotImplemented
        return self._key() == other._key() and (
            self.payload != b"" or self.batch == other.batch  # items built without a payload (tests, tools)
        )

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (
            f"BatchReceived(worker={self.worker!r}, seq={self.seq}, batch_ts={self.batch_ts}, "
            f"payload=<{len(self.payload)} bytes>, epoch={self.epoch}, replayed={self.replayed})"
        )


@dataclass(frozen=True, slots=True)
class PublisherRestarted:
    """The publisher's seq went backwards: clear the worker before applying later items."""

    worker: str
    last_seq: int
    new_seq: int
    epoch: int


@dataclass(frozen=True, slots=True)
class ResyncNeeded:
    """Batches ``[expected_seq, got_seq)`` are lost for good: clear the worker.

    Later batches are applied to the cleared state; the worker is resyncing
    until its state is consistent again.
    """

    worker: str
    expected_seq: int
    got_seq: int
    reason: str
    epoch: int


SubscriberItem = BatchReceived | PublisherRestarted | ResyncNeeded


@dataclass(frozen=True, slots=True)
class SubscriberStatistics:
    """A snapshot of one subscriber's counters."""

    worker: str
    received: int
    """Messages read from the SUB socket (good or bad)."""
    delivered: int
    """BatchReceived items emitted (live and replayed)."""
    replayed: int
    """Of which came through replay."""
    duplicates: int
    malformed: Mapping[str, int]
    """Skipped messages by reason (frame_count, seq_length, topic, payload_size,
    payload_decode, no_known_events, replay_frame)."""
    gaps: int
    replay_requests: int
    replay_timeouts: int
    resyncs: int
    restarts: int
    last_seq: int | None
    epoch: int
    replaying: bool
    held: int
    """Live messages held while a replay is in flight."""
    last_recv_time_s: float | None
    shed: int = 0
    """Live batches dropped unapplied by :meth:`EventSubscriber.shed_backlog`."""

    @property
    def malformed_total(self) -> int:
        return sum(self.malformed.values())
