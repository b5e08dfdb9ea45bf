"""The OpenAI gateway (DESIGN §10) end to end: engine-sim subprocesses behind a real ``serve``.

Streaming is checked event by event as it arrives, a disconnect must free the
router's in-flight entry, a killed engine must not cost the client its answer
(or, mid-stream, must end the stream with an error event), P/D runs vLLM's
two legs, and bad input gets OpenAI-shaped 4xx answers.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support import wait_until
from support.engine_sim import words
from support.gateway import Gateway, open_with_fixed_ports, sse_events

from tokenspeed_router.endpoints import free_tcp_port

#: one decode step: slow enough that a buffered stream would be visible, fast enough for CI
STEP_S = 0.05


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    engine = ["--decode-s-per-token", str(STEP_S), "--prefill-tokens-per-s", "1000000"]
    with Gateway(tmp_path_factory.mktemp("gateway"), [engine, engine]) as gateway:
        yield gateway


def _ids(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def test_completion_goes_where_the_prefix_is_and_the_truth_loop_counts_it(gw: Gateway) -> None:
    worker, first = gw.complete(words(1000, 64))
    assert first["system_fingerprint"] == gw.engine_of(worker).name  # the header names the engine that answered
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_until(lambda: gw.held_blocks(_ids(1000, 64)).get(worker) == 4, 20, interval_s=0.02,
               what="the engine's BlockStored events to reach the index")
    again, second = gw.complete(words(1000, 64) + " 9 9 9")
    assert again == worker
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    truth = gw.workers()[worker]["truth"]
    assert truth["reported_cached_tokens"] >= 64 and truth["predicted_cached_tokens"] >= 64
    assert not truth["misaligned"] and truth["reports_cached_tokens"]
    assert gw.metric("tokenspeed_gateway_reported_cached_tokens_total", worker=worker) >= 64
    assert gw.metric("tokenspeed_gateway_predicted_cached_tokens_total", worker=worker) >= 64
    assert gw.metric("tokenspeed_gateway_worker_misaligned", worker=worker) == 0
    assert gw.metric("tokenspeed_gateway_requests_total", worker=worker, outcome="ok") >= 2


def test_token_ids_chat_and_unknown_fields(gw: Gateway) -> None:
    _, answer = gw.complete(_ids(7000, 40), max_tokens=3, x_vendor_field={"kept": True})
    assert answer["usage"]["prompt_tokens"] == 40 and answer["usage"]["completion_tokens"] == 3
    resp = gw.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": words(5000, 40)}], "max_tokens": 3, "temperature": 0.5})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert body["system_fingerprint"] == gw.engine_of(resp.headers["x-tokenspeed-worker"]).name
    models = gw.client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tokenspeed-sim"]


def _stream(gw: Gateway, path: str, body: dict[str, object]) -> tuple[str, list[tuple[float, object]]]:
    """(worker, [(arrival time, event)]) of one streamed answer."""
    with gw.client.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [(time.monotonic(), e) for e in sse_events(resp.iter_lines())]
        return resp.headers["x-tokenspeed-worker"], events


def test_stream_is_relayed_event_by_event_and_usage_stripped(gw: Gateway) -> None:
    n = 8
    worker, events = _stream(gw, "/v1/completions", {"prompt": words(20_000, 48), "max_tokens": n})
    tokens = [(t, e) for t, e in events if isinstance(e, dict) and e["choices"] and e["choices"][0]["text"]]
    assert len(tokens) == n and events[-1][1] == "[DONE]"
    # the gateway asked for usage; the client did not, so no usage chunk reaches it
    assert not any(isinstance(e, dict) and "usage" in e for _, e in events)
    # relayed as produced: the engine spaces tokens by a decode step, a buffering proxy would not
    assert tokens[-1][0] - tokens[0][0] >= 0.5 * (n - 1) * STEP_S
    assert gw.workers()[worker]["truth"]["requests"] >= 1  # the stripped usage still fed the truth loop


def test_stream_usage_kept_when_the_client_asks_and_chat_streams(gw: Gateway) -> None:
    body = {"prompt": words(30_000, 40), "max_tokens": 2, "stream_options": {"include_usage": True}}
    _, events = _stream(gw, "/v1/completions", body)
    usage = [e for _, e in events if isinstance(e, dict) and e.get("usage")]
    assert len(usage) == 1 and usage[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage[0]["choices"] == []
    _, chat = _stream(gw, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}],
                                                    "max_tokens": 3})
    deltas = [e["choices"][0]["delta"] for _, e in chat if isinstance(e, dict)]
    assert deltas[0].get("role") == "assistant" and sum(1 for d in deltas if d.get("content")) == 3


def test_a_prefill_counts_as_load_until_its_first_token_not_the_role_chunk(tmp_path: Path) -> None:
    # FIFO engine prefilling 200 tokens/s: a 400-token prompt takes 2 s, during which the
    # chat stream has already sent its role chunk (vLLM and engine-sim send it at once)
    engine = ["--timing", "fifo", "--prefill-tokens-per-s", "200", "--decode-s-per-token", "0.01"]
    with Gateway(tmp_path, [engine]) as gw, httpx.Client(base_url=gw.serve.url, timeout=30.0) as client, \
            client.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": " ".join(str(i) for i in range(400))}],
                "max_tokens": 2, "stream": True}) as resp:
        events = sse_events(resp.iter_lines())
        first = next(e for e in events if isinstance(e, dict))
        assert first["choices"][0]["delta"].get("role") == "assistant"
        row = gw.workers()["w0"]
        assert row["in_flight"] == 1 and row["queued_prefill_tokens"] > 300  # still queued load
        token = next(e for e in events if isinstance(e, dict) and e["choices"] and e["choices"][0]["delta"].get("content"))
        assert token
        wait_until(lambda: gw.workers()["w0"]["queued_prefill_tokens"] == 0, 10, interval_s=0.02,
                   what="the first token to end the prefill's load")
        assert gw.workers()["w0"]["in_flight"] in (0, 1)


def test_client_disconnect_mid_stream_releases_the_request(gw: Gateway) -> None:
    aborted_before = {w: gw.engine_of(w).metrics().get("tokenspeed_engine_sim_aborted_requests_total", 0.0)
                      for w in ("w0", "w1")}
    with httpx.Client(base_url=gw.serve.url, timeout=30.0) as client, client.stream(
        "POST", "/v1/completions", json={"prompt": words(40_000, 32), "max_tokens": 400, "stream": True}
    ) as resp:
        worker = resp.headers["x-tokenspeed-worker"]
        lines = resp.iter_lines()
        assert next(e for e in sse_events(lines) if isinstance(e, dict))
        assert gw.workers()[worker]["in_flight"] == 1
    # the client is gone (20 s of tokens were still to come): the router lets go at once
    wait_until(lambda: gw.workers()[worker]["in_flight"] == 0, 10, interval_s=0.02,
               what="the disconnect to release the in-flight entry")
    engine = gw.engine_of(worker)
    wait_until(lambda: engine.metrics().get("tokenspeed_engine_sim_aborted_requests_total", 0.0)
               > aborted_before[worker], 10, interval_s=0.05, what="the engine to see the request aborted")
    assert gw.metric("tokenspeed_gateway_client_disconnects_total") >= 1


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b'{"max_tokens": 3}', "prompt"),
    ("/v1/completions", b'{"prompt": {"a": 1}}', "prompt"),
    ("/v1/completions", b'{"prompt": "x", "stream": 1}', "stream"),
    ("/v1/chat/completions", b'{"messages": "hi"}', "messages"),
    ("/v1/chat/completions", b"[]", None),
])
def test_bad_input_gets_openai_shaped_4xx(gw: Gateway, path: str, body: bytes, param: str | None) -> None:
    resp = gw.client.post(path, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert error["type"] == "invalid_request_error" and error["message"]


def test_engine_errors_are_relayed_with_the_worker(gw: Gateway) -> None:
    resp = gw.post("/v1/completions", {"prompt": "a b c", "max_tokens": 2, "n": 2})
    assert resp.status_code == 400 and "x-tokenspeed-worker" in resp.headers
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert gw.serve.alive() and gw.client.get("/health").json()["status"] == "ok"


def test_killed_engine_mid_stream_then_failover(tmp_path: Path) -> None:
    slow = ["--decode-s-per-token", "0.1", "--prefill-tokens-per-s", "1000000"]
    with Gateway(tmp_path, [slow, slow], serve_args=["--worker-down-cooldown-s", "600"]) as gw:
        prompt = words(50_000, 64)
        with gw.client.stream("POST", "/v1/completions",
                              json={"prompt": prompt, "max_tokens": 300, "stream": True}) as resp:
            worker = resp.headers["x-tokenspeed-worker"]
            events = sse_events(resp.iter_lines())
            assert isinstance(next(events), dict)
            victim = gw.engine_of(worker)
            assert victim.proc is not None
            victim.proc.send_signal(signal.SIGKILL)
            rest = list(events)
        # after the first byte there is no retry: the stream ends with an error event, then [DONE]
        assert rest[-1] == "[DONE]" and isinstance(rest[-2], dict), rest[-3:]
        assert rest[-2]["error"]["code"] == "upstream_error"
        wait_until(lambda: gw.workers()[worker]["in_flight"] == 0, 10, interval_s=0.02, what="release")
        victim.proc.wait(10)
        # the index still says the dead engine holds the prompt, so the router picks it first:
        # the connection is refused, the worker is marked down, and the request moves on
        other, answer = gw.complete(prompt)
        assert other != worker and answer["system_fingerprint"] == gw.engine_of(other).name
        entry = gw.workers()[worker]
        assert entry["reachable"] is False
        assert gw.metric("tokenspeed_gateway_retries_total") >= 1
        health = gw.client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert health.json()["down"] == [worker]
        # every engine gone: 503 in OpenAI's shape, and /health stops saying ok
        gw.engine_of(other).stop()
        resp = gw.post("/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert resp.status_code in (502, 503) and resp.json()["error"]["code"] in (
            "no_worker_available", "upstream_unreachable")
        wait_until(lambda: gw.client.get("/health").status_code == 503, 10, interval_s=0.05,
                   what="/health to report no engine")


def test_data_parallel_ranks_are_addressed_by_header(tmp_path: Path) -> None:
    """A ``dp_ranks=2`` worker: the router picks a rank, vLLM's X-data-parallel-rank header takes it there."""
    def make() -> Gateway:
        events = free_tcp_port(consecutive=2)
        replay = free_tcp_port(consecutive=2, avoid=(events,))
        args = ["--instant", "--dp-ranks", "2", "--events", f"tcp://127.0.0.1:{events}",
                "--replay", f"tcp://127.0.0.1:{replay}"]
        return Gateway(tmp_path, [args], spec_extra="dp_ranks=2")

    with open_with_fixed_ports(make) as gw:
        assert set(gw.workers()) == {"w0/dp0", "w0/dp1"}
        seen = set()
        for start in range(60_000, 64_000, 1000):
            rank, _ = gw.complete(words(start, 64))
            seen.add(rank)
            # the rank the router chose is the rank that cached the prompt
            wait_until(lambda start=start: gw.held_blocks(_ids(start, 64)), 20, interval_s=0.02,
                       what="the rank's events")
            assert gw.held_blocks(_ids(start, 64)) == {rank: 4}
            again, answer = gw.complete(words(start, 64) + " 1")
            assert again == rank and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        assert seen == {"w0/dp0", "w0/dp1"}


def test_down_worker_comes_back_when_its_engine_answers_again(tmp_path: Path) -> None:
    def fixed_ports() -> list[str]:
        return ["--instant", "--port", str(free_tcp_port()), "--events", f"tcp://127.0.0.1:{free_tcp_port()}",
                "--replay", f"tcp://127.0.0.1:{free_tcp_port()}"]

    # a cooldown far beyond the test: only the /health probe can bring the worker back
    with open_with_fixed_ports(lambda: Gateway(tmp_path, [fixed_ports(), fixed_ports()],
                                               serve_args=["--worker-down-cooldown-s", "600"])) as gw:
        prompt = words(70_000, 64)
        worker, _ = gw.complete(prompt)
        wait_until(lambda: gw.held_blocks(_ids(70_000, 64)).get(worker), 20, interval_s=0.02, what="events")
        index = int(worker[1:])
        gw.engines[index].stop()
        other, _ = gw.complete(prompt)
        assert other != worker and gw.workers()[worker]["reachable"] is False
        gw.restart_engine(index)
        wait_until(lambda: gw.workers()[worker]["reachable"], 20, interval_s=0.05,
                   what="the health probe to put the worker back")
        assert gw.client.get("/health").json()["down"] == []
        # routable again: fresh prompts reach it
        landed = {gw.complete(words(80_000 + 1000 * i, 32))[0] for i in range(12)}
        assert worker in landed


def test_models_is_the_union_of_the_workers_models(tmp_path: Path) -> None:
    with Gateway(tmp_path, [["--instant"], ["--instant", "--model", "other-model"]]) as gw:
        models = gw.client.get("/v1/models")
        assert models.status_code == 200
        assert sorted(m["id"] for m in models.json()["data"]) == ["other-model", "tokenspeed-sim"]
        gw.engines[1].stop()  # one engine gone: the other's models still listed
        assert [m["id"] for m in gw.client.get("/v1/models").json()["data"]] == ["tokenspeed-sim"]
