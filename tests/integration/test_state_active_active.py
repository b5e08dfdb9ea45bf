"""Active-active replicas (``serve --state redis://...``, ``ingest=direct``) with real faults.

Every replica subscribes to every engine itself and shares its in-flight
work (load totals and route predictions) through a real redis-server. Two
replicas that split a request stream must decide as one router; then, with
real processes: a replica SIGKILLed mid-run, a replica joining late, Redis
restarted. No routing call may fail, and the survivors' view of the others'
in-flight work must be right within ``load_ttl_s``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from support import wait_until
from support.state_harness import Reference, Workers
from support.state_serve import Serve, handshake, wait_seqs

from tokenspeed_router.router.router import Router, RouterConfig

pytestmark = [pytest.mark.redis, pytest.mark.slow]

WORKERS = ["w0", "w1"]
OPTIONS = "&load_ttl_s=1.0&backoff_max_s=0.2&socket_timeout_s=0.5"
#: Engines of 1 token/s, never refitted: every queue is far longer than the test, so the
#: wall time between requests (the replicas wait for each other) drains every engine's
#: queue clock alike and changes no comparison: the replicas must decide exactly as the
#: one reference router, which shares their config on a frozen clock.
COST = ("--router-option", "prefill_tokens_per_s=1", "--router-option", "fit_prefill=false")


def _requests() -> list[list[int]]:
    """Prompts with repeated prefixes (not in any engine's cache): only predictions tell them apart."""
    heads = [[h * 100_000 + j for j in range(256 + 64 * h)] for h in range(3)]
    out = []
    for i in range(12):
        head = heads[i % 3]
        out.append(head + [900_000 + i * 1000 + j for j in range(16 * (i % 4))])
    return out


def _one_router(requests: list[list[int]]) -> list[str]:
    router = Router(None, RouterConfig(prefill_tokens_per_s=1.0, fit_prefill=False), clock=lambda: 0.0)
    for w in WORKERS:
        router.add_worker(w)
    return [router.route(tokens, request_id=f"q{i}").worker for i, tokens in enumerate(requests)]


@pytest.fixture
def cluster(redis_url: str) -> Iterator[tuple[Workers, Reference, Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    workers = Workers(WORKERS, ctx)
    reference = Reference(workers.endpoints(), ctx)
    made: list[Serve] = []

    def serve(name: str) -> Serve:
        s = Serve(name, redis_url, workers, "direct", OPTIONS, COST)
        made.append(s)
        return s

    yield workers, reference, serve
    for s in made:
        s.stop()
    reference.close()
    workers.close()
    ctx.term()


def test_active_active_replicas_decide_as_one_and_survive_faults(cluster: Any, redis_server: Any) -> None:
    workers, reference, serve = cluster
    a, b = serve("ra"), serve("rb")
    handshake(workers, a, b, reference)
    workers.publish(20)
    wait_seqs(workers, a, b, reference)
    expected = reference.answers()
    assert a.answers() == expected and b.answers() == expected  # both ingest directly
    state = a.state()
    assert state["ingest"] == "direct" and state["sharing"] == "shared" and not state["degraded"]

    # Split request by request, each change waited for: the same decisions as one router.
    requests = _requests()
    routed = {"ra": 0, "rb": 0}
    chosen = []
    for i, tokens in enumerate(requests):
        me, other = (a, b) if i % 2 == 0 else (b, a)
        chosen.append(me.route(tokens, f"q{i}")["worker"])
        routed[me.name] += 1
        wait_until(lambda o=other, m=me: o.peers_in_flight() == routed[m.name], 15, interval_s=0.01,
                   what="the other replica to see the route")
    assert chosen == _one_router(requests)
    shared = b.state()["shared_load"]
    assert shared["predictions_received"] >= 6 and shared["peers"] == 1

    # A replica SIGKILLed with requests in flight: its work expires from the survivor's view.
    a.kill()
    assert b.route(requests[0], "after-kill")["worker"] in WORKERS  # routing goes on
    routed["rb"] += 1
    wait_until(lambda: b.peers_in_flight() == 0, 15, interval_s=0.05, what="the dead replica's work to expire")

    # A replica joining late: the survivor's in-flight work within one heartbeat, a complete index.
    c = serve("rc")
    wait_until(lambda: c.peers_in_flight() == routed["rb"], 15, interval_s=0.05,
               what="the late replica to see the survivor's work")
    workers.publish(5)
    wait_seqs(workers, b, c, reference)
    assert c.answers() == reference.answers() == b.answers()
    c.route(requests[1], "c0")
    wait_until(lambda: b.peers_in_flight() == 1, 15, interval_s=0.05, what="the survivor to see c's route")

    # Redis restarted: both keep routing on their local view, say so, and share again after.
    redis_server.stop()
    try:
        for i in range(3):
            assert b.route(requests[i], f"down-{i}")["worker"] in WORKERS
        routed["rb"] += 3
        wait_until(lambda: b.http.get("/health").json()["status"] == "degraded", 15, interval_s=0.05,
                   what="b to report degraded sharing")
        health = b.http.get("/health")
        assert health.status_code == 200
        assert health.json()["state"]["sharing"] == "degraded"
        assert all(w["in_flight_sharing"] == "degraded" for w in b.workers().values())
    finally:
        redis_server.start()
    wait_until(lambda: c.peers_in_flight() == routed["rb"] and b.peers_in_flight() == 1, 20,
               interval_s=0.05, what="sharing to come back after the Redis restart")
    assert b.http.get("/health").json()["status"] == "ok"
    workers.publish(5)
    wait_seqs(workers, b, c, reference)
    assert c.answers() == reference.answers() == b.answers()
