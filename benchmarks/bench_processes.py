"""``serve --processes 2`` against one ``serve`` process: saturation through the gateway.

Run::

    flock /tmp/tsr-bench.lock .venv/bin/python benchmarks/bench_processes.py [--rounds 3] [--json OUT]

Processes on loopback: ``--engines`` (4) ``engine-sim --instant`` engines (no
modelled delays: what is measured is the gateway's own cost), one ``serve``
with them as ``url=`` workers, and one ``serve --processes N`` (``--processes``,
2) with the same workers (SO_REUSEPORT on one port, sharing in-flight work
through the private redis-server the supervisor starts). ``wrk`` (``-t``
``--wrk-threads``, ``--conns`` connections, ``--duration-s``) saturates one
target at a time, alternating within each round; figures are medians over
the rounds (min-max) and the ratio is taken within each round. The requests
are those of ``bench_gateway.py`` (1,024-token id prompts, half a shared
prefix, streamed, 16 tokens).

On a machine with fewer free cores than N gateway processes + the engines +
wrk, the ratio measures the machine, not the gateway: the script prints the
core count and the load average before each round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from bench_gateway import Proc, _bodies, _engine, _prompts, _wait_http, saturate

from tokenspeed_router.endpoints import free_tcp_port


def _gateway(workdir: Path, engines: list[dict[str, Any]], processes: int, name: str) -> tuple[Proc, int]:
    port = free_tcp_port()
    argv = [sys.executable, "-m", "tokenspeed_router.cli", "--log-level", "WARNING", "serve",
            "--http", f"127.0.0.1:{port}"]
    if processes > 1:
        argv += ["--processes", str(processes)]
    for i, e in enumerate(engines):
        argv += ["--worker", f"name=w{i},url={e['url']},events={e['events'][0]},replay={e['replay'][0]}"]
    p = Proc(name, argv, workdir)
    _wait_http(f"http://127.0.0.1:{port}/health", p)
    return p, port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--conns", type=int, default=32)
    parser.add_argument("--wrk-threads", type=int, default=1)
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tsr-bench-processes"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    bodies = _bodies(_prompts(1024), text=False, stream=True, max_tokens=16)
    procs: list[Proc] = []
    rounds: list[dict[str, Any]] = []
    try:
        engines = []
        for i in range(args.engines):
            p, info = _engine(args.workdir, i)
            procs.append(p)
            engines.append(info)
        one, one_port = _gateway(args.workdir, engines, 1, "serve-1")
        many, many_port = _gateway(args.workdir, engines, args.processes, f"serve-{args.processes}")
        procs += [one, many]
        targets = {"1 process": (one_port, one), f"{args.processes} processes": (many_port, many)}
        for r in range(args.rounds):
            load = os.getloadavg()[0]
            row: dict[str, Any] = {"round": r, "loadavg_1m": round(load, 2)}
            for name, (port, proc) in targets.items():
                got = saturate(port, bodies, args.conns, args.duration_s, proc.proc.pid)
                row[name] = {k: got[k] for k in ("req_per_s", "p50_ms", "p99_ms", "errors")}
            row["ratio"] = row[f"{args.processes} processes"]["req_per_s"] / row["1 process"]["req_per_s"]
            rounds.append(row)
            print(f"# round {r} (cores {os.cpu_count()}, load {load:.1f}): "
                  + ", ".join(f"{n} {row[n]['req_per_s']:.0f} req/s" for n in targets)
                  + f", ratio {row['ratio']:.2f}", flush=True)
    finally:
        for p in reversed(procs):
            p.stop()
    ratios = [r["ratio"] for r in rounds]
    summary: dict[str, Any] = {"ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                               "ratio_max": max(ratios), "cores": os.cpu_count()}
    for name in ("1 process", f"{args.processes} processes"):
        rps = [r[name]["req_per_s"] for r in rounds]
        summary[name] = {"req_per_s_median": statistics.median(rps), "min": min(rps), "max": max(rps)}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "rounds": rounds, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
