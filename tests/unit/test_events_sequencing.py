"""SequenceTracker: the seq state machine shared by the subscriber and log replay."""

from __future__ import annotations

import pytest

from tokenspeed_router.events import SequenceTracker, VerdictKind


def test_in_order_from_any_first_seq() -> None:
    t = SequenceTracker()
    assert t.expected_seq is None
    assert t.observe(7).kind is VerdictKind.IN_ORDER
    assert (t.last_seq, t.expected_seq, t.epoch) == (7, 8, 0)
    assert t.observe(8).kind is VerdictKind.IN_ORDER


def test_gap_reports_missing_range_and_commits() -> None:
    t = SequenceTracker(0)
    t.observe(0)
    v = t.classify(4)
    assert (v.kind, v.expected, v.got, v.missing) == (VerdictKind.GAP, 1, 4, 3)
    assert t.expected_seq == 1, "classify must not commit"
    assert t.observe(4).kind is VerdictKind.GAP
    assert t.expected_seq == 5


def test_restart_bumps_epoch() -> None:
    t = SequenceTracker()
    for seq in range(5):
        t.observe(seq)
    v = t.observe(0, b"new process")
    assert (v.kind, v.last, v.got) == (VerdictKind.RESTART, 4, 0)
    assert t.epoch == 1 and t.expected_seq == 1
    assert t.observe(2).kind is VerdictKind.GAP  # gaps in the new epoch are gaps


def test_repeat_of_last_seq_is_a_duplicate() -> None:
    t = SequenceTracker()
    t.observe(3)
    assert t.observe(3).kind is VerdictKind.DUPLICATE
    assert t.epoch == 0 and t.expected_seq == 4


def test_fingerprint_tells_duplicate_from_restart() -> None:
    t = SequenceTracker()
    for seq in range(10):
        t.observe(seq, f"payload-{seq}".encode())
    assert t.classify(3, b"payload-3").kind is VerdictKind.DUPLICATE
    assert t.classify(3, b"something else").kind is VerdictKind.RESTART
    assert t.classify(3).kind is VerdictKind.RESTART  # no payload: only last seq is a dup
    assert t.observe(9, b"payload-9").kind is VerdictKind.DUPLICATE


def test_window_bounds_memory() -> None:
    t = SequenceTracker(window=4)
    for seq in range(10):
        t.observe(seq, bytes([seq]))
    assert t.classify(9, bytes([9])).kind is VerdictKind.DUPLICATE
    assert t.classify(2, bytes([2])).kind is VerdictKind.RESTART  # forgotten


def test_start_expectation_and_jump() -> None:
    t = SequenceTracker(5)
    assert t.classify(5).kind is VerdictKind.IN_ORDER
    assert t.classify(3).kind is VerdictKind.RESTART
    t.jump_to(9)
    assert t.observe(9).kind is VerdictKind.IN_ORDER
    assert t.new_epoch() == 1 and t.expected_seq is None


@pytest.mark.parametrize("bad", [-1])
def test_rejects_negative(bad: int) -> None:
    with pytest.raises(ValueError):
        SequenceTracker(bad)
    with pytest.raises(ValueError):
        SequenceTracker().jump_to(bad)


def test_repeat_of_last_seq_with_other_bytes_is_a_restart() -> None:
    # A restarted publisher that published as many batches as the old one: its
    # first seq seen equals the last one delivered; only the bytes differ.
    t = SequenceTracker()
    for seq in range(3):
        t.observe(seq, f"old-{seq}".encode())
    assert t.classify(2, b"old-2").kind is VerdictKind.DUPLICATE
    v = t.observe(2, b"new-2")
    assert (v.kind, v.last, v.got) == (VerdictKind.RESTART, 2, 2)
    assert t.epoch == 1 and t.expected_seq == 3
    assert t.observe(2, b"new-2").kind is VerdictKind.DUPLICATE  # now it is the new one's
    assert t.classify(1, b"old-1").kind is VerdictKind.RESTART  # old fingerprints are gone
    assert t.matches(2, b"new-2") is True and t.matches(2, b"old-2") is False
    assert t.matches(7, b"never seen") is None
