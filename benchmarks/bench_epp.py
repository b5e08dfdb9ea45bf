"""The endpoint picker (``serve --epp``): same decisions as ``/route``, its cost, its latency, no leaks.

Run:  .venv/bin/python benchmarks/bench_epp.py [--quick] [--json OUT] [--only agreement|cost|latency|leaks]

No Envoy binary runs here: this benchmark is Envoy. It sends the picker the
messages Envoy's ext_proc filter sends (``tokenspeed_router.epp.client``:
the generated ``envoy.service.ext_proc.v3`` protos, full-duplex bodies, over
gRPC on loopback), sends the body the picker gave back to the endpoint it
named (a real engine-sim), and streams the engine's answer back through the
response phase chunk by chunk, as the filter does. Four parts:

* **agreement** — two routers on the same four engines' KV events (same
  recorded state): A answers ``POST /route``, B picks over ext_proc. A
  seeded trace (prefix families, shared and private suffixes) warms the
  engines directly, then every request goes to both in lockstep, released
  in the same order (window 1: each released before the next; window 4: up
  to four in flight). The figure: the share of requests where B's primary
  endpoint is A's worker's.
* **cost** — ``benchmarks/bench_gateway.py``'s load (1,024-token prompts half
  shared, ``stream: true``, ``max_tokens`` 16, 100 req/s over 4 keep-alive
  connections) through the HTTP gateway and through the picker of one
  ``serve --http --epp`` process, in interleaved slices; router CPU
  (user + system, all threads, ``/proc/PID/stat``) per request, both phases.
* **latency** — the picker alone at 500 requests/s (16 paced streams): the
  request phase's round trip (headers + body sent -> destination and body
  back) and each response chunk's (sent -> sent back), p50/p99; the
  engine's answer is one real engine-sim answer replayed (its chunks).
* **leaks** — 100,000 picks, 10 % of the streams dropped mid-way (after the
  pick, or mid-answer), 1 % bodies that are not JSON; in-flight load after
  (``/workers`` and ``tokenspeed_epp_in_flight``) and RSS growth from the
  5,000th pick on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
from bench_gateway import (
    Proc,
    _bodies,
    _cpu_s,
    _pct,
    _prompts,
    _wait_http,
    fixed_rate,
    start_engines,
)
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc

from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.epp.client import (
    FULL_DUPLEX,
    NONE,
    destination,
    health,
    request_body,
    request_headers,
    response_body,
    response_headers,
)

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- processes


def _serve(workdir: Path, engines: list[dict[str, Any]], name: str, *, epp: bool) -> tuple[Proc, int, int]:
    port, epp_port = free_tcp_port(), free_tcp_port()
    argv = [sys.executable, "-m", "tokenspeed_router.cli", "--log-level", "WARNING", "serve",
            "--http", f"127.0.0.1:{port}"]
    if epp:
        argv += ["--epp", f"127.0.0.1:{epp_port}"]
    for i, e in enumerate(engines):
        argv += ["--worker", f"name=w{i},url={e['url']},events={e['events'][0]},replay={e['replay'][0]}"]
    p = Proc(name, argv, workdir)
    _wait_http(f"http://127.0.0.1:{port}/health", p)
    if epp:
        channel = grpc.insecure_channel(f"127.0.0.1:{epp_port}")
        deadline = time.monotonic() + 60
        while health(channel, "readiness") != "SERVING":
            if time.monotonic() > deadline:
                raise RuntimeError(f"the picker never got ready: {p.tail()}")
            time.sleep(0.05)
        channel.close()
    return p, port, epp_port


def _metric(port: int, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _in_flight(port: int) -> int:
    workers = httpx.get(f"http://127.0.0.1:{port}/workers", timeout=10).json()
    return sum(int(w.get("in_flight", 0)) for w in workers.values())


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


# --------------------------------------------------------------------------- Envoy, over grpc.aio


class Envoy:
    """Envoy's ext_proc filter for one request at a time (full-duplex bodies both ways)."""

    def __init__(self, channel: grpc.aio.Channel, response_mode: int = FULL_DUPLEX) -> None:
        self._stub = external_processor_pb2_grpc.ExternalProcessorStub(channel)
        self.response_mode = response_mode

    async def request_phase(self, body: bytes) -> tuple[Any, str, bytes, float]:
        """(call, endpoints, body sent on, round trip s) — or (call, "", b"", rtt) after an ImmediateResponse."""
        call = self._stub.Process()
        t0 = time.perf_counter()
        await call.write(request_headers(modes=(FULL_DUPLEX, self.response_mode)))
        await call.write(request_body(body, end_of_stream=True))
        first = await call.read()
        if first.HasField("immediate_response"):
            return call, "", b"", time.perf_counter() - t0
        sent = b""
        while True:
            got = await call.read()
            sr = got.request_body.response.body_mutation.streamed_response
            sent += sr.body
            if sr.end_of_stream:
                break
        rtt = time.perf_counter() - t0
        return call, destination(first)[0], sent, rtt

    async def response_phase(self, call: Any, chunks: list[bytes], chunk_rtts: list[float] | None = None,
                             content_type: str = "text/event-stream", abort_after: int | None = None) -> None:
        """Feed the answer's chunks (``abort_after``: drop the stream after that many). With
        ``response_body_mode: NONE`` Envoy sends the headers only, then ends the stream."""
        await call.write(response_headers(200, content_type))
        await call.read()
        if self.response_mode == NONE:
            chunks = []
        last = len(chunks) - 1
        for i, chunk in enumerate(chunks):
            if abort_after is not None and i >= abort_after:
                call.cancel()
                return
            t0 = time.perf_counter()
            await call.write(response_body(chunk, end_of_stream=i == last))
            if chunk_rtts is not None or i == last:
                # the picker answers once an SSE event is whole; engine-sim's chunks are whole events
                while True:
                    got = await call.read()
                    if got is grpc.aio.EOF:
                        return
                    if chunk_rtts is not None:
                        chunk_rtts.append(time.perf_counter() - t0)
                    if got.response_body.response.body_mutation.streamed_response.body or i == last:
                        break
        await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass


class EngineClient:
    """A keep-alive HTTP/1.1 connection per engine; the answer comes back as Envoy hands it to its
    filters: one body chunk per read from the upstream socket (the chunked framing removed)."""

    def __init__(self) -> None:
        self._conns: dict[str, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}

    async def post(self, endpoint: str, body: bytes) -> list[bytes]:
        conn = self._conns.get(endpoint)
        if conn is None:
            host, port = endpoint.rsplit(":", 1)
            conn = self._conns[endpoint] = await asyncio.open_connection(host, int(port))
        reader, writer = conn
        writer.write((f"POST /v1/completions HTTP/1.1\r\nhost: {endpoint}\r\ncontent-type: application/json\r\n"
                      f"content-length: {len(body)}\r\n\r\n").encode() + body)
        head = await reader.readuntil(b"\r\n\r\n")
        if b" 200 " not in head.split(b"\r\n", 1)[0]:
            raise RuntimeError(f"engine answered {head[:80]!r}")
        low = head.lower()
        if b"transfer-encoding: chunked" not in low:
            length = int(low.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            return [await reader.readexactly(length)]
        chunks: list[bytes] = []
        buf = b""
        while True:
            data = await reader.read(65536)
            if not data:
                raise RuntimeError("the engine closed mid-answer")
            buf += data
            out = b""
            while True:  # every whole chunk this read completed
                end = buf.find(b"\r\n")
                if end < 0:
                    break
                size = int(buf[:end].split(b";", 1)[0], 16)
                if len(buf) < end + 2 + size + 2:
                    break
                if size == 0:
                    if out:
                        chunks.append(out)
                    return chunks
                out += buf[end + 2:end + 2 + size]
                buf = buf[end + 2 + size + 2:]
            if out:
                chunks.append(out)

    def close(self) -> None:
        for _, writer in self._conns.values():
            writer.close()


# --------------------------------------------------------------------------- agreement


def _trace(seed: int, n: int, families: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 100_000) for _ in range(rng.choice((256, 512, 768)))] for _ in range(families)]
    out = []
    for _ in range(n):
        p = prefixes[min(int(rng.expovariate(0.15)), families - 1)]
        out.append(p[: rng.choice((len(p) // 2, len(p)))] + [rng.randrange(1000, 100_000)
                                                             for _ in range(rng.randrange(16, 257))])
    return out


def agreement(workdir: Path, engines: list[dict[str, Any]], requests: int, windows: tuple[int, ...]) -> dict[str, Any]:
    a, a_port, _ = _serve(workdir, engines, "serve-route", epp=False)
    b, b_port, b_epp = _serve(workdir, engines, "serve-epp", epp=True)
    endpoint_of = {f"w{i}": e["url"].removeprefix("http://") for i, e in enumerate(engines)}
    results: dict[str, Any] = {}
    try:
        for k, window in enumerate(windows):
            trace = _trace(seed=100 + k, n=requests)
            # warm the engines directly (both routers see the same events), then wait for both indexes
            with httpx.Client(timeout=60) as client:
                for i, p in enumerate(trace[: requests // 3]):
                    client.post(f"{engines[i % len(engines)]['url']}/v1/completions",
                                json={"prompt": p, "max_tokens": 1})
                deadline = time.monotonic() + 60
                while True:
                    same = all(client.post(f"http://127.0.0.1:{a_port}/match", json={"token_ids": p}).json()["scores"]
                               == client.post(f"http://127.0.0.1:{b_port}/match", json={"token_ids": p}).json()["scores"]
                               for p in trace[: requests // 3: 7])
                    if same or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
            agree, rows = asyncio.run(_lockstep(a_port, b_epp, trace, window, endpoint_of))
            results[f"window_{window}"] = {"requests": len(trace), "agree": agree,
                                           "agreement": agree / len(trace), "disagreements": rows[:20]}
            print(f"agreement, window {window}: {agree} / {len(trace)}", flush=True)
        results["in_flight_after"] = {"route": _in_flight(a_port), "picker": _in_flight(b_port)}
    finally:
        b.stop()
        a.stop()
    return results


async def _lockstep(a_port: int, b_epp: int, trace: list[list[int]], window: int,
                    endpoint_of: dict[str, str]) -> tuple[int, list[dict[str, Any]]]:
    agree = 0
    rows: list[dict[str, Any]] = []
    open_calls: list[tuple[str, Any]] = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{a_port}", timeout=30) as http, \
            grpc.aio.insecure_channel(f"127.0.0.1:{b_epp}") as channel:
        envoy = Envoy(channel)

        async def release_oldest() -> None:
            rid, call = open_calls.pop(0)
            await http.post("/release", json={"request_id": rid})
            await envoy.response_phase(call, [b'{"choices": []}'], content_type="application/json")

        for i, tokens in enumerate(trace):
            rid = f"cmp-{i}"
            routed = (await http.post("/route", json={"token_ids": tokens, "request_id": rid})).json()
            call, endpoints, _, _ = await envoy.request_phase(json.dumps({"prompt": tokens, "max_tokens": 1}).encode())
            picked = endpoints.split(",")[0]
            if picked == endpoint_of[routed["worker"]]:
                agree += 1
            else:
                rows.append({"i": i, "route": routed["worker"], "picker": picked})
            open_calls.append((rid, call))
            if len(open_calls) >= window:
                await release_oldest()
        while open_calls:
            await release_oldest()
    return agree, rows


# --------------------------------------------------------------------------- cost


async def _picker_paced(epp_port: int, bodies: list[bytes], rate: float, duration_s: float, conns: int = 4,
                        req_rtts: list[float] | None = None, chunk_rtts: list[float] | None = None,
                        canned: list[bytes] | None = None, response_mode: int = FULL_DUPLEX,
                        offset: int = 0) -> tuple[int, int]:
    """Requests through the picker at ``rate`` (``conns`` paced streams in parallel); (done, errors)."""
    per_conn = max(1, round(rate * duration_s / conns))
    done = errors = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{epp_port}") as channel:
        envoy = Envoy(channel, response_mode)
        start = time.perf_counter() + 0.05

        async def conn(k: int) -> None:
            nonlocal done, errors
            engine = EngineClient()
            try:
                for i in range(per_conn):
                    due = start + k / rate + i * conns / rate
                    now = time.perf_counter()
                    if now < due:
                        await asyncio.sleep(due - now)
                    call, endpoints, sent, rtt = await envoy.request_phase(
                        bodies[(i * conns + k + offset) % len(bodies)])
                    if req_rtts is not None:
                        req_rtts.append(rtt)
                    if not endpoints:
                        errors += 1
                        continue
                    if canned is not None:
                        chunks = canned
                    elif envoy.response_mode == NONE:  # Envoy still carries the answer; the picker sees none
                        await engine.post(endpoints.split(",")[0], sent)
                        chunks = []
                    else:
                        chunks = await engine.post(endpoints.split(",")[0], sent)
                    await envoy.response_phase(call, chunks, chunk_rtts)
                    done += 1
            finally:
                engine.close()

        await asyncio.gather(*(conn(k) for k in range(conns)))
    return done, errors


def cost(workdir: Path, engines: list[dict[str, Any]], rate: float, duration_s: float, slices: int,
         rounds: int, max_tokens: int) -> dict[str, Any]:
    """Gateway vs picker (response body FULL_DUPLEX_STREAMED, and NONE) in interleaved slices."""
    serve, port, epp_port = _serve(workdir, engines, "serve", epp=True)
    pid = serve.proc.pid
    bodies = _bodies(_prompts(1024), text=False, stream=True, max_tokens=max_tokens)
    modes = {"picker": FULL_DUPLEX, "picker_response_none": NONE}
    per_round: list[dict[str, Any]] = []
    try:
        fixed_rate(port, bodies, rate, 1.0)  # warm both paths
        asyncio.run(_picker_paced(epp_port, bodies, rate, 1.0))
        for r in range(rounds):
            names = ["gateway", *modes]
            rtts: dict[str, list[float]] = {name: [] for name in modes}
            cpu = dict.fromkeys(names, 0.0)
            count = dict.fromkeys(names, 0)
            errors = dict.fromkeys(names, 0)
            for _ in range(slices):
                c0 = _cpu_s(pid)
                out = fixed_rate(port, bodies, rate, duration_s / slices)
                cpu["gateway"] += _cpu_s(pid) - c0
                count["gateway"] += out["requests"]
                errors["gateway"] += out["errors"]
                for name, mode in modes.items():
                    c0 = _cpu_s(pid)
                    done, bad = asyncio.run(_picker_paced(epp_port, bodies, rate, duration_s / slices,
                                                          response_mode=mode, req_rtts=rtts[name]))
                    cpu[name] += _cpu_s(pid) - c0
                    count[name] += done
                    errors[name] += bad
            row: dict[str, Any] = {name: {"requests": count[name], "errors": errors[name],
                                          "cpu_us_per_request": cpu[name] / max(1, count[name]) * 1e6}
                                   for name in names}
            for name in modes:
                row[f"{name}_ratio"] = row[name]["cpu_us_per_request"] / row["gateway"]["cpu_us_per_request"]
                # the request phase's round trip at this rate: what the picker adds before Envoy forwards
                row[name]["request_phase_p50_ms"] = _pct(rtts[name], 0.5) * 1e3
                row[name]["request_phase_p99_ms"] = _pct(rtts[name], 0.99) * 1e3
            per_round.append(row)
            print(f"cost round {r + 1}: " + ", ".join(f"{n} {row[n]['cpu_us_per_request']:.0f} us/req"
                                                     for n in names)
                  + ", ratios " + ", ".join(f"{row[f'{n}_ratio']:.2f}" for n in modes), flush=True)
        in_flight = _in_flight(port)
    finally:
        serve.stop()
    out: dict[str, Any] = {"rounds": per_round, "rate": rate, "duration_s": duration_s,
                           "in_flight_after": in_flight}
    for name in ["gateway", *modes]:
        out[f"{name}_cpu_us"] = _summary([r[name]["cpu_us_per_request"] for r in per_round])
    for name in modes:
        out[f"{name}_ratio"] = _summary([r[f"{name}_ratio"] for r in per_round])
        out[f"{name}_request_phase_p99_ms"] = _summary([r[name]["request_phase_p99_ms"] for r in per_round])
    return out


def _canned_answer(engine: dict[str, Any], max_tokens: int) -> list[bytes]:
    """One real engine-sim streamed answer, as the chunks it sent."""
    body = _bodies(_prompts(1024), text=False, stream=True, max_tokens=max_tokens)[0]

    async def main() -> list[bytes]:
        client = EngineClient()
        try:
            return await client.post(engine["url"].removeprefix("http://"), body)
        finally:
            client.close()

    return asyncio.run(main())


def _latency_client(epp_port: int, rate: float, duration_s: float, canned: list[bytes], offset: int,
                    max_tokens: int) -> tuple[int, int, list[float], list[float]]:
    """One load process's share of the latency run (picklable for the process pool)."""
    bodies = _bodies(_prompts(1024), text=False, stream=True, max_tokens=max_tokens)
    req: list[float] = []
    chunk: list[float] = []
    done, errors = asyncio.run(_picker_paced(epp_port, bodies, rate, duration_s, conns=8, req_rtts=req,
                                             chunk_rtts=chunk, canned=canned, offset=offset))
    return done, errors, req, chunk


def latency(workdir: Path, engines: list[dict[str, Any]], rate: float, duration_s: float, rounds: int,
            max_tokens: int, clients: int = 2) -> dict[str, Any]:
    """The picker alone at ``rate``, from ``clients`` load processes (one Python client cannot send 500/s)."""
    serve, port, epp_port = _serve(workdir, engines, "serve", epp=True)
    canned = _canned_answer(engines[0], max_tokens)
    per_round = []
    try:
        with ProcessPoolExecutor(clients) as pool:
            list(pool.map(_latency_client, [epp_port] * clients, [rate / clients] * clients, [1.0] * clients,
                          [canned] * clients, range(clients), [max_tokens] * clients))
            for r in range(rounds):
                t0 = time.perf_counter()
                parts = list(pool.map(_latency_client, [epp_port] * clients, [rate / clients] * clients,
                                      [duration_s] * clients, [canned] * clients, range(clients),
                                      [max_tokens] * clients))
                wall = time.perf_counter() - t0
                done = sum(p[0] for p in parts)
                req = [x for p in parts for x in p[2]]
                chunk = [x for p in parts for x in p[3]]
                row = {"requests": done, "errors": sum(p[1] for p in parts), "achieved_req_per_s": done / wall,
                       "request_phase_p50_ms": _pct(req, 0.5) * 1e3, "request_phase_p99_ms": _pct(req, 0.99) * 1e3,
                       "chunk_p50_ms": _pct(chunk, 0.5) * 1e3, "chunk_p99_ms": _pct(chunk, 0.99) * 1e3,
                       "chunks_per_request": len(canned)}
                per_round.append(row)
                print(f"latency round {r + 1}: {row['achieved_req_per_s']:.0f} req/s, request phase p50 "
                      f"{row['request_phase_p50_ms']:.2f} p99 {row['request_phase_p99_ms']:.2f} ms, chunk p50 "
                      f"{row['chunk_p50_ms']:.2f} p99 {row['chunk_p99_ms']:.2f} ms", flush=True)
        in_flight = _in_flight(port)
    finally:
        serve.stop()
    return {"rounds": per_round, "rate": rate, "clients": clients, "conns_per_client": 8,
            "request_phase_p99_ms": _summary([r["request_phase_p99_ms"] for r in per_round]),
            "chunk_p99_ms": _summary([r["chunk_p99_ms"] for r in per_round]),
            "achieved_req_per_s": _summary([r["achieved_req_per_s"] for r in per_round]),
            "in_flight_after": in_flight}


# --------------------------------------------------------------------------- leaks


async def _churn(epp_port: int, bodies: list[bytes], canned: list[bytes], picks: int, seed: int,
                 conns: int = 16) -> dict[str, int]:
    rng = random.Random(seed)
    plan = ["bad" if rng.random() < 0.01 else "abort" if rng.random() < 0.10 / 0.99 else "ok" for _ in range(picks)]
    counts = {"ok": 0, "abort": 0, "bad": 0, "immediate": 0}
    cursor = 0
    async with grpc.aio.insecure_channel(f"127.0.0.1:{epp_port}") as channel:
        envoy = Envoy(channel)

        async def conn() -> None:
            nonlocal cursor
            while cursor < len(plan):
                i = cursor
                cursor += 1
                kind = plan[i]
                body = b"{not json" if kind == "bad" else bodies[i % len(bodies)]
                call, endpoints, _, _ = await envoy.request_phase(body)
                counts[kind] += 1
                if not endpoints:
                    counts["immediate"] += 1
                    continue
                if kind == "abort":
                    if i % 2:
                        call.cancel()  # dropped right after the pick
                    else:
                        await envoy.response_phase(call, canned, abort_after=len(canned) // 2)
                    continue
                await envoy.response_phase(call, canned)

        await asyncio.gather(*(conn() for _ in range(conns)))
    return counts


def leaks(workdir: Path, engines: list[dict[str, Any]], picks: int, max_tokens: int) -> dict[str, Any]:
    serve, port, epp_port = _serve(workdir, engines, "serve", epp=True)
    pid = serve.proc.pid
    bodies = _bodies(_prompts(1024), text=False, stream=True, max_tokens=max_tokens)
    canned = _canned_answer(engines[0], max_tokens)
    try:
        warm = min(5000, picks // 20)
        asyncio.run(_churn(epp_port, bodies, canned, warm, seed=1))
        rss0 = _rss_kib(pid)
        t0 = time.perf_counter()
        counts = asyncio.run(_churn(epp_port, bodies, canned, picks, seed=2))
        wall = time.perf_counter() - t0
        deadline = time.monotonic() + 30
        while (_in_flight(port) or _metric(port, "tokenspeed_epp_in_flight")) and time.monotonic() < deadline:
            time.sleep(0.1)
        rss1 = _rss_kib(pid)
        result = {"picks": picks, "warmup_picks": warm, "counts": counts, "wall_s": wall,
                  "in_flight_after": _in_flight(port), "epp_in_flight_after": _metric(port, "tokenspeed_epp_in_flight"),
                  "rss_kib_after_warmup": rss0, "rss_kib_after": rss1, "rss_growth": (rss1 - rss0) / rss0,
                  "aborted_outcomes": _metric(port, 'tokenspeed_epp_requests_total{outcome="aborted"}'),
                  "http_400_outcomes": _metric(port, 'tokenspeed_epp_requests_total{outcome="http_400"}')}
        print(f"leaks: {picks} picks in {wall:.0f} s ({counts}); in flight after {result['in_flight_after']}, "
              f"RSS {rss0} -> {rss1} KiB ({result['rss_growth'] * 100:+.1f} %)", flush=True)
    finally:
        serve.stop()
    return result


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=["agreement", "cost", "latency", "leaks"])
    parser.add_argument("--quick", action="store_true", help="small counts (a smoke run)")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    parts = args.only or ["agreement", "cost", "latency", "leaks"]
    quick = args.quick
    results: dict[str, Any] = {"config": {"engines": args.engines, "rounds": args.rounds, "quick": quick,
                                          "cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()[0]}}
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory(prefix="bench-epp-") as tmp:
        workdir = Path(tmp)
        try:
            engines = start_engines(workdir, args.engines, procs)
            if "agreement" in parts:
                results["agreement"] = agreement(workdir, engines, 60 if quick else 600, (1, 4))
            if "cost" in parts:
                results["cost"] = cost(workdir, engines, 100.0, 2.0 if quick else 6.0, 3,
                                       1 if quick else args.rounds, 16)
            if "latency" in parts:
                results["latency"] = latency(workdir, engines, 500.0, 2.0 if quick else 10.0,
                                             1 if quick else args.rounds, 16)
            if "leaks" in parts:
                results["leaks"] = leaks(workdir, engines, 2000 if quick else 100_000, 16)
        finally:
            for p in reversed(procs):
                p.stop()
    if args.json:
        out = Path(args.json)
        if args.only and out.exists():  # a rerun of some parts keeps the others' figures
            results = {**json.loads(out.read_text()), **{k: v for k, v in results.items() if k != "config"},
                       f"config_{'_'.join(sorted(parts))}": results["config"]}
        out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
