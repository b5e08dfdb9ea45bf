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
from tokenspeed_router.sim.peers import PEER_VALIDATION, validation_label
from tokenspeed_router.sim.policies import KNOWN_POLICIES
from tokenspeed_router.sim.report import (
    POLICY_ORDER,
    check_out_dir,
    format_table,
    results_document,
    try_write_plots,
    write_results,
)
from tokenspeed_router.sim.runner import (
    Interrupted,
    ProgressBar,
    ReplicaOptions,
    run_policies,
    sweep,
)
from tokenspeed_router.sim.shapes import WorkloadConfig, generate_workload
from tokenspeed_router.sim.traces import (
    MOONCAKE_BLOCK_TOKENS,
    TraceRequest,
    TraceWindow,
    load_mooncake,
    trace_summary,
)
from tokenspeed_router.timing import PROFILES

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
    g.add_argument("--trace",
                   help="Mooncake-format .jsonl file, or 'synthetic' for the built-in generator "
                        "(required unless --decisions)")
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
    c.add_argument("--workers", type=int,
                   help="workers (prefill pool if disaggregated; required unless --decisions)")
    c.add_argument("--decode-workers", type=int, default=0,
                   help="> 0: disaggregated run with this many decode workers")
    c.add_argument("--capacity-tokens", type=int, default=400_000, help="KV cache per worker (tokens)")
    c.add_argument("--block-size", type=int, default=16, help="cache page size (tokens)")
    c.add_argument("--eviction-policy", default="lru", help="lru, lfu, fifo, mru, filo, priority")
    c.add_argument("--timing", choices=PROFILES, default="fifo",
                   help="engine scheduler profile, the one engine-sim --timing runs: fifo = one "
                        "prefill at a time (overhead + uncached / rate), decode without contention; "
                        "chunked = vLLM-style steps with a token budget (default fifo)")
    c.add_argument("--max-batched-tokens", type=int, default=2048,
                   help="chunked profile: token budget per step (default 2048)")
    c.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once per worker")
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
    c.add_argument("--replicas", type=int, default=1,
                   help="N router replicas split the requests round-robin (each follows every engine)")
    c.add_argument("--replica-delay-ms", type=float, default=2.0,
                   help="how late one replica's in-flight work reaches the others (Redis Pub/Sub: ~2 ms)")
    c.add_argument("--replica-sharing", choices=["all", "load", "none"], default="all",
                   help="what replicas share: load and route predictions (all), load only, or nothing")
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
    d = parser.add_argument_group("decision log (instead of a trace)")
    d.add_argument("--decisions", metavar="FILE",
                   help="a decision log (serve --decision-log): decide every logged decision again under each "
                        "of --policies, on the logged credits and loads, and print a JSON comparison "
                        "(docs/operations.md); --router-option applies")
    d.add_argument("--decisions-out", metavar="FILE",
                   help="with --decisions: one JSON line per decision and policy (logged vs re-decided)")


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
            profile=args.timing,
            max_batched_tokens=args.max_batched_tokens,
        ),
        max_num_seqs=args.max_num_seqs,
        event_delay_s=args.event_delay_ms / 1000.0,
        event_loss_rate=args.event_loss,
        seed=args.seed,
        restarts=tuple(sorted(getattr(args, "restart", []))),
    )


def _run_decisions(args: argparse.Namespace) -> int:
    """``simulate --decisions FILE``: each of --policies against the logged decisions (logged state)."""
    from tokenspeed_router.router.scoring import Policy
    from tokenspeed_router.server.decision_log import DecisionLogReader
    from tokenspeed_router.tools.decision_replay import redecide_config, simulate_decisions

    known = [p.value for p in Policy]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if args.policies == ",".join(POLICY_ORDER):  # the default: every policy a Router has
        policies = [p for p in POLICY_ORDER if p in known]
    unknown = [p for p in policies if p not in known]
    if unknown or not policies:
        raise ConfigError(f"--decisions re-decides with a Router policy; unknown {unknown}, choose from "
                          f"{', '.join(known)}")
    options = parse_router_options(args.router_option)
    reader = DecisionLogReader(args.decisions)
    first = next(iter(reader), None)
    out = None
    if args.decisions_out:
        try:
            out = open(args.decisions_out, "w", encoding="utf-8")  # noqa: SIM115 - closed below
        except OSError as err:
            raise ConfigError(f"--decisions-out {args.decisions_out}: {err}") from err
    results: dict[str, Any] = {}
    try:
        for policy in policies:
            reader.malformed = 0
            config = redecide_config(first, policy, options, logged_view=True)
            if out is not None:
                out.write(json.dumps({"policy": policy}) + "\n")
            results[policy] = simulate_decisions(reader, config, out=out).to_dict()
    finally:
        if out is not None:
            out.close()
    doc = {"decisions": args.decisions, "logged_policy": first.policy if first else None,
           "malformed_lines": reader.malformed, "policies": results}
    print(json.dumps(doc, sort_keys=True))
    return 0


def run(args: argparse.Namespace) -> int:
    """Entry point of ``tokenspeed-router simulate``."""
    if args.decisions_out and not args.decisions:
        raise ConfigError("--decisions-out needs --decisions FILE")
    if args.decisions:
        return _run_decisions(args)
    if args.trace is None or args.workers is None:
        raise ConfigError("simulate needs --trace FILE and --workers N (or --decisions FILE)")
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
    if args.replicas < 1:
        raise ConfigError(f"--replicas must be at least 1, got {args.replicas}")
    if args.replica_delay_ms < 0:
        raise ConfigError(f"--replica-delay-ms must be >= 0, got {args.replica_delay_ms}")
    replicas = ReplicaOptions(args.replicas, args.replica_delay_ms / 1000.0,
                              None if args.replica_sharing == "none" else args.replica_sharing)
    if args.event_loss > 0 or args.sweep_event_loss:
        # Losses are deliberate here: one resync warning per lost batch would bury the table.
        ingest_log = logging.getLogger("tokenspeed_router.router.ingest")
        ingest_log.setLevel(max(ingest_log.getEffectiveLevel(), logging.ERROR))
    interrupted = False
    try:
        runs = run_policies(policies, requests, cluster, router_options=router_options,
                            signal_prefill_done=signal, progress=bar, replicas=replicas)
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
        "timing": cluster.cost.profile,
        "max_batched_tokens": cluster.cost.max_batched_tokens,
        "max_num_seqs": cluster.max_num_seqs,
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
        "replicas": args.replicas,
        "replica_delay_s": replicas.delay_s if args.replicas > 1 else None,
        "replica_sharing": args.replica_sharing if args.replicas > 1 else None,
        "interrupted": interrupted,
    }
    # a peer emulation that was not checked live against the real peer backs no claim: say so
    config["peer_validation"] = {n: PEER_VALIDATION[n] for n in runs if n in PEER_VALIDATION}
    doc = results_document(trace=trace_name, workers=cluster.num_workers, runs=runs,
                           config=config, trace_stats=stats, sweeps=sweeps or None)
    labels = {n: validation_label(n) for n in runs if validation_label(n)}
    print(format_table(doc, modes=labels or None))
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
