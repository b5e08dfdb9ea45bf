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
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
from wrk_output import histogram_buckets, parse_wrk

from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.percentiles import percentile

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16
CHAIN_BLOCKS = 32
PREFIX_BLOCKS = 4  # each worker's shared system prefix
CATCH_UP_S = 30.0  # longest wait for the router to apply a phase's backlog (else: reported unbounded)
POOL = 256  # chains per worker in the churn cycle


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i) % 150_000 + seed % 1000 * 150_000 for i in range(n)]


def _prefix_tokens(worker: int) -> list[int]:
    """Worker ``worker``'s shared system prefix (every request on it starts with these)."""
    return _tokens(900_000 + worker, PREFIX_BLOCKS * BLOCK)


def _cached_prompt(worker: int, chain: int) -> list[int]:
    """The tokens worker ``worker`` holds for chain ``chain``: its prefix, then the chain."""
    return _prefix_tokens(worker) + _tokens(worker * POOL + chain, CHAIN_BLOCKS * BLOCK)


def _opaque_hashes(tokens: list[int], seed: bytes) -> list[int | bytes]:
    """vLLM-style external block ids: low 64 bits of a SHA-256 chained over the blocks."""
    out: list[int | bytes] = []
    prev = seed
    for i in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
        digest = hashlib.sha256(prev + repr(tokens[i:i + BLOCK]).encode()).digest()
        out.append(int.from_bytes(digest[-8:], "big"))
        prev = digest
    return out


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

    return {**parse_wrk(out), "conns": conns, "target_rate": 0, "client": "wrk"}


def _run_zmq(endpoint: str, prompts: list[list[int]], window: int, duration_s: float, rate: float) -> dict[str, Any]:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    enc = msgspec.msgpack.Encoder()

    class Reply(msgspec.Struct):  # the client reads only these: skipping the result costs little
        id: Any = None
        status: int = 0

    dec = msgspec.msgpack.Decoder(Reply)
    # Encoded once: request k carries id k, and k is never reused while in flight (window < prompts),
    # so the client spends a send and a small decode per request, not an encode of 1k token ids.
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
            if k in sent:  # still in flight from the previous cycle: take the next one
                i += 1
                continue
            sock.send(payloads[k])
            sent[k] = time.perf_counter()
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
                t_sent = sent.pop(reply.id, None)
                if t_sent is not None:
                    lat.append(time.perf_counter() - t_sent)
                if reply.status != 200:
                    errors += 1
        elif now >= stop_at + 5:
            break
    elapsed = time.perf_counter() - t0
    sock.close()
    ctx.term()
    return {"requests": len(lat), "req_per_s": len(lat) / elapsed, "p50_ms": _pct(lat, 0.5) * 1e3,
            "p99_ms": _pct(lat, 0.99) * 1e3, "errors": errors, "window": window, "target_rate": rate}


def _run_visibility(endpoint: str, probes: int, worker: str, base: int = 0,
                    deadline_s: float = 120.0) -> dict[str, Any]:
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
    deadline = time.monotonic() + deadline_s
    for k in range(probes):
        q = enc.encode({"op": "match", "id": k, "token_ids": _tokens(10_000_000 + base + k, BLOCK)})
        if time.monotonic() > deadline:
            break
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
        cached = _cached_prompt(w, c)
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
        out = _run_visibility(spec["endpoint"], spec["probes"], spec["worker"], spec.get("probe_base", 0),
                              spec["duration_s"] + CATCH_UP_S)
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
    """Steady vLLM-shaped KV-event churn from one publisher per worker, plus visibility probes.

    Shaped like vLLM 0.33's publisher (``vllm/distributed/kv_events.py``,
    ``block_pool.py``): tagged-map events; block hashes are opaque 64-bit ints
    (the low 64 bits of a chained SHA-256, as with vLLM's default
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), never the router's own content
    hash; each worker first stores a shared system prefix, then every batch is
    one request's newly full blocks (``CHAIN_BLOCKS`` of them, parent = the
    prefix's last block) plus the eviction of an older request's blocks.
    """

    def __init__(self, num_workers: int) -> None:
        from tokenspeed_router.events import BlockRemoved, BlockStored, KVEventBatch
        from tokenspeed_router.events.publisher import ZmqEventPublisher

        self.KVEventBatch = KVEventBatch
        self.pubs = [ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                       hwm=1_000_000) for _ in range(num_workers)]
        self.prefixes: list[Any] = []
        self.stores: list[list[Any]] = []
        self.removes: list[list[Any]] = []
        for w in range(max(1, num_workers)):
            ptoks = _prefix_tokens(w)
            phashes = _opaque_hashes(ptoks, f"w{w}".encode())
            self.prefixes.append(BlockStored(block_hashes=phashes, parent_block_hash=None, token_ids=ptoks,
                                             block_size=BLOCK, medium="GPU"))
            st, rm = [], []
            for c in range(POOL):
                toks = _tokens(w * POOL + c, CHAIN_BLOCKS * BLOCK)
                tail = phashes[-1]
                assert isinstance(tail, int)
                hashes = _opaque_hashes(toks, tail.to_bytes(8, "big"))
                st.append(BlockStored(block_hashes=hashes, parent_block_hash=phashes[-1], token_ids=toks,
                                      block_size=BLOCK, medium="GPU"))
                rm.append(BlockRemoved(block_hashes=hashes, medium="GPU"))
            self.stores.append(st)
            self.removes.append(rm)
        self.step = [0] * max(1, num_workers)
        self.probe_times: dict[int, float] = {}
        self._stop = threading.Event()
        self.published_blocks = 0

    def preload(self) -> None:
        """Store every worker's prefix and the first half of its pool (what routing will find)."""
        for w, pub in enumerate(self.pubs):
            pub.publish(self.KVEventBatch(time.time(), [self.prefixes[w]]))
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

    def run(self, blocks_per_s: float, duration_s: float, probes: int, probe_base: int = 0) -> None:
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
                toks = _tokens(10_000_000 + probe_base + k, BLOCK)
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
    prefix = encode_batch(streamer_like.KVEventBatch(time.time(), [streamer_like.prefixes[0]]))
    from tokenspeed_router import _native

    def ingest_service() -> RouterService:
        svc = RouterService(ServerConfig(http=None))
        svc.apply_item(BatchReceived("w0", 0, decoder.decode(prefix), prefix, b"", time.time(), 0, False))
        return svc

    typed, raw = ingest_service(), ingest_service()

    def apply_typed(i: int) -> None:  # the typed path: decode to Python objects, KvIndex.apply
        batch = decoder.decode(payloads[i])
        typed.apply_item(BatchReceived("w0", i + 1, batch, b"", b"", time.time(), 0, False))

    def apply_raw(i: int) -> None:  # what serve does now: scan (no objects), then apply_raw in C
        ts = _native.scan_batch(payloads[i])
        raw.apply_item(BatchReceived("w0", i + 1, None, payloads[i], b"", time.time(), 0, False, ts))

    timed("ingest_batch_decode_apply_us", apply_typed)
    timed("ingest_batch_scan_apply_raw_us", apply_raw)
    assert raw.ingestor.raw_batches == n, "the raw path did not take the churn batches"
    out["ingest_stored_blocks_per_cpu_s"] = CHAIN_BLOCKS / (out["ingest_batch_decode_apply_us"] * 1e-6)
    out["ingest_raw_stored_blocks_per_cpu_s"] = CHAIN_BLOCKS / (out["ingest_batch_scan_apply_raw_us"] * 1e-6)
    typed.stop()
    raw.stop()
    service.stop()
    return out


# --------------------------------------------------------------------------- orchestration


def _start_router(streamer: Streamer, http_port: int, zmq_ep: str, env: dict[str, str],
                  checkout: Path = REPO) -> subprocess.Popen[bytes]:
    """``serve`` of ``checkout``'s package (its compiled core built in place), following the streamer."""
    args = [sys.executable, "-m", "tokenspeed_router.cli", "--log-level", "WARNING", "serve",
            "--http", f"127.0.0.1:{http_port}", "--zmq-api", zmq_ep]
    for w, pub in enumerate(streamer.pubs):
        args += ["--worker", f"name=w{w},events={pub.endpoint},replay={pub.replay_endpoint}"]
    proc = subprocess.Popen(args, cwd=checkout, env={**env, "PYTHONPATH": str(checkout)})
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


def _histogram(http_port: int, name: str) -> dict[float, float]:
    """One of the router's histograms (cumulative counts by upper bound) from ``/metrics``."""
    import httpx

    return histogram_buckets(httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=10).text, name)


def _visible_buckets(http_port: int) -> dict[float, float]:
    """The router's own publish->applied histogram."""
    return _histogram(http_port, "tokenspeed_ingest_visible_delay_seconds")


def _loop_lag_buckets(http_port: int) -> dict[float, float]:
    """The router's HTTP event-loop lag histogram."""
    return _histogram(http_port, "tokenspeed_http_loop_lag_seconds")


def _over(before: dict[float, float], after: dict[float, float], bound: float) -> float:
    """Fraction of the samples between two scrapes above ``bound``."""
    if bound not in after:
        return float("nan")
    total = after[float("inf")] - before.get(float("inf"), 0.0)
    return (total - (after[bound] - before.get(bound, 0.0))) / total if total else float("nan")


def _bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """Upper bound of the bucket holding quantile q of what was observed between two scrapes."""
    diff = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = diff[-1][1] if diff else 0.0
    for le, count in diff:
        if total and count >= q * total:
            return le
    return float("nan")


def _wait_caught_up(http_port: int, streamer: Streamer, poll_s: float = 0.05, timeout_s: float = 120.0,
                    *, required: bool = True) -> bool:
    """Until every worker's last applied seq is the last one published; False at the deadline
    (or RuntimeError when ``required``)."""
    import httpx

    want = {f"w{w}": p.statistics().published - 1 for w, p in enumerate(streamer.pubs)}
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            ws = client.get(f"http://127.0.0.1:{http_port}/workers").json()
            if all(ws[n]["last_seq"] == s for n, s in want.items()):
                return True
            threading.Event().wait(poll_s)
    if required:
        raise RuntimeError(f"router did not catch up with the publishers within {timeout_s:g}s")
    return False


def _ingest_counters(http_port: int) -> dict[str, float]:
    """Summed per-worker ingestion counters from ``GET /workers`` (gaps, resyncs, rejections, lag)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/workers", timeout=10) as resp:
        ws = json.loads(resp.read())
    out: dict[str, float] = {k: float(sum(w.get(k) or 0 for w in ws.values()))
                             for k in ("gaps", "resyncs", "events_rejected", "replayed_batches", "shed_batches")}
    # publisher timestamp -> applied, of each worker's last applied batch: the backlog, in seconds
    out["max_lag_s"] = max((float(w.get("ingest_delay_s") or 0.0) for w in ws.values()), default=0.0)
    out["not_live"] = float(sum(1 for w in ws.values() if w.get("state") != "live"))
    return out


def _batches_applied(http_port: int) -> int:
    """Batches the router applied so far, summed over its workers (``GET /workers``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/workers", timeout=10) as resp:
        ws = json.loads(resp.read())
    return int(sum(w.get("batches_applied") or 0 for w in ws.values()))


def _profile(pid: int, out_dir: str, tag: str, duration_s: float, *, idle: bool) -> subprocess.Popen[bytes] | None:
    """``py-spy record`` of the router for ``duration_s`` (native frames, per thread; with ``idle``
    the samples of threads waiting too): collapsed stacks in ``DIR/TAG.txt`` (what ``py-spy``'s
    flame graphs draw, as text)."""
    import shutil

    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(pyspy).exists():
        print("py-spy is not installed (pip install py-spy): no profile", file=sys.stderr)
        return None
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([pyspy, "record", "--pid", str(pid), "--native", "--threads", *(["--idle"] if idle else []),
                             "--rate", "200",
                             "--duration", str(max(1, int(duration_s))), "--format", "raw",
                             "--output", str(Path(out_dir) / f"{tag}.txt")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _thread_names(pid: int) -> dict[int, str]:
    """OS thread id -> Python thread name of a process, from ``py-spy dump`` (empty without py-spy).

    Python 3.11 does not name its OS threads, so /proc alone cannot tell the
    ingest thread from the HTTP loop; py-spy reads the names from the
    interpreter (``pip install py-spy``; not a project dependency).
    """
    import re
    import shutil

    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(pyspy).exists():
        return {}
    try:
        out = subprocess.run([pyspy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {int(m.group(1)): m.group(2) for m in re.finditer(r'^Thread (\d+) \([^)]*\): "([^"]*)"', out, re.M)}


def _thread_counters(pid: int) -> dict[int, tuple[float, int, int]]:
    """Per OS thread: CPU seconds, voluntary and involuntary context switches so far (Linux /proc)."""
    out: dict[int, tuple[float, int, int]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue
        vol = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        invol = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        out[int(tid)] = ((int(fields[11]) + int(fields[12])) / tick, vol, invol)
    return out


def _thread_rates(names: dict[int, str], before: dict[int, tuple[float, int, int]],
                  after: dict[int, tuple[float, int, int]], elapsed_s: float) -> dict[str, dict[str, float]]:
    """Per named thread over a phase: cores busy and context switches a second (voluntary: it
    blocked, e.g. handing the GIL over or waiting for it; involuntary: preempted)."""
    out: dict[str, dict[str, float]] = {}
    other = [0.0, 0.0, 0.0]
    for tid, (cpu, vol, invol) in after.items():
        c0, v0, i0 = before.get(tid, (0.0, 0, 0))
        d = ((cpu - c0) / elapsed_s, (vol - v0) / elapsed_s, (invol - i0) / elapsed_s)
        name = names.get(tid)
        if name is None:  # libzmq's I/O threads, uvicorn's workers, ... summed
            other = [a + b for a, b in zip(other, d, strict=True)]
            continue
        out[name] = {"cores": round(d[0], 3), "vol_switches_per_s": round(d[1]), "invol_switches_per_s": round(d[2])}
    out["(other threads)"] = {"cores": round(other[0], 3), "vol_switches_per_s": round(other[1]),
                              "invol_switches_per_s": round(other[2])}
    return out


def _summary(values: list[float]) -> dict[str, float]:
    vals = [v for v in values if v == v]
    if not vals:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def _show(name: str, out: dict[str, Any]) -> None:
    shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items() if k != "seen"}
    print(f"{name:<34} {json.dumps(shown)}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="one round of short phases (smoke test)")
    parser.add_argument("--workers", type=int, default=8, help="publishers (default 8)")
    parser.add_argument("--rates", default="20000,50000,100000,200000",
                        help="stored blocks per second to stream, comma-separated (an idle phase always runs)")
    parser.add_argument("--duration", type=float, default=None, help="seconds per phase (default 5)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; figures are medians (default 3)")
    parser.add_argument("--http-conns", type=int, default=8, help="wrk connections for /match and /route")
    parser.add_argument("--no-wrk", action="store_true", help="use the Python HTTP client even if wrk exists")
    parser.add_argument("--prompt-tokens", type=int, default=1024,
                        help="tokens per query; the first half is cached on some worker")
    parser.add_argument("--zmq-window", type=int, default=32)
    parser.add_argument("--json", metavar="OUT", help="also write the results here")
    parser.add_argument("--blocks-per-s", type=float, default=None,
                        help="one streaming rate instead of --rates (older spelling)")
    parser.add_argument("--only", choices=("costs", "cpu", "ingest", "zmq", "http", "match", "visible"),
                        action="append",
                        help="run only these parts (repeatable; default: all; match and visible are the "
                             "ingest phases' two halves and run them; cpu: streaming alone, the router's CPU "
                             "per applied batch at each rate)")
    parser.add_argument("--profile", metavar="DIR",
                        help="py-spy record the router during each cpu and route phase into DIR (its figures then "
                             "carry py-spy's own cost: profile and measure in separate runs)")
    parser.add_argument("--router-checkout", metavar="DIR",
                        help="run the router from another checkout of the project (an A/B: e.g. a `git worktree` "
                             "of main with its compiled core built in place, `setup.py build_ext --inplace`); "
                             "run the in-process costs of it with PYTHONPATH=DIR")
    parser.add_argument("--profile-idle", action="store_true", help="--profile with the waiting threads' samples")
    args = parser.parse_args()
    if args.role == "loadgen":
        return loadgen_main(args)
    duration = args.duration or (2.0 if args.quick else 5.0)
    repeats = 1 if args.quick else args.repeats
    rates = [args.blocks_per_s] if args.blocks_per_s else [float(r) for r in args.rates.split(",") if r.strip()]
    parts = {"ingest" if p in ("match", "visible") else p
             for p in (args.only or ("costs", "cpu", "ingest", "zmq", "http"))}
    env = dict(os.environ)
    results: dict[str, Any] = {"config": {"workers": args.workers, "rates": rates, "phase_s": duration,
                                          "repeats": repeats, "cpus": os.cpu_count(),
                                          "prompt_tokens": args.prompt_tokens,
                                          "loadavg_at_start": os.getloadavg()[0]}}
    if "costs" in parts:
        results["costs"] = measure_costs(args.workers, args.prompt_tokens, 1000 if args.quick else 3000)
        _show("in_process_cpu_costs", {k: round(v, 1) for k, v in results["costs"].items()})
        if parts == {"costs"}:
            return _write(args, results)
    streamer = Streamer(args.workers)
    http_port, zmq_ep = free_tcp_port(), f"tcp://127.0.0.1:{free_tcp_port()}"
    router = _start_router(streamer, http_port, zmq_ep, env, Path(args.router_checkout or REPO))
    thread_names = _thread_names(router.pid)
    rounds: list[dict[str, Any]] = []
    probe_base = 0
    try:
        streamer.preload()
        _wait_caught_up(http_port, streamer)
        base = {"seed": 1, "workers": args.workers, "duration_s": duration, "port": http_port,
                "endpoint": zmq_ep, "conns": args.http_conns, "window": args.zmq_window,
                "prompt_tokens": args.prompt_tokens, "python_client": args.no_wrk}

        def ingest_phase(rate: float) -> dict[str, Any]:
            """/match at saturation (wrk) and publish->visible probes while streaming at ``rate``."""
            nonlocal probe_base
            _wait_caught_up(http_port, streamer, timeout_s=2 * CATCH_UP_S)  # no backlog from the last phase
            probes = int(duration * 50)
            match = _loadgen({**base, "mode": "http", "rate": 0, "path": "/match"}, env)
            visible = _loadgen({**base, "mode": "visible", "probes": probes, "worker": "w0",
                                "probe_base": probe_base}, env)
            streamer.probe_times.clear()
            before, t0 = streamer.published_blocks, time.perf_counter()
            counters0 = _ingest_counters(http_port)
            hist0 = _visible_buckets(http_port)
            lag0 = _loop_lag_buckets(http_port)
            threads0, t_threads = _thread_counters(router.pid), time.perf_counter()
            streamer.run(rate, duration + 0.5, probes, probe_base)
            threads = _thread_rates(thread_names, threads0, _thread_counters(router.pid),
                                    time.perf_counter() - t_threads)
            lag1 = _loop_lag_buckets(http_port)
            streamed = (streamer.published_blocks - before) / (time.perf_counter() - t0)
            t_stop = time.perf_counter()
            at_stop = _ingest_counters(http_port)  # the backlog as publishing stops
            caught_up = _wait_caught_up(http_port, streamer, poll_s=0.005, timeout_s=CATCH_UP_S, required=False)
            catch_up = time.perf_counter() - t_stop if caught_up else float("inf")
            after = _ingest_counters(http_port)
            hist1 = _visible_buckets(http_port)
            out = _result(match)
            seen = {int(k): v for k, v in _result(visible)["seen"].items()}
            delays = [seen[k] - t for k, t in streamer.probe_times.items() if k in seen]
            probe_base += probes
            return {"rate": rate, "streamed_blocks_per_s": streamed, "match_req_per_s": out["req_per_s"],
                    "match_p99_ms": out["p99_ms"], "match_errors": out["errors"],
                    "visible_probes": len(delays), "visible_lost": probes - len(delays),
                    "visible_p50_ms": _pct(delays, 0.5) * 1e3, "visible_p99_ms": _pct(delays, 0.99) * 1e3,
                    "visible_max_ms": max(delays) * 1e3 if delays else float("nan"),
                    # the router's own publisher-timestamp -> applied histogram (bucket upper bounds): the
                    # probes above also carry the prober's own query latency on a saturated machine
                    "applied_p50_le_ms": _bucket_quantile(hist0, hist1, 0.5) * 1e3,
                    "applied_p99_le_ms": _bucket_quantile(hist0, hist1, 0.99) * 1e3, "catch_up_s": catch_up,
                    # the HTTP loop serving /match while events stream in: does ingest starve it?
                    "loop_lag_p99_le_ms": _bucket_quantile(lag0, lag1, 0.99) * 1e3,
                    "loop_lag_over_10ms": _over(lag0, lag1, 0.01), "loop_lag_over_50ms": _over(lag0, lag1, 0.05),
                    "lag_at_stop_s": at_stop["max_lag_s"],
                    **{k: after[k] - counters0[k]
                       for k in ("gaps", "resyncs", "events_rejected", "replayed_batches", "shed_batches")},
                    "workers_not_live": after["not_live"], "router_threads": threads}

        def cpu_phase(rate: float, tag: str) -> dict[str, Any]:
            """Streaming alone (no queries, no prober): the router's CPU per batch it applied, from
            /proc, over the streaming window only (the batches applied in that same window)."""
            _wait_caught_up(http_port, streamer, timeout_s=2 * CATCH_UP_S)
            counters0 = _ingest_counters(http_port)
            applied0 = _batches_applied(http_port)
            spy = _profile(router.pid, args.profile, tag, duration, idle=args.profile_idle) if args.profile else None
            threads0, c0, t0 = _thread_counters(router.pid), _cpu_s(router.pid), time.perf_counter()
            before = streamer.published_blocks
            streamer.run(rate, duration, 0)
            elapsed = time.perf_counter() - t0
            cpu = _cpu_s(router.pid) - c0
            applied = _batches_applied(http_port) - applied0
            threads = _thread_rates(thread_names, threads0, _thread_counters(router.pid), elapsed)
            streamed = (streamer.published_blocks - before) / elapsed
            if spy is not None:
                spy.wait(60)
            _wait_caught_up(http_port, streamer, timeout_s=2 * CATCH_UP_S, required=False)
            after = _ingest_counters(http_port)
            return {"rate": rate, "streamed_blocks_per_s": streamed, "batches_applied": applied,
                    "router_cpu_cores": cpu / elapsed,
                    "router_cpu_us_per_batch": cpu / applied * 1e6 if applied else float("nan"),
                    **{k: after[k] - counters0[k] for k in ("gaps", "resyncs", "shed_batches")},
                    "router_threads": threads}

        def query_phase(kind: str) -> dict[str, Any]:
            """/route at saturation over ``kind`` (zmq: a DEALER window; http: wrk), no events."""
            _wait_caught_up(http_port, streamer)
            proc = _loadgen({**base, "mode": kind, "rate": 0}, env)
            if args.profile:
                _profile(router.pid, args.profile, f"{kind}-route", duration, idle=args.profile_idle)
            threads0 = _thread_counters(router.pid)
            c0, t0 = _cpu_s(router.pid), time.perf_counter()
            streamer.run(0, duration + 0.5, 0)
            out = _result(proc)
            out["router_threads"] = _thread_rates(thread_names, threads0, _thread_counters(router.pid),
                                                  time.perf_counter() - t0)
            out["router_cpu_cores"] = (_cpu_s(router.pid) - c0) / (time.perf_counter() - t0)
            out["router_cpu_us_per_request"] = (out["router_cpu_cores"] * (time.perf_counter() - t0)
                                                / max(1, out["requests"]) * 1e6)
            return out

        for r in range(repeats):
            rnd: dict[str, Any] = {}
            if "cpu" in parts:
                rnd["cpu"] = []
                for rate in [0.0, *rates]:
                    row = cpu_phase(rate, f"cpu-{rate:g}-r{r + 1}")
                    _show(f"round {r + 1} cpu {rate:g}/s", row)
                    rnd["cpu"].append(row)
            if "ingest" in parts:
                idle = ingest_phase(0)
                _show(f"round {r + 1} ingest idle", idle)
                rnd["ingest"] = [idle]
                for rate in rates:
                    row = ingest_phase(rate)
                    row["match_vs_idle"] = row["match_req_per_s"] / idle["match_req_per_s"]
                    _show(f"round {r + 1} ingest {rate:g}/s", row)
                    rnd["ingest"].append(row)
            for kind in ("zmq", "http"):
                if kind in parts:
                    rnd[f"{kind}_route"] = query_phase(kind)
                    _show(f"round {r + 1} {kind} /route", rnd[f"{kind}_route"])
            rounds.append(rnd)
        results["rounds"] = rounds
        results["summary"] = _summarise(rounds)
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/workers", timeout=10) as resp:
            ws = json.loads(resp.read())
        results["ingest_totals"] = {
            "published_blocks": streamer.published_blocks,
            "events_applied": sum(w["events_applied"] for w in ws.values()),
            "events_rejected": sum(w["events_rejected"] for w in ws.values()),
            "states": sorted({w["state"] for w in ws.values()}),
        }
        _show("ingest_totals", results["ingest_totals"])
    finally:
        router.terminate()
        try:
            router.wait(30)
        except subprocess.TimeoutExpired:
            router.kill()
        streamer.close()
    _print_summary(results)
    return _write(args, results)


def _summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    figures: dict[str, list[float]] = {}
    for rnd in rounds:
        for row in rnd.get("cpu", []):
            tag = "idle" if row["rate"] == 0 else f"{row['rate']:g}"
            for key in ("router_cpu_cores", "router_cpu_us_per_batch", "streamed_blocks_per_s", "shed_batches",
                        "resyncs"):
                figures.setdefault(f"cpu[{tag}].{key}", []).append(row[key])
            for thread, rates in row.get("router_threads", {}).items():
                for key in ("cores", "vol_switches_per_s", "invol_switches_per_s"):
                    figures.setdefault(f"cpu[{tag}].thread[{thread}].{key}", []).append(rates[key])
        for row in rnd.get("ingest", []):
            tag = "idle" if row["rate"] == 0 else f"{row['rate']:g}"
            for key in ("match_req_per_s", "match_vs_idle", "visible_p50_ms", "visible_p99_ms", "visible_max_ms",
                        "applied_p50_le_ms", "applied_p99_le_ms", "loop_lag_p99_le_ms", "loop_lag_over_10ms",
                        "loop_lag_over_50ms",
                        "catch_up_s", "lag_at_stop_s", "gaps", "resyncs", "shed_batches", "visible_lost",
                        "streamed_blocks_per_s"):
                if key in row:
                    figures.setdefault(f"ingest[{tag}].{key}", []).append(row[key])
            for thread, rates in row.get("router_threads", {}).items():
                for key in ("cores", "vol_switches_per_s"):
                    figures.setdefault(f"ingest[{tag}].thread[{thread}].{key}", []).append(rates[key])
        for kind in ("zmq", "http"):
            row = rnd.get(f"{kind}_route")
            if row:
                for key in ("req_per_s", "p50_ms", "p99_ms", "router_cpu_cores", "router_cpu_us_per_request"):
                    figures.setdefault(f"{kind}_route.{key}", []).append(row[key])
    return {k: _summary(v) for k, v in figures.items()}


def _print_summary(results: dict[str, Any]) -> None:
    c = results["config"]
    print(f"\n{c['workers']} vLLM-shaped publishers, {c['prompt_tokens']}-token queries, {c['phase_s']:g} s phases; "
          f"median (min-max) of {c['repeats']} round(s)")
    for key, s in results.get("summary", {}).items():
        print(f"  {key:<44}{s['median']:>12.3f}   ({s['min']:.3f} - {s['max']:.3f})")


def _write(args: argparse.Namespace, results: dict[str, Any]) -> int:
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
