"""The Redis state backend when Redis misbehaves: restarts, outages, trimming.

The session redis-server runs without persistence, so a restart loses the
stream, the lease and the snapshots: the leader must re-seed the stream from
its own index and followers must notice the new generation and resync.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from support import wait_until
from support.state_harness import Reference, Replica, Workers, wait_converged, wait_leader
from support.zmq_context import end_context

pytestmark = pytest.mark.redis

WORKERS = ["w0", "w1"]


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
def replicas(redis_url: str, redis_server: Any, workers: Workers,
             ctx: zmq.Context[Any]) -> Iterator[Any]:
    made: list[Replica] = []

    def make(name: str, **overrides: Any) -> Replica:
        replica = Replica(redis_url, name, workers.endpoints(), ctx, **overrides)
        made.append(replica)
        return replica.start()

    yield make
    for replica in made:
        replica.close()
    if redis_server.proc is None:
        redis_server.start()


def test_redis_restart_mid_stream_both_recover(
    replicas: Any, redis_server: Any, workers: Workers, reference: Reference
) -> None:
    a = replicas("a")
    b = replicas("b")
    leader = wait_leader(a, b)
    follower = b if leader is a else a
    workers.handshake(a, b, reference)
    workers.publish(25)
    wait_converged(workers, a, b, reference)
    generation = leader.state.health().generation

    redis_server.restart()  # no persistence: stream, lease, snapshots are gone
    workers.publish(25)  # the leader keeps receiving (and buffering) meanwhile
    wait_until(lambda: follower.state.health().resets_detected >= 1, 15,
               what="the follower to notice the stream reset")
    wait_converged(workers, a, b, reference)
    expected = reference.answers()
    assert a.answers() == expected
    assert b.answers() == expected
    for replica in (a, b):
        health = replica.state.health()
        assert health.generation != generation
        assert not health.degraded, health.reason
    workers.publish(10)
    wait_converged(workers, a, b, reference)
    assert a.answers() == b.answers() == reference.answers()


def test_redis_down_replicas_keep_serving_and_report_degraded(
    replicas: Any, redis_server: Any, workers: Workers, reference: Reference
) -> None:
    a = replicas("a")
    b = replicas("b")
    leader = wait_leader(a, b)
    follower = b if leader is a else a
    workers.handshake(a, b, reference)
    workers.publish(20)
    wait_converged(workers, a, b, reference)
    before = follower.answers()

    redis_server.stop()
    wait_until(lambda: follower.state.health().degraded, 10, what="follower degraded")
    wait_until(lambda: leader.state.health().degraded, 10, what="leader degraded")
    health = follower.state.health()
    assert not health.connected and health.reason and "unreachable" in health.reason
    assert follower.answers() == before  # queries never touch Redis
    workers.publish(10)  # buffered by the leader
    wait_until(lambda: leader.state.health().buffered == 10 * len(WORKERS), 10,
               what="leader to buffer while Redis is down")

    redis_server.start()
    wait_converged(workers, a, b, reference, timeout_s=30)
    assert a.answers() == b.answers() == reference.answers()
    wait_until(lambda: not follower.state.health().degraded, 10, what="follower healthy again")
    assert leader.state.health().dropped == 0


def test_leader_buffer_overflow_drops_and_marks_workers_resyncing(
    replicas: Any, redis_server: Any, workers: Workers
) -> None:
    leader = a = replicas("a", buffer_size=6)
    wait_leader(a)
    # b retries the lease only every 20 s: after Redis restarts, a gets it back
    # (otherwise b would lead and replay everything from the workers' rings).
    follower = b = replicas("b", buffer_size=6, lease_ttl_s=60.0, lease_renew_s=20.0)
    workers.handshake(a, b)
    workers.publish(5)
    wait_converged(workers, a, b)

    redis_server.stop()
    workers.publish(10)  # 20 items into a 6-entry buffer
    wait_until(lambda: leader.state.health().dropped > 0, 10, what="leader to drop")
    redis_server.start()
    workers.publish(3)  # the next item of each worker carries the resync marker in
    wait_converged(workers, a, b, timeout_s=30)
    health = leader.state.health()
    assert health.role == "leader" and health.takeovers == 1
    assert health.dropped >= 10 * len(WORKERS) - 6  # + the last 3 rounds if still down
    assert set(health.dropped_workers) == set(WORKERS)
    with leader.host.locked():
        resyncing = [w for w, s in leader.host.ingestor.statuses().items()
                     if s.state.value == "resyncing"]
    assert health.degraded == bool(resyncing)  # degraded while hit workers are resyncing
    if resyncing:
        assert "dropped" in (health.reason or "")
    with follower.host.locked():
        resyncs = {w: s.resyncs for w, s in follower.host.ingestor.statuses().items()}
    assert all(resyncs[w] >= 1 for w in WORKERS), resyncs


def test_trimmed_stream_is_detected_and_snapshot_fixes_it(
    replicas: Any, workers: Workers, reference: Reference
) -> None:
    a = replicas("a", maxlen=20)
    wait_leader(a)
    workers.handshake(a, reference)
    for _ in range(30):  # 300 entries into a stream of about 20 (whole nodes trimmed),
        workers.publish(5)  # paced so that the leader's own follower keeps up
        wait_converged(workers, a, reference)
    assert a.state.health().stream_gaps == 0

    late = replicas("late", maxlen=20)  # only the seed snapshot (n=0) exists: a gap
    health = late.state.health()
    assert health.stream_gaps >= 1
    with late.host.locked():
        resyncs = {w: s.resyncs for w, s in late.host.ingestor.statuses().items()}
    # every worker was cleared and marked resyncing (some may have recovered
    # already from the clean batches of the tail)
    assert all(resyncs.get(w, 0) >= 1 for w in WORKERS), resyncs

    a.state.write_snapshot_soon()
    wait_until(lambda: a.state.health().snapshots_written >= 1, 10, what="snapshot")
    workers.publish(3)
    wait_converged(workers, a, reference)
    fresh = replicas("fresh", maxlen=20)
    health = fresh.state.health()
    assert health.stream_gaps == 0 and not health.degraded
    assert health.warm_start is not None and health.warm_start.source == "snapshot"
    assert fresh.answers() == reference.answers()
