"""Router-added latency during a trace replay: client TTFT minus the engine's own TTFT (issue 20 item 5).

Run: ``flock /tmp/tsr-bench.lock .venv/bin/python benchmarks/router_added_latency.py
[--quick] [--runs 3] [--trace synthetic] [--timing fifo] [--out DIR]``.

The load of docs/compare-routers.md (``compare_routers.py``'s slice, 4
engine-sims with 12.5k-token caches, ``--time-scale`` 4, memory pressure):
each request's engine reports its own wall-clock TTFT
(``engine_timing.ttft_s``, from the request reaching the engine to its
first token), so ``client TTFT - engine TTFT`` is what everything in between
added. Two rows per run, each on a fresh fleet, interleaved:

* ``tokenspeed`` — through our ``serve`` gateway (kv_aware);
* ``direct`` — right after, loadgen sends each request straight to the
  engine the gateway chose for it in that run (the same placement, so the
  same engine load and stream traffic, without a router): the floor of
  loadgen's own loop, HTTP and the engines' HTTP layer, measured in the same
  run on the same machine.

Reported: router-added p50 / p99 / max (wall ms) per run, medians and
min-max over runs, the gateway's p99 minus the direct p99 (what the gateway
itself adds), and what the gateway's ``/metrics`` says stalled its loop
(``tokenspeed_http_loop_longest_lag_seconds``, the longest GC pause,
``tokenspeed_gc_pause_seconds``). Target: gateway p99 <= 20 ms wall on 2
cores. Output: ``DIR/results.json`` and a text table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from compare_routers import ROUTERS, load_slice, run_one

from tokenspeed_router.sim.report import write_results
from tokenspeed_router.sim.runner import ProgressBar

TARGET_P99_S = 0.020


def _gateway_stalls(urls: Sequence[str]) -> dict[str, Any]:
    """The gateway's own account of its loop's stalls, from ``/metrics`` (before it stops)."""
    out: dict[str, Any] = {}
    try:
        with urllib.request.urlopen(urls[0] + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError as err:
        return {"error": str(err)}
    for line in text.splitlines():
        if line.startswith("tokenspeed_http_loop_longest_lag_seconds"):
            out["loop_longest_lag_s"] = float(line.split()[-1])
        elif line.startswith("tokenspeed_gc_longest_pause_seconds"):
            out["gc_longest_pause_s"] = float(line.split()[-1])
        elif line.startswith("tokenspeed_http_loop_lag_seconds_count"):
            out["loop_lag_samples"] = float(line.split()[-1])
    return out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="synthetic", help="synthetic or conversation")
    parser.add_argument("--timing", default="fifo", help="engine timing profile (fifo, chunked)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--groups", type=int, default=None, help="prefix groups (default: the slice's, 60)")
    parser.add_argument("--time-scale", type=float, default=4.0)
    parser.add_argument("--quick", action="store_true", help="12 groups, one run")
    parser.add_argument("--out", type=Path, default=Path("out/router_added_latency"))
    args = parser.parse_args(argv)
    groups = 12 if args.quick else args.groups
    runs = 1 if args.quick else max(1, args.runs)
    requests = load_slice(args.trace, groups=groups, speedup_factor=args.time_scale)
    log_root = Path(tempfile.mkdtemp(prefix="router-added-"))
    bar = ProgressBar()
    rows: dict[str, list[dict[str, Any]]] = {"tokenspeed": [], "direct": []}
    started = time.monotonic()
    for run in range(runs):
        summary, records = run_one(ROUTERS["tokenspeed"], "pressure", requests, time_scale=args.time_scale,
                                   log_dir=log_root / f"tokenspeed-{run}", progress=bar, timing=args.timing,
                                   label=f"tokenspeed#{run + 1}", inspect=_gateway_stalls)
        rows["tokenspeed"].append(summary)
        placement = [r.worker for r in records]
        summary, _ = run_one(ROUTERS["direct"], "pressure", requests, time_scale=args.time_scale,
                             log_dir=log_root / f"direct-{run}", progress=bar, timing=args.timing,
                             label=f"direct#{run + 1}", placement=placement)
        rows["direct"].append(summary)
    keys = ("router_added_p50_s", "router_added_p99_s", "router_added_max_s", "ttft_p99_s")
    medians = {name: {k: statistics.median(v for r in rs if (v := r.get(k)) is not None) for k in keys}
               for name, rs in rows.items()}
    spans = {name: {k: (min(r[k] for r in rs), max(r[k] for r in rs)) for k in keys} for name, rs in rows.items()}
    gateway_over_direct = [g["router_added_p99_s"] - d["router_added_p99_s"]
                           for g, d in zip(rows["tokenspeed"], rows["direct"], strict=True)]
    doc = {
        "config": {"trace": args.trace, "timing": args.timing, "runs": runs, "groups": groups,
                   "time_scale": args.time_scale, "requests": len(requests), "target_p99_s": TARGET_P99_S},
        "runs": rows,
        "median": medians,
        "min_max": spans,
        "gateway_minus_direct_p99_s": gateway_over_direct,
        "wall_s": time.monotonic() - started,
    }
    path = write_results(doc, args.out)
    print(f"\n{args.trace}, {len(requests)} requests, engines {args.timing}, {runs} run(s)")
    print(f"{'':<12}{'added p50':>12}{'added p99':>12}{'added max':>12}   (wall ms, median [min-max])")
    for name in rows:
        m, sp = medians[name], spans[name]
        cells = [f"{_ms(m[k])} [{_ms(sp[k][0])}-{_ms(sp[k][1])}]" for k in keys[:3]]
        print(f"{name:<12}" + "".join(f"{c:>22}" for c in cells))
    stalls = [r.get("inspected", {}) for r in rows["tokenspeed"]]
    print("gateway p99 - direct p99 (ms): " + ", ".join(_ms(v) for v in gateway_over_direct))
    print("gateway loop longest lag (ms): " + ", ".join(_ms(s.get("loop_longest_lag_s")) for s in stalls))
    print("gateway longest GC pause (ms): " + ", ".join(_ms(s.get("gc_longest_pause_s")) for s in stalls))
    met = medians["tokenspeed"]["router_added_p99_s"] <= TARGET_P99_S
    print(f"target gateway p99 <= {TARGET_P99_S * 1000:.0f} ms: {'met' if met else 'NOT met'}")
    print(f"results: {path} (wall {doc['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
