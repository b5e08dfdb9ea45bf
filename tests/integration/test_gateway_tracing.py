"""W3C trace context through the gateway; the otel extra's span per request; no cost without it.

Real processes: an engine-sim (``--log-level DEBUG`` logs the ``traceparent``
each request carried), a ``serve`` in front of it, and for the span test a
small OTLP/HTTP collector (``http.server`` on a free port) that decodes what
the SDK's exporter posts with OpenTelemetry's own protobuf classes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import REPO_ROOT, wait_until, without_packages_env
from support.engine_sim import EngineSim
from support.server import ServeProcess

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineSim]:
    with EngineSim(tmp_path_factory.mktemp("tracing"), ["--instant", "--capacity-tokens", "8192",
                                                          "--log-level", "DEBUG"]).start(timeout_s=90) as e:
        yield e


def seen_traceparents(engine: EngineSim) -> list[str]:
    return [line.rsplit("traceparent=", 1)[1].strip() for line in engine.stderr_path.read_text().splitlines()
            if "traceparent=" in line]


def worker(engine: EngineSim) -> list[str]:
    return ["--worker", f"name=w0,url={engine.url},events={engine.events},replay={engine.replay_endpoint}"]


def test_the_gateway_forwards_traceparent_and_tracestate(engine: EngineSim, tmp_path: Path) -> None:
    before = len(seen_traceparents(engine))
    with ServeProcess(worker(engine), tmp_path).start(timeout_s=60) as router:
        resp = httpx.post(f"{router.url}/v1/completions", timeout=30.0,
                          json={"prompt": "one two three four", "max_tokens": 2},
                          headers={"traceparent": TRACEPARENT, "tracestate": "vendor=abc"})
        assert resp.status_code == 200, resp.text
        got = wait_until(lambda: seen_traceparents(engine)[before:], 10.0, interval_s=0.02,
                         what="the engine to log the request's traceparent")
    assert got == [TRACEPARENT]  # unchanged: the router emits no span of its own without the extra


class _Collector(BaseHTTPRequestHandler):
    bodies: list[bytes] = []

    def do_POST(self) -> None:
        self.bodies.append(self.rfile.read(int(self.headers["content-length"])))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def spans(bodies: list[bytes]) -> list[Any]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    out = []
    for body in bodies:
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        out.extend(s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans)
    return out


def test_one_span_per_request_with_the_decision(engine: EngineSim, tmp_path: Path) -> None:
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra is part of the dev install")
    _Collector.bodies = []
    collector = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    before = len(seen_traceparents(engine))
    try:
        with ServeProcess([*worker(engine), "--otlp-traces-endpoint", endpoint], tmp_path,
                          env={"OTEL_BSP_SCHEDULE_DELAY": "50"}).start(timeout_s=60) as router:
            resp = httpx.post(f"{router.url}/v1/chat/completions", timeout=30.0,
                              json={"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2},
                              headers={"traceparent": TRACEPARENT})
            assert resp.status_code == 200, resp.text
            got = wait_until(lambda: spans(_Collector.bodies), 20.0, interval_s=0.05, what="a span exported")
    finally:
        collector.shutdown()
        collector.server_close()
    [span] = got
    attrs = {a.key: (a.value.string_value or a.value.int_value) for a in span.attributes}
    assert span.name == "tokenspeed.route"
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == CLIENT_SPAN
    assert attrs["tokenspeed.worker"] == "w0" and attrs["tokenspeed.kind"] == "chat"
    assert attrs["tokenspeed.prompt_tokens"] > 0 and "tokenspeed.request_id" in attrs
    # the engine is parented on the router's span, in the client's trace
    [forwarded] = seen_traceparents(engine)[before:]
    assert forwarded == f"00-{TRACE_ID}-{span.span_id.hex()}-01"


def test_without_the_extra_nothing_of_opentelemetry_is_imported(tmp_path: Path) -> None:
    code = ("import sys, tokenspeed_router.server.http, tokenspeed_router.gateway.app; "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]"
    env = {**os.environ, **without_packages_env(tmp_path / "no_otel", "opentelemetry")}
    proc = subprocess.run([sys.executable, "-m", "tokenspeed_router.cli", "serve", "--worker",
                           "name=w0,url=http://127.0.0.1:9,events=tcp://127.0.0.1:9", "--http", "127.0.0.1:0",
                           "--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'tokenspeed-router[otel]'" in proc.stderr and "Traceback" not in proc.stderr
