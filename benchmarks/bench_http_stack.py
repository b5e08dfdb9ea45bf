"""Which HTTP server and client the gateway should use, measured: CPU per proxied streaming request.

Run:  .venv/bin/python benchmarks/bench_http_stack.py [--duration-s 4] [--repeats 3] [--json OUT]
      (granian: ``pip install granian`` into the venv first; skipped when absent)

Each *stack* is a minimal proxy in its own process that does what the
gateway's hot path does with HTTP, and nothing else: read the POST body,
POST it to one upstream, relay the SSE answer to the client chunk by chunk.
The upstream is a fake engine (a raw asyncio protocol on uvloop, in its own
process) answering every POST with ``--events`` (18) SSE events, each written
in its own loop turn as an engine does. ``wrk`` (``--conns`` 32 connections)
drives each proxy for ``--duration-s``; the figure is the CPU (user + system,
the proxy's whole process tree) per completed request, with wrk's p50/p99.
Stacks are measured in interleaved rounds; the median of ``--repeats``.

Servers: uvicorn + httptools (ASGI), granian (its RSGI interface and ASGI),
aiohttp's server (low-level ``web.Server``), and a raw asyncio protocol with
httptools. Clients: aiohttp's ``ClientSession``, httpx's ``AsyncClient``, and
the gateway's own pooled HTTP/1.1 client (``gateway/http1.py``). All servers
run on uvloop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import tree_cpu_seconds
from wrk_output import parse_wrk

from tokenspeed_router.endpoints import free_tcp_port

REPO = Path(__file__).resolve().parents[1]
BODY = json.dumps({"model": "m", "prompt": list(range(1000, 2024)), "max_tokens": 16, "stream": True},
                  separators=(",", ":")).encode()

STACKS = [
    ("uvicorn", "aiohttp"), ("uvicorn", "httpx"), ("uvicorn", "http1"),
    ("granian-rsgi", "aiohttp"), ("granian-rsgi", "http1"), ("granian-asgi", "http1"),
    ("aiohttp", "aiohttp"), ("aiohttp", "http1"),
    ("raw", "aiohttp"), ("raw", "http1"),
]


# --------------------------------------------------------------------------- the fake engine


def _sse_events(n: int) -> list[bytes]:
    out = []
    for i in range(n):
        payload = json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                              "choices": [{"index": 0, "text": f" t{i}", "logprobs": None,
                                           "finish_reason": None}]}).encode()
        event = b"data: " + payload + b"\n\n"
        out.append(f"{len(event):x}\r\n".encode() + event + b"\r\n")
    out.append(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
    return out


def upstream_main(port_file: str, events: int) -> None:
    import httptools
    import uvloop

    chunks = _sse_events(events)
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n")

    class Engine(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.t = transport
            self.p = httptools.HttpRequestParser(self)
            self.loop = asyncio.get_running_loop()

        def data_received(self, data: bytes) -> None:
            self.p.feed_data(data)

        def on_message_complete(self) -> None:
            self.t.write(head)
            self.loop.call_soon(self._next, 0)

        def _next(self, i: int) -> None:
            if self.t.is_closing():
                return
            self.t.write(chunks[i])
            if i + 1 < len(chunks):
                self.loop.call_soon(self._next, i + 1)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Engine, "127.0.0.1", 0, backlog=1024)
        Path(port_file).write_text(str(server.sockets[0].getsockname()[1]))
        await asyncio.Event().wait()

    uvloop.run(main())


# --------------------------------------------------------------------------- clients


class _Client:
    """One POST to the upstream, the answer as an async iterator of byte chunks."""

    def __init__(self, kind: str, url: str) -> None:
        self.kind = kind
        self.url = url
        self._c: Any = None

    def _make(self) -> Any:
        if self.kind == "aiohttp":
            import aiohttp

            return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0),
                                         auto_decompress=False, skip_auto_headers=("Accept-Encoding",))
        if self.kind == "httpx":
            import httpx

            return httpx.AsyncClient(limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024),
                                     timeout=600)
        from tokenspeed_router.gateway.http1 import Http1Pool

        return Http1Pool(max_connections=1024, connect_timeout_s=5, read_timeout_s=600, keepalive_s=4)

    async def stream(self, body: bytes) -> Any:
        if self._c is None:
            self._c = self._make()
        if self.kind == "aiohttp":
            resp = await self._c.post(self.url + "/v1/completions", data=body,
                                      headers={"content-type": "application/json"})
            try:
                async for chunk in resp.content.iter_any():
                    yield chunk
            finally:
                resp.release()
        elif self.kind == "httpx":
            req = self._c.build_request("POST", self.url + "/v1/completions", content=body,
                                        headers={"content-type": "application/json"})
            resp = await self._c.send(req, stream=True)
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()
        else:
            resp = await self._c.post(self.url, "/v1/completions", body)
            try:
                while (chunk := await resp.next_chunk()) is not None:
                    yield chunk
            finally:
                resp.release()


# --------------------------------------------------------------------------- servers

_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


def asgi_app(client: _Client) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        started = False
        async for chunk in client.stream(body):
            if not started:
                started = True
                await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def rsgi_app(client: _Client) -> Any:
    class App:
        async def __rsgi__(self, scope: Any, proto: Any) -> None:
            body = await proto()
            transport = None
            async for chunk in client.stream(body):
                if transport is None:
                    transport = proto.response_stream(200, [("content-type", "text/event-stream"),
                                                            ("cache-control", "no-cache")])
                await transport.send_bytes(chunk)

    return App()


def run_proxy(server: str, client_kind: str, upstream: str, port_file: str) -> None:
    import uvloop

    client = _Client(client_kind, upstream)
    if server == "uvicorn":
        import socket

        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        Path(port_file).write_text(str(sock.getsockname()[1]))
        config = uvicorn.Config(asgi_app(client), http="httptools", loop="uvloop", lifespan="off",
                                access_log=False, log_level="warning", server_header=False, date_header=False)
        uvloop.run(uvicorn.Server(config).serve(sockets=[sock]))
    elif server.startswith("granian"):
        port = free_tcp_port()
        Path(port_file).write_text(str(port))
        os.environ["BENCH_STACK_CLIENT"] = client_kind
        os.environ["BENCH_STACK_UPSTREAM"] = upstream
        from granian.constants import Interfaces, Loops
        from granian.server import Server

        iface = Interfaces.RSGI if server == "granian-rsgi" else Interfaces.ASGI
        target = "bench_http_stack:granian_rsgi" if iface is Interfaces.RSGI else "bench_http_stack:granian_asgi"
        Server(target, address="127.0.0.1", port=port, interface=iface, workers=1, loop=Loops.uvloop,
               log_enabled=False, backlog=1024).serve()
    elif server == "aiohttp":
        from aiohttp import web

        async def handler(request: web.BaseRequest) -> web.StreamResponse:
            body = await request.read()
            resp = web.StreamResponse(status=200, headers={"content-type": "text/event-stream",
                                                           "cache-control": "no-cache"})
            started = False
            async for chunk in client.stream(body):
                if not started:
                    started = True
                    await resp.prepare(request)
                await resp.write(chunk)
            await resp.write_eof()
            return resp

        async def main() -> None:
            srv = web.Server(handler, access_log=None)
            s = await asyncio.get_running_loop().create_server(srv, "127.0.0.1", 0, backlog=1024)
            Path(port_file).write_text(str(s.sockets[0].getsockname()[1]))
            await asyncio.Event().wait()

        uvloop.run(main())
    else:
        uvloop.run(_raw_server(client, port_file))


async def _raw_server(client: _Client, port_file: str) -> None:
    import httptools

    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n")

    class Proto(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.t = transport
            self.p = httptools.HttpRequestParser(self)
            self.body: list[bytes] = []
            self.tasks: set[asyncio.Task[None]] = set()

        def data_received(self, data: bytes) -> None:
            self.p.feed_data(data)

        def on_body(self, b: bytes) -> None:
            self.body.append(b)

        def on_message_complete(self) -> None:
            body, self.body = b"".join(self.body), []
            task = asyncio.ensure_future(self.handle(body))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

        async def handle(self, body: bytes) -> None:
            started = False
            async for chunk in client.stream(body):
                if not started:
                    started = True
                    self.t.write(head)
                self.t.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.t.write(b"0\r\n\r\n")

    s = await asyncio.get_running_loop().create_server(Proto, "127.0.0.1", 0, backlog=1024)
    Path(port_file).write_text(str(s.sockets[0].getsockname()[1]))
    await asyncio.Event().wait()


def _granian_client() -> _Client:
    return _Client(os.environ["BENCH_STACK_CLIENT"], os.environ["BENCH_STACK_UPSTREAM"])


def __getattr__(name: str) -> Any:  # granian imports its target by name in the worker process
    if name == "granian_rsgi":
        return rsgi_app(_granian_client())
    if name == "granian_asgi":
        return asgi_app(_granian_client())
    raise AttributeError(name)


# --------------------------------------------------------------------------- orchestration


def _wait_port(path: Path, proc: subprocess.Popen[bytes], timeout_s: float = 30) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            port = int(path.read_text())
            import socket

            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return port
            except OSError:
                pass
        if proc.poll() is not None:
            raise RuntimeError("process exited before listening")
        time.sleep(0.05)
    raise RuntimeError("no port in time")


def _wrk(port: int, conns: int, duration_s: float) -> dict[str, Any]:
    wrk = shutil.which("wrk")
    assert wrk is not None, "wrk is needed (apt-get install wrk)"
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write("wrk.method = 'POST'\nwrk.headers['Content-Type'] = 'application/json'\n"
                f"wrk.body = [[{BODY.decode()}]]\nwrk.path = '/v1/completions'\n")
        script = f.name
    try:
        out = subprocess.run([wrk, "-t1", f"-c{conns}", f"-d{max(1, round(duration_s))}s", "--latency", "-s",
                              script, f"http://127.0.0.1:{port}/v1/completions"], capture_output=True,
                             text=True, check=True).stdout
    finally:
        os.unlink(script)

    figures = parse_wrk(out)
    figures.pop("req_per_s")  # (timed by the caller over the CPU window)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--server", help=argparse.SUPPRESS)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--upstream", help=argparse.SUPPRESS)
    parser.add_argument("--port-file", help=argparse.SUPPRESS)
    parser.add_argument("--events", type=int, default=18, help="SSE events per answer (default 18)")
    parser.add_argument("--duration-s", type=float, default=4.0, help="wrk seconds per stack per round")
    parser.add_argument("--conns", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stacks", help="comma-separated server:client pairs (default: all)")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    if args.role == "upstream":
        upstream_main(args.port_file, args.events)
        return 0
    if args.role == "proxy":
        sys.path.insert(0, str(Path(__file__).parent))
        run_proxy(args.server, args.client, args.upstream, args.port_file)
        return 0
    stacks = [tuple(s.split(":")) for s in args.stacks.split(",")] if args.stacks else STACKS
    try:
        import granian  # noqa: F401
    except ImportError:
        print("granian not installed: its stacks are skipped (pip install granian)", file=sys.stderr)
        stacks = [s for s in stacks if not s[0].startswith("granian")]
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-http-stack-") as tmp:
        try:
            pf = Path(tmp) / "upstream.port"
            up = subprocess.Popen([sys.executable, __file__, "--role", "upstream", "--port-file", str(pf),
                                   "--events", str(args.events)], env=env)
            procs.append(up)
            upstream = f"http://127.0.0.1:{_wait_port(pf, up)}"
            ports: dict[str, tuple[int, int]] = {}
            for server, client in stacks:
                name = f"{server}:{client}"
                pf = Path(tmp) / f"{server}-{client}.port"
                p = subprocess.Popen([sys.executable, __file__, "--role", "proxy", "--server", server, "--client",
                                      client, "--upstream", upstream, "--port-file", str(pf)], env=env,
                                     stderr=subprocess.DEVNULL)
                procs.append(p)
                ports[name] = (_wait_port(pf, p), p.pid)
                _wrk(ports[name][0], args.conns, 1)  # warm
            for _ in range(args.repeats):
                for name, (port, pid) in ports.items():
                    c0 = tree_cpu_seconds(pid)
                    out = _wrk(port, args.conns, args.duration_s)
                    out["cpu_us_per_request"] = (tree_cpu_seconds(pid) - c0) / max(1, out["requests"]) * 1e6
                    out["req_per_s"] = out["requests"] / args.duration_s
                    results.setdefault(name, []).append(out)
        finally:
            for p in reversed(procs):
                p.terminate()
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
    summary = {}
    print(f"{'server:client':<24}{'CPU us/req':>12}{'(min-max)':>16}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}")
    for name, rows in results.items():
        cpu = [r["cpu_us_per_request"] for r in rows]
        summary[name] = {"cpu_us_per_request": statistics.median(cpu), "cpu_min": min(cpu), "cpu_max": max(cpu),
                         "req_per_s": statistics.median(r["req_per_s"] for r in rows),
                         "p50_ms": statistics.median(r["p50_ms"] for r in rows),
                         "p99_ms": statistics.median(r["p99_ms"] for r in rows),
                         "errors": sum(r["errors"] for r in rows)}
        s = summary[name]
        print(f"{name:<24}{s['cpu_us_per_request']:>12.0f}{f'({min(cpu):.0f}-{max(cpu):.0f})':>16}"
              f"{s['req_per_s']:>9.0f}{s['p50_ms']:>9.2f}{s['p99_ms']:>9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rounds": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
