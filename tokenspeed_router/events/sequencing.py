"""Per-publisher sequence bookkeeping, shared by the live subscriber and log replay.

Publishers number their batches 0, 1, 2, ... from process start and persist
nothing, so the sequence number is the only thing that reveals lost batches
(a jump forward) and a restarted publisher (a jump backwards). This module
turns each observed seq into a :class:`Verdict`; it does no I/O and keeps no
clock, so the same rules apply to a ZeroMQ stream and to a recorded log.

Duplicates versus restarts: a seq below the expected one is either a copy of a
batch already seen (a live message that also came back through replay) or the
first batch of a restarted publisher that happens to reuse an old number.
Sequence numbers alone cannot tell them apart, so the tracker remembers a
fingerprint (a 64-bit hash and the length) of the last ``window`` batches observed *with*
their payload (the live subscriber passes every payload, live or replayed): a
lower seq -- including an exact repeat of the last one -- whose payload matches
is a duplicate, one whose payload differs is a restart. That is what catches a
restarted publisher whose first batch reuses the last number seen (it
published as many batches as the old process, or the slow joiner lost its
first ones). Otherwise (no payload given, or none remembered for that seq)
only an exact repeat of the last seq counts as a duplicate. Replayed payloads
are byte-identical to the live ones in every engine (see
``docs/wire-format.md``), which is what makes the fingerprint
reliable; batches carry their publish time, so a new process does not repeat
the bytes of an old one.

Batches that cannot move the state. Only a batch that decoded and
validated is ever observed: the callers (the subscriber, log replay) count and
skip anything else *before* it reaches this module, whatever its seq says, so a
malformed frame can neither declare a gap nor fake a restart. A well-formed
batch whose every event is of a kind this router does not know (a newer
engine's, or a stray frame's; ``codec.only_unknown_events``) is no evidence
either: it is noted as a *filler*
(:meth:`SequenceTracker.note_filler`) and changes nothing by itself. A gap
made only of filler seqs is flagged ``covered``: with nothing to replay it
from (log replay, a stream without a replay endpoint) it is no loss -- the
engine did publish those batches, we had nothing to apply from them -- while
a subscriber that can replay still asks, so that a real batch lost under a
seq some stray frame also used is still fetched. So a stray batch of unknown
kinds under the last seq is not a restart, and a newer engine's is not a
loss. A batch with no event at all is an ordinary batch (tools publish them
as probes; a restarted publisher's may reuse a seq).

Complexity: O(1) per observation (a gap walks its filler seqs); memory O(window).
"""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass

try:  # XXH3 from the compiled extension: a seventh of CRC32's time on a 3 KB batch
    from tokenspeed_router._native import chain_hash as _hash
except ImportError:
    _hash = None  # type: ignore[assignment]

__all__ = ["SequenceTracker", "Verdict", "VerdictKind"]

#: Filler seqs remembered at most (a flood of empty batches cannot grow memory or slow accepts).
_MAX_FILLERS = 1024


class VerdictKind(enum.Enum):
    """What an observed seq means relative to what was expected."""

    IN_ORDER = "in_order"
    DUPLICATE = "duplicate"
    GAP = "gap"
    RESTART = "restart"


@dataclass(frozen=True, slots=True)
class Verdict:
    """Outcome of one observation.

    ``expected`` is the seq that was due (None before the first observation);
    ``last`` the last accepted seq (None before the first one); ``got`` the
    observed seq. For a GAP the missing range is ``[expected, got)``.
    """

    kind: VerdictKind
    got: int
    expected: int | None
    last: int | None
    covered: bool = False
    """A GAP whose every missing seq was noted as a filler (:meth:`SequenceTracker.note_filler`):
    no loss, unless a replay can still bring a batch there."""

    @property
    def missing(self) -> int:
        """Number of batches skipped by a GAP (0 for any other kind)."""
        if self.kind is VerdictKind.GAP and self.expected is not None:
            return self.got - self.expected
        return 0


def _fingerprint(payload: bytes | bytearray | memoryview) -> tuple[int, int]:
    """What tells two payloads under one seq apart: in-process only, never stored or sent."""
    if _hash is not None:
        return _hash(payload), len(payload)
    return zlib.crc32(payload), len(payload)


class SequenceTracker:
    """Sequence state machine of one publisher (not thread safe: one owner).

    ``observe(seq)`` classifies and commits: IN_ORDER and GAP move the cursor
    to ``seq``, RESTART also bumps :attr:`epoch`, DUPLICATE changes nothing.
    ``classify(seq)`` answers the same question without committing, for
    callers that want to try a replay before accepting a gap.
    """

    def __init__(self, next_seq: int | None = None, *, window: int = 4096) -> None:
        if next_seq is not None and next_seq < 0:
            raise ValueError(f"next_seq must be >= 0, got {next_seq}")
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        self._expected = next_seq
        self._last: int | None = None
        self._epoch = 0
        self._window = window
        self._recent: dict[int, tuple[int, int]] = {}
        self._fillers: dict[int, None] = {}  # insertion-ordered set, bounded by window

    @property
    def expected_seq(self) -> int | None:
        """The next seq due, or None when anything is acceptable (nothing seen yet)."""
        return self._expected

    @property
    def last_seq(self) -> int | None:
        """The last accepted seq (None before the first)."""
        return self._last

    @property
    def epoch(self) -> int:
        """Number of publisher restarts observed so far."""
        return self._epoch

    def classify(self, seq: int, payload: bytes | bytearray | memoryview | None = None) -> Verdict:
        """Say what ``seq`` would be, without changing any state."""
        expected = self._expected
        if expected is None or seq == expected:
            return Verdict(VerdictKind.IN_ORDER, seq, expected, self._last)
        if seq > expected:
            fillers = self._fillers
            covered = bool(fillers) and all(s in fillers for s in range(expected, seq))
            return Verdict(VerdictKind.GAP, seq, expected, self._last, covered)
        if self._is_duplicate(seq, payload):
            return Verdict(VerdictKind.DUPLICATE, seq, expected, self._last)
        return Verdict(VerdictKind.RESTART, seq, expected, self._last)

    def observe(self, seq: int, payload: bytes | bytearray | memoryview | None = None) -> Verdict:
        """Classify ``seq`` and commit it (see the class docstring)."""
        verdict = self.classify(seq, payload)
        if verdict.kind is VerdictKind.DUPLICATE:
            return verdict
        if verdict.kind is VerdictKind.RESTART:
            self._epoch += 1
            self._recent.clear()
            self._fillers.clear()
        self._accept(seq, payload)
        return verdict

    def advance_if_next(self, seq: int, payload: bytes | bytearray | memoryview | None = None) -> bool:
        """Commit ``seq`` when it is the one due (or anything is), as :meth:`observe` does for
        an IN_ORDER verdict, and say so; otherwise change nothing and return False.

        The stream's common case, without building a :class:`Verdict` twice.
        """
        expected = self._expected
        if expected is None or seq == expected:
            self._accept(seq, payload)
            return True
        return False

    def note_filler(self, seq: int) -> None:
        """``seq`` carried a well-formed batch with nothing to apply (module docstring).

        It moves nothing; a later gap over filler seqs only is not a loss.
        """
        if seq < 0 or (self._expected is not None and seq < self._expected) or not self._window:
            return
        fillers = self._fillers
        fillers[seq] = None
        if len(fillers) > min(self._window, _MAX_FILLERS):
            del fillers[next(iter(fillers))]

    def is_filler(self, seq: int) -> bool:
        """Whether ``seq`` was noted by :meth:`note_filler` (and is still remembered)."""
        return seq in self._fillers

    def matches(self, seq: int, payload: bytes | bytearray | memoryview) -> bool | None:
        """Whether ``payload`` is what was accepted under ``seq`` (None: not remembered)."""
        known = self._recent.get(seq)
        if known is None:
            return None
        return known == _fingerprint(payload)

    def jump_to(self, next_seq: int) -> None:
        """Expect ``next_seq`` next without a verdict (after an accepted loss)."""
        if next_seq < 0:
            raise ValueError(f"next_seq must be >= 0, got {next_seq}")
        self._expected = next_seq

    def reset(self, next_seq: int | None = None) -> None:
        """Forget the cursor (not the epoch): the next seq starts a fresh stream."""
        self._expected = next_seq
        self._last = None
        self._recent.clear()
        self._fillers.clear()

    def new_epoch(self) -> int:
        """Count a restart learnt from outside the seq stream; returns the new epoch."""
        self._epoch += 1
        self.reset()
        return self._epoch

    def _accept(self, seq: int, payload: bytes | bytearray | memoryview | None) -> None:
        self._last = seq
        self._expected = seq + 1
        if self._fillers:
            for old in [f for f in self._fillers if f <= seq]:
                del self._fillers[old]
        if payload is not None and self._window:
            recent = self._recent
            recent.pop(seq, None)
            recent[seq] = _fingerprint(payload)
            if len(recent) > self._window:
                del recent[next(iter(recent))]

    def _is_duplicate(self, seq: int, payload: bytes | bytearray | memoryview | None) -> bool:
        known = self._recent.get(seq) if payload is not None else None
        if known is not None and payload is not None:
            return known == _fingerprint(payload)
        return seq == self._last
