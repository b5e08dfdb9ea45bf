"""``tokenspeed-router simulate``: trace-driven evaluation of routing policies.

Fast mode (virtual clock): every policy replays the same requests on fresh
simulated workers (real PrefixCaches), the event-fed policies through a real
KvIndex with the configured event delay/loss. Prints a table, and with
``--out DIR`` writes ``results.json`` and PNG plots.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.sim.cluster import ClusterConfig, CostModel
from tokenspeed_router.sim.policies import KNOWN_POLICIES
from tokenspeed_router.sim.report import (
    POLICY_ORDER,
    check_out_dir,
    format_table,
    results_document,
    try_write_plots,
    write_results,
)
from tokenspeed_router.sim.runner import Interrupted, ProgressBar, run_policies, sweep
from tokenspeed_router.sim.traces import (
    MOONCAKE_BLOCK_TOKENS,
    TraceRequest,
    TraceWindow,
    load_mooncake,
    trace_summary,
)
from tokenspeed_router.sim.workload import WorkloadConfig, generate_workload

__all__ = ["add_arguments", "load_requests", "parse_router_options", "run"]


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from err


def _restart(text: str) -> tuple[float, str]:
    name, sep, when = text.rpartition("@")
    try:
        if not sep or not name:
            raise ValueError(text)
        return float(when), name
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected WORKER@SECONDS, got {text!r}") from err


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``simulate`` (defaults documented in ``sim/cluster.py``)."""
    g = parser.add_argument_group("trace")
    g.add_argument("--trace", required=True,
                   help="Mooncake-format .jsonl file, or 'synthetic' for the built-in generator")
    g.add_argument("--trace-block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS,
                   help="tokens per trace hash id (Mooncake: 512)")
    g.add_argument("--start-s", type=float, default=0.0, help="window start, trace time (s)")
    g.add_argument("--duration-s", type=float, default=None, help="window length, trace time (s)")
    g.add_argument("--max-requests", type=int, default=None, help="stop after this many requests")
    g.add_argument("--rate-scale", type=float, default=1.0,
                   help="multiply the arrival rate (2 = twice as fast)")
    g.add_argument("--synthetic-requests", type=int, default=3000,
                   help="requests generated for --trace synthetic")
    c = parser.add_argument_group("cluster")
    c.add_argument("--workers", type=int, required=True, help="workers (prefill pool if disaggregated)")
    c.add_argument("--decode-workers", type=int, default=0,
                   help="> 0: disaggregated run with this many decode workers")
    c.add_argument("--capacity-tokens", type=int, default=400_000, help="KV cache per worker (tokens)")
    c.add_argument("--block-size", type=int, default=16, help="cache page size (tokens)")
    c.add_argument("--eviction-policy", default="lru", help="lru, lfu, fifo, mru, filo, priority")
    c.add_argument("--prefill-rate", type=float, default=10_000.0, help="prefill tokens/s per worker")
    c.add_argument("--prefill-overhead-ms", type=float, default=20.0, help="fixed cost per prefill")
    c.add_argument("--decode-ms-per-token", type=float, default=20.0, help="time per output token")
    c.add_argument("--kv-transfer-rate", type=float, default=400_000.0,
                   help="tokens/s moved prefill -> decode (disaggregated)")
    c.add_argument("--event-delay-ms", type=float, default=10.0,
                   help="delay from an engine publishing an event to the index applying it")
    c.add_argument("--event-loss", type=float, default=0.0,
                   help="probability that an event batch is lost (no replay)")
    c.add_argument("--seed", type=int, default=0, help="seed of every RNG in the run")
    c.add_argument("--restart", type=_restart, action="append", default=[], metavar="WORKER@SECONDS",
                   help="restart an engine at this simulated time (empty cache, event seq back to 0); "
                        "repeatable, e.g. --restart w1@600")
    p = parser.add_argument_group("policies and output")
    p.add_argument("--policies", default=",".join(POLICY_ORDER),
                   help="comma-separated subset of " + ", ".join(KNOWN_POLICIES)
                        + " (the last four: peer routers emulated from their source, sim/peers)")
    p.add_argument("--router-option", action="append", default=[], metavar="KEY=VALUE",
                   help="override a RouterConfig field (repeatable), e.g. queue_weight=1.5")
    p.add_argument("--no-prefill-signal", action="store_true",
                   help="the router hears only 'release' at request end (as over HTTP), "
                        "not the first token, so queued prefill counts as load until then")
    p.add_argument("--sweep-event-delay-ms", type=_floats, default=None, metavar="MS,MS,...",
                   help="also re-run kv_aware at each event delay")
    p.add_argument("--sweep-event-loss", type=_floats, default=None, metavar="P,P,...",
                   help="also re-run kv_aware at each event-batch loss probability")
    p.add_argument("--out", type=Path, default=None, help="write results.json and plots here")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def parse_router_options(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings to RouterConfig overrides (JSON values, else str)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--router-option expects KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def load_requests(args: argparse.Namespace) -> tuple[str, list[TraceRequest]]:
    """The request list and its display name, from ``--trace`` and the window flags."""
    window = TraceWindow(start_s=args.start_s, duration_s=args.duration_s,
                         max_requests=args.max_requests, rate_scale=args.rate_scale)
    if args.trace == "synthetic":
        reqs = generate_workload(WorkloadConfig(num_requests=args.synthetic_requests, seed=args.seed))
        t0 = window.start_s
        end = None if window.duration_s is None else t0 + window.duration_s
        reqs = [r for r in reqs if r.arrival_s >= t0 and (end is None or r.arrival_s < end)]
        reqs = reqs[: window.max_requests] if window.max_requests else reqs
        reqs = [replace(r, arrival_s=(r.arrival_s - t0) / window.rate_scale) for r in reqs]
        return "synthetic", reqs
    path = Path(args.trace)
    return path.name, load_mooncake(path, window, block_tokens=args.trace_block_tokens)


def cluster_from_args(args: argparse.Namespace) -> ClusterConfig:
    """The :class:`ClusterConfig` the flags describe."""
    return ClusterConfig(
        num_workers=args.workers,
        num_decode_workers=args.decode_workers,
        capacity_tokens=args.capacity_tokens,
        page_size=args.block_size,
        eviction_policy=args.eviction_policy,
        cost=CostModel(
            prefill_tokens_per_s=args.prefill_rate,
            prefill_overhead_s=args.prefill_overhead_ms / 1000.0,
            decode_s_per_token=args.decode_ms_per_token / 1000.0,
            kv_transfer_tokens_per_s=args.kv_transfer_rate,
        ),
        event_delay_s=args.event_delay_ms / 1000.0,
        event_loss_rate=args.event_loss,
        seed=args.seed,
        restarts=tuple(sorted(getattr(args, "restart", []))),
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``tokenspeed-router simulate``."""
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in KNOWN_POLICIES]
    if unknown or not policies:
        raise ConfigError(f"unknown policies {unknown}; choose from {', '.join(KNOWN_POLICIES)}")
    if args.out is not None:
        check_out_dir(args.out)
    cluster = cluster_from_args(args)
    router_options = parse_router_options(args.router_option)
    trace_name, requests = load_requests(args)
    if not requests:
        raise ConfigError("the trace window selects no requests")
    too_long = sum(1 for r in requests if r.input_length > cluster.capacity_tokens)
    if too_long:
        # A real engine would reject such a prompt; the simulator serves it (full
        # prefill cost) and caches only the leading pages that fit, so the other
        # requests' numbers stay comparable.
        print(f"warning: {too_long} prompt(s) exceed --capacity-tokens "
              f"{cluster.capacity_tokens}; they are prefilled whole and cached only as far "
              "as they fit", file=sys.stderr)
    stats = trace_summary(requests)
    print(f"trace {trace_name}: {len(requests)} requests over {stats['span_s']:.0f} s, "
          f"{stats['input_tokens'] / 1e6:.1f} M prompt tokens, ideal hit ratio "
          f"{stats['ideal_hit_ratio']:.1%}", file=sys.stderr)
    bar = None if args.quiet else ProgressBar()
    signal = not args.no_prefill_signal
    if args.event_loss > 0 or args.sweep_event_loss:
        # Losses are deliberate here: one resync warning per lost batch would bury the table.
        ingest_log = logging.getLogger("tokenspeed_router.router.ingest")
        ingest_log.setLevel(max(ingest_log.getEffectiveLevel(), logging.ERROR))
    interrupted = False
    try:
        runs = run_policies(policies, requests, cluster, router_options=router_options,
                            signal_prefill_done=signal, progress=bar)
    except Interrupted as stop:
        if not stop.finished:
            raise
        runs, interrupted = stop.finished, True
        print(f"\ninterrupted: reporting the {len(runs)} finished "
              f"polic{'y' if len(runs) == 1 else 'ies'} ({', '.join(runs)})", file=sys.stderr)
    sweeps: dict[str, Any] = {}
    # No sweeps after Ctrl-C: write what finished and stop.
    if args.sweep_event_delay_ms and not interrupted:
        sweeps["event_delay"] = sweep("event_delay_s", [v / 1000.0 for v in args.sweep_event_delay_ms],
                                      requests, cluster, router_options=router_options,
                                      signal_prefill_done=signal, progress=bar)
    if args.sweep_event_loss and not interrupted:
        sweeps["event_loss"] = sweep("event_loss_rate", args.sweep_event_loss, requests, cluster,
                                     router_options=router_options, signal_prefill_done=signal,
                                     progress=bar)
    config = {
        "mode": "fast",
        "capacity_tokens": cluster.capacity_tokens,
        "block_size": cluster.page_size,
        "eviction_policy": cluster.eviction_policy,
        "decode_workers": cluster.num_decode_workers,
        "prefill_tokens_per_s": cluster.cost.prefill_tokens_per_s,
        "prefill_overhead_s": cluster.cost.prefill_overhead_s,
        "decode_s_per_token": cluster.cost.decode_s_per_token,
        "kv_transfer_tokens_per_s": cluster.cost.kv_transfer_tokens_per_s,
        "event_delay_s": cluster.event_delay_s,
        "event_loss_rate": cluster.event_loss_rate,
        "seed": cluster.seed,
        "restarts": [[t, w] for t, w in cluster.restarts],
        "rate_scale": args.rate_scale,
        "start_s": args.start_s,
        "duration_s": args.duration_s,
        "max_requests": args.max_requests,
        "router_options": router_options,
        "prefill_done_signal": signal,
        "interrupted": interrupted,
    }
    doc = results_document(trace=trace_name, workers=cluster.num_workers, runs=runs,
                           config=config, trace_stats=stats, sweeps=sweeps or None)
    print(format_table(doc))
    for name, rows in sweeps.items():
        print(f"\nsweep {name} (kv_aware):")
        for row in rows:
            print("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in row.items()))
    if args.out is not None:
        path = write_results(doc, args.out)
        print(f"wrote {path}")
        if not args.no_plots:
            plots, note = try_write_plots(runs, args.out, title=f"{trace_name}, {cluster.num_workers} workers, "
                                          f"{cluster.cost.prefill_tokens_per_s:g} tok/s")
            for plot in plots:
                print(f"wrote {plot}")
            if note:
                print(note, file=sys.stderr)
    return 130 if interrupted else 0
