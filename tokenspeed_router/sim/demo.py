"""``tokenspeed-router demo --sim``: the in-process simulation demo.

The default ``demo`` runs engine-sim processes behind a real gateway
(``loadgen/cli_demo.py``); ``--sim`` runs this one instead, with no engine
processes: 4 simulated workers (real PrefixCaches, real ZmqEventPublishers on
loopback) and a real ``tokenspeed-router serve`` subprocess subscribed to
them, the shipped Mooncake slice (``sim/data/``) driven through
``POST /route`` / ``POST /release`` in compressed real time; then the same
slice in fast mode (virtual clock, in-process router) for the baselines and
the oracle. It prints one table and writes plots.

Timing is simulated in both modes (the cost model of ``sim/cluster.py``), so
the live kv_aware row and the fast rows are comparable; the live row is the
real event path end to end. ``fast_only`` (``demo --sim --fast-only``)
skips the live part.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

from tokenspeed_router.errors import TokenspeedError
from tokenspeed_router.percentiles import percentile
from tokenspeed_router.sim.cluster import ClusterConfig, CostModel, RunResult, Simulator
from tokenspeed_router.sim.report import (
    check_out_dir,
    format_table,
    results_document,
    try_write_plots,
    write_results,
)
from tokenspeed_router.sim.runner import ProgressBar, run_policies
from tokenspeed_router.sim.traces import TraceRequest, TraceWindow, parse_mooncake, trace_summary

__all__ = [
    "DEMO_TRACE",
    "LIVE_TIME_SCALE",
    "RECOMMENDED_ROUTER_OPTIONS",
    "demo_cluster",
    "demo_requests",
    "run_demo",
    "run_live",
]

logger = logging.getLogger(__name__)

#: Package data: a slice of the Mooncake synthetic trace (see data/README.md).
DEMO_TRACE = "mooncake_synthetic_slice.jsonl"
#: simulated seconds per wall second in the live run (``demo --sim`` without ``--time-scale``)
LIVE_TIME_SCALE = 5.0
_BASELINES = ("random", "round_robin", "least_loaded", "approx", "kv_aware", "oracle")
#: RouterConfig overrides for the demo's routers: none. The shipped defaults
#: (``prefill_weight=2.5``, ``predict_on_route_ttl_s=15``) are the settings the
#: trace study found (docs/simulation.md, "Why the defaults"); the demo shows
#: exactly what a user gets out of the box.
RECOMMENDED_ROUTER_OPTIONS: dict[str, Any] = {}


def demo_requests(*, rate_scale: float = 8.0, max_requests: int | None = None) -> list[TraceRequest]:
    """The shipped slice, sped up by ``rate_scale`` (read from package data)."""
    text = resources.files("tokenspeed_router.sim").joinpath("data").joinpath(DEMO_TRACE).read_text("utf-8")
    return parse_mooncake(text.splitlines(), TraceWindow(rate_scale=rate_scale,
                                                         max_requests=max_requests),
                          source=DEMO_TRACE)


def demo_cluster(workers: int = 4, *, seed: int = 0, event_delay_s: float = 0.0) -> ClusterConfig:
    """Demo cluster: 200 k-token caches (the slice holds ~1.7 M distinct prompt
    tokens, so caches are under pressure), 16-token pages, 20 k prefill tokens/s
    (the upper end of the 10-20 k range of ``CostModel``: a small cluster that
    is busy but not drowning at the slice's 3 req/s)."""
    return ClusterConfig(
        num_workers=workers,
        capacity_tokens=200_000,
        page_size=16,
        cost=CostModel(prefill_tokens_per_s=20_000.0),
        event_delay_s=event_delay_s,
        seed=seed,
    )


def run_live(requests: list[TraceRequest], cluster: ClusterConfig, *, time_scale: float,
             progress: ProgressBar | None = None) -> tuple[RunResult, dict[str, Any]]:
    """Run kv_aware through a real ``serve`` subprocess; returns (result, info)."""
    from tokenspeed_router.sim.live import HttpRouterBackend, LiveCluster, RealTimePacer

    with LiveCluster(cluster.worker_names(), router_options=RECOMMENDED_ROUTER_OPTIONS,
                     time_scale=time_scale) as live:
        pacer = RealTimePacer(time_scale)
        sim = Simulator(cluster, pacer=pacer)
        backend = HttpRouterBackend(live)
        if progress is not None:
            progress.start("kv_aware live")
        started = time.perf_counter()
        result = sim.run(requests, backend, progress=progress)
        result.wall_s = time.perf_counter() - started
        lat = backend.route_latency_s
        info = {
            "route_latency_p50_ms": 1000 * percentile(lat, 50) if lat else None,
            "route_latency_p99_ms": 1000 * percentile(lat, 99) if lat else None,
            "max_lateness_s": pacer.max_lateness_s,
            "time_scale": time_scale,
        }
    return result, info


def run_demo(*, out: Path | None = None, workers: int = 4, max_requests: int | None = None,
             rate_scale: float = 8.0, time_scale: float = LIVE_TIME_SCALE, fast_only: bool = False,
             seed: int = 0) -> int:
    """Run the simulation demo (``demo --sim``); 0 on success.

    ``out``: where results.json and plots go (default: a new temporary
    directory, ``tokenspeed-router-demo-*`` under ``$TMPDIR``); ``max_requests``:
    only the first N of the slice; ``rate_scale``: speed-up of the slice's
    arrivals (8: ~3 req/s); ``time_scale``: simulated seconds per wall second
    in the live run.
    """
    requests = demo_requests(rate_scale=rate_scale, max_requests=max_requests)
    stats = trace_summary(requests)
    if out is not None:
        check_out_dir(out)
    print(f"demo: {len(requests)} requests of the Mooncake synthetic trace (shipped slice), "
          f"{stats['span_s']:.0f} s simulated, {workers} workers x 200k-token caches, "
          f"ideal hit ratio {stats['ideal_hit_ratio']:.0%}", file=sys.stderr)
    bar = ProgressBar()
    runs: dict[str, RunResult] = {}
    modes: dict[str, str] = {}
    live_info: dict[str, Any] = {}
    if not fast_only:
        try:
            live_run, live_info = run_live(requests, demo_cluster(workers, seed=seed),
                                           time_scale=time_scale, progress=bar)
            runs["kv_aware"] = live_run
            modes["kv_aware"] = "live: serve + ZMQ events + HTTP /route"
        except (TokenspeedError, OSError) as err:
            print(f"\nlive run failed ({err}); showing fast mode only", file=sys.stderr)
    # Baselines on the same slice, virtual clock, in-process router, 10 ms event delay.
    fast_cluster = demo_cluster(workers, seed=seed, event_delay_s=0.010)
    fast = run_policies(_BASELINES, requests, fast_cluster, router_options=RECOMMENDED_ROUTER_OPTIONS,
                        signal_prefill_done=False, progress=bar)
    for name, result in fast.items():
        key = "kv_aware_fast" if name == "kv_aware" and "kv_aware" in runs else name
        runs[key] = result
        modes[key] = "fast (virtual clock)" + (", exact caches" if name == "oracle" else "")
    doc = results_document(
        trace=DEMO_TRACE, workers=workers, runs=runs, trace_stats=stats,
        config={"mode": "demo", "capacity_tokens": fast_cluster.capacity_tokens,
                "block_size": fast_cluster.page_size,
                "prefill_tokens_per_s": fast_cluster.cost.prefill_tokens_per_s,
                "rate_scale": rate_scale, "live": live_info,
                "router_options": RECOMMENDED_ROUTER_OPTIONS},
    )
    print()
    print(format_table(doc, modes=modes))
    if live_info:
        print(f"\nlive router: route latency p50 {live_info['route_latency_p50_ms']:.1f} ms, "
              f"p99 {live_info['route_latency_p99_ms']:.1f} ms (HTTP round trip); "
              f"TTFT is simulated in every row (prefill {fast_cluster.cost.prefill_tokens_per_s:g} tok/s)")
    # Created only now, so an early failure leaves no empty folder behind.
    out_dir = out or Path(tempfile.mkdtemp(prefix="tokenspeed-router-demo-"))
    results = write_results(doc, out_dir)
    print(f"\nresults: {results}")
    paths, note = try_write_plots(runs, out_dir, title=f"demo: {len(requests)} requests, {workers} workers")
    if paths:
        print(f"plot: {paths[0]}")
    if note:
        print(note, file=sys.stderr)
    return 0
