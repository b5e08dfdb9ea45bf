"""Gateway benchmark: what the OpenAI gateway in ``serve`` costs, and what it sustains.

Run:  .venv/bin/python benchmarks/bench_gateway.py [--quick] [--json OUT] [--no-peer]

Processes on loopback, as in production:

* two ``tokenspeed-router engine-sim --instant`` engines (no modelled delays:
  an answer costs only the engine's own HTTP handling, so what is left is the
  proxy's cost);
* ``tokenspeed-router serve`` with both as ``url=`` workers (events and replay
  subscribed, the gateway on its HTTP port);
* optionally ``vllm-router`` (``pip install vllm-router``; skipped with a note
  when absent) in front of the same two engines, for the same figures;
* the load: a raw keep-alive asyncio HTTP client for the fixed-rate phase, and
  ``wrk`` for saturation (a Python client would cost as much CPU per request
  as the servers, on a 2-core machine that halves what is measured).

Figures (non-stream ``/v1/completions``, ``max_tokens: 1``, 64 token-id prompts
of 256 tokens sharing 128-token prefixes, fixed seed):

* **overhead**: p50/p99 latency at ``--rate`` req/s (default 100) through the
  gateway minus the same straight to one engine, in the same run;
  also with text prompts (the gateway asks the engine's ``/tokenize`` first:
  one more round trip, ``--tokenizer engine``);
* **throughput**: wrk with ``--conns`` connections for ``--duration-s``: straight
  to one engine (the reference), through the gateway, through vllm-router.

Timing on a shared 2-core machine is noisy: compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.loadgen.fleet import stop_process

REPO = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 256
NUM_PROMPTS = 64


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 100_000) for _ in range(PROMPT_TOKENS // 2)] for _ in range(8)]
    return [prefixes[i % 8] + [rng.randrange(1000, 100_000) for _ in range(PROMPT_TOKENS // 2)]
            for i in range(NUM_PROMPTS)]


def _bodies(prompts: list[list[int]], text: bool) -> list[bytes]:
    return [json.dumps({"model": "tokenspeed-sim", "max_tokens": 1,
                        "prompt": " ".join(map(str, p)) if text else p}).encode() for p in prompts]


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
                            "--events", "tcp://127.0.0.1:0", "--replay", "tcp://127.0.0.1:0", "--instant"],
             workdir, stdout_pipe=True)
    assert p.proc.stdout is not None
    line = p.proc.stdout.readline()
    if not line:
        raise RuntimeError(f"engine-sim did not start: {p.tail()}")
    return p, json.loads(line)


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


def _vllm_router(workdir: Path, engines: list[dict[str, Any]]) -> tuple[Proc, int, str] | None:
    exe = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    if not Path(exe).exists():
        return None
    kv = ["--kv-event-block-size", "16", "--kv-event-model", "tokenspeed-sim"]
    for e in engines:
        kv += ["--kv-event-source", f"{e['url']}={e['events'][0]}"]
    for policy, extra in (("kv_aware", kv), ("round_robin", [])):
        port = free_tcp_port()
        argv = [exe, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *[e["url"] for e in engines],
                "--policy", policy, *extra]
        p = Proc(f"vllm-router-{policy}", argv, workdir)
        try:
            _wait_http(f"http://127.0.0.1:{port}/health", p, timeout_s=30)
        except RuntimeError as err:
            p.stop()
            print(f"vllm-router --policy {policy} did not start: {err}", file=sys.stderr)
            continue
        return p, port, policy
    return None


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
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def interleaved(targets: dict[str, tuple[int, list[bytes], int]], rate: float, duration_s: float,
                rounds: int) -> dict[str, dict[str, Any]]:
    """``fixed_rate`` per target, in ``rounds`` alternating slices: machine load drifts, and on a
    shared machine a target measured only first or only last would carry that drift. Also the
    CPU the serving process (``pid``) spent per request."""
    lat: dict[str, list[float]] = {name: [] for name in targets}
    errors = dict.fromkeys(targets, 0)
    cpu = dict.fromkeys(targets, 0.0)
    for _ in range(rounds):
        for name, (port, bodies, pid) in targets.items():
            c0 = _cpu_s(pid)
            out = fixed_rate(port, bodies, rate, duration_s / rounds, samples=lat[name])
            cpu[name] += _cpu_s(pid) - c0
            errors[name] += out["errors"]
    return {name: {"requests": len(xs), "p50_ms": _pct(xs, 0.5) * 1e3, "p99_ms": _pct(xs, 0.99) * 1e3,
                   "errors": errors[name], "cpu_us_per_request": cpu[name] / max(1, len(xs)) * 1e6}
            for name, xs in lat.items()}


def saturate(port: int, bodies: list[bytes], conns: int, duration_s: float) -> dict[str, Any]:
    wrk = shutil.which("wrk")
    if wrk is None:
        return {"req_per_s": float("nan"), "note": "wrk not installed"}
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write("local bodies = {\n")
        for b in bodies:
            f.write("  [[" + b.decode() + "]],\n")
        f.write("}\nlocal i = 0\nwrk.method = 'POST'\nwrk.headers['Content-Type'] = 'application/json'\n"
                "request = function()\n  i = i % #bodies + 1\n"
                "  return wrk.format(nil, '/v1/completions', nil, bodies[i])\nend\n")
        script = f.name
    try:
        out = subprocess.run([wrk, "-t1", f"-c{conns}", f"-d{max(1, round(duration_s))}s", "--latency", "-s", script,
                              f"http://127.0.0.1:{port}"], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(script)

    def ms(label: str) -> float:
        m = re.search(rf"{label}\s+([\d.]+)(us|ms|s)\b", out)
        return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)] if m else float("nan")

    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"req_per_s": float(rps.group(1)) if rps else 0.0, "p50_ms": ms("50%"), "p99_ms": ms("99%"),
            "errors": int(non2xx.group(1)) if non2xx else 0, "conns": conns}


# --------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=100.0, help="fixed-rate phase, requests/s (default 100)")
    parser.add_argument("--duration-s", type=float, default=10.0, help="length of each phase (default 10)")
    parser.add_argument("--conns", type=int, default=32, help="wrk connections at saturation (default 32)")
    parser.add_argument("--rounds", type=int, default=5, help="fixed-rate slices per target, interleaved (default 5)")
    parser.add_argument("--quick", action="store_true", help="3 s phases")
    parser.add_argument("--no-peer", action="store_true", help="skip vllm-router even if installed")
    parser.add_argument("--json", metavar="OUT", help="also write the figures as JSON")
    parser.add_argument("--compare-src", metavar="DIR", type=Path,
                        help="also measure a second gateway run from DIR's tokenspeed_router (for example "
                             "`git archive main tokenspeed_router | tar -x -C DIR`, plus the built _native "
                             "module): before/after figures in one run, as 'gateway_before'")
    args = parser.parse_args()
    duration = 3.0 if args.quick else args.duration_s
    procs: list[Proc] = []
    results: dict[str, Any] = {"rate": args.rate, "duration_s": duration, "prompt_tokens": PROMPT_TOKENS}
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        workdir = Path(tmp)
        try:
            engines = []
            for i in range(2):
                p, info = _engine(workdir, i)
                procs.append(p)
                engines.append(info)
            serve, gw_port = _serve(workdir, engines)
            procs.append(serve)
            before = None
            if args.compare_src is not None:
                before = _serve(workdir, engines, args.compare_src.resolve(), "serve-before")
                procs.append(before[0])
            peer = None if args.no_peer else _vllm_router(workdir, engines)
            if peer is not None:
                procs.append(peer[0])
            engine_port = int(engines[0]["url"].rsplit(":", 1)[1])
            ids, text = _bodies(_prompts(), False), _bodies(_prompts(), True)
            fixed_rate(gw_port, ids, args.rate, 1.0)  # warm: connections, index, caches
            fixed_rate(engine_port, ids, args.rate, 1.0)
            e0, gw_pid = procs[0].proc.pid, serve.proc.pid
            targets = {"engine": (engine_port, ids, e0), "gateway": (gw_port, ids, gw_pid),
                       "gateway_text": (gw_port, text, gw_pid)}
            if before is not None:
                fixed_rate(before[1], ids, args.rate, 1.0)
                targets["gateway_before"] = (before[1], ids, before[0].proc.pid)
            if peer is not None:
                fixed_rate(peer[1], ids, args.rate, 1.0)
                targets["vllm_router"] = (peer[1], ids, peer[0].proc.pid)
            latency = interleaved(targets, args.rate, duration, args.rounds)
            results["latency"] = latency
            results["overhead_p50_ms"] = latency["gateway"]["p50_ms"] - latency["engine"]["p50_ms"]
            results["overhead_p50_text_ms"] = latency["gateway_text"]["p50_ms"] - latency["engine"]["p50_ms"]
            throughput = {
                "engine": saturate(engine_port, ids, args.conns, duration),
                "gateway": saturate(gw_port, ids, args.conns, duration),
            }
            if before is not None:
                throughput["gateway_before"] = saturate(before[1], ids, args.conns, duration)
                results["overhead_p50_before_ms"] = latency["gateway_before"]["p50_ms"] - latency["engine"]["p50_ms"]
            if peer is not None:
                throughput["vllm_router"] = saturate(peer[1], ids, args.conns, duration)
                results["vllm_router_policy"] = peer[2]
            results["throughput"] = throughput
        finally:
            for p in reversed(procs):
                p.stop()
    _print(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def _print(r: dict[str, Any]) -> None:
    print(f"fixed rate {r['rate']:g} req/s, {r['duration_s']:g} s per phase, {r['prompt_tokens']}-token prompts")
    print(f"{'target':<14}{'p50 ms':>9}{'p99 ms':>9}{'errors':>8}{'CPU us/req':>12}  (of the process answering)")
    for name, row in r["latency"].items():
        print(f"{name:<14}{row['p50_ms']:>9.2f}{row['p99_ms']:>9.2f}{row['errors']:>8}"
              f"{row['cpu_us_per_request']:>12.0f}")
    print(f"gateway overhead p50: {r['overhead_p50_ms']:.2f} ms (token ids), "
          f"{r['overhead_p50_text_ms']:.2f} ms (text: + /tokenize round trip)")
    if "overhead_p50_before_ms" in r:
        print(f"gateway_before overhead p50: {r['overhead_p50_before_ms']:.2f} ms (--compare-src)")
    if "vllm_router" in r["latency"]:
        print(f"vllm_router overhead p50: {r['latency']['vllm_router']['p50_ms'] - r['latency']['engine']['p50_ms']:.2f} ms")
    print(f"\nsaturation (wrk, {r['throughput']['engine'].get('conns', '?')} connections)")
    print(f"{'target':<14}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'errors':>8}{'x engine':>10}")
    base = r["throughput"]["engine"]["req_per_s"]
    for name, row in r["throughput"].items():
        print(f"{name:<14}{row['req_per_s']:>9.0f}{row.get('p50_ms', float('nan')):>9.2f}"
              f"{row.get('p99_ms', float('nan')):>9.2f}{row.get('errors', 0):>8}{row['req_per_s'] / base:>10.2f}")
    if "vllm_router_policy" in r:
        print(f"(vllm-router policy: {r['vllm_router_policy']})")


if __name__ == "__main__":
    raise SystemExit(main())
