"""Several router replicas on one real Redis: convergence, failover, warm restart.

Events come from real ZmqEventPublishers; the leader's subscriptions are
real EventSubscribers started from the stream's last seq per worker; a
``Reference`` router subscribed to the same publishers is the "single router
that saw everything" the replicas must agree with.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from support import wait_until
from support.state_harness import (
    Reference,
    Replica,
    Workers,
    queries,
    wait_converged,
    wait_leader,
)
from support.zmq_context import end_context

pytestmark = pytest.mark.redis

WORKERS = ["w0", "w1", "w2"]


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    end_context(context, strict=True)


@pytest.fixture
def workers(ctx: zmq.Context[Any]) -> Iterator[Workers]:
    w = Workers(WORKERS, ctx)
    yield w
    w.close()


@pytest.fixture
def reference(workers: Workers, ctx: zmq.Context[Any]) -> Iterator[Reference]:
    ref = Reference(workers.endpoints(), ctx)
    yield ref
    ref.close()


@pytest.fixture
def replicas(redis_url: str, workers: Workers, ctx: zmq.Context[Any]) -> Iterator[Any]:
    made: list[Replica] = []

    def make(name: str, **overrides: Any) -> Replica:
        replica = Replica(redis_url, name, workers.endpoints(), ctx, **overrides)
        made.append(replica)
        return replica.start()

    yield make
    for replica in made:
        replica.close()


def _nonempty(answers: list[dict[str, int]]) -> int:
    return sum(1 for a in answers if a)


def test_two_replicas_converge_on_identical_answers(
    replicas: Any, workers: Workers, reference: Reference
) -> None:
    a = replicas("a")
    b = replicas("b")
    leader = wait_leader(a, b)
    follower = b if leader is a else a
    workers.handshake(a, b, reference)
    workers.publish(40)
    wait_converged(workers, a, b, reference)
    expected = reference.answers()
    assert _nonempty(expected) > len(queries()) // 3
    assert a.answers() == expected
    assert b.answers() == expected
    health = follower.state.health()
    assert health.role == "follower" and not health.degraded
    assert health.stream_lag_entries == 0
    assert health.entries_applied >= 40 * len(WORKERS)
    wait_until(lambda: a.state.health().appended + b.state.health().appended
               == health.entries_applied, 10, what="every applied entry to be counted as appended")


def test_leader_killed_follower_takes_over_without_loss(
    replicas: Any, workers: Workers, reference: Reference
) -> None:
    a = replicas("a", lease_ttl_s=1.5)
    b = replicas("b", lease_ttl_s=1.5)
    leader = wait_leader(a, b)
    other = b if leader is a else a
    workers.handshake(a, b, reference)
    workers.publish(30)
    wait_converged(workers, a, b, reference)
    before = dict(other.seqs())

    leader.crash()  # SIGKILL-like: lease not released, nothing flushed
    workers.publish(20)  # nobody ingests now: the replay rings keep these
    assert wait_leader(other, timeout_s=15.0) is other
    # The new leader resumed every worker right after the last seq in the stream.
    assert other.pump.started_with[-1] == {w: s + 1 for w, s in before.items()}
    workers.publish(20)
    wait_converged(workers, other, reference)
    assert other.answers() == reference.answers()
    health = other.state.health()
    assert health.takeovers == 1 and health.fence is not None and health.fence >= 2
    # nothing applied twice, nothing missing: per worker, exactly one entry per seq
    assert health.duplicates_skipped == 0
    assert health.entries_applied == sum(s + 1 for s in workers.last_seq.values())


def test_restarted_replica_warms_from_snapshot_and_stream(
    replicas: Any, workers: Workers, reference: Reference
) -> None:
    a = replicas("a")
    wait_leader(a)
    workers.handshake(a, reference)
    workers.publish(30)
    wait_converged(workers, a, reference)
    snapshot_n = a.state.health().applied_n
    a.state.write_snapshot_soon()
    wait_until(lambda: a.state.health().snapshots_written >= 1, 10, what="a snapshot")
    workers.publish(15)  # the tail after the snapshot
    wait_converged(workers, a, reference)

    b = replicas("b")
    report = b.state.health().warm_start
    assert report is not None and report.source == "snapshot"
    assert report.snapshot_n == snapshot_n
    assert report.tail_entries == 15 * len(WORKERS)
    assert report.total_s < 5.0
    print(f"time to warm: {report.total_s * 1000:.1f} ms "
          f"(snapshot {report.snapshot_blocks} blocks + {report.tail_entries} entries)")
    assert b.answers() == reference.answers()
    workers.publish(10)
    wait_converged(workers, a, b, reference)
    assert b.answers() == a.answers() == reference.answers()


def test_duplicate_appends_are_applied_once(replicas: Any, workers: Workers) -> None:
    a = replicas("a")
    wait_leader(a)
    seen: list[Any] = []
    original = a.state.writer.submit

    def twice(item: Any) -> None:  # as if every append was retried after a lost reply
        seen.append(item)
        original(item)
        original(item)

    a.pump.submit = twice
    base = a.state.health().appended
    a.pump.start({})
    workers.handshake(a)
    # The writer counts a chunk once Redis answered: let the handshake's probes
    # be counted before taking the baseline, or they would land in the delta.
    wait_until(lambda: a.state.health().appended - base == 2 * len(seen), 10,
               what="the handshake's appends to be counted")
    before = a.state.health()
    seen.clear()
    workers.publish(10)
    wait_converged(workers, a)
    assert len(seen) == 10 * len(WORKERS)
    # (the writer counts a chunk after Redis answered; the follower may be faster)
    wait_until(lambda: a.state.health().appended - before.appended == 2 * len(seen), 10,
               what="the appends to be counted")
    health = a.state.health()
    assert health.duplicates_skipped - before.duplicates_skipped == len(seen)
    assert health.entries_applied - before.entries_applied == len(seen)
