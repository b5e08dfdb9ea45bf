"""The subscriber's replay merge is a pure step: replayed + held live -> deliveries and losses."""

from __future__ import annotations

from tokenspeed_router.events.schema import KVEventBatch
from tokenspeed_router.events.subscriber import (
    RESYNC_REPLAY_INCOMPLETE,
    RESYNC_REPLAY_TIMEOUT,
    RESYNC_RING_EXHAUSTED,
    _Loss,
    _merge_replay,
    _Message,
)


def _msg(seq: int, *, replayed: bool) -> _Message:
    return _Message(seq, b"%d" % seq, KVEventBatch(0.0, []), b"", 0.0, replayed)


def _shape(steps: list[_Message | _Loss]) -> list[object]:
    return [s.seq if isinstance(s, _Message) else (s.expected, s.got, s.reason) for s in steps]


def test_replay_and_held_merge_in_order_with_duplicates_counted() -> None:
    replayed = [_msg(s, replayed=True) for s in (3, 4, 5, 6)]
    held = [_msg(s, replayed=False) for s in (6, 7, 2)]  # 2: a drop, left to the live path
    plan = _merge_replay(3, replayed, held, fresh=False, failure=None)
    assert _shape(plan.steps) == [3, 4, 5, 6, 7]
    assert plan.held_consumed == 2 and plan.duplicates == 1
    assert plan.steps[3].replayed  # the replayed copy of 6 wins


def test_ring_exhausted_versus_incomplete_versus_failure() -> None:
    held = [_msg(9, replayed=False)]
    plan = _merge_replay(2, [_msg(5, replayed=True)], held, fresh=False, failure=None)
    assert _shape(plan.steps) == [(2, 5, RESYNC_RING_EXHAUSTED), 5, (6, 9, RESYNC_REPLAY_INCOMPLETE), 9]
    plan = _merge_replay(2, [], held, fresh=False, failure=RESYNC_REPLAY_TIMEOUT)
    assert _shape(plan.steps) == [(2, 9, RESYNC_REPLAY_TIMEOUT), 9]


def test_fresh_join_forgives_only_the_first_hole() -> None:
    replayed = [_msg(s, replayed=True) for s in (40, 41, 43)]
    plan = _merge_replay(0, replayed, [_msg(44, replayed=False)], fresh=True, failure=None)
    assert _shape(plan.steps) == [(0, 40, None), 40, 41, (42, 43, RESYNC_REPLAY_INCOMPLETE), 43, 44]


def test_ring_ahead_of_the_live_stream_stops_at_the_hole() -> None:
    # Live stream at 5; the ring already holds 8..9 but not 6..7: those still arrive live.
    replayed = [_msg(s, replayed=True) for s in (4, 8, 9)]
    plan = _merge_replay(4, replayed, [_msg(5, replayed=False)], fresh=False, failure=None)
    assert _shape(plan.steps) == [4, 5]


def test_empty_answer_gives_no_steps() -> None:
    plan = _merge_replay(0, [], [], fresh=True, failure=None)
    assert plan.steps == [] and plan.held_consumed == 0
