"""HTTP API handlers (Starlette TestClient): DESIGN §6 shapes, bad input, limits, auth."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import msgspec
import pytest
from starlette.exceptions import StarletteDeprecationWarning
from support.server import batch, nonzero, removed, stored, tokens

from tokenspeed_router.server import ApiLimits, RouterService, ServerConfig, create_app

with warnings.catch_warnings():
    # Starlette 1.x asks for the httpx2 fork in its TestClient; httpx works the same here.
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from starlette.testclient import TestClient


def _service(**kwargs: object) -> RouterService:
    service = RouterService(ServerConfig(http=None, **kwargs))  # type: ignore[arg-type]
    service.start()
    a, b = tokens(1, 4), tokens(2, 2)
    service.apply_record("w0", 0, batch(stored(a)), 1.0)
    service.apply_record("w1", 0, batch(stored(a[:32]), stored(b, medium="cpu")), 1.0)
    return service


@pytest.fixture
def client() -> Iterator[TestClient]:
    service = _service(limits=ApiLimits(max_tokens=1000, max_body_bytes=20_000))
    with TestClient(create_app(service)) as c:
        yield c
    service.stop()


def test_match_shape_and_tiers(client: TestClient) -> None:
    resp = client.post("/match", json={"token_ids": [*tokens(1, 4), 7, 8]})
    assert resp.status_code == 200
    assert resp.json() == {
        "scores": {"w0": 4, "w1": 2},
        "block_size": {"w0": 16, "w1": 16},
        "tiers": {"w0": {"gpu": 4, "cpu": 0, "storage": 0}, "w1": {"gpu": 2, "cpu": 0, "storage": 0}},
    }
    cpu = client.post("/match", json={"token_ids": tokens(2, 2)}).json()
    assert nonzero(cpu["scores"]) == {"w1": 2} and cpu["tiers"]["w1"]["cpu"] == 2
    # a LoRA namespace matches nothing stored without it (by id or by name)
    assert nonzero(client.post("/match", json={"token_ids": tokens(1, 4), "lora_id": 3}).json()["scores"]) == {}
    assert nonzero(client.post("/match", json={"token_ids": tokens(1, 4), "lora_id": "sql"}).json()["scores"]) == {}


def test_lora_by_name_or_id() -> None:
    """vLLM publishes ``lora_name``; SGLang/TokenSpeed a numeric ``lora_id``: both can be asked for."""
    service = RouterService(ServerConfig(http=None))
    a = tokens(1, 2)
    service.apply_record("named", 0, batch(msgspec.structs.replace(stored(a), lora_name="sql")), 1.0)
    service.apply_record("numbered", 0, batch(msgspec.structs.replace(stored(a), lora_id=7)), 1.0)
    with TestClient(create_app(service)) as c:
        by_name = c.post("/match", json={"token_ids": a, "lora_id": "sql"})
        assert by_name.status_code == 200, by_name.text
        assert nonzero(by_name.json()["scores"]) == {"named": 2}
        assert nonzero(c.post("/match", json={"token_ids": a, "lora_id": 7}).json()["scores"]) == {"numbered": 2}
        assert nonzero(c.post("/match", json={"token_ids": a}).json()["scores"]) == {}
        assert c.post("/route", json={"token_ids": a, "lora_id": "sql"}).json()["worker"] == "named"
    service.stop()


def test_route_release_and_workers(client: TestClient) -> None:
    resp = client.post("/route", json={"token_ids": tokens(1, 4), "request_id": "r1"})
    assert resp.status_code == 200
    body = resp.json()
    assert set(body) == {"worker", "matched_blocks", "matched_tokens", "scores", "prefill_worker",
                         "decode_worker", "request_id"}
    assert body["worker"] == "w0" and body["matched_blocks"] == 4 and body["matched_tokens"] == 64
    assert body["request_id"] == "r1" and body["decode_worker"] == "w0"
    workers = client.get("/workers").json()
    assert workers["w0"]["in_flight"] == 1
    assert workers["w0"]["state"] == "live" and workers["w0"]["blocks"] == 4
    assert workers["w1"]["blocks_by_tier"] == {"gpu": 2, "cpu": 2, "storage": 0}
    # DESIGN §6: {name: info} at the top level; info has role, state, blocks held,
    # last seq, events applied, lag (under both the short and the literal names)
    assert set(workers) == {"w0", "w1"}
    for key in ("role", "state", "blocks", "blocks_held", "last_seq", "events_applied", "lag_s", "lag"):
        assert key in workers["w0"]
    assert workers["w0"]["blocks_held"] == workers["w0"]["blocks"] == 4
    assert workers["w0"]["lag"] == workers["w0"]["lag_s"]
    assert client.post("/release", json={"request_id": "r1"}).json() == {}
    assert client.get("/workers").json()["w0"]["in_flight"] == 0
    # unknown / already released ids are not errors (idempotent release)
    assert client.post("/release", json={"request_id": "r1"}).status_code == 200
    assert client.post("/route", json={"token_ids": [1, 2, 3]}).json()["request_id"]


def test_health_and_metrics(client: TestClient) -> None:
    assert client.get("/health").json()["status"] == "ok"
    client.post("/route", json={"token_ids": tokens(1, 4)})
    text = client.get("/metrics").text
    for name in ("tokenspeed_route_latency_seconds_bucket", "tokenspeed_match_latency_seconds_count",
                 'tokenspeed_route_decisions_total{worker="w0"}', "tokenspeed_ingest_events_applied_total",
                 'tokenspeed_index_blocks{tier="gpu",worker="w0"}', "tokenspeed_worker_lag_seconds",
                 "tokenspeed_route_predicted_hit_tokens_total", 'tokenspeed_worker_state{state="live",worker="w0"}'):
        assert name in text, name


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/match", b"", 400, "empty request body"),
        ("/match", b"{not json", 400, "malformed JSON"),
        ("/match", b"[1,2]", 400, "Expected `object`"),
        ("/match", b"{}", 400, "missing required field `token_ids`"),
        ("/match", b'{"token_ids": "abc"}', 400, "Expected `array`"),
        ("/match", b'{"token_ids": [1, "x"]}', 400, "$.token_ids[1]"),
        ("/match", b'{"token_ids": [1, -5]}', 400, ">= 0"),
        ("/match", b'{"token_ids": [1, 1e30]}', 400, "Expected `int`"),
        ("/match", b'{"token_ids": [99999999999999999999999]}', 400, "<= 9223372036854775807"),
        ("/match", b'{"token_ids": [1], "lora_id": ""}', 400, "$.lora_id"),
        ("/match", b'{"token_ids": [1], "lora_id": -1}', 400, "$.lora_id"),
        ("/match", b'{"token_ids": [1], "lora_id": 1.5}', 400, "$.lora_id"),
        ("/match", b'{"token_ids": [1], "lora_id": [1]}', 400, "$.lora_id"),
        ("/match", b'{"token_ids": [1], "salt": 5}', 400, "$.salt"),
        ("/route", b'{"token_ids": [1], "request_id": ""}', 400, "request_id"),
        ("/route", b'{"token_ids": [1], "request_id": [1]}', 400, "$.request_id"),
        ("/release", b"{}", 400, "missing required field `request_id`"),
        ("/match", b'{"token_ids": [' + b"1," * 1000 + b"1]}", 413, "limit 1000"),
        ("/match", b'{"token_ids": [' + b"1," * 12_000 + b"1]}", 413, "exceeds the limit"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_problem(
    client: TestClient, path: str, body: bytes, status: int, fragment: str
) -> None:
    resp = client.post(path, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    assert fragment in resp.json()["error"]
    # and the index is untouched
    assert client.post("/match", json={"token_ids": tokens(1, 4)}).json()["scores"]["w0"] == 4


def test_unknown_paths_methods_and_workers(client: TestClient) -> None:
    assert client.get("/nope").status_code == 404 and "error" in client.get("/nope").json()
    resp = client.get("/match")
    assert resp.status_code == 405 and "not allowed" in resp.json()["error"]
    resp = client.delete("/workers/ghost")
    assert resp.status_code == 404 and "unknown worker 'ghost'" in resp.json()["error"]
    resp = client.put("/workers/w9", json={"events": "http://nope"})
    assert resp.status_code == 400 and "not a ZeroMQ endpoint" in resp.json()["error"]
    resp = client.put("/workers/w9", json={"events": "tcp://127.0.0.1:1", "colour": "red"})
    assert resp.status_code == 400 and "colour" in resp.json()["error"]
    resp = client.put("/workers/w9", content=b"[" * 5_000 + b"]" * 5_000)
    assert resp.status_code == 400 and "nested too deeply" in resp.json()["error"]
    resp = client.post("/match", content=b"[" * 5_000 + b"]" * 5_000)
    assert resp.status_code == 400


def test_put_and_delete_workers_at_run_time(client: TestClient) -> None:
    resp = client.put("/workers/w9", json={"events": "tcp://127.0.0.1:1", "role": "decode", "dp_ranks": 2})
    assert resp.status_code == 201, resp.text
    assert resp.json()["streams"] == ["w9/dp0", "w9/dp1"]
    workers = client.get("/workers").json()
    assert workers["w9/dp1"]["role"] == "decode" and workers["w9/dp1"]["events_endpoint"] == "tcp://127.0.0.1:2"
    # same spec again: no change
    assert client.put("/workers/w9", json={"events": "tcp://127.0.0.1:1", "role": "decode", "dp_ranks": 2}).status_code == 200
    # an endpoint in use by another worker is a conflict
    resp = client.put("/workers/w10", json={"events": "tcp://127.0.0.1:2"})
    assert resp.status_code == 409 and "already used" in resp.json()["error"]
    resp = client.delete("/workers/w9/dp1")
    assert resp.status_code == 409 and "one rank of worker 'w9'" in resp.json()["error"]
    assert client.delete("/workers/w9").json() == {"removed": ["w9/dp0", "w9/dp1"]}
    assert "w9/dp0" not in client.get("/workers").json()
    # a worker known only from its events can be removed too
    assert client.delete("/workers/w1").status_code == 200
    assert nonzero(client.post("/match", json={"token_ids": tokens(2, 2)}).json()["scores"]) == {}


def test_removal_keeps_no_stale_claims() -> None:
    service = _service()
    a = tokens(1, 4)
    service.apply_record("w0", 1, batch(removed(a, 2, 2)), 2.0)
    with TestClient(create_app(service)) as c:
        assert c.post("/match", json={"token_ids": a}).json()["scores"]["w0"] == 2
    service.stop()


def test_auth_required_except_health() -> None:
    service = _service(auth_token="t0ken")
    with TestClient(create_app(service)) as c:
        assert c.get("/health").status_code == 200
        for method, path in (("post", "/match"), ("post", "/route"), ("post", "/release"),
                             ("get", "/workers"), ("get", "/metrics"), ("delete", "/workers/w0")):
            resp = getattr(c, method)(path)
            assert resp.status_code == 401, path
            assert resp.headers["www-authenticate"] == "Bearer"
        bad = c.post("/match", json={"token_ids": [1]}, headers={"authorization": "Bearer nope"})
        assert bad.status_code == 401 and "invalid bearer token" in bad.json()["error"]
        basic = c.post("/match", json={"token_ids": [1]}, headers={"authorization": "Basic dDp0"})
        assert basic.status_code == 401
        ok = c.post("/match", json={"token_ids": tokens(1, 4)}, headers={"authorization": "Bearer t0ken"})
        assert ok.status_code == 200 and ok.json()["scores"]["w0"] == 4
    service.stop()


def test_route_without_workers_is_503() -> None:
    service = RouterService(ServerConfig(http=None))
    with TestClient(create_app(service)) as c:
        resp = c.post("/route", json={"token_ids": [1, 2]})
        assert resp.status_code == 503 and "no worker" in resp.json()["error"]
        assert c.post("/match", json={"token_ids": [1, 2]}).json() == {"scores": {}, "block_size": {}, "tiers": {}}
    service.stop()
