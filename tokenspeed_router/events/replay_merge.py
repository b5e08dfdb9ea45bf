"""The replay merge: a replay answer and the live messages held meanwhile, in seq order.

When a subscriber's live stream skips ahead it asks the publisher's replay
ROUTER for the missing seqs and holds the live messages that keep arriving;
when the answer is in, :func:`merge_replay` decides, as one pure function,
what is delivered, what is a duplicate and which holes are lost for good
(and why: the ``RESYNC_*`` reasons a :class:`ResyncNeeded` carries). Kept
apart from the sockets of ``subscriber.py`` so that it can be tested, and
read, on its own (``tests/unit/test_events_replay_merge.py``).
"""

from __future__ import annotations

import enum
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Final

from tokenspeed_router.events.schema import KVEventBatch

__all__ = [
    "RESYNC_NO_REPLAY",
    "RESYNC_REPLAY_INCOMPLETE",
    "RESYNC_REPLAY_TIMEOUT",
    "RESYNC_RING_EXHAUSTED",
    "RESYNC_SHED",
    "Loss",
    "MergePlan",
    "Message",
    "ReplayPurpose",
    "loss_reason",
    "merge_replay",
]


#: Reasons carried by :class:`ResyncNeeded`.
RESYNC_REPLAY_TIMEOUT: Final = "replay_timeout"
RESYNC_RING_EXHAUSTED: Final = "replay_ring_exhausted"
RESYNC_REPLAY_INCOMPLETE: Final = "replay_incomplete"
RESYNC_NO_REPLAY: Final = "no_replay_endpoint"
#: not a loss on the wire: the router dropped a backlog on purpose (it fell too far behind)
RESYNC_SHED: Final = "shed_backlog"


@dataclass(slots=True)
class Message:
    """One batch as the subscriber received it (live or replayed), before delivery."""


    seq: int
    payload: bytes
    batch: KVEventBatch | None  # None: proved well formed by the native scanner, decoded on use
    topic: bytes
    recv_time_s: float
    replayed: bool
    ts: float  # the batch's publisher timestamp


class ReplayPurpose(enum.Enum):
    """Why a replay was asked for: decides how its answer is merged."""

    JOIN = "join"
    """First contact: fetch what the publisher holds (or the first live seq was not 0)."""
    RESUME = "resume"
    """The caller asked to start at ``start_seq``."""
    GAP = "gap"
    """A live seq skipped ahead of the expected one."""
    RESTART = "restart"
    """A restarted publisher's first message seen was not seq 0."""
    VERIFY = "verify"
    """The connection came back: same publisher process or a new one?"""


@dataclass(frozen=True, slots=True)
class Loss:
    """Seqs ``[expected, got)`` neither the replay nor the live stream supplied.

    ``reason`` None: history before a fresh subscription, not a loss to report.
    """

    expected: int
    got: int
    reason: str | None


@dataclass(frozen=True, slots=True)
class MergePlan:
    """What to do with a finished replay: deliver/skip ``steps`` in order."""

    steps: list[Message | Loss]
    held_consumed: int
    """Leading held live messages merged (the caller drops them)."""
    duplicates: int
    """Of those, how many the replay also brought."""


def merge_replay(
    start: int,
    replayed: Sequence[Message],
    held: Sequence[Message],
    *,
    fresh: bool,
    failure: str | None,
    fillers: Container[int] = frozenset(),
) -> MergePlan:
    """Merge a replay answer with the live messages held meanwhile (pure).

    Replayed seqs >= ``start`` come first; held live messages are merged while
    their seqs keep increasing (a drop is a restart during the replay, left to
    the live path). A seq in both is delivered once. Walking the merged seqs in
    order from ``start``, each hole becomes a :class:`Loss`, except that a
    hole past the newest live seq stops the walk: the ring ran ahead of a
    lagging SUB socket and those seqs will still arrive live; and a hole past
    the answer's last seq also stops it, leaving the held messages from there
    on to the live path: those seqs were published after the answer was made
    and lost live, so the ring can still supply them (a new gap, a new replay;
    found by ``benchmarks/faults.py`` at 10 % frame loss, where treating them
    as lost cascaded into resyncs). ``fresh`` (the very first connection)
    turns the first hole into history, not a loss. Seqs in ``fillers`` came
    as well-formed batches with nothing to apply (``sequencing.py``): a hole
    made of them is no loss.
    """
    merged: dict[int, Message] = {}
    for message in replayed:
        if message.seq >= start:
            merged.setdefault(message.seq, message)
    previous = start - 1
    newest_live: int | None = None
    consumed = duplicates = 0
    for message in held:
        if message.seq <= previous:
            break
        consumed += 1
        previous = newest_live = message.seq
        if message.seq in merged:
            duplicates += 1
        else:
            merged[message.seq] = message
    first_replayed = replayed[0].seq if replayed else None
    last_replayed = replayed[-1].seq if replayed else None
    steps: list[Message | Loss] = []
    expected = start
    for seq in sorted(merged):
        while expected < seq and expected in fillers:
            expected += 1
        if seq > expected:
            if newest_live is not None and expected > newest_live:
                break
            if failure is None and last_replayed is not None and expected > last_replayed >= start:
                # The answer ended (the ring's newest seq when it was served) before
                # this hole: those seqs were published after it and lost live. The
                # ring still has them: stop here and let the live path ask again.
                kept = [m for m in held[:consumed] if m.seq < expected]
                duplicates = sum(1 for m in kept if m.seq <= last_replayed)
                return MergePlan(steps, len(kept), duplicates)
            steps.append(Loss(expected, seq, None if fresh else loss_reason(seq, first_replayed, failure)))
        fresh = False
        steps.append(merged[seq])
        expected = seq + 1
    return MergePlan(steps, consumed, duplicates)


def loss_reason(seq: int, first_replayed: int | None, failure: str | None) -> str:
    if failure is not None:
        return failure
    if first_replayed is None or seq <= first_replayed:
        return RESYNC_RING_EXHAUSTED
    return RESYNC_REPLAY_INCOMPLETE
