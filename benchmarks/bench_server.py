"""Router service benchmark: /route over HTTP and ZMQ while KV events stream in.

Run:  .venv/bin/python benchmarks/bench_server.py [--quick] [--json OUT]

Three processes on loopback, as in production:

* the router: ``tokenspeed-router serve`` (subprocess) following ``--workers``
  publishers, with the HTTP API and the ZMQ API;
* the event streamer (this process): one ``ZmqEventPublisher`` per worker,
  publishing a steady churn at ``--blocks-per-s`` stored blocks per second
  (each batch stores a 32-block chain and removes an older one, so the index
  stays bounded), plus a *probe* chain every 20 ms for event-to-visible
  latency;
* the load generator (subprocess): ``/route`` requests with ``--prompt-tokens``
  (default 1,024) token prompts whose first half is cached on some worker,
  over HTTP and over ZMQ (a DEALER with a window of outstanding requests); a
  second loop polls ``match`` over ZMQ for each probe chain and stamps when it
  became visible. HTTP saturation uses ``wrk`` when it is installed
  (``apt-get install wrk``: a Python client costs as much CPU per request as
  the server, on a 2-core machine that halves what is measured); the
  fixed-rate HTTP phase uses a raw keep-alive asyncio client.

Figures: requests/s, p50/p99 latency as the client sees it (send -> full
answer), at saturation and at the issue's target rates (5,000/s HTTP,
20,000/s ZMQ), and event-to-visible p50/p99 (publisher timestamp -> first
``match`` that shows the probe). The baseline is the same run with no events
streaming (``--blocks-per-s 0`` phase), reported as a ratio. Fixed seeds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec

from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.percentiles import percentile

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16
CHAIN_BLOCKS = 32
POOL = 256  # chains per worker in the churn cycle


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i) % 150_000 + seed % 1000 * 150_000 for i in range(n)]


def _pct(xs: list[float], q: float) -> float:
    """``q`` as a fraction (0.99), as the rest of this file writes it."""
    return percentile(xs, 100 * q)


# --------------------------------------------------------------------------- load generator


def _http_request(body: bytes, port: int, path: str = "/route") -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    return head + body


async def _http_conn(port: int, bodies: list[bytes], stop_at: float, interval_s: float,
                     lat: list[float], errors: list[int], path: str = "/route") -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    i = 0
    next_t = time.perf_counter()
    while True:
        now = time.perf_counter()
        if now >= stop_at:
            break
        if interval_s and now < next_t:
            await asyncio.sleep(next_t - now)
        next_t += interval_s
        t0 = time.perf_counter()
        writer.write(_http_request(bodies[i % len(bodies)], port, path))
        i += 1
        status_line = await reader.readline()
        length = 0
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b""):
                break
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await reader.readexactly(length)
        lat.append(time.perf_counter() - t0)
        if b" 200 " not in status_line:
            errors.append(1)
    writer.close()


def _run_http(port: int, prompts: list[list[int]], conns: int, duration_s: float, rate: float,
              path: str = "/route") -> dict[str, Any]:
    bodies = [msgspec.json.encode({"token_ids": p}) for p in prompts]
    lat: list[float] = []
    errors: list[int] = []
    interval = conns / rate if rate else 0.0

    async def main() -> float:
        t0 = time.perf_counter()
        stop_at = t0 + duration_s
        await asyncio.gather(*(_http_conn(port, bodies[k::conns], stop_at, interval, lat, errors, path)
                               for k in range(conns)))
        return time.perf_counter() - t0

    elapsed = asyncio.run(main())
    return {"requests": len(lat), "req_per_s": len(lat) / elapsed, "p50_ms": _pct(lat, 0.5) * 1e3,
            "p99_ms": _pct(lat, 0.99) * 1e3, "errors": len(errors), "conns": conns, "target_rate": rate}


def _run_http_wrk(port: int, prompts: list[list[int]], conns: int, duration_s: float,
                  path: str = "/route") -> dict[str, Any]:
    """Saturation with wrk (C, ~10x cheaper per request than a Python client): cycles 64 bodies."""
    import re
    import shutil
    import tempfile

    wrk = shutil.which("wrk")
    assert wrk is not None
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write("local bodies = {\n")
        for p in prompts[:64]:
            f.write("  [[" + msgspec.json.encode({"token_ids": p}).decode() + "]],\n")
        f.write("}\nlocal i = 0\nwrk.method = 'POST'\nwrk.headers['Content-Type'] = 'application/json'\n"
                "request = function()\n  i = i % #bodies + 1\n"
                f"  return wrk.format(nil, '{path}', nil, bodies[i])\nend\n")
        script = f.name
    out = subprocess.run([wrk, "-t1", f"-c{conns}", f"-d{max(1, round(duration_s))}s", "--latency", "-s", script,
                          f"http://127.0.0.1:{port}"], capture_output=True, text=True, check=True).stdout
    os.unlink(script)

    def ms(label: str) -> float:
        m = re.search(rf"{label}\s+([\d.]+)(us|ms|s)\b", out)
        if m is None:
            return float("nan")
        return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]

    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"requests": int(total.group(1)) if total else 0, "req_per_s": float(rps.group(1)) if rps else 0.0,
            "p50_ms": ms("50%"), "p99_ms": ms("99%"), "errors": int(non2xx.group(1)) if non2xx else 0,
            "conns": conns, "target_rate": 0, "client": "wrk"}


def _run_zmq(endpoint: str, prompts: list[list[int]], window: int, duration_s: float, rate: float) -> dict[str, Any]:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder()
    payloads = [enc.encode({"op": "route", "id": i, "token_ids": p}) for i, p in enumerate(prompts)]
    sent: dict[int, float] = {}
    lat: list[float] = []
    errors = 0
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    t0 = time.perf_counter()
    stop_at = t0 + duration_s
    i = 0
    interval = 1.0 / rate if rate else 0.0
    next_t = t0
    while True:
        now = time.perf_counter()
        if now >= stop_at and not sent:
            break
        while now < stop_at and len(sent) < window and (not interval or now >= next_t):
            k = i % len(payloads)
            rid = i
            sock.send(payloads[k] if rid == k else enc.encode({"op": "route", "id": rid, "token_ids": prompts[k]}))
            sent[rid] = time.perf_counter()
            i += 1
            next_t += interval
            now = time.perf_counter()
        # Block (never spin: the router needs the CPU): until a reply, or about when the
        # next request is due (1 ms granularity; latency is timed from the actual send).
        if not interval or len(sent) >= window:
            timeout = 50
        else:
            timeout = max(1, int((next_t - time.perf_counter()) * 1000 + 0.999))
        if poller.poll(timeout):
            while True:
                try:
                    msg = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                reply = dec.decode(msg)
                t_sent = sent.pop(reply.get("id"), None)
                if t_sent is not None:
                    lat.append(time.perf_counter() - t_sent)
                if reply.get("status") != 200:
                    errors += 1
        elif now >= stop_at + 5:
            break
    elapsed = time.perf_counter() - t0
    sock.close()
    ctx.term()
    return {"requests": len(lat), "req_per_s": len(lat) / elapsed, "p50_ms": _pct(lat, 0.5) * 1e3,
            "p99_ms": _pct(lat, 0.99) * 1e3, "errors": errors, "window": window, "target_rate": rate}


def _run_visibility(endpoint: str, probes: int, worker: str) -> dict[str, Any]:
    """Poll ``match`` for probe k until visible; print (k, wall time) pairs."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder()
    seen: dict[int, float] = {}
    pause = threading.Event()
    deadline = time.monotonic() + 120
    for k in range(probes):
        q = enc.encode({"op": "match", "id": k, "token_ids": _tokens(10_000_000 + k, BLOCK)})
        while time.monotonic() < deadline:
            sock.send(q)
            if not sock.poll(2000):
                continue
            reply = dec.decode(sock.recv())
            if reply.get("result", {}).get("scores", {}).get(worker):
                seen[k] = time.time()
                break
            pause.wait(0.0002)
    sock.close()
    ctx.term()
    return {"seen": seen}


def loadgen_main(args: argparse.Namespace) -> int:
    spec = json.loads(sys.stdin.read())
    rng = random.Random(spec["seed"])
    prompts = []
    for _ in range(2000):
        w = rng.randrange(spec["workers"])
        c = rng.randrange(POOL)
        cached = _tokens(w * POOL + c, CHAIN_BLOCKS * BLOCK)
        n = spec["prompt_tokens"]
        prompt = cached[: n // 2] + [rng.randrange(150_000) for _ in range(n - min(n // 2, len(cached)))]
        prompts.append(prompt)
    sys.stdout.write("ready\n")  # the orchestrator starts streaming (and probing) only now
    sys.stdout.flush()
    if spec["mode"] == "http":
        import shutil

        if spec["rate"] == 0 and shutil.which("wrk") and not spec.get("python_client"):
            out = _run_http_wrk(spec["port"], prompts, spec["conns"], spec["duration_s"], spec.get("path", "/route"))
        else:
            out = _run_http(spec["port"], prompts, spec["conns"], spec["duration_s"], spec["rate"],
                            spec.get("path", "/route"))
            out["client"] = "python-asyncio"
    elif spec["mode"] == "zmq":
        out = _run_zmq(spec["endpoint"], prompts, spec["window"], spec["duration_s"], spec["rate"])
    else:
        out = _run_visibility(spec["endpoint"], spec["probes"], spec["worker"])
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


def _loadgen(spec: dict[str, Any], env: dict[str, str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, __file__, "--role", "loadgen"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(spec))
    proc.stdin.close()
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError("load generator failed to start")
    return proc


def _result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    out = proc.stdout.read()
    proc.wait(300)
    return dict(json.loads(out.strip().splitlines()[-1]))


# --------------------------------------------------------------------------- event streamer


class Streamer:
    """Steady KV-event churn from one publisher per worker, plus visibility probes."""

    def __init__(self, num_workers: int) -> None:
        from tokenspeed_router.events import KVEventBatch
        from tokenspeed_router.events.publisher import ZmqEventPublisher
        from tokenspeed_router.hashing import block_hashes

        self.KVEventBatch = KVEventBatch
        self.pubs = [ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                       hwm=1_000_000) for _ in range(num_workers)]
        from tokenspeed_router.events import BlockHash, BlockRemoved, BlockStored

        self.stores: list[list[Any]] = []
        self.removes: list[list[Any]] = []
        for w in range(max(1, num_workers)):
            st, rm = [], []
            for c in range(POOL):
                toks = _tokens(w * POOL + c, CHAIN_BLOCKS * BLOCK)
                hashes: list[BlockHash] = list(block_hashes(toks, BLOCK))
                st.append(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=toks, block_size=BLOCK))
                rm.append(BlockRemoved(block_hashes=hashes))
            self.stores.append(st)
            self.removes.append(rm)
        self.step = [0] * max(1, num_workers)
        self.probe_times: dict[int, float] = {}
        self._stop = threading.Event()
        self.published_blocks = 0

    def preload(self) -> None:
        """Store the first half of every worker's pool (what routing will find)."""
        for w, pub in enumerate(self.pubs):
            for _ in range(POOL // 2):
                self._churn(w, pub)
            pub.wait_sent(30)

    def _churn(self, w: int, pub: Any) -> None:
        j = self.step[w]
        events = [self.stores[w][j % POOL]]
        if j >= POOL // 2:
            events.insert(0, self.removes[w][(j - POOL // 2) % POOL])
        pub.publish(self.KVEventBatch(time.time(), events))
        self.step[w] = j + 1
        self.published_blocks += CHAIN_BLOCKS

    def run(self, blocks_per_s: float, duration_s: float, probes: int) -> None:
        """Publish at the rate for the duration; a probe every duration/probes seconds."""
        from tokenspeed_router.events import BlockHash, BlockStored
        from tokenspeed_router.hashing import block_hashes

        batches_per_s = blocks_per_s / CHAIN_BLOCKS
        t0 = time.perf_counter()
        n = 0
        k = 0
        probe_every = duration_s / max(1, probes)
        pause = threading.Event()
        while not self._stop.is_set():
            now = time.perf_counter()
            if now - t0 >= duration_s:
                break
            if k < probes and now - t0 >= k * probe_every:
                toks = _tokens(10_000_000 + k, BLOCK)
                ev = BlockStored(block_hashes=list[BlockHash](block_hashes(toks, BLOCK)), parent_block_hash=None,
                                 token_ids=toks, block_size=BLOCK)
                ts = time.time()
                self.pubs[0].publish(self.KVEventBatch(ts, [ev]))
                self.probe_times[k] = ts
                k += 1
            due = int((now - t0) * batches_per_s) if batches_per_s else 0
            while n < due:
                w = n % len(self.pubs)
                self._churn(w, self.pubs[w])
                n += 1
            pause.wait(0.0005)

    def close(self) -> None:
        for p in self.pubs:
            p.close()


# --------------------------------------------------------------------------- in-process costs


def measure_costs(num_workers: int, prompt_tokens: int, n: int = 3000) -> dict[str, float]:
    """CPU microseconds per operation, in process (``time.process_time``): stable on a busy host.

    Where the per-request time goes, without sockets: the HTTP app called as an
    ASGI callable (Starlette routing + body read + msgspec decode + route +
    encode), the ZMQ API's ``handle`` (msgpack decode + route + encode), the
    routing decision alone, and ingestion of one churn batch (decode + apply).
    """
    import asyncio

    from tokenspeed_router.events import encode_batch
    from tokenspeed_router.events.codec import BatchDecoder
    from tokenspeed_router.events.subscriber import BatchReceived
    from tokenspeed_router.server import RouterService, ServerConfig, ZmqApiServer, create_app

    service = RouterService(ServerConfig(http=None))
    rng = random.Random(1)
    streamer_like = Streamer.__new__(Streamer)
    Streamer.__init__(streamer_like, 0)  # no publishers: only the event lists
    for w in range(num_workers):
        for c in range(POOL // 2):
            toks = _tokens(w * POOL + c, CHAIN_BLOCKS * BLOCK)
            from tokenspeed_router.events import BlockHash, BlockStored, KVEventBatch
            from tokenspeed_router.hashing import block_hashes

            hashes: list[BlockHash] = list(block_hashes(toks, BLOCK))
            service.apply_record(f"w{w}", c, KVEventBatch(1.0, [BlockStored(
                block_hashes=hashes, parent_block_hash=None, token_ids=toks, block_size=BLOCK)]), 1.0)
    prompts = []
    for _ in range(500):
        cached = _tokens(rng.randrange(num_workers) * POOL + rng.randrange(POOL // 2), CHAIN_BLOCKS * BLOCK)
        prompts.append(cached[: prompt_tokens // 2] +
                       [rng.randrange(150_000) for _ in range(prompt_tokens - prompt_tokens // 2)])
    out: dict[str, float] = {}

    def timed(name: str, fn: Any) -> None:
        t0 = time.process_time()
        for i in range(n):
            fn(i)
        out[name] = (time.process_time() - t0) / n * 1e6

    timed("route_decision_us", lambda i: service.route(prompts[i % 500], request_id=f"c{i}"))
    zmq_api = ZmqApiServer(service, "inproc://bench-costs")
    enc = msgspec.msgpack.Encoder()
    zpayloads = [enc.encode({"op": "route", "id": i, "token_ids": p}) for i, p in enumerate(prompts)]
    timed("zmq_route_handle_us", lambda i: zmq_api.handle(zpayloads[i % 500]))
    zmq_api.stop()
    app = create_app(service)
    bodies = [msgspec.json.encode({"token_ids": p}) for p in prompts]

    async def asgi_loop() -> None:
        sent: list[Any] = []

        async def send(message: Any) -> None:
            sent.append(message)

        for i in range(n):
            body = bodies[i % 500]

            async def receive(body: bytes = body) -> Any:
                return {"type": "http.request", "body": body, "more_body": False}

            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                     "scheme": "http", "path": "/route", "raw_path": b"/route", "query_string": b"",
                     "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
                     "headers": [(b"content-type", b"application/json"),
                                 (b"content-length", str(len(body)).encode())]}
            await app(scope, receive, send)
            sent.clear()

    t0 = time.process_time()
    asyncio.run(asgi_loop())
    out["http_route_asgi_us"] = (time.process_time() - t0) / n * 1e6
    payloads = []
    for j in range(n):
        events = [streamer_like.stores[0][j % POOL]]
        if j >= POOL // 2:
            events.insert(0, streamer_like.removes[0][(j - POOL // 2) % POOL])
        payloads.append(encode_batch(streamer_like.KVEventBatch(time.time(), events)))
    decoder = BatchDecoder()
    ingest = RouterService(ServerConfig(http=None))

    def apply(i: int) -> None:
        batch = decoder.decode(payloads[i])
        ingest.apply_item(BatchReceived("w0", i, batch, payloads[i], b"", time.time(), 0, False))

    timed("ingest_batch_decode_apply_us", apply)
    out["ingest_stored_blocks_per_cpu_s"] = CHAIN_BLOCKS / (out["ingest_batch_decode_apply_us"] * 1e-6)
    service.stop()
    ingest.stop()
    return out


# --------------------------------------------------------------------------- orchestration


def _start_router(streamer: Streamer, http_port: int, zmq_ep: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "tokenspeed_router.cli", "--log-level", "WARNING", "serve",
            "--http", f"127.0.0.1:{http_port}", "--zmq-api", zmq_ep]
    for w, pub in enumerate(streamer.pubs):
        args += ["--worker", f"name=w{w},events={pub.endpoint},replay={pub.replay_endpoint}"]
    proc = subprocess.Popen(args, cwd=REPO, env=env)
    import httpx

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            threading.Event().wait(0.1)
    proc.kill()
    raise RuntimeError("router did not start")


def _visible_buckets(http_port: int) -> dict[float, float]:
    """The router's own publish->applied histogram (cumulative counts by upper bound)."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=10).text
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("tokenspeed_ingest_visible_delay_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float("inf") if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def _bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """Upper bound of the bucket holding quantile q of what was observed between two scrapes."""
    diff = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = diff[-1][1] if diff else 0.0
    for le, count in diff:
        if total and count >= q * total:
            return le
    return float("nan")


def _wait_caught_up(http_port: int, streamer: Streamer, poll_s: float = 0.05) -> None:
    import httpx

    want = {f"w{w}": p.statistics().published - 1 for w, p in enumerate(streamer.pubs)}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ws = httpx.get(f"http://127.0.0.1:{http_port}/workers", timeout=5).json()
        if all(ws[n]["last_seq"] == s for n, s in want.items()):
            return
        threading.Event().wait(poll_s)
    raise RuntimeError("router did not catch up with the preload")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="short phases (smoke test)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--blocks-per-s", type=float, default=100_000)
    parser.add_argument("--duration", type=float, default=None, help="seconds per phase")
    parser.add_argument("--http-conns", type=int, default=4)
    parser.add_argument("--no-wrk", action="store_true", help="use the Python HTTP client even if wrk exists")
    parser.add_argument("--prompt-tokens", type=int, default=1024,
                        help="tokens per /route request; the first half is cached on some worker")
    parser.add_argument("--zmq-window", type=int, default=32)
    parser.add_argument("--json", metavar="OUT", help="also write the results here")
    parser.add_argument("--only", choices=("costs", "match", "http", "zmq", "visible"), action="append",
                        help="run only these parts (repeatable)")
    args = parser.parse_args()
    if args.role == "loadgen":
        return loadgen_main(args)
    duration = args.duration or (2.0 if args.quick else 6.0)
    env = dict(os.environ)
    results_costs: dict[str, Any] = {}
    if not args.only or "costs" in args.only:
        results_costs = measure_costs(args.workers, args.prompt_tokens, 1000 if args.quick else 3000)
        print(f"{'in_process_cpu_costs':<34} {json.dumps({k: round(v, 1) for k, v in results_costs.items()})}",
              flush=True)
        if args.only == ["costs"]:
            if args.json:
                Path(args.json).write_text(json.dumps({"costs": results_costs}, indent=2))
            return 0
    streamer = Streamer(args.workers)
    http_port, zmq_ep = free_tcp_port(), f"tcp://127.0.0.1:{free_tcp_port()}"
    router = _start_router(streamer, http_port, zmq_ep, env)
    results: dict[str, Any] = {"config": {"workers": args.workers, "blocks_per_s": args.blocks_per_s,
                                          "phase_s": duration, "cpus": os.cpu_count(),
                                          "prompt_tokens": args.prompt_tokens,
                                          "loadavg_at_start": os.getloadavg()[0]},
                               "costs": results_costs}
    try:
        streamer.preload()
        _wait_caught_up(http_port, streamer)
        base = {"seed": 1, "workers": args.workers, "duration_s": duration, "port": http_port,
                "endpoint": zmq_ep, "conns": args.http_conns, "window": args.zmq_window,
                "prompt_tokens": args.prompt_tokens, "python_client": args.no_wrk}

        def phase(name: str, spec: dict[str, Any], blocks_per_s: float, probes: int = 0) -> dict[str, Any]:
            _wait_caught_up(http_port, streamer)  # no backlog from the previous phase
            proc = _loadgen({**base, **spec}, env)
            before, t0 = streamer.published_blocks, time.perf_counter()
            streamer.run(blocks_per_s, duration + 0.5, probes)
            out = _result(proc)
            out["streamed_blocks_per_s"] = (streamer.published_blocks - before) / (time.perf_counter() - t0)
            results[name] = out
            print(f"{name:<34} {json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items() if k != 'seen'})}",
                  flush=True)
            return out

        parts = set(args.only or ("match", "http", "zmq", "visible")) - {"costs"}
        # ingest capacity: a burst as fast as the publishers go, until the router has applied it
        _wait_caught_up(http_port, streamer)
        burst = 1000 if args.quick else 3000
        t0 = time.perf_counter()
        for n in range(burst):
            w = n % len(streamer.pubs)
            streamer._churn(w, streamer.pubs[w])
        _wait_caught_up(http_port, streamer, poll_s=0.005)
        elapsed = time.perf_counter() - t0
        results["ingest_burst"] = {"batches": burst, "stored_blocks": burst * CHAIN_BLOCKS,
                                   "seconds": elapsed, "stored_blocks_per_s": burst * CHAIN_BLOCKS / elapsed}
        print(f"{'ingest_burst':<34} {json.dumps(results['ingest_burst'])}", flush=True)
        if "match" in parts:
            # POST /match (no side effects) at saturation, idle vs while events stream in
            spec = {"mode": "http", "rate": 0, "path": "/match"}
            idle = phase("http_match_idle_saturation", spec, 0)
            busy = phase("http_match_saturation", spec, args.blocks_per_s)
            results["http_match_ratio_streaming_vs_idle"] = busy["req_per_s"] / idle["req_per_s"]
            print(f"{'http_match_ratio_streaming_vs_idle':<34} {results['http_match_ratio_streaming_vs_idle']:.2f}",
                  flush=True)
        for kind, target in (("http", 5000), ("zmq", 20000)):
            if kind not in parts:
                continue
            idle = phase(f"{kind}_route_idle_saturation", {"mode": kind, "rate": 0}, 0)
            busy = phase(f"{kind}_route_saturation", {"mode": kind, "rate": 0}, args.blocks_per_s)
            phase(f"{kind}_route_at_{target}", {"mode": kind, "rate": target}, args.blocks_per_s)
            results[f"{kind}_throughput_ratio_streaming_vs_idle"] = busy["req_per_s"] / idle["req_per_s"]
        if "visible" not in parts:
            return _finish(args, results, router, streamer)
        probes = int(duration * 50)
        _wait_caught_up(http_port, streamer)
        buckets_before = _visible_buckets(http_port)
        t_start = time.monotonic()
        proc = _loadgen({**base, "mode": "visible", "probes": probes, "worker": "w0"}, env)
        streamer.probe_times.clear()
        streamer.run(args.blocks_per_s, duration, probes)
        seen = {int(k): v for k, v in _result(proc)["seen"].items()}
        delays = [seen[k] - t for k, t in streamer.probe_times.items() if k in seen]
        results["event_to_visible"] = {
            "probes": len(delays), "p50_ms": _pct(delays, 0.5) * 1e3, "p99_ms": _pct(delays, 0.99) * 1e3,
            "max_ms": max(delays) * 1e3 if delays else float("nan"),
            "elapsed_s": time.monotonic() - t_start,
        }
        _wait_caught_up(http_port, streamer)
        after = _visible_buckets(http_port)
        results["event_to_visible"]["router_histogram_p50_le_ms"] = _bucket_quantile(buckets_before, after, 0.5) * 1e3
        results["event_to_visible"]["router_histogram_p99_le_ms"] = _bucket_quantile(buckets_before, after, 0.99) * 1e3
        print(f"{'event_to_visible':<34} {json.dumps(results['event_to_visible'])}", flush=True)
        # GET /workers answers {worker: status} (DESIGN §6), not {"workers": ...}.
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/workers", timeout=10) as resp:
            ws = json.loads(resp.read())
        results["ingest"] = {
            "published_blocks": streamer.published_blocks,
            "events_applied": sum(w["events_applied"] for w in ws.values()),
            "events_rejected": sum(w["events_rejected"] for w in ws.values()),
            "states": sorted({w["state"] for w in ws.values()}),
        }
        print(f"{'ingest':<34} {json.dumps(results['ingest'])}", flush=True)
    except BaseException:
        router.kill()
        streamer.close()
        raise
    return _finish(args, results, router, streamer)


def _finish(args: argparse.Namespace, results: dict[str, Any], router: subprocess.Popen[bytes],
            streamer: Streamer) -> int:
    router.terminate()
    router.wait(30)
    streamer.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
