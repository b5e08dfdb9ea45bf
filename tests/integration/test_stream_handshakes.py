"""A stream that connects but never works is named per worker, and /health is degraded.

Real relays with CURVE (as ``tests/integration/test_relay_curve.py`` starts
them), real publishers and a real ``RouterService`` subscribing to them:

* the router holds the wrong server key (the relay's is another): the relay
  drops every handshake, the TCP connection comes back every reconnect
  interval; before, ``/health`` said ``ok`` for minutes;
* the relay refuses the router's client key (not on its allow-list);
* the router speaks plain ZeroMQ to a CURVE relay (mechanism mismatch);
* the spec's ``topic=`` is not the publisher's: the publisher filters, so the
  stream stays silent; the topic probe sees what does get published.

A healthy CURVE stream and an idle stream with the right topic are named
nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import wait_until
from support.relay import Ctx, Engine, RelayThread
from support.server import ServeProcess, batch, stored, tokens

from tokenspeed_router.events.curve import generate_key_files
from tokenspeed_router.events.publisher import ZmqEventPublisher
from tokenspeed_router.server import RouterService, ServerConfig, ingest_loop
from tokenspeed_router.server.worker_spec import WorkerSpec


class Keys:
    def __init__(self, folder: Path) -> None:
        self.relay_pub, self.relay_secret = generate_key_files(folder / "relay", "relay")
        self.other_pub, _ = generate_key_files(folder / "other", "other")
        self.router_pub, self.router_secret = generate_key_files(folder / "router", "router")
        self.stranger_pub, self.stranger_secret = generate_key_files(folder / "stranger", "stranger")


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return Keys(tmp_path)


@pytest.fixture
def relay(ctx: Ctx, keys: Keys) -> Iterator[RelayThread]:
    engine = Engine(ctx, buffer_steps=100)
    thread = RelayThread(ctx, engine, buffer_steps=8, curve_secret_key=str(keys.relay_secret),
                         curve_allow=(str(keys.router_pub),))
    try:
        yield thread
    finally:
        thread.close()
        engine.close()


def _service(*specs: WorkerSpec) -> RouterService:
    # stale_after_s long: these tests look at the named cause, not at staleness
    service = RouterService(ServerConfig(http=None, workers=specs, stale_after_s=120.0))
    service.start()
    return service


def _spec(name: str, relay: RelayThread, **kw: Any) -> WorkerSpec:
    return WorkerSpec(name=name, events=relay.relay.endpoint, replay=relay.relay.replay_endpoint, **kw)


def _named(service: RouterService, name: str, fragment: str) -> dict[str, Any]:
    """Wait until ``name``'s stream problem mentions ``fragment``; return /health."""
    def named() -> bool:
        problem = service.workers()[name]["stream_problem"]
        return problem is not None and fragment in problem

    wait_until(named, 20, what=f"{name}'s stream problem naming {fragment!r}")
    health = service.health()
    assert health["status"] == "degraded", health
    assert fragment in health["stream_problems"][name]
    assert any(p.startswith(f"worker {name}: ") and fragment in p for p in health["problems"]), health
    return health


@pytest.mark.parametrize("case", ["wrong server key", "refused client key", "plaintext to CURVE"])
def test_a_failed_handshake_is_named_and_health_degraded(ctx: Ctx, relay: RelayThread, keys: Keys,
                                                         case: str) -> None:
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", context=ctx)
    good = WorkerSpec(name="good", events=pub.endpoint)
    if case == "wrong server key":
        bad = _spec("bad", relay, curve_server_key=str(keys.other_pub), curve_key=str(keys.router_secret))
        fragment = "curve_server_key"
    elif case == "refused client key":
        bad = _spec("bad", relay, curve_server_key=str(keys.relay_pub), curve_key=str(keys.stranger_secret))
        fragment = "refused our CURVE client key (ZAP status 400)"
    else:
        bad = _spec("bad", relay)
        fragment = "mechanism mismatch"
    service = _service(good, bad)
    try:
        health = _named(service, "bad", fragment)
        assert "good" not in health["stream_problems"]
        workers = service.workers()
        assert workers["good"]["stream_problem"] is None and workers["good"]["connected"]
        assert not workers["bad"]["connected"]  # a TCP connection without a handshake is not one
    finally:
        service.stop()
        pub.close()


def test_the_only_stream_with_a_wrong_key_is_named_then_unavailable_once_stale(
        relay: RelayThread, keys: Keys) -> None:
    """Degraded at once with the cause; and like any stream that never delivers, stale after
    stale_after_s, which with no other stream makes the router unavailable (as a refused key does)."""
    bad = _spec("bad", relay, curve_server_key=str(keys.other_pub), curve_key=str(keys.router_secret))
    service = RouterService(ServerConfig(http=None, workers=(bad,), stale_after_s=1.0))
    service.start()
    try:
        _named(service, "bad", "curve_server_key")
        wait_until(lambda: service.health()["status"] == "unavailable", 20, what="unavailable once stale")
        health = service.health()
        assert any("every worker is stale" in p for p in health["problems"])
        assert "curve_server_key" in health["stream_problems"]["bad"]  # and still why
    finally:
        service.stop()


@pytest.fixture
def fast_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingest_loop, "TOPIC_PROBE_AFTER_S", 0.3)


def test_a_wrong_topic_is_named_once_the_publisher_publishes(ctx: Ctx, fast_probe: None) -> None:
    pubs = [ZmqEventPublisher("tcp://127.0.0.1:*", context=ctx, topic="kv@engine-7") for _ in range(2)]
    right = WorkerSpec(name="right", events=pubs[0].endpoint, topic="kv@engine-7")
    wrong = WorkerSpec(name="wrong", events=pubs[1].endpoint, topic="kv@engine-9")
    service = _service(right, wrong)
    try:
        seed = iter(range(1, 10_000))

        def named() -> bool:
            for pub in pubs:
                pub.publish(batch(stored(tokens(next(seed), 1)), ts=time.time()))
            return service.workers()["wrong"]["stream_problem"] is not None

        wait_until(named, 20, interval_s=0.05, what="the wrong topic to be named")
        health = _named(service, "wrong", "publishes under topic 'kv@engine-7', not under the spec's "
                                          "topic='kv@engine-9'")
        assert "right" not in health["stream_problems"]
        assert service.workers()["right"]["blocks"] > 0
    finally:
        service.stop()
        for pub in pubs:
            pub.close()


def test_an_idle_stream_is_not_a_problem(ctx: Ctx, relay: RelayThread, keys: Keys, fast_probe: None) -> None:
    """Idle with the right topic, or with a wrong one on a publisher that publishes nothing:
    nothing to name (the latter is undetectable: docs/service.md, "connected but silent")."""
    pubs = [ZmqEventPublisher("tcp://127.0.0.1:*", context=ctx, topic="kv") for _ in range(2)]
    idle = WorkerSpec(name="idle", events=pubs[0].endpoint, topic="kv")
    silent = WorkerSpec(name="silent", events=pubs[1].endpoint, topic="other")
    curve = _spec("curve", relay, curve_server_key=str(keys.relay_pub), curve_key=str(keys.router_secret))
    service = _service(idle, silent, curve)
    try:
        wait_until(lambda: all(w["connected"] for w in service.workers().values()), 20, what="all connected")
        deadline = time.monotonic() + 1.0  # well past the probe's 0.3 s: probes run, see nothing
        while time.monotonic() < deadline:
            assert service.health()["status"] == "ok", service.health()
        assert all(w["stream_problem"] is None for w in service.workers().values())
    finally:
        service.stop()
        for pub in pubs:
            pub.close()


def test_serve_answers_degraded_with_the_cause_over_http(relay: RelayThread, keys: Keys, tmp_path: Path) -> None:
    """The issue's run: ``serve`` given the wrong relay key; GET /health is 200 "degraded" naming it."""
    spec = (f"name=w0,events={relay.relay.endpoint},replay={relay.relay.replay_endpoint},"
            f"curve_server_key={keys.other_pub},curve_key={keys.router_secret}")
    with ServeProcess(["--worker", spec, "--stale-after-s", "300"], tmp_path).start() as serve:
        def named() -> bool:
            resp = serve.http.get("/health")
            return resp.status_code == 200 and resp.json()["status"] == "degraded"

        wait_until(named, 20, what="GET /health degraded")
        health = serve.http.get("/health").json()
        assert "curve_server_key" in health["stream_problems"]["w0"]
        assert "curve_server_key" in serve.workers()["w0"]["stream_problem"]
