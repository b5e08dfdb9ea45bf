"""``serve --state redis://...`` end to end: real processes, real publishers, SIGKILL.

Two router processes share one redis-server; only the lease holder subscribes
to the workers. Their ``/match`` answers must agree, and after the leader is
SIGKILLed the survivor takes over and agrees with a router that saw everything.
A third process started later comes up warm from the snapshot + stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from support import wait_until
from support.proc_cpu import cpu_share
from support.state_harness import Reference, Workers
from support.state_serve import Serve, handshake, one_leader, wait_seqs

pytestmark = [pytest.mark.redis, pytest.mark.slow]

WORKERS = ["w0", "w1"]


@pytest.fixture
def setup(redis_url: str) -> Iterator[tuple[Workers, Reference, Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    workers = Workers(WORKERS, ctx)
    reference = Reference(workers.endpoints(), ctx)
    made: list[Serve] = []

    def serve(name: str, ingest: str = "stream") -> Serve:
        s = Serve(name, redis_url, workers, ingest)
        made.append(s)
        return s

    yield workers, reference, serve
    for s in made:
        s.stop()
    reference.close()
    workers.close()
    ctx.term()


def test_serve_replicas_agree_survive_sigkill_and_warm_restart(setup: Any) -> None:
    workers, reference, serve = setup
    a = serve("ra")
    b = serve("rb")
    leader = wait_until(lambda: one_leader(a, b), 20, interval_s=0.05, what="one leader")
    assert leader is not None
    other = b if leader is a else a
    handshake(workers, a, b, reference)
    workers.publish(30)
    wait_seqs(workers, a, b, reference)
    expected = reference.answers()
    assert a.answers() == expected and b.answers() == expected
    state = other.state()
    assert state["role"] == "follower" and not state["degraded"]
    assert state["stream_lag_entries"] == 0

    leader.kill()
    workers.publish(10)
    wait_until(lambda: other.state()["role"] == "leader", 20, interval_s=0.05,
               what="the survivor to take the lease")
    workers.publish(10)
    wait_seqs(workers, other, reference)
    assert other.answers() == reference.answers()

    c = serve("rc")  # a restarted replica: snapshot (if any) + stream, timed
    wait_seqs(workers, c)
    warm = c.state()["warm_start"]
    assert warm is not None and warm["source"] in ("snapshot", "stream")
    print(f"serve replica warm in {warm['total_s'] * 1000:.1f} ms from {warm['source']}")
    assert c.answers() == reference.answers()
    metrics = c.http.get("/metrics").text
    assert "tokenspeed_state_role" in metrics and "tokenspeed_state_entries_applied" in metrics


def test_idle_replicas_do_not_spin(setup: Any) -> None:
    """A follower holds no event socket: its ingestion loop must block, not poll nothing.

    It used to spin (77-97% of a core, idle or loaded) because a zmq poll over
    no sockets returns at once. Measured from /proc over a 2 s window: an idle
    replica uses a few percent of a core; the bound leaves room for a loaded
    machine. Both ingestion modes: ``stream`` (leader + follower) and ``direct``.
    """
    workers, _reference, serve = setup
    a = serve("ra")
    b = serve("rb")
    leader = wait_until(lambda: one_leader(a, b), 20, interval_s=0.05, what="one leader")
    assert leader is not None
    follower = b if leader is a else a
    c = serve("rc", ingest="direct")
    handshake(workers, a, b, c)
    assert follower.state()["role"] == "follower"
    assert c.state()["ingest"] == "direct"
    shares = {p.name: cpu_share(p.proc.pid, 2.0) for p in (follower, leader, c)}
    print(f"idle CPU share (cores): {shares}")
    assert all(share < 0.2 for share in shares.values()), shares
