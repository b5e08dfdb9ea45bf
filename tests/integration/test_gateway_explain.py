"""Why this worker through the gateway: ``x-tokenspeed-explain`` in, ``x-tokenspeed-route`` out (DESIGN §13).

Real engine-sim subprocesses behind a real ``serve --decision-log FILE
--explain-sample 0.5 --record FILE``; the decision log it writes is read back
by ``replay --decisions`` against the event log recorded in the same run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import wait_until
from support.gateway import Gateway, sse_events

from tokenspeed_router.cli import main

KEYS = {"worker", "matched_tokens", "uncached_tokens", "queue_tokens", "cost", "reason"}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("gateway-explain")
    engine = ["--decode-s-per-token", "0.001", "--prefill-tokens-per-s", "1000000"]
    serve = ["--decision-log", str(tmp / "decisions.jsonl"), "--explain-sample", "0.5",
             "--record", str(tmp / "events.tslog")]
    with Gateway(tmp, [engine, engine], serve_args=serve) as gateway:
        gateway.files = tmp  # type: ignore[attr-defined]
        yield gateway


def _complete(gw: Gateway, prompt: list[int], explain: str | None = None, **extra: Any) -> Any:
    headers = {"x-tokenspeed-explain": explain} if explain is not None else {}
    resp = gw.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, **extra}, headers=headers)
    assert resp.status_code == 200, resp.text
    return resp


def _route_header(resp: Any) -> dict[str, Any]:
    explained: dict[str, Any] = json.loads(resp.headers["x-tokenspeed-route"])
    return explained


def test_header_absent_present_and_sampled(gw: Gateway) -> None:
    # unasked: exactly every second decision is explained (--explain-sample 0.5, deterministic)
    answers = [_complete(gw, list(range(1000 * i, 1000 * i + 48))) for i in range(1, 7)]
    assert sum("x-tokenspeed-route" in r.headers for r in answers) == 3
    # asked for: the decision, naming the worker that answered, every candidate with the §13 keys
    prompt = list(range(1000, 1048))  # the first prompt again: its worker holds it now
    wait_until(lambda: any(gw.held_blocks(prompt).values()), 20, interval_s=0.02, what="the BlockStored events")
    resp = _complete(gw, [*prompt, 7, 7], explain="1")
    ex = _route_header(resp)
    assert ex["worker"] == resp.headers["x-tokenspeed-worker"] == answers[0].headers["x-tokenspeed-worker"]
    rows = {c["worker"]: c for c in ex["candidates"]}
    assert set(rows) == {"w0", "w1"} and all(set(c) >= KEYS for c in rows.values())
    assert rows[ex["worker"]]["matched_tokens"] == 48 and rows[ex["worker"]]["chosen"]
    other = next(c for w, c in rows.items() if w != ex["worker"])
    assert other["matched_tokens"] == 0 and other["cost"] > rows[ex["worker"]]["cost"] and other["reason"]
    assert "omitted" not in ex


def test_streams_carry_the_header_and_bad_values_are_400(gw: Gateway) -> None:
    body = {"prompt": list(range(50_000, 50_032)), "max_tokens": 2, "stream": True}
    with gw.client.stream("POST", "/v1/completions", json=body, headers={"x-tokenspeed-explain": "true"}) as resp:
        assert resp.status_code == 200
        ex = json.loads(resp.headers["x-tokenspeed-route"])
        assert ex["worker"] == resp.headers["x-tokenspeed-worker"]
        assert list(sse_events(resp.iter_lines()))[-1] == "[DONE]"
    bad = gw.client.post("/v1/completions", json={"prompt": [1, 2, 3]}, headers={"x-tokenspeed-explain": "yes"})
    assert bad.status_code == 400
    err = bad.json()["error"]
    assert err["param"] == "x-tokenspeed-explain" and "1 or 0" in err["message"]


def test_decision_log_is_read_back_by_replay(gw: Gateway, capsys: pytest.CaptureFixture[str]) -> None:
    path: Path = gw.files / "decisions.jsonl"  # type: ignore[attr-defined]
    _complete(gw, list(range(60_000, 60_064)), explain="1")

    def lines() -> list[dict[str, Any]]:
        text = path.read_text() if path.exists() else ""
        return [json.loads(x) for x in text.split("\n")[:-1]]  # complete lines only: one may be half written

    # the writer thread flushes after every burst: every explained decision so far is there
    wait_until(lambda: len(lines()) >= 6, 20, interval_s=0.05, what="the decision log lines")
    logged = lines()
    assert {x["cause"] for x in logged} == {"asked", "sampled"}
    assert all(x["request_id"].startswith("gw-") and x["decision"]["worker"] == x["explain"]["worker"]
               for x in logged)
    assert gw.metric("tokenspeed_decision_log_lines_total") >= len(logged)
    assert gw.metric("tokenspeed_decision_log_dropped_total") == 0
    assert gw.metric("tokenspeed_route_explained_total", cause="asked") >= 3
    assert main(["replay", str(gw.files / "events.tslog"), "--decisions", str(path),  # type: ignore[attr-defined]
                 "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["decisions"] == len(logged) and summary["malformed_lines"] == 0
    # the live decisions are reproduced from the recorded events (ingestion lag may differ: not all)
    assert summary["agree"] >= len(logged) // 2
