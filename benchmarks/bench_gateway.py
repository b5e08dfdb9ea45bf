"""Gateway benchmark: what the OpenAI gateway in ``serve`` costs, what it sustains, and whether it stalls.

Run:  .venv/bin/python benchmarks/bench_gateway.py [--quick] [--repeats 3] [--json OUT] [--no-peer]

Processes on loopback, as in production (all on this machine's cores):

* ``--engines`` (4) ``tokenspeed-router engine-sim --instant`` engines (no
  modelled delays: an answer costs only the engine's own HTTP handling, so
  what is left is the proxy's cost);
* ``tokenspeed-router serve`` with them as ``url=`` workers (events and replay
  subscribed, the gateway on its HTTP port);
* ``vllm-router --policy kv_aware`` in front of the same engines, on the same
  KV events (``--peer-bin``; default: ``vllm-router`` on PATH, beside this
  Python, or in ``/work/peers-venv``; ``pip install vllm-router==0.1.17`` into
  a venv of its own; skipped with a note when absent);
* optionally (``--compare-src DIR``) a second gateway running another
  checkout's ``tokenspeed_router``: before/after figures in one run;
* the load: a raw keep-alive asyncio HTTP client for the fixed-rate phase, and
  ``wrk`` for saturation (a Python client would cost as much CPU per request
  as the servers; ``apt-get install wrk``).

The requests: ``/v1/completions`` with token-id prompts of ``--prompt-tokens``
(1,024) tokens whose first half is one of 8 shared prefixes, ``stream: true``
(``--no-stream`` for JSON answers), ``max_tokens`` ``--max-tokens`` (16: 16
SSE chunks, the usage chunk and ``[DONE]``), fixed seed.

Figures, per target, each the median of ``--repeats`` rounds with min-max:

* **overhead**: p50/p99 latency (send -> whole answer) at ``--rate`` req/s
  through the router minus the same straight to one engine, all targets
  measured in interleaved slices (machine load drifts);
* **CPU per request**: CPU seconds (user + system, every thread) the
  router process spent, divided by the requests it answered, at the fixed
  rate and at saturation;
* **saturation**: wrk with ``--conns`` (32) connections for ``--duration-s``;
* **longest pause**: the longest interval in which no request completed,
  under saturation (wrk's Lua ``response`` hook reads CLOCK_MONOTONIC through
  LuaJIT's FFI at each completion), and how many such intervals were over
  10 ms. A full garbage-collector pass of the router shows up here; the
  gateway's own longest full-collection pause is also read from its
  ``/metrics`` (``tokenspeed_gc_longest_pause_seconds``).

Ratios against vllm-router kv_aware are taken within each round, then the
median of those. Timing on a shared 2-core machine is noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from wrk_output import histogram_buckets, parse_wrk

from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.loadgen.fleet import stop_process

REPO = Path(__file__).resolve().parents[1]
NUM_PROMPTS = 64
PEER_VENV = Path("/work/peers-venv/bin/vllm-router")
MODEL = "tokenspeed-sim"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _prompts(prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """Half shared: 8 prefixes of ``prompt_tokens // 2`` tokens, each prompt's rest its own."""
    rng = random.Random(seed)
    half = prompt_tokens // 2
    prefixes = [[rng.randrange(1000, 100_000) for _ in range(half)] for _ in range(8)]
    return [prefixes[i % 8] + [rng.randrange(1000, 100_000) for _ in range(prompt_tokens - half)]
            for i in range(NUM_PROMPTS)]


def _bodies(prompts: list[list[int]], *, text: bool, stream: bool, max_tokens: int) -> list[bytes]:
    out = []
    for p in prompts:
        body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens,
                                "prompt": " ".join(map(str, p)) if text else p}
        if stream:
            body["stream"] = True
        out.append(json.dumps(body, separators=(",", ":")).encode())
    return out


# --------------------------------------------------------------------------- processes


class Proc:
    """A subprocess whose stderr goes to a file (shown when it fails)."""

    def __init__(self, name: str, argv: list[str], workdir: Path, *, stdout_pipe: bool = False,
                 src: Path | None = None) -> None:
        self.name = name
        self.log = workdir / f"{name}.log"
        self._log = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if src is not None:  # another checkout's tokenspeed_router (same venv): --compare-src
            env["PYTHONPATH"] = str(src)
        self.proc = subprocess.Popen(argv, cwd=src or REPO,
                                     stdout=subprocess.PIPE if stdout_pipe else subprocess.DEVNULL,
                                     stderr=self._log, env=env)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        stop_process(self.proc, 20)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


def _engine(workdir: Path, i: int) -> tuple[Proc, dict[str, Any]]:
    p = Proc(f"engine{i}", [sys.executable, "-m", "tokenspeed_router.cli", "engine-sim", "--port", "0",
                            "--events", "tcp://127.0.0.1:0", "--replay", "tcp://127.0.0.1:0", "--instant",
                            "--name", f"e{i}"],
             workdir, stdout_pipe=True)
    assert p.proc.stdout is not None
    line = p.proc.stdout.readline()
    if not line:
        raise RuntimeError(f"engine-sim did not start: {p.tail()}")
    return p, json.loads(line)


def start_engines(workdir: Path, count: int, procs: list[Proc]) -> list[dict[str, Any]]:
    """``count`` instant engine-sims (appended to ``procs`` as they start); their start-up lines."""
    engines = []
    for i in range(count):
        p, info = _engine(workdir, i)
        procs.append(p)
        engines.append(info)
    return engines


def _wait_http(url: str, proc: Proc, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"{proc.name} exited: {proc.tail()}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{proc.name} did not answer {url}: {proc.tail()}")


def _serve(workdir: Path, engines: list[dict[str, Any]], src: Path | None = None,
           name: str = "serve") -> tuple[Proc, int]:
    port = free_tcp_port()
    argv = [sys.executable, "-m", "tokenspeed_router.cli", "--log-level", "WARNING", "serve",
            "--http", f"127.0.0.1:{port}"]
    for i, e in enumerate(engines):
        argv += ["--worker", f"name=w{i},url={e['url']},events={e['events'][0]},replay={e['replay'][0]}"]
    p = Proc(name, argv, workdir, src=src)
    _wait_http(f"http://127.0.0.1:{port}/health", p)
    return p, port


def _peer_exe(given: str | None) -> str | None:
    if given:
        return given if Path(given).exists() else None
    for candidate in (shutil.which("vllm-router"), str(Path(sys.executable).parent / "vllm-router"),
                      str(PEER_VENV)):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def _vllm_router(workdir: Path, engines: list[dict[str, Any]], exe: str) -> tuple[Proc, int] | None:
    port = free_tcp_port()
    argv = [exe, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *[e["url"] for e in engines],
            "--policy", "kv_aware", "--kv-event-block-size", "16", "--kv-event-model", MODEL]
    for e in engines:
        argv += ["--kv-event-source", f"{e['url']}={e['events'][0]}"]
    p = Proc("vllm-router", argv, workdir)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", p, timeout_s=30)
    except RuntimeError as err:
        p.stop()
        print(f"vllm-router --policy kv_aware did not start: {err}", file=sys.stderr)
        return None
    return p, port


# --------------------------------------------------------------------------- load


def _request(body: bytes, port: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


async def _read_answer(reader: asyncio.StreamReader) -> bytes:
    status = await reader.readline()
    length = -1
    chunked = False
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        low = line.lower()
        if low.startswith(b"content-length:"):
            length = int(line[15:])
        elif low.startswith(b"transfer-encoding:") and b"chunked" in low:
            chunked = True
    if chunked:
        while True:
            size = int((await reader.readline()).strip(), 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    elif length >= 0:
        await reader.readexactly(length)
    return status


async def _paced_conn(port: int, bodies: list[bytes], start: float, interval_s: float, count: int,
                      lat: list[float], errors: list[bytes]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for i in range(count):
        due = start + i * interval_s
        now = time.perf_counter()
        if now < due:
            await asyncio.sleep(due - now)
        t0 = time.perf_counter()
        writer.write(_request(bodies[i % len(bodies)], port))
        status = await _read_answer(reader)
        lat.append(time.perf_counter() - t0)
        if b" 200 " not in status:
            errors.append(status)
    writer.close()


def fixed_rate(port: int, bodies: list[bytes], rate: float, duration_s: float, conns: int = 4,
               samples: list[float] | None = None) -> dict[str, Any]:
    """Open loop at ``rate`` req/s over ``conns`` keep-alive connections (each paced at rate/conns)."""
    lat: list[float] = samples if samples is not None else []
    errors: list[bytes] = []
    per_conn = max(1, round(rate * duration_s / conns))

    async def main() -> None:
        start = time.perf_counter() + 0.05
        await asyncio.gather(*(_paced_conn(port, bodies[k::conns], start + k / rate, conns / rate, per_conn,
                                           lat, errors) for k in range(conns)))

    asyncio.run(main())
    return {"requests": len(lat), "p50_ms": _pct(lat, 0.5) * 1e3, "p99_ms": _pct(lat, 0.99) * 1e3,
            "errors": len(errors)}


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def interleaved(targets: dict[str, tuple[int, list[bytes], int]], rate: float, duration_s: float,
                slices: int) -> dict[str, dict[str, Any]]:
    """``fixed_rate`` per target in ``slices`` alternating slices, with the CPU the answering process spent."""
    lat: dict[str, list[float]] = {name: [] for name in targets}
    errors = dict.fromkeys(targets, 0)
    cpu = dict.fromkeys(targets, 0.0)
    for _ in range(slices):
        for name, (port, bodies, pid) in targets.items():
            c0 = _cpu_s(pid)
            out = fixed_rate(port, bodies, rate, duration_s / slices, samples=lat[name])
            cpu[name] += _cpu_s(pid) - c0
            errors[name] += out["errors"]
    return {name: {"requests": len(xs), "p50_ms": _pct(xs, 0.5) * 1e3, "p99_ms": _pct(xs, 0.99) * 1e3,
                   "errors": errors[name], "cpu_us_per_request": cpu[name] / max(1, len(xs)) * 1e6}
            for name, xs in lat.items()}


#: wrk's Lua side: cycle the bodies; at each completion read CLOCK_MONOTONIC (LuaJIT FFI) and keep
#: the longest gap between two completions and the count of gaps over 10 ms (globals: read by done()).
_WRK_LUA = """
local ffi = require("ffi")
ffi.cdef[[
typedef struct { long tv_sec; long tv_nsec; } bench_timespec;
int clock_gettime(int clk_id, bench_timespec *tp);
]]
local ts = ffi.new("bench_timespec")
local function now() ffi.C.clock_gettime(1, ts); return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9 end
local i = 0
wrk.method = 'POST'
wrk.headers['Content-Type'] = 'application/json'
request = function()
  i = i % #bodies + 1
  return wrk.format(nil, '/v1/completions', nil, bodies[i])
end
last_t = -1
max_gap = 0
gaps_over_10ms = 0
completions = 0
response = function(status, headers, body)
  local t = now()
  if last_t >= 0 then
    local g = t - last_t
    if g > max_gap then max_gap = g end
    if g > 0.010 then gaps_over_10ms = gaps_over_10ms + 1 end
  end
  last_t = t
  completions = completions + 1
end
local threads = {}
function setup(thread) table.insert(threads, thread) end
function done(summary, latency, requests)
  for _, t in ipairs(threads) do
    io.write(string.format("PAUSE max_gap_ms=%.3f gaps_over_10ms=%d completions=%d\\n",
      t:get("max_gap") * 1000, t:get("gaps_over_10ms"), t:get("completions")))
  end
end
"""


def _gc_longest_pause_ms(port: int) -> float:
    """The router's own longest full-collection pause (``/metrics``, ours only; NaN elsewhere)."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return float("nan")
    m = re.search(r'^tokenspeed_gc_longest_pause_seconds\{generation="2"\} ([\d.e+-]+)$', text, re.M)
    return float(m.group(1)) * 1e3 if m else float("nan")


def _loop_lag_buckets(port: int) -> dict[float, float]:
    """The gateway's event-loop lag histogram (cumulative counts by upper bound); {} elsewhere."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    return histogram_buckets(text, "tokenspeed_http_loop_lag_seconds")


def _lag_over(before: dict[float, float], after: dict[float, float], bound_s: float) -> float:
    """Loop-lag samples above ``bound_s`` between two scrapes (NaN without the metric)."""
    if not after or bound_s not in after:
        return float("nan")
    total = after[float("inf")] - before.get(float("inf"), 0.0)
    return total - (after[bound_s] - before.get(bound_s, 0.0))


def saturate(port: int, bodies: list[bytes], conns: int, duration_s: float, pid: int) -> dict[str, Any]:
    """wrk at ``conns`` connections: req/s, latency, CPU per request of ``pid``, longest pause."""
    wrk = shutil.which("wrk")
    if wrk is None:
        return {"req_per_s": float("nan"), "note": "wrk not installed (apt-get install wrk)"}
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write("bodies = {\n")
        for b in bodies:
            f.write("  [[" + b.decode() + "]],\n")
        f.write("}\n" + _WRK_LUA)
        script = f.name
    try:
        c0 = _cpu_s(pid)
        out = subprocess.run([wrk, "-t1", f"-c{conns}", f"-d{max(1, round(duration_s))}s", "--latency", "-s",
                              script, f"http://127.0.0.1:{port}"], capture_output=True, text=True,
                             check=True).stdout
        cpu = _cpu_s(pid) - c0
    finally:
        os.unlink(script)

    figures = parse_wrk(out)
    pause = re.search(r"PAUSE max_gap_ms=([\d.]+) gaps_over_10ms=(\d+)", out)
    requests = figures["requests"]
    return {"req_per_s": figures["req_per_s"], "requests": requests, "p50_ms": figures["p50_ms"],
            "p99_ms": figures["p99_ms"], "errors": figures["errors"],
            "cpu_us_per_request": cpu / max(1, requests) * 1e6,
            "max_pause_ms": float(pause.group(1)) if pause else float("nan"),
            "pauses_over_10ms": int(pause.group(2)) if pause else -1, "conns": conns}


# --------------------------------------------------------------------------- summary


def _summary(values: list[float]) -> dict[str, float]:
    vals = [v for v in values if v == v]  # drop NaN
    if not vals:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and min-max over rounds of every figure, and of the per-round ratios to the peer."""
    figures: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        figures.setdefault(key, []).append(value)

    for r in rounds:
        lat, sat = r["latency"], r["throughput"]
        for name, row in lat.items():
            add(f"{name}.p50_ms", row["p50_ms"])
            add(f"{name}.p99_ms", row["p99_ms"])
            add(f"{name}.cpu_us_per_request_fixed_rate", row["cpu_us_per_request"])
            if name != "engine":
                add(f"{name}.overhead_p50_ms", row["p50_ms"] - lat["engine"]["p50_ms"])
        for name, row in sat.items():
            add(f"{name}.saturation_req_per_s", row["req_per_s"])
            add(f"{name}.cpu_us_per_request_saturation", row.get("cpu_us_per_request", float("nan")))
            add(f"{name}.max_pause_ms", row.get("max_pause_ms", float("nan")))
            add(f"{name}.pauses_over_10ms", float(row.get("pauses_over_10ms", -1)))
            for key in ("gc_longest_full_pause_ms", "loop_lag_over_10ms", "loop_lag_over_50ms"):
                if key in row:
                    add(f"{name}.{key}", row[key])
        if "vllm_router" in sat and sat["vllm_router"]["req_per_s"] > 0:
            for name in ("gateway", "gateway_before"):
                if name not in sat:
                    continue
                add(f"{name}_vs_vllm_router.saturation_ratio",
                    sat[name]["req_per_s"] / sat["vllm_router"]["req_per_s"])
                add(f"{name}_vs_vllm_router.cpu_ratio_saturation",
                    sat[name]["cpu_us_per_request"] / sat["vllm_router"]["cpu_us_per_request"])
                add(f"{name}_vs_vllm_router.cpu_ratio_fixed_rate",
                    lat[name]["cpu_us_per_request"] / lat["vllm_router"]["cpu_us_per_request"])
    return {k: _summary(v) for k, v in figures.items()}


# --------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=4, help="engine-sims behind each router (default 4)")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="tokens per prompt, half shared (1024)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default 16)")
    parser.add_argument("--no-stream", action="store_true", help="JSON answers instead of SSE streams")
    parser.add_argument("--rate", type=float, default=100.0, help="fixed-rate phase, requests/s (default 100)")
    parser.add_argument("--duration-s", type=float, default=6.0, help="seconds per target per phase (default 6)")
    parser.add_argument("--conns", type=int, default=32, help="wrk connections at saturation (default 32)")
    parser.add_argument("--slices", type=int, default=3, help="fixed-rate slices per target per round (3)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; figures are medians (default 3)")
    parser.add_argument("--quick", action="store_true", help="one round of 2 s phases (smoke test)")
    parser.add_argument("--text", action="store_true", help="also text prompts through the gateway "
                        "(--tokenizer engine: one /tokenize round trip, cached)")
    parser.add_argument("--no-peer", action="store_true", help="skip vllm-router even if installed")
    parser.add_argument("--peer-bin", help="the vllm-router executable (default: found on PATH or in "
                        f"{PEER_VENV.parent.parent})")
    parser.add_argument("--json", metavar="OUT", help="also write the figures as JSON")
    parser.add_argument("--compare-src", metavar="DIR", type=Path,
                        help="also measure a second gateway run from DIR's tokenspeed_router (for example "
                             "`git archive main tokenspeed_router | tar -x -C DIR`, plus the built _native "
                             "module): before/after figures in one run, as 'gateway_before'")
    args = parser.parse_args()
    duration = 2.0 if args.quick else args.duration_s
    repeats = 1 if args.quick else args.repeats
    stream = not args.no_stream
    procs: list[Proc] = []
    results: dict[str, Any] = {"config": {
        "engines": args.engines, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
        "stream": stream, "rate": args.rate, "duration_s": duration, "conns": args.conns, "repeats": repeats,
        "cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()[0]}}
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        workdir = Path(tmp)
        try:
            engines = start_engines(workdir, args.engines, procs)
            serve, gw_port = _serve(workdir, engines)
            procs.append(serve)
            before = None
            if args.compare_src is not None:
                before = _serve(workdir, engines, args.compare_src.resolve(), "serve-before")
                procs.append(before[0])
            peer = None
            exe = None if args.no_peer else _peer_exe(args.peer_bin)
            if exe is not None:
                peer = _vllm_router(workdir, engines, exe)
                if peer is not None:
                    procs.append(peer[0])
            elif not args.no_peer:
                print("vllm-router not found: no peer figures (pip install vllm-router==0.1.17)", file=sys.stderr)
            engine_port = int(engines[0]["url"].rsplit(":", 1)[1])
            prompts = _prompts(args.prompt_tokens)
            ids = _bodies(prompts, text=False, stream=stream, max_tokens=args.max_tokens)
            targets: dict[str, tuple[int, list[bytes], int]] = {
                "engine": (engine_port, ids, procs[0].proc.pid), "gateway": (gw_port, ids, serve.proc.pid)}
            if args.text:
                text = _bodies(prompts, text=True, stream=stream, max_tokens=args.max_tokens)
                targets["gateway_text"] = (gw_port, text, serve.proc.pid)
            if before is not None:
                targets["gateway_before"] = (before[1], ids, before[0].proc.pid)
            if peer is not None:
                targets["vllm_router"] = (peer[1], ids, peer[0].proc.pid)
            for port, bodies, _ in targets.values():  # warm: connections, index, caches
                fixed_rate(port, bodies, args.rate, 1.0)
            rounds = []
            for r in range(repeats):
                latency = interleaved(targets, args.rate, duration, args.slices)
                throughput = {}
                for name, (port, bodies, pid) in targets.items():
                    if name == "gateway_text":
                        continue
                    lag0 = _loop_lag_buckets(port) if name.startswith("gateway") else {}
                    throughput[name] = saturate(port, bodies, args.conns, duration, pid)
                    if lag0:  # the gateway's own loop: 10 ms samples that ran over 10 ms / 50 ms late
                        lag1 = _loop_lag_buckets(port)
                        throughput[name]["loop_lag_over_10ms"] = _lag_over(lag0, lag1, 0.01)
                        throughput[name]["loop_lag_over_50ms"] = _lag_over(lag0, lag1, 0.05)
                for name in ("gateway", "gateway_before"):
                    if name in throughput:  # the process's own collector, since it started
                        throughput[name]["gc_longest_full_pause_ms"] = _gc_longest_pause_ms(targets[name][0])
                rounds.append({"latency": latency, "throughput": throughput})
                _print_round(r, rounds[-1])
            results["rounds"] = rounds
            results["summary"] = summarise(rounds)
        finally:
            for p in reversed(procs):
                p.stop()
    _print_summary(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def _print_round(r: int, rnd: dict[str, Any]) -> None:
    print(f"round {r + 1}")
    print(f"  {'fixed rate':<16}{'p50 ms':>9}{'p99 ms':>9}{'errors':>8}{'CPU us/req':>12}")
    for name, row in rnd["latency"].items():
        print(f"  {name:<16}{row['p50_ms']:>9.2f}{row['p99_ms']:>9.2f}{row['errors']:>8}"
              f"{row['cpu_us_per_request']:>12.0f}")
    print(f"  {'saturation':<16}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'errors':>8}{'CPU us/req':>12}"
          f"{'max pause ms':>14}{'>10ms':>7}")
    for name, row in rnd["throughput"].items():
        print(f"  {name:<16}{row['req_per_s']:>9.0f}{row.get('p50_ms', float('nan')):>9.2f}"
              f"{row.get('p99_ms', float('nan')):>9.2f}{row.get('errors', 0):>8}"
              f"{row.get('cpu_us_per_request', float('nan')):>12.0f}{row.get('max_pause_ms', float('nan')):>14.1f}"
              f"{row.get('pauses_over_10ms', -1):>7}", flush=True)


def _print_summary(results: dict[str, Any]) -> None:
    c = results["config"]
    print(f"\n{c['engines']} instant engines, {c['prompt_tokens']}-token prompts (half shared), "
          f"{'streaming' if c['stream'] else 'JSON'}, max_tokens {c['max_tokens']}; fixed rate {c['rate']:g} "
          f"req/s; wrk {c['conns']} connections; median (min-max) of {c['repeats']} round(s)")
    for key, s in results.get("summary", {}).items():
        print(f"  {key:<52}{s['median']:>10.3f}   ({s['min']:.3f} - {s['max']:.3f})")


if __name__ == "__main__":
    raise SystemExit(main())
