"""The subscriber's replay merge is a pure step: replayed + held live -> deliveries and losses."""

from __future__ import annotations

from tokenspeed_router.events.replay_merge import (
    RESYNC_REPLAY_INCOMPLETE,
    RESYNC_REPLAY_TIMEOUT,
    RESYNC_RING_EXHAUSTED,
    Loss,
    Message,
    merge_replay,
)
from tokenspeed_router.events.schema import KVEventBatch


def _msg(seq: int, *, replayed: bool) -> Message:
    return Message(seq, b"%d" % seq, KVEventBatch(0.0, []), b"", 0.0, replayed, 0.0)


def _shape(steps: list[Message | Loss]) -> list[object]:
    return [s.seq if isinstance(s, Message) else (s.expected, s.got, s.reason) for s in steps]


def test_replay_and_held_merge_in_order_with_duplicates_counted() -> None:
    replayed = [_msg(s, replayed=True) for s in (3, 4, 5, 6)]
    held = [_msg(s, replayed=False) for s in (6, 7, 2)]  # 2: a drop, left to the live path
    plan = merge_replay(3, replayed, held, fresh=False, failure=None)
    assert _shape(plan.steps) == [3, 4, 5, 6, 7]
    assert plan.held_consumed == 2 and plan.duplicates == 1
    assert plan.steps[3].replayed  # the replayed copy of 6 wins


def test_ring_exhausted_versus_incomplete_versus_failure() -> None:
    held = [_msg(9, replayed=False)]
    plan = merge_replay(2, [_msg(5, replayed=True), _msg(7, replayed=True)], held, fresh=False,
                         failure=None)
    assert _shape(plan.steps) == [(2, 5, RESYNC_RING_EXHAUSTED), 5, (6, 7, RESYNC_REPLAY_INCOMPLETE), 7]
    assert plan.held_consumed == 0  # 8 was published after the answer: the live path asks again
    plan = merge_replay(2, [], held, fresh=False, failure=RESYNC_REPLAY_TIMEOUT)
    assert _shape(plan.steps) == [(2, 9, RESYNC_REPLAY_TIMEOUT), 9]


def test_a_hole_after_the_answer_is_left_to_the_live_path() -> None:
    # Gap at 3 (live 4 seen); the answer was made when the ring ended at 5; live 6 was
    # lost on the way and 7, 8 arrived: 6 is not lost for good, the ring has it now.
    replayed = [_msg(s, replayed=True) for s in (3, 4, 5)]
    held = [_msg(s, replayed=False) for s in (4, 5, 7, 8)]
    plan = merge_replay(3, replayed, held, fresh=False, failure=None)
    assert _shape(plan.steps) == [3, 4, 5]
    assert plan.held_consumed == 2 and plan.duplicates == 2  # 7 and 8 stay held


def test_fresh_join_forgives_only_the_first_hole() -> None:
    replayed = [_msg(s, replayed=True) for s in (40, 41, 43)]
    plan = merge_replay(0, replayed, [_msg(44, replayed=False)], fresh=True, failure=None)
    assert _shape(plan.steps) == [(0, 40, None), 40, 41, (42, 43, RESYNC_REPLAY_INCOMPLETE), 43, 44]


def test_ring_ahead_of_the_live_stream_stops_at_the_hole() -> None:
    # Live stream at 5; the ring already holds 8..9 but not 6..7: those still arrive live.
    replayed = [_msg(s, replayed=True) for s in (4, 8, 9)]
    plan = merge_replay(4, replayed, [_msg(5, replayed=False)], fresh=False, failure=None)
    assert _shape(plan.steps) == [4, 5]


def test_empty_answer_gives_no_steps() -> None:
    plan = merge_replay(0, [], [], fresh=True, failure=None)
    assert plan.steps == [] and plan.held_consumed == 0
