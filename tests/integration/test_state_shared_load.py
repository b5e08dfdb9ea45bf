"""Router replicas share in-flight load through a real redis-server (state/load.py).

Two replicas splitting a request stream must decide as one router would; a
dead replica's load must stop counting; Redis down must fall back to local
load (counted and logged) and come back. Distinct prompts and no index keep
the decisions load-driven, so any difference is the load view's fault.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import wait_until
from support.server import ServeProcess
from support.state_harness import make_config

from tokenspeed_router.events.publisher import ZmqEventPublisher
from tokenspeed_router.router.cost import CostModel
from tokenspeed_router.router.router import Router, RouterConfig
from tokenspeed_router.state.load import SharedLoad

pytestmark = pytest.mark.redis

WORKERS = ("w0", "w1", "w2")


#: See Replica: queues far longer than any test, so waiting for Redis changes no decision.
SLOW = {"prefill_tokens_per_s": 1.0, "fit_prefill": False}
SLOW_OPTIONS = ("--router-option", "prefill_tokens_per_s=1", "--router-option", "fit_prefill=false")


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    """Distinct prompts of distinct lengths (no exact cost ties, no shared prefixes)."""
    rng = random.Random(seed)
    lengths = rng.sample(range(200, 2000), n)
    return [[i * 10_000 + j for j in range(length)] for i, length in enumerate(lengths)]


class Replica:
    """A Router plus its SharedLoad, locked the way the router service locks them."""

    def __init__(self, url: str | None, name: str, **overrides: Any) -> None:
        self.name = name
        self.lock = threading.Lock()
        # Engines of 1 token/s, never refitted: every queue is far longer than the test, so
        # the wall time these replicas spend waiting for Redis drains every queue alike and
        # changes no comparison ("decide as one router" stays exact, as for serve below).
        self.router = Router(None, RouterConfig(**SLOW), clock=lambda: 0.0)
        for w in WORKERS:
            self.router.add_worker(w)
        self.shared: SharedLoad | None = None
        if url is not None:
            config = make_config(url, name, **overrides)
            self.shared = SharedLoad(config, self.local_load).start()
            self.router.set_peer_load(self.shared)

    def local_load(self) -> dict[str, Any]:
        with self.lock:
            return self.router.load()

    def route(self, tokens: list[int], request_id: str) -> str:
        with self.lock:
            return self.router.route(tokens, request_id=request_id).worker

    def release(self, request_id: str) -> None:
        with self.lock:
            self.router.release(request_id)

    def peer_requests(self) -> int:
        assert self.shared is not None
        return sum(p.active_requests for p in self.shared.peers().values())

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()


@pytest.fixture
def made() -> Iterator[list[Replica]]:
    replicas: list[Replica] = []
    yield replicas
    for r in replicas:
        r.close()


def _drive(replicas: list[Replica], prompts: list[list[int]], *, wait: bool) -> list[str]:
    """Route prompts round-robin over replicas, releasing every third; optionally wait for sync."""
    chosen: list[str] = []
    for i, tokens in enumerate(prompts):
        r = replicas[i % len(replicas)]
        chosen.append(r.route(tokens, f"q{i}"))
        if i % 3 == 2:
            replicas[(i - 2) % len(replicas)].release(f"q{i - 2}")
        if wait:
            _wait_synced(replicas)
    return chosen


def _wait_synced(replicas: list[Replica]) -> None:
    """Every replica sees exactly the sum of the other replicas' current load."""
    def expected(me: Replica) -> dict[str, tuple[int, int, int]]:
        sums = {w: (0, 0, 0) for w in WORKERS}
        for r in replicas:
            if r is not me:
                for w, load in r.local_load().items():
                    q, p, a = sums[w]
                    sums[w] = (q + load.active_requests, p + load.pending_prefill_tokens,
                               a + load.active_tokens)
        return sums

    def seen(me: Replica) -> dict[str, tuple[int, int, int]]:
        assert me.shared is not None
        peers = me.shared.peers()
        return {w: ((peers[w].active_requests, peers[w].pending_prefill_tokens,
                     peers[w].active_tokens) if w in peers else (0, 0, 0)) for w in WORKERS}

    def synced() -> bool:
        return all(seen(r) == expected(r) for r in replicas)

    wait_until(synced, 10, what="replicas to see each other's load")


@pytest.mark.parametrize("transport", ["pubsub", "streams"])
def test_two_replicas_decide_as_one_router(redis_url: str, made: list[Replica], transport: str) -> None:
    prompts = _prompts(24)
    one = Replica(None, "single")
    reference = _drive([one], prompts, wait=False)
    made.extend([Replica(redis_url, "ra", flight_transport=transport),
                 Replica(redis_url, "rb", flight_transport=transport)])
    shared = _drive(made, prompts, wait=True)
    assert shared == reference
    # the same split without sharing piles up: each replica thinks the others' workers are idle
    alone = _drive([Replica(None, "xa"), Replica(None, "xb")], prompts, wait=False)
    assert alone != reference


def test_dead_replica_load_expires_and_clean_close_clears_at_once(
    redis_url: str, made: list[Replica]
) -> None:
    a = Replica(redis_url, "ra", load_ttl_s=0.6)
    b = Replica(redis_url, "rb", load_ttl_s=0.6)
    c = Replica(redis_url, "rc", load_ttl_s=0.6)
    made.extend([b])
    for i, tokens in enumerate(_prompts(3)):
        a.route(tokens, f"a{i}")
    c.route(_prompts(1, seed=9)[0], "c0")
    wait_until(lambda: b.peer_requests() == 4, 10, what="b to see a's and c's requests")
    assert b.shared is not None and b.shared.statistics().peers == 2

    c.close()  # clean: its fields are deleted, b sees it on its next sync
    wait_until(lambda: b.peer_requests() == 3, 5, what="c's load gone after its clean close")

    assert a.shared is not None
    a.shared.crash()  # as SIGKILL: nothing deleted; its fields expire after load_ttl_s
    wait_until(lambda: b.peer_requests() == 0, 10, what="a's load to expire")
    stats = b.shared.statistics()
    assert stats.peers == 0 and stats.sync_errors == 0 and not stats.fallback


def test_redis_down_falls_back_to_local_load_then_recovers(
    redis_url: str, redis_server: Any, made: list[Replica], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tokenspeed_router.state.load")
    overrides = {"load_ttl_s": 0.5, "backoff_max_s": 0.1, "socket_timeout_s": 0.3}
    a = Replica(redis_url, "ra", **overrides)
    b = Replica(redis_url, "rb", **overrides)
    made.extend([a, b])
    prompts = _prompts(6)
    a.route(prompts[0], "a0")
    wait_until(lambda: b.peer_requests() == 1, 10, what="b to see a's request")
    assert b.route(prompts[1], "b0") != "w0"  # a's request counts on b

    redis_server.stop()
    try:
        assert b.shared is not None
        wait_until(lambda: b.shared is not None and b.shared.statistics().fallback, 10,
                   what="b to fall back to local load")
        stats = b.shared.statistics()
        assert stats.sync_errors >= 1 and stats.peers == 0 and stats.last_error
        assert b.peer_requests() == 0
        # routing goes on, on local load alone: b's own request still counts, a's does not
        assert b.route(prompts[2], "b1") == "w0"
        assert any("Redis unreachable for load sharing" in r.getMessage() for r in caplog.records)
    finally:
        redis_server.start()
    wait_until(lambda: b.shared is not None and not b.shared.statistics().fallback
               and b.peer_requests() == 1, 15, what="load sharing to come back")
    assert any("load sharing back" in r.getMessage() for r in caplog.records)


def test_two_serve_processes_share_load(redis_url: str, tmp_path: Path) -> None:
    pubs = [ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
            for _ in WORKERS]
    specs = [a for w, p in zip(WORKERS, pubs, strict=True)
             for a in ("--worker", f"name={w},events={p.endpoint},replay={p.replay_endpoint}")]
    procs = [ServeProcess([*specs, *SLOW_OPTIONS,  # as Replica: see there
                           "--state", f"{redis_url}?replica_id={n}&load_ttl_s=1.0"
                                      "&lease_ttl_s=1.5&read_block_ms=50"], tmp_path)
             for n in ("ra", "rb")]
    try:
        for p in procs:
            p.start()
        prompts = _prompts(12)
        one = Replica(None, "single")
        reference = _drive([one], prompts, wait=False)
        chosen: list[str] = []
        routed = [0, 0]

        def synced() -> bool:
            for k, p in enumerate(procs):
                peers = sum(w["in_flight_peers"] for w in p.workers().values())
                if peers != routed[1 - k]:
                    return False
            return True

        # one change at a time, each waited for: a count seen equal is then the latest state
        for i, tokens in enumerate(prompts):
            k = i % 2
            chosen.append(procs[k].post("/route", {"token_ids": tokens, "request_id": f"q{i}"})["worker"])
            routed[k] += 1
            wait_until(synced, 15, interval_s=0.01, what="serve replicas to see each other's load")
            if i % 3 == 2:
                procs[(i - 2) % 2].post("/release", {"request_id": f"q{i - 2}"})
                routed[(i - 2) % 2] -= 1
                wait_until(synced, 15, interval_s=0.01, what="serve replicas to see the release")
        assert chosen == reference
        health = procs[0].get("/health")["state"]["shared_load"]
        assert health["peers"] == 1 and health["sync_errors"] == 0
        assert "tokenspeed_state_load_peers 1.0" in procs[0].http.get("/metrics").text

        procs[0].proc.kill()  # type: ignore[union-attr]
        procs[0].proc.wait()  # type: ignore[union-attr]
        wait_until(lambda: sum(w["in_flight_peers"] for w in procs[1].workers().values()) == 0,
                   15, interval_s=0.05, what="the killed replica's load to expire")
        assert procs[1].stop() == 0  # clean shutdown with the load thread running
    finally:
        for p in procs:
            if p.proc is not None:
                p.stop()
        for pub in pubs:
            pub.close()


def test_replicas_learn_one_share_of_session_follow_ups(redis_url: str, made: list[Replica]) -> None:
    """The cost model's share of requests carrying a session's own history (router/cost.py) counts
    every replica's routes: each route's flag travels with it (the message's ``histories``)."""
    made.extend([Replica(redis_url, "ha"), Replica(redis_url, "hb")])
    ha, hb = made
    assert ha.shared is not None and hb.shared is not None
    routes = 0
    for i, first in enumerate(_prompts(30, seed=11)):
        ha.route(first, f"first{i}")  # a new session: no history anywhere
        ha.route([*first, *range(90_000_000, 90_000_300)], f"next{i}")  # its next turn: its own history
        routes += 2
    after_ha = ha.router.followup_share
    assert after_ha > 0.1
    wait_until(lambda: hb.shared.statistics().predictions_received == routes, 10,  # type: ignore[union-attr]
               what="the peer's routes to arrive")
    hb.route(list(range(80_000_000, 80_000_500)), "fresh")  # takes the peer's routes in, then its own
    assert hb.router.followup_share == pytest.approx(after_ha * (1.0 - CostModel.SHARE_GAIN))
