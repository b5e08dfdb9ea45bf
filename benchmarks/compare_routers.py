"""Our gateway against real routers, in front of the same engine-sims (issue 12).

Run: ``.venv/bin/python benchmarks/compare_routers.py [--quick] [--out DIR]``
(peers: ``pip install vllm-router sglang-router`` into the venv; they are not
project dependencies, and a router whose binary is missing is skipped with a
note). See docs/compare-routers.md for what is measured and the last results.

For each Mooncake trace (a time-scaled slice of both files in
``../shared/traces/mooncake``), each scenario and each router, on a *fresh*
fleet of engine-sims (cold caches, same seeds):

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
from tokenspeed_router.loadgen.replay import ReplayConfig, replay
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


def run_one(kind: RouterKind, scenario: str, requests: Sequence[TraceRequest], *, time_scale: float,
            log_dir: Path, progress: ProgressBar, python: str = sys.executable,
            router_options: Sequence[str] = ()) -> tuple[dict[str, Any], list[RequestRecord]]:
    engine = EngineSimOptions(capacity_tokens=12_500, prefill_tokens_per_s=2_500.0,
                              decode_s_per_token=0.02, time_scale=time_scale, model=MODEL)
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
        urls = [kind.start(RunContext(fleet=fleet, replica=i, time_scale=time_scale, redis=redis,
                                      router_options=tuple(router_options)), engines)
                for i in range(replicas)]
        builder = PromptBuilder(PromptConfig(model=MODEL, prompt_format=kind.prompt_format,
                                             max_output_tokens=MAX_OUTPUT_TOKENS))
        progress.start(f"{kind.name}/{scenario}")
        outcome = replay(requests, builder, ReplayConfig(target=urls[0], extra_targets=tuple(urls[1:])),
                         progress=progress)
    summary = summarize(outcome.records, wall_s=outcome.wall_s, workers=[e.name for e in engines])
    summary["max_send_lateness_s"] = outcome.max_send_lateness_s
    return summary, outcome.records


def _check_targets(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 12 targets for our row against the best peer in the same scenario."""
    ours = rows.get("tokenspeed")
    peers = {k: v for k, v in rows.items() if k in ("vllm-router", "sglang-router") and v.get("ok")}
    if not ours or not peers:
        return {}

    def best(key: str, low: bool) -> float:
        vals = [v[key] for v in peers.values() if v.get(key) is not None]
        return min(vals) if low else max(vals)

    out = {
        "ttft_p50": ours["ttft_p50_s"] is not None and ours["ttft_p50_s"] <= best("ttft_p50_s", True),
        "ttft_p99": ours["ttft_p99_s"] is not None and ours["ttft_p99_s"] <= best("ttft_p99_s", True),
        "hit": ours["hit_ratio"] is not None and ours["hit_ratio"] >= best("hit_ratio", False) - 0.01,
    }
    return out


def markdown_table(results: dict[str, Any]) -> str:
    """One markdown row per trace, scenario and router (what docs/compare-routers.md shows)."""
    lines = ["| trace | scenario | router | TTFT p50 (s) | TTFT p99 (s) | hit | spread | errors |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for trace, per_trace in results.items():
        for scenario, doc in per_trace.items():
            if scenario in ("trace_stats", "slice"):
                continue
            for router, m in doc["routers"].items():
                hit = "-" if m.get("hit_ratio") is None else f"{m['hit_ratio']:.1%}"
                p50 = "-" if m.get("ttft_p50_s") is None else f"{m['ttft_p50_s']:.3f}"
                p99 = "-" if m.get("ttft_p99_s") is None else f"{m['ttft_p99_s']:.3f}"
                spread = "-" if m.get("spread_max_over_mean") is None else f"{m['spread_max_over_mean']:.2f}"
                lines.append(f"| {trace} | {scenario} | {router} | {p50} | {p99} | {hit} | {spread} "
                             f"| {m.get('errors', 0)} |")
            met = doc.get("targets_met")
            if met:
                lines.append(f"| {trace} | {scenario} | *targets met* | {'yes' if met['ttft_p50'] else 'no'} "
                             f"| {'yes' if met['ttft_p99'] else 'no'} | {'yes' if met['hit'] else 'no'} | | |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/compare_routers"))
    parser.add_argument("--traces", default=",".join(TRACES), help="comma-separated: " + ",".join(TRACES))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--routers", default="tokenspeed,vllm-router,sglang-router")
    parser.add_argument("--baseline", action="store_true", help="also our round_robin")
    parser.add_argument("--groups", type=int, default=None,
                        help="prefix groups per trace slice (default: the slice's, 60)")
    parser.add_argument("--time-scale", type=float, default=4.0,
                        help="modelled seconds per wall second (engines and arrivals; default 4)")
    parser.add_argument("--quick", action="store_true", help="12 groups, one scenario (smoke run)")
    parser.add_argument("--router-option", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to our gateway (serve --router-option), for experiments")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter that runs engine-sim and serve (default: this one)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    exit_on_sigterm()
    groups = 12 if args.quick else args.groups
    scenarios = ["pressure"] if args.quick else [s for s in args.scenarios.split(",") if s]
    names = [r for r in args.routers.split(",") if r] + (["round_robin"] if args.baseline else [])
    kinds = []
    for name in names:
        kind = ROUTERS[name]
        why = kind.available()
        if why:
            print(f"skipping {name}: {why}", file=sys.stderr)
        else:
            kinds.append(kind)
    traces_dir = _shared_traces()
    out: dict[str, Any] = {"config": {"groups": groups, "time_scale": args.time_scale,
                                      "router_options": args.router_option,
                                      "engines": NUM_ENGINES, "prompt_scale": PROMPT_SCALE,
                                      "max_output_tokens": MAX_OUTPUT_TOKENS,
                                      "engine": "capacity 12.5k tokens (100k full-size), prefill 2.5k tok/s "
                                                "(20k full-size), decode 20 ms/token, block 16"},
                           "results": {}}
    log_root = Path(tempfile.mkdtemp(prefix="compare-routers-"))
    bar = ProgressBar()
    tables = []
    for trace in [t for t in args.traces.split(",") if t]:
        cut = TRACES[trace]
        full = load_mooncake(traces_dir / cut.file)
        requests = scale_prompts(sample_prefix_groups(
            full, prefix_blocks=cut.prefix_blocks, groups=groups or cut.groups, seed=cut.seed,
            speedup=cut.speedup * args.time_scale), PROMPT_SCALE)
        stats = trace_summary(requests)
        out["results"].setdefault(trace, {"trace_stats": stats, "slice": asdict(cut)})
        for scenario in scenarios:
            rows: dict[str, dict[str, Any]] = {}
            records: dict[str, list[RequestRecord]] = {}
            for kind in kinds:
                rows[kind.name], records[kind.name] = run_one(
                    kind, scenario, requests, time_scale=args.time_scale,
                    log_dir=log_root / trace / scenario / kind.name, progress=bar,
                    python=args.python, router_options=args.router_option)
            targets = _check_targets(rows)
            out["results"][trace][scenario] = {"routers": rows, "targets_met": targets}
            table = format_runs_table(rows, label=f"{trace}/{scenario}")
            tables.append(table + (f"\ntargets met: {targets}" if targets else ""))
            print("\n" + tables[-1], flush=True)
            write_results(out, args.out)  # after every scenario: a long run killed keeps what it measured
            write_plots(records, args.out, title=f"{trace} / {scenario}",
                        workers=[f"engine{i}" for i in range(NUM_ENGINES)], name=f"{trace}-{scenario}.png")
    path = write_results(out, args.out)
    print("\n\n".join(tables))
    print("\n" + markdown_table(out["results"]))
    print(f"\nresults: {path}\nlogs: {log_root}")
    print(json.dumps({t: {s: v.get("targets_met") for s, v in r.items() if s not in ("trace_stats", "slice")}
                      for t, r in out["results"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
