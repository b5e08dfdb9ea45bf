"""``tokenspeed-router demo``: the serving path end to end, against the baselines.

Zero configuration, about two minutes. For each routing policy in turn, on a
fresh fleet (cold caches for everyone):

1. N ``engine-sim`` processes (real PrefixCaches, real KV events on
   loopback) with small caches, so blocks are evicted all the time (memory
   pressure), and one engine restarted mid-run by its fault knob (fresh cache,
   event seq back to 0);
2. a ``tokenspeed-router serve`` gateway in front of them with that policy
   (``kv_aware``: ours, fed by the engines' events; ``approx``: the
   event-less policy that remembers what it routed, the way most KV-aware
   routers without events work; ``round_robin``: cache-blind);
3. ``loadgen`` replaying the shipped Mooncake slice through the gateway,
   open loop.

It prints one table (TTFT p50/p99, end-to-end p99, the engines' own hit
ratio, requests-per-worker spread) and writes ``results.json`` and
``loadgen.png``. Every latency is measured on the wall clock through real
HTTP; the engines model prefill/decode time at ``--time-scale`` times real
speed, so seconds here are 1/K of the modelled seconds.

Scale: prompts are shrunk 8x (``scale_prompts(0.125)``: each 512-token
hash block becomes 64 tokens), and the engines' cache and prefill rate with
them, so the modelled system is a 100k-token-cache, 20k-token/s engine fleet
while a 2-core laptop moves 8x fewer token ids. ``--sim`` runs the earlier
in-process simulation demo instead (no HTTP, virtual clock).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.loadgen.client import RequestRecord
from tokenspeed_router.loadgen.fleet import (
    EngineHandle,
    EngineSimOptions,
    Fleet,
    clock_scaled_router_flags,
    exit_on_sigterm,
)
from tokenspeed_router.loadgen.prompts import PromptBuilder, PromptConfig, scale_prompts
from tokenspeed_router.loadgen.replay import ReplayConfig, replay
from tokenspeed_router.loadgen.report import (
    format_runs_table,
    summarize,
    write_plots,
    write_results,
)
from tokenspeed_router.sim.runner import ProgressBar
from tokenspeed_router.sim.traces import TraceRequest, TraceWindow, parse_mooncake, trace_summary

__all__ = [
    "DEMO_POLICIES",
    "DemoSetup",
    "add_arguments",
    "demo_setup",
    "run",
    "run_policies",
    "run_policy",
]

logger = logging.getLogger(__name__)

#: Ours first, then the event-less approximation, then the cache-blind baseline.
DEMO_POLICIES = ("kv_aware", "approx", "round_robin")
DEMO_TRACE = "mooncake_synthetic_slice.jsonl"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Optional knobs; the defaults are the demo."""
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write results.json and plots (default: a temp dir)")
    parser.add_argument("--engines", type=int, default=4, help="engine-sim processes (default 4)")
    parser.add_argument("--requests", type=int, default=None,
                        help="use only the first N requests of the slice (default all 399)")
    parser.add_argument("--policies", default=",".join(DEMO_POLICIES),
                        help=f"comma-separated gateway policies (default {','.join(DEMO_POLICIES)})")
    parser.add_argument("--rate-scale", type=float, default=8.0,
                        help="speed-up of the slice's arrivals in modelled time (default 8: ~3 req/s)")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="modelled seconds per wall second (default 8 here; 5 with --sim)")
    parser.add_argument("--no-restart", action="store_true", help="no engine restart mid-run")
    parser.add_argument("--sim", action="store_true",
                        help="the in-process simulation demo (virtual clock, no HTTP) instead")
    parser.add_argument("--fast-only", action="store_true", help="with --sim: skip the live cluster")
    parser.add_argument("--seed", type=int, default=0, help="with --sim: simulator seed")
    parser.add_argument("--workers", type=int, default=4, help="with --sim: simulated workers (default 4)")


class DemoSetup:
    """The demo's fleet and load, in one place (the README quotes these)."""

    def __init__(self, *, engines: int, requests: list[TraceRequest], time_scale: float,
                 restart: bool) -> None:
        if engines < 2:
            raise ConfigError(f"--engines must be >= 2, got {engines}")
        self.num_engines = engines
        self.requests = requests
        self.time_scale = time_scale
        #: Modelled at full size: 100k-token caches (the slice holds ~1.7M distinct prompt
        #: tokens), 20k prefill tokens/s, 20 ms/token decode.
        self.engine = EngineSimOptions(capacity_tokens=12_500, prefill_tokens_per_s=2_500.0,
                                       decode_s_per_token=0.02, time_scale=time_scale)
        #: The second engine restarts after a quarter of the slice's share per engine.
        self.restart_after = max(1, len(requests) // (4 * engines)) if restart else None

    def gateway_flags(self) -> list[str]:
        return clock_scaled_router_flags(self.time_scale)

    def engine_options(self) -> list[EngineSimOptions]:
        opts = [self.engine] * self.num_engines
        if self.restart_after is not None:
            opts[1] = replace(self.engine, restart_after_requests=self.restart_after)
        return opts

    def engine_names(self) -> list[str]:
        return [f"engine{i}" for i in range(self.num_engines)]

    def describe(self) -> dict[str, Any]:
        return {"engines": self.num_engines, "engine": self.engine.args(),
                "restart": None if self.restart_after is None else
                {"engine": "engine1", "after_requests": self.restart_after},
                "time_scale": self.time_scale, "prompt_scale": 0.125,
                "gateway_flags": self.gateway_flags()}


def demo_setup(args: argparse.Namespace) -> DemoSetup:
    text = resources.files("tokenspeed_router.sim").joinpath("data").joinpath(DEMO_TRACE).read_text("utf-8")
    time_scale = args.time_scale or 8.0
    # Arrivals: the slice sped up by rate_scale (modelled), then by the time scale (wall).
    requests = parse_mooncake(text.splitlines(),
                              TraceWindow(rate_scale=args.rate_scale * time_scale,
                                          max_requests=args.requests), source=DEMO_TRACE)
    return DemoSetup(engines=args.engines, requests=scale_prompts(requests, 0.125),
                     time_scale=time_scale, restart=not args.no_restart)


def run_policy(policy: str, setup: DemoSetup, fleet: Fleet, engines: Sequence[EngineHandle], *,
               progress: ProgressBar | None = None) -> tuple[dict[str, Any], list[RequestRecord]]:
    """A gateway with ``policy`` in front of this policy's own fresh engines; one replay."""
    url = fleet.start_gateway("gateway", engines, policy=policy, extra=setup.gateway_flags())
    builder = PromptBuilder(PromptConfig(model=setup.engine.model))
    if progress is not None:
        progress.start(policy)
    outcome = replay(setup.requests, builder, ReplayConfig(target=url), progress=progress)
    summary = summarize(outcome.records, wall_s=outcome.wall_s, workers=setup.engine_names())
    summary["max_send_lateness_s"] = outcome.max_send_lateness_s
    return summary, outcome.records


def run_policies(policies: Sequence[str], setup: DemoSetup, *, log_dir: Path,
                 progress: ProgressBar | None = None
                 ) -> tuple[dict[str, dict[str, Any]], dict[str, list[RequestRecord]]]:
    """Every policy on its own fleet. All engines start together (their start-up
    is mostly importing torch, which overlaps well); runs are sequential, and
    each fleet is stopped once its run is over."""
    fleets = {p: Fleet(log_dir / p) for p in policies}
    summaries: dict[str, dict[str, Any]] = {}
    records: dict[str, list[RequestRecord]] = {}
    try:
        launched = {p: f.launch_engines(setup.engine_names(), setup.engine_options())
                    for p, f in fleets.items()}
        engines = {p: fleets[p].wait_engines(procs) for p, procs in launched.items()}
        for policy in policies:
            summaries[policy], records[policy] = run_policy(policy, setup, fleets[policy],
                                                            engines[policy], progress=progress)
            fleets[policy].close()
    finally:
        for fleet in fleets.values():
            fleet.close()
    return summaries, records


def _run_sim(args: argparse.Namespace) -> int:
    from tokenspeed_router.sim.demo import LIVE_TIME_SCALE, run_demo

    return run_demo(out=args.out, workers=args.workers, max_requests=args.requests,
                    rate_scale=args.rate_scale, seed=args.seed, fast_only=args.fast_only,
                    time_scale=LIVE_TIME_SCALE if args.time_scale is None else args.time_scale)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``tokenspeed-router demo``."""
    if args.sim:
        return _run_sim(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    exit_on_sigterm()  # a killed demo stops its engines and gateways too
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise ConfigError("--policies names no policy")
    setup = demo_setup(args)
    out_dir = args.out or Path(tempfile.gettempdir()) / "tokenspeed-router-demo"
    out_dir.mkdir(parents=True, exist_ok=True)
    stats = trace_summary(setup.requests)
    restart = (f", engine1 restarts after {setup.restart_after} requests"
               if setup.restart_after is not None else "")
    print(f"demo: {len(setup.requests)} requests of the Mooncake synthetic slice, "
          f"{stats['span_s']:.0f} s; {setup.num_engines} engine-sims with small caches "
          f"(memory pressure){restart}; gateway policies {', '.join(policies)}; "
          f"time scale {setup.time_scale:g}", file=sys.stderr)
    print(f"starting {len(policies) * setup.num_engines} engine-sims ...", file=sys.stderr)
    summaries, records = run_policies(policies, setup, log_dir=out_dir / "logs", progress=ProgressBar())
    doc = {"mode": "demo", "trace": DEMO_TRACE, "setup": setup.describe(), "trace_stats": stats,
           "policies": summaries,
           "requests": {p: [r.as_dict() for r in recs] for p, recs in records.items()}}
    path = write_results(doc, out_dir)
    plots = write_plots(records, out_dir, title=f"demo: {len(setup.requests)} requests, "
                        f"{setup.num_engines} engine-sims, memory pressure{restart}",
                        workers=setup.engine_names(), name="demo.png")
    print()
    print(format_runs_table(summaries, label="policy"))
    print(f"\n(wall-clock seconds through real HTTP; engines modelled at {setup.time_scale:g}x speed; "
          "hit = engines' own cached_tokens / prompt_tokens; spread = busiest engine's requests / mean)")
    print(f"\nresults: {path}")
    print(f"plot: {plots[0]}" if plots else "plots skipped: matplotlib is not installed")
    logger.debug("demo summaries: %s", json.dumps(summaries))
    return 0 if all(s["ok"] for s in summaries.values()) else 1
