"""Why this worker (DESIGN §13): sampling, /route and ZMQ ``explain``, the decision log, bad values."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import wait_until
from support.server import batch, stored, tokens

from tokenspeed_router.cli import main
from tokenspeed_router.errors import ConfigError
from tokenspeed_router.server import RouterService, ServerConfig, ZmqApiServer, create_app
from tokenspeed_router.server.config import load_server_config
from tokenspeed_router.server.decision_log import DecisionLogReader, DecisionLogWriter
from tokenspeed_router.server.explain import ExplainConfig, ExplainSampler

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

A, B = tokens(1, 4), tokens(2, 2)


def _service(tmp_path: Path | None = None, **explain: Any) -> RouterService:
    cfg = ExplainConfig(**explain)
    service = RouterService(ServerConfig(http=None, explain=cfg))
    service.start()
    service.apply_record("w0", 0, batch(stored(A)), 1.0)
    service.apply_record("w1", 0, batch(stored(A[:32]), stored(B, medium="cpu")), 1.0)
    return service


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --- sampling ------------------------------------------------------------------------------


@pytest.mark.parametrize(("rate", "expected"), [(0.0, 0), (1.0, 1000), (0.5, 500), (0.25, 250), (0.001, 1)])
def test_sampler_takes_exactly_rate_of_the_decisions(rate: float, expected: int) -> None:
    sampler = ExplainSampler(rate)
    picks = [sampler.take() for _ in range(1000)]
    assert sum(picks) == expected
    if rate == 0.5:
        assert picks[:6] == [False, True, False, True, False, True]  # evenly spread, not bursts


@settings(max_examples=200, deadline=None)
@given(rate=st.floats(0.0, 1.0), n=st.integers(0, 3000))
def test_sampler_matches_the_floor_reference(rate: float, n: int) -> None:
    """After n decisions exactly floor(n * step / unit) were picked, step = rate in units of 1e-9."""
    sampler = ExplainSampler(rate)
    step = round(rate * 10**9)
    taken = 0
    for i in range(1, n + 1):
        taken += sampler.take()
        if i in (1, n // 2, n):
            assert taken == i * step // 10**9


def test_service_samples_unasked_decisions_and_counts_by_cause() -> None:
    service = _service(explain_sample=0.5)
    try:
        explained = [service.route(A, request_id=f"r{i}").explanation is not None for i in range(10)]
        assert explained == [False, True] * 5
        asked = service.route(A, request_id="asked", explain=True)
        assert asked.explanation is not None
        text = service.metrics_text().decode()
        assert 'tokenspeed_route_explained_total{cause="sampled"} 5.0' in text
        assert 'tokenspeed_route_explained_total{cause="asked"} 1.0' in text
    finally:
        service.stop()


def test_rate_zero_explains_only_when_asked() -> None:
    service = _service(explain_sample=0.0)
    try:
        assert all(service.route(A, request_id=f"r{i}").explanation is None for i in range(20))
        assert service.route(A, request_id="x", explain=True).explanation is not None
    finally:
        service.stop()


# --- config and CLI --------------------------------------------------------------------------


def test_explain_config_defaults_and_bad_values(tmp_path: Path) -> None:
    assert ExplainConfig().sample_rate == 0.0
    assert ExplainConfig(decision_log=str(tmp_path / "d.jsonl")).sample_rate == 1.0  # the log wants decisions
    assert ExplainConfig(decision_log="x", explain_sample=0.1).sample_rate == 0.1
    for bad in (2, -0.1, float("nan"), True, "0.5"):
        with pytest.raises(ConfigError, match="explain_sample"):
            ExplainConfig(explain_sample=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="decision_log_max_bytes"):
        ExplainConfig(decision_log_max_bytes=10)


def test_settings_from_flags_environment_and_file(tmp_path: Path) -> None:
    log = str(tmp_path / "d.jsonl")
    cfg = load_server_config({"decision_log": log, "explain_sample": "0.25"})
    assert cfg.explain == ExplainConfig(decision_log=log, explain_sample=0.25)
    env = {"TOKENSPEED_ROUTER_EXPLAIN_SAMPLE": "0.5", "TOKENSPEED_ROUTER_DECISION_LOG_MAX_BYTES": "65536"}
    assert load_server_config({}, env).explain == ExplainConfig(explain_sample=0.5, decision_log_max_bytes=65536)
    toml = tmp_path / "r.toml"
    toml.write_text(f'decision_log = "{log}"\nexplain_sample = 0.1\n')
    assert load_server_config({}, {}, toml).explain.sample_rate == 0.1
    with pytest.raises(ConfigError, match=r"explain_sample \(flag\).*\[0, 1\]"):
        load_server_config({"explain_sample": "2"})
    with pytest.raises(ConfigError, match=r"decision_log.*does not exist"):
        load_server_config({"decision_log": str(tmp_path / "no" / "d.jsonl")})


def test_serve_refuses_a_bad_rate_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--http", "127.0.0.1:0", "--explain-sample", "2"]) == 2
    err = capsys.readouterr().err
    assert "explain_sample" in err and "[0, 1]" in err
    assert main(["serve", "--http", "127.0.0.1:0", "--explain-sample", "often"]) == 2


# --- POST /route and the ZMQ route -------------------------------------------------------------


@pytest.fixture
def client() -> Iterator[TestClient]:
    service = _service()
    with TestClient(create_app(service)) as c:
        yield c
    service.stop()


def test_http_route_explain_true_false_and_bad(client: TestClient) -> None:
    plain = client.post("/route", json={"token_ids": A, "request_id": "p"})
    assert plain.status_code == 200 and "explain" not in plain.json()
    off = client.post("/route", json={"token_ids": A, "request_id": "o", "explain": False})
    assert off.status_code == 200 and "explain" not in off.json()
    # Released: queued prefill decays on the wall clock, so a queue left on w0 would make
    # the choice depend on how fast this machine runs the test.
    for rid in ("p", "o"):
        assert client.post("/release", json={"request_id": rid}).status_code == 200
    on = client.post("/route", json={"token_ids": A, "request_id": "e", "explain": True})
    assert on.status_code == 200
    answer = on.json()
    ex = answer["explain"]
    assert ex["worker"] == answer["worker"] == "w0"
    rows = {c["worker"]: c for c in ex["candidates"]}
    assert set(rows) == {"w0", "w1"}
    for row in rows.values():  # the DESIGN §13 keys of every candidate
        assert {"worker", "matched_tokens", "uncached_tokens", "queue_tokens", "cost", "reason"} <= set(row)
    assert rows["w0"]["matched_tokens"] == 64 and rows["w0"]["uncached_tokens"] == 0
    for row in rows.values():  # the prefix by tier adds up to the prefix (w1: stored on GPU, or predicted)
        assert sum(row["matched_tokens_by_tier"].values()) == row["matched_tokens"] > 0
        assert row["matched_tokens_by_tier"]["cpu"] == row["matched_tokens_by_tier"]["storage"] == 0
    assert rows["w0"]["chosen"] and "lowest cost" in rows["w0"]["reason"]
    assert rows["w1"]["reason"].startswith("higher cost: ") and " on w0 (uncached " in rows["w1"]["reason"]
    for bad in ("yes", 1, None):
        resp = client.post("/route", json={"token_ids": A, "explain": bad})
        assert resp.status_code == 400
        assert "explain" in resp.json()["error"] and "bool" in resp.json()["error"]


def test_zmq_route_explain() -> None:
    service = _service()
    server = ZmqApiServer(service, "tcp://127.0.0.1:*")
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
    try:
        on = dec.decode(server.handle(enc.encode({"op": "route", "id": 1, "token_ids": A, "explain": True})))
        assert on["status"] == 200 and on["result"]["explain"]["worker"] == on["result"]["worker"] == "w0"
        off = dec.decode(server.handle(enc.encode({"op": "route", "id": 2, "token_ids": A})))
        assert off["status"] == 200 and "explain" not in off["result"]
        bad = dec.decode(server.handle(enc.encode({"op": "route", "id": 3, "token_ids": A, "explain": "yes"})))
        assert bad["status"] == 400 and "explain" in bad["error"] and bad["id"] == 3
    finally:
        server.stop()
        service.stop()


# --- the decision log --------------------------------------------------------------------------


def test_decision_log_holds_explained_decisions_and_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    service = _service(decision_log=str(path), explain_sample=0.5)
    try:
        for i in range(6):
            service.route(A if i % 2 else B, request_id=f"r{i}")
        service.route(A, request_id="asked", explain=True, lora_id=None, salt=None)
    finally:
        service.stop()  # flushes the writer thread
    lines = _lines(path)
    assert [(x["request_id"], x["cause"]) for x in lines] == [
        ("r1", "sampled"), ("r3", "sampled"), ("r5", "sampled"), ("asked", "asked")]
    first = lines[0]
    assert first["token_ids"] == A and first["num_tokens"] == len(A) and first["policy"] == "kv_aware"
    assert first["decision"]["worker"] == first["explain"]["worker"] == "w0"
    assert first["weights"]["prefill_weight"] == 1.0  # every CostWeights field, whatever the version
    assert 0.0 <= first["weights"]["followup_share"] <= 1.0  # the share this decision priced with
    reader = DecisionLogReader(str(path))
    decisions = list(reader)
    assert [d.request_id for d in decisions] == ["r1", "r3", "r5", "asked"] and reader.malformed == 0
    chosen = decisions[0].chosen()
    assert chosen is not None and chosen["worker"] == "w0" and chosen["matched_tokens"] == 64


def test_decision_log_metrics_drops_and_rotation(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    service = _service(decision_log=str(path))
    try:
        service.route(A, request_id="one")
        text = service.metrics_text().decode()
        assert "tokenspeed_decision_log_dropped_total" in text and "tokenspeed_decision_log_queue" in text
        wait_until(lambda: "tokenspeed_decision_log_lines_total 1.0" in service.metrics_text().decode(), 10,
                   what="the writer thread to write the line")
    finally:
        service.stop()
    d = service.route(A, request_id="after-stop", explain=True)  # routing goes on; the line is counted, not written
    assert d.explanation is not None
    assert service.decision_log is not None and service.decision_log.counters.dropped["closed"] == 1

    # a full queue drops and counts; routing never waits for the file
    full = DecisionLogWriter(str(tmp_path / "full.jsonl"), max_bytes=1 << 20, max_queue=0)
    assert not full.submit(d, time_s=1.0, cause="asked", token_ids=A, lora_id=None, salt=None)
    assert full.counters.dropped["queue_full"] == 1
    full.close()

    rot = tmp_path / "rot.jsonl"
    writer = DecisionLogWriter(str(rot), max_bytes=4096)
    for i in range(12):
        assert writer.submit(d, time_s=float(i), cause="asked", token_ids=A, lora_id=None, salt=None)
    writer.close()
    assert writer.counters.rotations >= 1 and writer.counters.lines == 12
    assert rot.stat().st_size <= 4096 and Path(f"{rot}.1").stat().st_size <= 4096
    kept = _lines(Path(f"{rot}.1")) + _lines(rot)
    assert [x["time"] for x in kept] == [float(i) for i in range(12 - len(kept), 12)]  # newest kept, in order


def test_reader_skips_and_counts_malformed_lines(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    service = _service(decision_log=str(path))
    try:
        service.route(A, request_id="good")
    finally:
        service.stop()
    good = path.read_text()
    path.write_text('not json\n{"v": 2, "time": 1, "request_id": "x", "explain": {}}\n' + good + '{"v": 1, "ti')
    reader = DecisionLogReader(str(path))
    assert [d.request_id for d in reader] == ["good"] and reader.malformed == 3
    with pytest.raises(ConfigError, match="no such file"):
        DecisionLogReader(str(tmp_path / "missing.jsonl"))


# --- the gateway's header ------------------------------------------------------------------------


def test_explain_header_values() -> None:
    from tokenspeed_router.gateway.explain import explain_requested
    from tokenspeed_router.gateway.openai import OpenAIError

    assert explain_requested(b"1") and explain_requested(b"TRUE ") and explain_requested(b"true")
    assert not explain_requested(b"0") and not explain_requested(b"false") and not explain_requested(b"")
    for bad in (b"yes", b"2", b"on"):
        with pytest.raises(OpenAIError, match="x-tokenspeed-explain must be 1 or 0") as err:
            explain_requested(bad)
        assert err.value.status == 400 and err.value.param == "x-tokenspeed-explain"


def test_route_header_fits_common_clients_and_stays_latin1() -> None:
    from tokenspeed_router.gateway.explain import MAX_HEADER_BYTES, route_header

    service = RouterService(ServerConfig(http=None))
    try:
        for i in range(60):  # 60 candidates: ~25 kB of JSON in full
            service.apply_record(f"wörker-{i:02d}", 0, batch(stored(A[: 16 * (1 + i % 4)])), 1.0)
        d = service.route(A, request_id="big", explain=True)
    finally:
        service.stop()
    assert d.explanation is not None and len(d.explanation.candidates) == 60
    value = route_header(d.explanation)
    assert len(value) <= MAX_HEADER_BYTES and value.isascii()
    ex = json.loads(value)
    assert ex["worker"] == d.worker and ex["omitted"] == 60 - len(ex["candidates"]) > 0
    kept = ex["candidates"]
    assert kept[0]["worker"] == d.worker and kept[0]["chosen"]  # the chosen row first, then the cheapest
    costs = [c["cost"] for c in kept[1:]]
    assert costs == sorted(costs)
    names = {c["worker"] for c in kept}
    left_out = [c.cost for c in d.explanation.candidates if c.worker not in names]
    assert max(costs) <= min(x for x in left_out if x is not None)  # what was left out cost more
    small = json.loads(route_header(d.explanation, max_bytes=10**6))
    assert "omitted" not in small and len(small["candidates"]) == 60
