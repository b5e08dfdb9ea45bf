"""Sim-to-live parity: the same trace slice through ``simulate`` and through engine-sims + the gateway.

Run: ``.venv/bin/python benchmarks/sim_live_parity.py [--quick] [--timing fifo,chunked]
[--traces synthetic,conversation] [--out DIR]`` (under ``flock /tmp/tsr-bench.lock``).

Per trace and timing profile, one slice (compare_routers.py's: whole prefix
groups, prompts shrunk 8x, 4 workers with 12.5k-token caches: memory
pressure) goes through ``simulate``'s engine model with the in-process
router, and through 4 ``engine-sim --timing PROFILE`` processes behind a
``serve`` gateway with loadgen, at ``--time-scale`` times real speed. Both
sides share the engine model (``tokenspeed_router/engine_model.py``), so
what differs is what only the live path does. Prints, and writes to
``DIR/results.json``, per-worker request counts, hit ratio and TTFT
p50/p99 side by side with the tolerances of ``loadgen.parity.Tolerances``,
around the range of ``simulate_spread``'s runs (the live path's timing noise)
(docs/compare-routers.md#simulate-against-the-live-gateway says why).
Exit status 1 when a comparison is out of tolerance.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from compare_routers import PROMPT_SCALE, TRACES, _shared_traces

from tokenspeed_router.loadgen.parity import (
    ParitySetup,
    Tolerances,
    compare,
    format_comparison,
    live_side,
    prepare,
    simulate_side,
    simulate_spread,
)
from tokenspeed_router.loadgen.prompts import scale_prompts
from tokenspeed_router.sim.report import write_results
from tokenspeed_router.sim.traces import load_mooncake, sample_prefix_groups, trace_summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default="synthetic,conversation")
    parser.add_argument("--timing", default="fifo,chunked", help="comma-separated profiles")
    parser.add_argument("--groups", type=int, default=30, help="prefix groups per slice (default 30)")
    parser.add_argument("--time-scale", type=float, default=4.0, help="live engines run K x faster")
    parser.add_argument("--quick", action="store_true", help="12 groups, synthetic, fifo")
    parser.add_argument("--out", type=Path, default=Path("out/sim_live_parity"))
    args = parser.parse_args(argv)
    traces = ["synthetic"] if args.quick else [t for t in args.traces.split(",") if t]
    profiles = ["fifo"] if args.quick else [p for p in args.timing.split(",") if p]
    groups = 12 if args.quick else args.groups
    tol = Tolerances()
    doc: dict[str, Any] = {"config": {"groups": groups, "time_scale": args.time_scale,
                                      "tolerances": tol.__dict__}, "results": {}}
    all_ok = True
    log_root = Path(tempfile.mkdtemp(prefix="sim-live-parity-"))
    for trace in traces:
        cut = TRACES[trace]
        full = load_mooncake(_shared_traces() / cut.file)
        requests = scale_prompts(sample_prefix_groups(full, prefix_blocks=cut.prefix_blocks, groups=groups,
                                                      seed=cut.seed, speedup=cut.speedup), PROMPT_SCALE)
        for profile in profiles:
            setup = ParitySetup(timing=profile, time_scale=args.time_scale)  # type: ignore[arg-type]
            slice_ = prepare(requests, setup)
            sim = simulate_side(slice_, setup)
            live = live_side(slice_, setup, log_root / trace / profile)
            result = compare(sim, live, setup.worker_names(), tol, spread=simulate_spread(slice_, setup))
            all_ok &= bool(result["ok"])
            print(f"\n{trace} / {profile}: {len(slice_)} requests, "
                  f"{trace_summary(slice_)['span_s']:.0f} s modelled")
            print(format_comparison(result), flush=True)
            doc["results"].setdefault(trace, {})[profile] = result
            write_results(doc, args.out)
    print(f"\nresults: {args.out / 'results.json'}; logs: {log_root}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
