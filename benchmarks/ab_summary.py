"""Summarise an A/B of ``bench_server.py``: runs of two checkouts, interleaved, into one results file.

Run (each bench run one round, the two sides alternating, under the benchmark lock)::

    for r in 1 2 3; do
      .venv/bin/python benchmarks/bench_server.py --repeats 1 --json /tmp/ab-ours-$r.json ARGS
      PYTHONPATH=/tmp/ab-main .venv/bin/python benchmarks/bench_server.py --router-checkout /tmp/ab-main \\
          --repeats 1 --json /tmp/ab-main-$r.json ARGS
    done
    .venv/bin/python benchmarks/ab_summary.py --a /tmp/ab-ours-*.json --b /tmp/ab-main-*.json \\
        --a-name this --b-name main --json docs/results/ingest-serve.json

Per side and figure: the median and min-max over its runs. The ratios to the
in-process costs are taken within each run (the same process, minutes apart),
so a machine that is slower in one run moves both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

#: (name in the results file, where it is read from a run's summary) -- summary keys of bench_server.py
FIGURES = {
    "in_process_raw_batch_us": ("costs", "ingest_batch_scan_apply_raw_us"),
    "in_process_zmq_route_us": ("costs", "zmq_route_handle_us"),
    "serve_cpu_us_per_batch_100k": ("summary", "cpu[100000].router_cpu_us_per_batch"),
    "serve_cpu_us_per_batch_200k": ("summary", "cpu[200000].router_cpu_us_per_batch"),
    "serve_idle_cores": ("summary", "cpu[idle].router_cpu_cores"),
    "match_idle_req_per_s": ("summary", "ingest[idle].match_req_per_s"),
    "match_vs_idle_100k": ("summary", "ingest[100000].match_vs_idle"),
    "match_vs_idle_200k": ("summary", "ingest[200000].match_vs_idle"),
    "visible_p50_ms_100k": ("summary", "ingest[100000].visible_p50_ms"),
    "visible_p99_ms_100k": ("summary", "ingest[100000].visible_p99_ms"),
    "visible_p99_ms_idle": ("summary", "ingest[idle].visible_p99_ms"),
    "visible_p99_ms_200k": ("summary", "ingest[200000].visible_p99_ms"),
    "shed_batches_100k": ("summary", "ingest[100000].shed_batches"),
    "shed_batches_200k": ("summary", "ingest[200000].shed_batches"),
    "resyncs_200k": ("summary", "ingest[200000].resyncs"),
    "zmq_route_req_per_s": ("summary", "zmq_route.req_per_s"),
    "zmq_route_cpu_us_per_request": ("summary", "zmq_route.router_cpu_us_per_request"),
}
#: (name, numerator, denominator): ratios taken within each run
RATIOS = {
    "serve_over_in_process_batch_100k": ("serve_cpu_us_per_batch_100k", "in_process_raw_batch_us"),
    "serve_over_in_process_zmq_route": ("zmq_route_cpu_us_per_request", "in_process_zmq_route_us"),
}


def _run_figures(run: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, (part, key) in FIGURES.items():
        section = run.get(part, {})
        value = section.get(key)
        if isinstance(value, dict):
            value = value.get("median")
        if isinstance(value, (int, float)) and value == value:
            out[name] = float(value)
    for name, (num, den) in RATIOS.items():
        if num in out and out.get(den):
            out[name] = out[num] / out[den]
    return out


def _summary(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def summarise(paths: list[str]) -> dict[str, Any]:
    runs = [_run_figures(json.loads(Path(p).read_text())) for p in paths]
    names = sorted({k for r in runs for k in r})
    return {name: _summary([r[name] for r in runs if name in r]) for name in names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", nargs="+", required=True, help="results files of side A (bench_server.py --json)")
    parser.add_argument("--b", nargs="+", required=True, help="results files of side B")
    parser.add_argument("--a-name", default="A")
    parser.add_argument("--b-name", default="B")
    parser.add_argument("--note", default="", help="what was run, when, on what (kept in the file)")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)
    first = json.loads(Path(args.a[0]).read_text())
    result = {
        "config": first.get("config", {}),
        "note": args.note,
        "sides": {args.a_name: summarise(args.a), args.b_name: summarise(args.b)},
        "files": {args.a_name: args.a, args.b_name: args.b},
    }
    a, b = result["sides"][args.a_name], result["sides"][args.b_name]
    print(f"{'figure':<36}{args.a_name:>28}{args.b_name:>28}")
    for name in sorted(set(a) | set(b)):
        cells = []
        for side in (a, b):
            s = side.get(name)
            cells.append(f"{s['median']:.3g} ({s['min']:.3g}-{s['max']:.3g})" if s else "-")
        print(f"{name:<36}{cells[0]:>28}{cells[1]:>28}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
