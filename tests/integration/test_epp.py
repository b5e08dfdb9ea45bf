"""The endpoint picker (``serve --epp``) over real gRPC on loopback, driven as Envoy drives it.

Real engine-sims publish KV events to a real ``serve --epp`` subprocess; the
test is Envoy (``support/envoy.py``): it sends the ext_proc messages Envoy's
filter sends, forwards the body the picker sends back to the endpoint the
picker named (a real HTTP request to that engine), and feeds the engine's
real answer through the response phase. Every MUST of the endpoint picker
protocol (v1.0.0) is checked where it applies, and after every path the
router holds no request in flight.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from support import wait_until
from support.envoy import (
    BUFFERED,
    STREAMED,
    ExtProcStream,
    envoy_request,
    health,
    request_body,
    request_headers,
    response_body,
    response_headers,
    set_headers,
)
from support.gateway import Gateway

from tokenspeed_router.endpoints import free_tcp_port

PROMPT = list(range(1000, 1064))  # 4 blocks of 16


def _endpoint(url: str) -> str:
    return url.removeprefix("http://")


@pytest.fixture(scope="module")
def epp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, grpc.Channel, str]]:
    port = free_tcp_port()
    workdir: Path = tmp_path_factory.mktemp("epp")
    with Gateway(workdir, [[], [], []], serve_args=["--epp", f"127.0.0.1:{port}"]) as gw:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        wait_until(lambda: health(channel, "readiness") == "SERVING", 30, interval_s=0.05,
                   what="the picker to be ready")
        yield gw, channel, f"127.0.0.1:{port}"
        channel.close()


def in_flight(gw: Gateway) -> int:
    return sum(int(w.get("in_flight", 0)) for w in gw.workers().values())


def no_leak(gw: Gateway) -> None:
    wait_until(lambda: in_flight(gw) == 0 and gw.metric("tokenspeed_epp_in_flight") == 0, 10, interval_s=0.02,
               what="every picked request to be released")


def as_envoy(gw: Gateway, channel: grpc.Channel, body: dict[str, Any], *, stream: bool = False,
             **kw: Any) -> tuple[Any, httpx.Response | None]:
    """One request as Envoy carries it: pick, send what the picker sent on to the endpoint it
    named (a real engine), feed the engine's answer back through the response phase."""
    answers: list[httpx.Response] = []

    def upstream(endpoint: str, sent: bytes) -> tuple[int, str, list[bytes]]:
        answer = httpx.post(f"http://{endpoint}/v1/completions", content=sent,
                            headers={"content-type": "application/json"}, timeout=30)
        answers.append(answer)
        content = answer.content
        chunks = [content[i:i + 7] for i in range(0, len(content), 7)] if stream else [content]
        return answer.status_code, answer.headers.get("content-type", ""), chunks

    done = envoy_request(channel, json.dumps(body).encode(), upstream=upstream, **kw)
    return done, answers[0] if answers else None


def test_health_services(epp: tuple[Gateway, grpc.Channel, str]) -> None:
    _, channel, _ = epp
    for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor", ""):
        assert health(channel, service) == "SERVING", service
    assert health(channel, "no.such.Service") == "NOT_FOUND"


def test_full_duplex_names_the_engine_that_holds_the_prefix(epp: tuple[Gateway, grpc.Channel, str]) -> None:
    gw, channel, _ = epp
    worker, _ = gw.complete(PROMPT)  # through the HTTP gateway: the prefix is now cached on `worker`
    wait_until(lambda: gw.held_blocks(PROMPT).get(worker) == 4, 10, what="the prefix's events")
    holder = _endpoint(gw.engine_of(worker).url)
    body = {"prompt": PROMPT, "max_tokens": 2, "x_unknown_field": {"kept": [1, 2]}}
    raw = json.dumps(body).encode()
    got = envoy_request(channel, raw, chunk_bytes=50)
    # MUST: the header and the envoy.lb metadata carry one and the same value, ip:port first
    assert got.endpoint == got.metadata
    assert got.endpoint.split(",")[0] == holder
    assert all(":" in ep for ep in got.endpoint.split(","))
    assert len(set(got.endpoint.split(","))) == len(got.endpoint.split(","))  # fallbacks: other endpoints
    # the headers answer first, then the body as it came (unchanged, unknown fields and all)
    kinds = [a.WhichOneof("response") for a in got.answers]
    assert kinds[0] == "request_headers" and set(kinds[1:]) == {"request_body"}
    assert got.answers[0].request_headers.response.clear_route_cache
    assert got.body_sent_on == raw
    no_leak(gw)  # Envoy half-closed without a response phase: released


def test_picker_decides_as_route_for_the_same_tokens(epp: tuple[Gateway, grpc.Channel, str]) -> None:
    gw, channel, _ = epp
    prompts = [[7000 + 100 * k + i for i in range(48)] for k in range(3)]
    for p in prompts:
        gw.complete(p)
    wait_until(lambda: all(gw.held_blocks(p) for p in prompts), 10, what="the prefixes' events")
    for p in prompts:
        routed = gw.serve.post("/route", {"token_ids": p, "request_id": "compare"})
        gw.serve.post("/release", {"request_id": "compare"})
        got = envoy_request(channel, json.dumps({"prompt": p, "max_tokens": 1}).encode())
        assert got.endpoint.split(",")[0] == _endpoint(gw.engine_of(routed["worker"]).url)
    no_leak(gw)


def test_json_answer_feeds_the_truth_loop_and_releases(epp: tuple[Gateway, grpc.Channel, str]) -> None:
    gw, channel, _ = epp
    prompt = list(range(3000, 3064))
    before = gw.metric("tokenspeed_epp_requests_total", outcome="completed")
    done, answer = as_envoy(gw, channel, {"prompt": prompt, "max_tokens": 2})
    assert answer is not None and answer.status_code == 200
    assert done.immediate is None
    head = next(a for a in done.answers if a.HasField("response_headers"))
    worker = set_headers(head)["x-tokenspeed-worker"]
    assert _endpoint(gw.engine_of(worker).url) == done.endpoint.split(",")[0]
    assert gw.metric("tokenspeed_epp_requests_total", outcome="completed") == before + 1
    # the second send of the same prompt is reused by the engine: the truth loop's sample agrees
    as_envoy(gw, channel, {"prompt": prompt, "max_tokens": 2})
    truth = gw.workers()[worker]["truth"]
    assert truth["requests"] >= 2 and truth["reports_cached_tokens"], truth
    assert truth["reported_cached_tokens"] >= 48, truth  # the second send reused the 3 full blocks
    no_leak(gw)


def test_streamed_answer_asks_for_usage_and_strips_it(epp: tuple[Gateway, grpc.Channel, str]) -> None:
    gw, channel, _ = epp
    prompt = list(range(4000, 4064))
    done, answer = as_envoy(gw, channel, {"prompt": prompt, "max_tokens": 3, "stream": True}, stream=True)
    assert answer is not None
    # the picker asked the engine for the usage chunk (the body it sent on says so) ...
    assert b'"include_usage":true' in answer.request.content
    assert b'"usage"' in answer.content
    # ... and the client does not see it: the stream it gets back ends with [DONE], without usage
    assert b'"usage"' not in done.response_sent_on
    assert done.response_sent_on.rstrip().endswith(b"data: [DONE]")
    no_leak(gw)


def test_buffered_mode_rides_the_destination_on_the_body_answer(epp: tuple[Gateway, grpc.Channel, str]) -> None:
    gw, channel, _ = epp
    got = envoy_request(channel, json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode(), modes=(BUFFERED, BUFFERED),
                        response=[b'{"choices": []}'], content_type="application/json")
    assert got.answers[0].HasField("request_headers")
    assert not got.answers[0].HasField("dynamic_metadata")
    body_answer = got.answers[1]
    assert body_answer.HasField("request_body") and body_answer.request_body.response.clear_route_cache
    assert got.endpoint and got.endpoint == got.metadata
    # buffered responses are let through, not sent back
    assert all(not a.response_body.response.HasField("body_mutation") for a in got.answers
               if a.HasField("response_body"))
    no_leak(gw)


def test_trailers_end_the_body_and_are_answered_last(epp: tuple[Gateway, grpc.Channel, str]) -> None:
    gw, channel, _ = epp
    raw = json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode()
    got = envoy_request(channel, raw, chunk_bytes=30, trailers=True)
    kinds = [a.WhichOneof("response") for a in got.answers]
    assert kinds[0] == "request_headers" and kinds[-1] == "request_trailers"
    assert got.body_sent_on == raw
    bodies = [a.request_body.response.body_mutation.streamed_response for a in got.answers
              if a.HasField("request_body")]
    assert not any(b.end_of_stream for b in bodies)  # the trailers end the stream, not the body
    no_leak(gw)


def test_streamed_request_mode_picks_on_load(epp: tuple[Gateway, grpc.Channel, str]) -> None:
    gw, channel, _ = epp
    got = envoy_request(channel, json.dumps({"prompt": PROMPT}).encode(), modes=(STREAMED, STREAMED))
    assert got.endpoint and got.endpoint == got.metadata
    no_leak(gw)


def test_older_envoy_without_protocol_config_is_taken_as_full_duplex(
        epp: tuple[Gateway, grpc.Channel, str]) -> None:
    gw, channel, _ = epp
    raw = json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode()
    got = envoy_request(channel, raw, modes=None)
    assert got.endpoint and got.body_sent_on == raw
    no_leak(gw)


def test_aborted_streams_release_their_load(epp: tuple[Gateway, grpc.Channel, str]) -> None:
    gw, channel, _ = epp
    raw = json.dumps({"prompt": PROMPT, "max_tokens": 8, "stream": True}).encode()
    streams = []
    for cut in ("after_pick", "after_response_headers", "mid_response"):
        s = ExtProcStream(channel)
        s.send(request_headers())
        s.send(request_body(raw, True))
        s.recv_n(2)
        if cut != "after_pick":
            s.send(response_headers())
            s.recv_n(1)
        if cut == "mid_response":
            s.send(response_body(b'data: {"choices": [{"text": "a"}]}\n\n', False))
            s.recv_n(1)
        streams.append(s)
    wait_until(lambda: gw.metric("tokenspeed_epp_in_flight") == 3, 10, what="three picks in flight")
    assert in_flight(gw) == 3
    for s in streams:
        s.cancel()  # Envoy drops the stream mid-way
    no_leak(gw)
    assert gw.metric("tokenspeed_epp_requests_total", outcome="aborted") >= 3


# --- bad input: an ImmediateResponse (or a gRPC error), never a crash, never a leak -----------------


@pytest.mark.parametrize(("body", "status"), [
    (b"this is not json", 400),
    (b"[1, 2, 3]", 400),
    (json.dumps({"prompt": 12345}).encode(), 400),  # a prompt that cannot be tokenized
    (json.dumps({"prompt": [1, -5, 3]}).encode(), 400),
    (json.dumps({"messages": "hello"}).encode(), 400),
    (b"", 400),
])
def test_bad_bodies_get_an_immediate_400(epp: tuple[Gateway, grpc.Channel, str], body: bytes, status: int) -> None:
    gw, channel, _ = epp
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    got = envoy_request(channel, body, path=path)
    assert got.immediate is not None, got.answers
    assert got.immediate.status.code == status
    assert "error" in json.loads(got.immediate.body)
    no_leak(gw)


def test_headers_without_a_body(epp: tuple[Gateway, grpc.Channel, str]) -> None:
    gw, channel, _ = epp
    s = ExtProcStream(channel)
    s.send(request_headers(end_of_stream=True))  # a POST that ends at its headers
    answer = s.recv()
    assert answer is not None and answer.immediate_response.status.code == 400
    s.done()
    s = ExtProcStream(channel)
    s.send(request_headers("/v1/models", method="GET", end_of_stream=True))  # a GET: least loaded engine
    answer = s.recv()
    assert answer is not None and answer.HasField("request_headers") and answer.HasField("dynamic_metadata")
    s.cancel()
    no_leak(gw)


def test_a_body_over_the_limit_is_413_in_any_chunking(epp: tuple[Gateway, grpc.Channel, str]) -> None:
    gw, channel, _ = epp
    big = json.dumps({"prompt": "x " * (5 << 20)}).encode()  # 10 MB
    got = envoy_request(channel, big, chunk_bytes=64 << 10)
    assert got.immediate is not None and got.immediate.status.code == 413
    no_leak(gw)


@pytest.mark.parametrize("subset", [[], ["10.255.255.1:8000"], "10.255.255.1:8000,10.255.255.2:8000"])
def test_an_ineligible_subset_is_503(epp: tuple[Gateway, grpc.Channel, str], subset: Any) -> None:
    gw, channel, _ = epp
    got = envoy_request(channel, json.dumps({"prompt": PROMPT}).encode(), subset=subset)
    assert got.immediate is not None and got.immediate.status.code == 503
    no_leak(gw)


def test_the_subset_hint_limits_the_pick(epp: tuple[Gateway, grpc.Channel, str]) -> None:
    gw, channel, _ = epp
    worker, _ = gw.complete(PROMPT)
    others = [_endpoint(e.url) for i, e in enumerate(gw.engines) if f"w{i}" != worker]
    for subset in (others[:1], others, ",".join(others), [*others[:1], "10.255.255.9:1"]):
        got = envoy_request(channel, json.dumps({"prompt": PROMPT}).encode(), subset=subset)
        names = got.endpoint.split(",")
        allowed = subset.split(",") if isinstance(subset, str) else subset
        assert set(names) <= set(allowed), (names, subset)
    got = envoy_request(channel, json.dumps({"prompt": PROMPT}).encode(), subset={"not": "a list"})
    assert got.immediate is not None and got.immediate.status.code == 400
    no_leak(gw)


def test_bad_explain_header_is_400_and_good_one_answers_the_route(epp: tuple[Gateway, grpc.Channel, str]) -> None:
    gw, channel, _ = epp
    got = envoy_request(channel, b'{"prompt": [1, 2, 3]}', extra_headers={"x-tokenspeed-explain": "maybe"})
    assert got.immediate is not None and got.immediate.status.code == 400
    done, _ = as_envoy(gw, channel, {"prompt": PROMPT, "max_tokens": 1},
                       extra_headers={"x-tokenspeed-explain": "1", "traceparent":
                                      "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
    head = next(a for a in done.answers if a.HasField("response_headers"))
    route = json.loads(set_headers(head)["x-tokenspeed-route"])
    assert route["worker"] == set_headers(head)["x-tokenspeed-worker"]
    assert {c["worker"] for c in route["candidates"]} == {"w0", "w1", "w2"}
    no_leak(gw)


def test_a_fallback_that_served_moves_the_load_and_marks_the_primary_down(
        epp: tuple[Gateway, grpc.Channel, str]) -> None:
    gw, channel, _ = epp
    raw = json.dumps({"prompt": list(range(9000, 9064)), "max_tokens": 1}).encode()
    down_before = gw.metric("tokenspeed_gateway_worker_down_events_total")
    s = ExtProcStream(channel)
    s.send(request_headers())
    s.send(request_body(raw, True))
    answers = s.recv_n(2)
    endpoints = set_headers(answers[0])["x-gateway-destination-endpoint"].split(",")
    assert len(endpoints) == 3  # the primary and two fallbacks (--epp-fallbacks 2)
    s.send(response_headers(200, "application/json", served=endpoints[1]))
    head = s.recv_n(1)[0]
    served_worker = set_headers(head)["x-tokenspeed-worker"]
    assert _endpoint(gw.engine_of(served_worker).url) == endpoints[1]
    assert gw.workers()[served_worker]["in_flight"] == 1
    s.send(response_body(b'{"choices": []}', True))
    s.recv_n(1)
    s.close()
    s.done()
    assert gw.metric("tokenspeed_epp_requests_total", outcome="fallback_served") >= 1
    assert gw.metric("tokenspeed_gateway_worker_down_events_total") >= down_before + 1  # the primary: probed
    no_leak(gw)


def test_doctor_checks_the_picker(epp: tuple[Gateway, grpc.Channel, str]) -> None:
    gw, _, address = epp
    proc = subprocess.run([sys.executable, "-m", "tokenspeed_router.cli", "doctor", "--router", gw.serve.url,
                           "--epp", address, "--json", "--timeout", "20"], capture_output=True, text=True,
                          timeout=120)
    report = json.loads(proc.stdout)
    [entry] = [e for e in report["engines"] if e["worker"] == f"epp {address}"]
    assert entry["ok"], entry
    assert [c["name"] for c in entry["checks"]] == ["epp_health", "epp_pick"]
    named = entry["checks"][1]["detail"].split()[1].split(",")[0]
    assert named in {_endpoint(e.url) for e in gw.engines}
    # a picker that is not there is a failed check with its cause, not a crash
    proc = subprocess.run([sys.executable, "-m", "tokenspeed_router.cli", "doctor", "--router", gw.serve.url,
                           "--epp", f"127.0.0.1:{free_tcp_port()}", "--json", "--timeout", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    [entry] = [e for e in json.loads(proc.stdout)["engines"] if e["worker"].startswith("epp ")]
    assert not entry["ok"] and all(c["cause"] for c in entry["checks"])
    no_leak(gw)


def test_shedding_and_readiness_before_sync(tmp_path: Path) -> None:
    """--epp-fallbacks 0 names one endpoint (an ORIGINAL_DST cluster reads one); --epp-max-in-flight 1
    answers 429 to the second request; a worker whose stream never connects keeps readiness
    NOT_SERVING while liveness is SERVING."""
    port = free_tcp_port()
    with Gateway(tmp_path, [[], []], serve_args=["--epp", f"127.0.0.1:{port}", "--epp-max-in-flight", "1",
                                                 "--epp-fallbacks", "0"]) as gw:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        wait_until(lambda: health(channel, "readiness") == "SERVING", 30, what="ready")
        held = ExtProcStream(channel)
        held.send(request_headers())
        held.send(request_body(json.dumps({"prompt": PROMPT}).encode(), True))
        named = set_headers(held.recv_n(2)[0])["x-gateway-destination-endpoint"]
        assert named in {_endpoint(e.url) for e in gw.engines}  # one ip:port, no fallbacks
        got = envoy_request(channel, json.dumps({"prompt": PROMPT}).encode())
        assert got.immediate is not None and got.immediate.status.code == 429
        held.cancel()
        no_leak(gw)
        # a worker whose event stream nobody publishes: never synced
        silent = free_tcp_port()
        gw.serve.http.put("/workers/ghost", json={"url": "http://127.0.0.1:9", "events": f"tcp://127.0.0.1:{silent}"})
        wait_until(lambda: health(channel, "readiness") == "NOT_SERVING", 30, what="not ready")
        assert health(channel, "liveness") == "SERVING"
        assert health(channel, "envoy.service.ext_proc.v3.ExternalProcessor") == "NOT_SERVING"
        channel.close()



def test_the_picker_without_the_http_api(tmp_path: Path) -> None:
    """``--http none``: the picker runs on a loop of its own; SIGTERM stops it cleanly."""
    port, events = free_tcp_port(), free_tcp_port()
    log = (tmp_path / "serve.stderr").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "tokenspeed_router.cli", "serve", "--http", "none",
                             "--epp", f"127.0.0.1:{port}", "--worker",
                             f"name=w0,url=http://127.0.0.1:9,events=tcp://127.0.0.1:{events}"],
                            stdout=subprocess.DEVNULL, stderr=log)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        wait_until(lambda: health(channel, "liveness") == "SERVING", 30, what="the picker to answer")
        assert health(channel, "readiness") == "NOT_SERVING"  # nobody publishes w0's events
        got = envoy_request(channel, json.dumps({"prompt": PROMPT}).encode())
        assert got.endpoint == got.metadata == "127.0.0.1:9"
        channel.close()
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, (tmp_path / "serve.stderr").read_text()
        log.close()
