"""Our gateway against real routers, in front of the same engine-sims (issue 12).

Run: ``.venv/bin/python benchmarks/compare_routers.py [--quick] [--runs 3] [--out DIR]``
(peers: ``pip install vllm-router sglang-router`` into the venv; they are not
project dependencies, and a router whose binary is missing is skipped with a
note). See docs/compare-routers.md for what is measured and the last results.

For each Mooncake trace (a time-scaled slice of both files in
``../shared/traces/mooncake``), each scenario, each engine timing profile
(``--timing``: ``fifo``, one prefill at a time with a fixed overhead, decode
without contention; ``chunked``, vLLM-style chunked prefill) and each router,
``--runs`` times (default 3) on a *fresh* fleet of engine-sims (cold caches,
same seeds); each cell reports the median and the min-max of its runs:

* ``pressure`` — small caches: blocks are evicted all the time, so a router
  must know what is still cached, not what it once sent;
* ``restart``  — the same, and two engines restart mid-run (fresh cache,
  event seq back to 0);
* ``replicas`` — the same as ``pressure``, with two router processes and the
  load generator alternating requests between them. Our two ``serve``
  processes share state through Redis (``--state redis://``); the peers have
  no shared state, so each replica sees half of the traffic.

Routers: ``tokenspeed`` (``serve`` gateway, ``kv_aware``, token-id prompts),
``vllm-router`` (``kv_aware``, the same KV events, token-id prompts) and
``sglang-router`` (``smg launch --policy cache_aware``: an approximate tree on
the prompt *text*, so it gets the same ids as digit words, which engine-sim
tokenizes back to the same ids). ``--baseline`` adds our ``round_robin``.

Prompts are shrunk 8x (hash block 512 -> 64 tokens) and the engines' cache
and prefill rate with them (see ``tokenspeed_router/loadgen/prompts.py``);
outputs are capped at 64 tokens. Latencies are wall-clock through real HTTP,
with engines modelled at ``--time-scale`` times real speed.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.loadgen.client import RequestRecord
from tokenspeed_router.loadgen.fleet import (
    EngineHandle,
    EngineSimOptions,
    Fleet,
    clock_scaled_router_flags,
    exit_on_sigterm,
)
from tokenspeed_router.loadgen.prompts import PromptBuilder, PromptConfig, scale_prompts
from tokenspeed_router.loadgen.replay import ReplayConfig, replay, warm_up
from tokenspeed_router.loadgen.report import (
    format_runs_table,
    summarize,
    write_plots,
    write_results,
)
from tokenspeed_router.sim.runner import ProgressBar
from tokenspeed_router.sim.traces import (
    TraceRequest,
    load_mooncake,
    sample_prefix_groups,
    trace_summary,
)

logger = logging.getLogger("compare_routers")

SCENARIOS = ("pressure", "restart", "replicas")
#: the grid of issue 20: both traces x these scenarios x both timing profiles
DEFAULT_SCENARIOS = ("pressure", "restart")
PROFILES = ("fifo", "chunked")
#: the metrics a cell summarises over its runs (median, min, max)
CELL_METRICS = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "e2e_p99_s", "hit_ratio", "spread_max_over_mean",
                "router_added_p50_s", "router_added_p99_s", "errors")
NUM_ENGINES = 4
PROMPT_SCALE = 0.125
MAX_OUTPUT_TOKENS = 64
MODEL = "tokenspeed-sim"
@dataclass(frozen=True)
class TraceSlice:
    """Whole prefix groups of a trace (``sample_prefix_groups``), sped up.

    Not the demo's slice: the synthetic trace is cut with another seed (other
    documents), the conversation trace by its first two blocks (sessions;
    every request shares block 0). ``speedup`` puts the full-size offered
    load at ~60k (synthetic) and ~100k (conversation, shorter and more
    shared prompts) prompt tokens/s against 4 x 20k tokens/s of prefill: a
    fleet that keeps up only when it reuses its caches, without drowning.
    """

    file: str
    prefix_blocks: int
    groups: int
    seed: int
    speedup: float


TRACES = {
    "conversation": TraceSlice("conversation_trace.jsonl", prefix_blocks=2, groups=60, seed=1, speedup=70.0),
    "synthetic": TraceSlice("synthetic_trace.jsonl", prefix_blocks=1, groups=60, seed=2, speedup=7.0),
}


def _shared_traces() -> Path:
    here = Path(__file__).resolve().parents[1]
    for base in (here.parent / "shared", here.parents[1] / "shared", Path("/work/shared")):
        if (base / "traces" / "mooncake").is_dir():
            return base / "traces" / "mooncake"
    raise SystemExit("Mooncake traces not found (expected ../shared/traces/mooncake)")


def _binary(name: str) -> str | None:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


@dataclass(frozen=True)
class RunContext:
    """What a router launcher needs besides the engines."""

    fleet: Fleet
    replica: int
    time_scale: float
    redis: str | None = None
    #: extra ``--router-option KEY=VALUE`` for our gateway (experiments; default none)
    router_options: tuple[str, ...] = ()


#: (context, engines) -> the router's base URL once it serves
Launcher = Callable[[RunContext, Sequence[EngineHandle]], str]


@dataclass(frozen=True)
class RouterKind:
    name: str
    prompt_format: str
    start: Launcher
    available: Callable[[], str | None]  # None = available, else why not
    #: no router at all: the load generator spreads requests over the engines itself
    direct: bool = False


def _ours(policy: str, processes: int = 1) -> Launcher:
    def start(ctx: RunContext, engines: Sequence[EngineHandle]) -> str:
        # Our time constants follow the engines' clock (see clock_scaled_router_flags);
        # the peers run with their defaults (no comparable time-based memory).
        extra = clock_scaled_router_flags(ctx.time_scale) + (["--state", ctx.redis] if ctx.redis else [])
        if processes > 1:  # serve --processes N: N processes on one port (a private Redis without --state)
            extra += ["--processes", str(processes)]
        for option in ctx.router_options:
            extra += ["--router-option", option]
        return ctx.fleet.start_gateway(f"tokenspeed-{policy}-{ctx.replica}", engines, policy=policy,
                                       extra=extra)
    return start


def _vllm_router(ctx: RunContext, engines: Sequence[EngineHandle]) -> str:
    port = free_tcp_port()
    cmd = [str(_binary("vllm-router")), "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *[e.url for e in engines], "--policy", "kv_aware",
           "--kv-event-block-size", "16", "--kv-event-model", MODEL, "--log-level", "warning",
           # its metrics exporter has a fixed default port: two replicas would collide
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_tcp_port())]
    for e in engines:
        cmd += ["--kv-event-source", f"{e.url}={e.events}"]
        if e.replay:
            cmd += ["--kv-event-replay-source", f"{e.url}={e.replay}"]
    proc = ctx.fleet.start(f"vllm-router-{ctx.replica}", cmd)
    url = f"http://127.0.0.1:{port}"
    ctx.fleet.wait_models(proc, url)
    return url


def _sglang_router(ctx: RunContext, engines: Sequence[EngineHandle]) -> str:
    port = free_tcp_port()
    cmd = [str(_binary("smg")), "launch", "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *[e.url for e in engines], "--policy", "cache_aware",
           "--log-level", "warn",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_tcp_port())]
    proc = ctx.fleet.start(f"sglang-router-{ctx.replica}", cmd)
    url = f"http://127.0.0.1:{port}"
    ctx.fleet.wait_models(proc, url)
    return url


def _needs(binary: str) -> Callable[[], str | None]:
    return lambda: None if _binary(binary) else f"{binary} not installed (pip install {binary})"


ROUTERS = {
    "tokenspeed": RouterKind("tokenspeed", "tokens", _ours("kv_aware"), lambda: None),
    "vllm-router": RouterKind("vllm-router", "tokens", _vllm_router, _needs("vllm-router")),
    "sglang-router": RouterKind("sglang-router", "text", _sglang_router, _needs("smg")),
    "round_robin": RouterKind("round_robin", "tokens", _ours("round_robin"), lambda: None),
    # the floor of every router-added latency: loadgen -> engine over HTTP, round robin
    "direct": RouterKind("direct", "tokens", lambda ctx, engines: "", lambda: None, direct=True),
    # two gateway processes on one port (serve --processes 2), sharing in-flight work
    "tokenspeed-p2": RouterKind("tokenspeed-p2", "tokens", _ours("kv_aware", processes=2), lambda: None),
}


def _redis(fleet: Fleet) -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("the replicas scenario needs redis-server on PATH")
    port = free_tcp_port()
    proc = fleet.start("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", str(fleet.log_dir)])
    import redis

    client = redis.Redis.from_url(f"redis://127.0.0.1:{port}/0")
    deadline = time.monotonic() + 15
    pause = threading.Event()
    while True:
        try:
            if client.ping():
                return f"redis://127.0.0.1:{port}/0"
        except redis.ConnectionError:
            if proc.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"redis-server did not start: {proc.log_tail()}") from None
        pause.wait(0.05)


def engine_options(time_scale: float, timing: str) -> EngineSimOptions:
    """The engines of every cell: 12.5k-token caches (100k full-size), 2.5k tok/s (20k full-size)."""
    return EngineSimOptions(capacity_tokens=12_500, prefill_tokens_per_s=2_500.0,
                            decode_s_per_token=0.02, time_scale=time_scale, model=MODEL, timing=timing)


def load_slice(trace: str, *, groups: int | None, speedup_factor: float) -> list[TraceRequest]:
    """The trace's slice (``TRACES``), prompts shrunk by ``PROMPT_SCALE``, arrivals sped up."""
    cut = TRACES[trace]
    full = load_mooncake(_shared_traces() / cut.file)
    return scale_prompts(sample_prefix_groups(
        full, prefix_blocks=cut.prefix_blocks, groups=groups or cut.groups, seed=cut.seed,
        speedup=cut.speedup * speedup_factor), PROMPT_SCALE)


def run_one(kind: RouterKind, scenario: str, requests: Sequence[TraceRequest], *, time_scale: float,
            log_dir: Path, progress: ProgressBar, python: str = sys.executable,
            router_options: Sequence[str] = (), timing: str = "chunked", label: str = "",
            inspect: Callable[[Sequence[str]], dict[str, Any]] | None = None,
            placement: Sequence[str | None] | None = None,
            on_ready: Callable[[Sequence[str]], None] | None = None,
            ) -> tuple[dict[str, Any], list[RequestRecord]]:
    """One run of one router on a fresh fleet: its summary (and ``inspect(urls)`` before it stops).

    ``placement`` (direct only): the engine name each request goes to, e.g.
    the workers a router chose in its own run (None: round robin).
    ``on_ready(urls)`` is called once the router serves, after the warm-up,
    right before the replay (e.g. to attach a profiler).
    """
    engine = engine_options(time_scale, timing)
    opts = [engine] * NUM_ENGINES
    if scenario == "restart":
        after = max(1, len(requests) // (3 * NUM_ENGINES))
        opts[1] = replace(engine, restart_after_requests=after)
        opts[2] = replace(engine, restart_after_requests=2 * after)
    with Fleet(log_dir, python=python) as fleet:
        engines = fleet.start_engines([f"engine{i}" for i in range(NUM_ENGINES)], opts)
        ours = ("tokenspeed", "round_robin", "tokenspeed-p2")
        redis = _redis(fleet) if scenario == "replicas" and kind.name in ours else None
        replicas = 2 if scenario == "replicas" else 1
        if kind.direct:
            urls = [e.url for e in engines]
        else:
            urls = [kind.start(RunContext(fleet=fleet, replica=i, time_scale=time_scale, redis=redis,
                                          router_options=tuple(router_options)), engines)
                    for i in range(replicas)]
        builder = PromptBuilder(PromptConfig(model=MODEL, prompt_format=kind.prompt_format,
                                             max_output_tokens=MAX_OUTPUT_TOKENS))
        pinned: tuple[int, ...] = ()
        if kind.direct and placement is not None:
            names = [e.name for e in engines]
            pinned = tuple(names.index(w) if w in names else i % len(names) for i, w in enumerate(placement))
        target = ReplayConfig(target=urls[0], extra_targets=tuple(urls[1:]), pinned=pinned)
        # the same few short requests before every router's run: first-request costs (lazy
        # imports, first tensor ops, connection pools) are not what is compared
        warm_up(target, MODEL, requests=2 * NUM_ENGINES, text=kind.prompt_format == "text")
        if on_ready is not None:
            on_ready(urls)
        progress.start(label or f"{kind.name}/{scenario}")
        outcome = replay(requests, builder, target, progress=progress)
        extra = inspect(urls) if inspect is not None else None
    summary = summarize(outcome.records, wall_s=outcome.wall_s, workers=[e.name for e in engines])
    summary["max_send_lateness_s"] = outcome.max_send_lateness_s
    if extra is not None:
        summary["inspected"] = extra
    return summary, outcome.records


def cell_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Median and min-max of each of ``CELL_METRICS`` over one router's runs of a cell."""
    out: dict[str, Any] = {"runs": len(runs)}
    for key in CELL_METRICS:
        values = sorted(v for r in runs if (v := r.get(key)) is not None)
        if not values:
            out[key] = {"median": None, "min": None, "max": None}
            continue
        out[key] = {"median": statistics.median(values), "min": values[0], "max": values[-1]}
    return out


def _check_targets(cells: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 20 targets for our medians against each peer's medians in the same cell.

    TTFT p50 and p99 <= every peer's; hit >= the best peer's - 1 point; spread
    (max/mean requests per engine) <= 1.5 unless our p99 is still the best.
    """
    ours = cells.get("tokenspeed")
    peers = {k: v for k, v in cells.items() if k in ("vllm-router", "sglang-router")}
    if not ours or not peers:
        return {}

    def med(cell: dict[str, Any], key: str) -> float | None:
        value = cell[key]["median"]
        return None if value is None else float(value)

    def at_most_every_peer(key: str) -> bool:
        mine = med(ours, key)
        theirs = [v for p in peers.values() if (v := med(p, key)) is not None]
        return mine is not None and all(mine <= v for v in theirs)

    hits = [v for p in peers.values() if (v := med(p, "hit_ratio")) is not None]
    hit = med(ours, "hit_ratio")
    spread = med(ours, "spread_max_over_mean")
    p99_ok = at_most_every_peer("ttft_p99_s")
    return {
        "ttft_p50": at_most_every_peer("ttft_p50_s"),
        "ttft_p99": p99_ok,
        "hit": hit is not None and (not hits or hit >= max(hits) - 0.01),
        "spread": spread is not None and (spread <= 1.5 or p99_ok),
    }


def _fmt_range(cell: dict[str, Any], key: str, fmt: str) -> str:
    m = cell[key]
    if m["median"] is None:
        return "-"
    if cell["runs"] <= 1 or m["min"] == m["max"]:
        return format(m["median"], fmt)
    return f"{format(m['median'], fmt)} ({format(m['min'], fmt)}-{format(m['max'], fmt)})"


def markdown_table(results: dict[str, Any]) -> str:
    """One markdown row per cell and router: medians, min-max in brackets (docs/compare-routers.md)."""
    lines = ["| trace | scenario | engine | router | TTFT p50 (s) | TTFT p99 (s) | hit | spread "
             "| router-added p99 (ms) | errors |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for trace, per_trace in results.items():
        for scenario, per_scenario in per_trace.items():
            if scenario in ("trace_stats", "slice"):
                continue
            for profile, doc in per_scenario.items():
                for router, cell in doc["routers"].items():
                    added = cell["router_added_p99_s"]
                    added_txt = "-" if added["median"] is None else (
                        f"{added['median'] * 1000:.0f}" + ("" if cell["runs"] <= 1 else
                                                           f" ({added['min'] * 1000:.0f}-{added['max'] * 1000:.0f})"))
                    hit = cell["hit_ratio"]
                    hit_txt = "-" if hit["median"] is None else (
                        f"{hit['median']:.1%}" + ("" if cell["runs"] <= 1 else
                                                  f" ({hit['min']:.1%}-{hit['max']:.1%})"))
                    lines.append(
                        f"| {trace} | {scenario} | {profile} | {router} | {_fmt_range(cell, 'ttft_p50_s', '.3f')} "
                        f"| {_fmt_range(cell, 'ttft_p99_s', '.3f')} | {hit_txt} "
                        f"| {_fmt_range(cell, 'spread_max_over_mean', '.2f')} | {added_txt} "
                        f"| {_fmt_range(cell, 'errors', '.0f')} |")
                met = doc.get("targets_met")
                if met:
                    yn = {k: "yes" if v else "no" for k, v in met.items()}
                    lines.append(f"| {trace} | {scenario} | {profile} | *targets met* | {yn['ttft_p50']} "
                                 f"| {yn['ttft_p99']} | {yn['hit']} | {yn['spread']} | | |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/compare_routers"))
    parser.add_argument("--traces", default=",".join(TRACES), help="comma-separated: " + ",".join(TRACES))
    parser.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS),
                        help="comma-separated of " + ",".join(SCENARIOS))
    parser.add_argument("--timing", default=",".join(PROFILES),
                        help="engine timing profiles, comma-separated of " + ",".join(PROFILES))
    parser.add_argument("--runs", type=int, default=3, help="runs per cell (median and min-max; default 3)")
    parser.add_argument("--routers", default="tokenspeed,vllm-router,sglang-router")
    parser.add_argument("--baseline", action="store_true", help="also our round_robin")
    parser.add_argument("--groups", type=int, default=None,
                        help="prefix groups per trace slice (default: the slice's, 60)")
    parser.add_argument("--time-scale", type=float, default=4.0,
                        help="modelled seconds per wall second (engines and arrivals; default 4)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 12 groups, one run, pressure, fifo (minutes, not hours)")
    parser.add_argument("--router-option", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to our gateway (serve --router-option), for experiments")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter that runs engine-sim and serve (default: this one)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    exit_on_sigterm()
    groups = 12 if args.quick else args.groups
    runs = 1 if args.quick else max(1, args.runs)
    scenarios = ["pressure"] if args.quick else [s for s in args.scenarios.split(",") if s]
    profiles = ["fifo"] if args.quick else [p for p in args.timing.split(",") if p]
    names = [r for r in args.routers.split(",") if r] + (["round_robin"] if args.baseline else [])
    kinds = []
    for name in names:
        kind = ROUTERS[name]
        why = kind.available()
        if why:
            print(f"skipping {name}: {why}", file=sys.stderr)
        else:
            kinds.append(kind)
    out: dict[str, Any] = {"config": {"groups": groups, "time_scale": args.time_scale, "runs": runs,
                                      "router_options": args.router_option, "profiles": profiles,
                                      "engines": NUM_ENGINES, "prompt_scale": PROMPT_SCALE,
                                      "max_output_tokens": MAX_OUTPUT_TOKENS,
                                      "engine": "capacity 12.5k tokens (100k full-size), prefill 2.5k tok/s "
                                                "(20k full-size), decode 20 ms/token, block 16"},
                           "results": {}}
    log_root = Path(tempfile.mkdtemp(prefix="compare-routers-"))
    bar = ProgressBar()
    tables = []
    started = time.monotonic()
    for trace in [t for t in args.traces.split(",") if t]:
        requests = load_slice(trace, groups=groups, speedup_factor=args.time_scale)
        stats = trace_summary(requests)
        out["results"].setdefault(trace, {"trace_stats": stats, "slice": asdict(TRACES[trace])})
        for scenario in scenarios:
            for profile in profiles:
                per_run: dict[str, list[dict[str, Any]]] = {k.name: [] for k in kinds}
                records: dict[str, list[RequestRecord]] = {}
                # runs interleave the routers (run 1 of each, then run 2, ...): slow drift of the
                # machine's load then spreads over every router instead of one
                for run in range(runs):
                    for kind in kinds:
                        summary, recs = run_one(
                            kind, scenario, requests, time_scale=args.time_scale,
                            log_dir=log_root / trace / scenario / profile / f"{kind.name}-{run}",
                            progress=bar, python=args.python, router_options=args.router_option,
                            timing=profile, label=f"{kind.name}/{scenario}/{profile}#{run + 1}")
                        per_run[kind.name].append(summary)
                        records[kind.name] = recs
                cells = {name: cell_summary(rs) for name, rs in per_run.items()}
                for name, cell in cells.items():
                    cell["each_run"] = per_run[name]
                targets = _check_targets(cells)
                out["results"][trace].setdefault(scenario, {})[profile] = {"routers": cells,
                                                                          "targets_met": targets}
                medians = {name: {k: cell[k]["median"] for k in CELL_METRICS} for name, cell in cells.items()}
                table = format_runs_table(medians, label=f"{trace}/{scenario}/{profile} (median of {runs})")
                tables.append(table + (f"\ntargets met: {targets}" if targets else ""))
                print("\n" + tables[-1], flush=True)
                out["wall_s"] = time.monotonic() - started
                write_results(out, args.out)  # after every cell: a long run killed keeps what it measured
                write_plots(records, args.out, title=f"{trace} / {scenario} / {profile} (last run)",
                            workers=[f"engine{i}" for i in range(NUM_ENGINES)],
                            name=f"{trace}-{scenario}-{profile}.png")
    out["wall_s"] = time.monotonic() - started
    path = write_results(out, args.out)
    print("\n\n".join(tables))
    print("\n" + markdown_table(out["results"]))
    print(f"\nresults: {path} (wall {out['wall_s']:.0f} s)\nlogs: {log_root}")
    print(json.dumps({t: {s: {p: d.get("targets_met") for p, d in v.items()} for s, v in r.items()
                          if s not in ("trace_stats", "slice")} for t, r in out["results"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
