"""Routing decision latency: ``Router.route`` per policy, 8 and 64 workers, loaded index.

Run::

    .venv/bin/python benchmarks/bench_router.py            # full (~1 min)
    .venv/bin/python benchmarks/bench_router.py --quick    # smoke (~10 s)
    .venv/bin/python benchmarks/bench_router.py --json out.json
    .venv/bin/python benchmarks/bench_router.py --trace conversation --requests 2000

``--trace`` replays the head of a Mooncake trace through every policy instead
(see :func:`replay_trace`): routing quality, not speed. The repository ships the
first 400 conversation / 200 synthetic rows (``tests/data/traces``); point
``TOKENSPEED_SHARED`` at a folder holding the whole traces (``traces/mooncake/``)
for longer runs. The ``requests`` column says how many rows were replayed.

Workload (fixed seed): block size 16; a few 512-token system prompts; every
worker holds conversations of 1k-16k tokens that start with one of them,
stored through ``KvIndex.apply`` as BlockStored events. Queries are the next
turn of a stored conversation (a long cached prefix on one worker, the
system prompt on many) at 1k/8k/32k tokens. The router keeps a window of 256
requests in flight (the oldest is released as each new one is routed), so the
load terms and the in-flight table are exercised as in a busy server.

Reported per (workers, policy, query length): ``route`` p50/p99 in µs,
routes/s, and the ratio to ``round_robin`` measured in the same run (the
cache-blind floor: no hashing, no index). ``match_detail`` alone is reported
too, so the router's own overhead is ``route - match``. The index and the
queries are moved out of the garbage collector's reach (``gc.freeze``), as
they would be old-generation objects in a long-running server.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from typing import Any

from tokenspeed_router.bench.cli_bench import IN_FLIGHT, POLICIES, time_routes
from tokenspeed_router.events.schema import BlockStored, KVEventBatch
from tokenspeed_router.percentiles import percentile as pct
from tokenspeed_router.router import KvIndex, Router, RouterConfig
from tokenspeed_router.sim.trace_replay import TraceReplay, replay_trace

BLOCK = 16
SEED = 20261129


def make_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 150_000) for _ in range(n)]


def build_index(
    num_workers: int, convs_per_worker: int, rng: random.Random
) -> tuple[KvIndex, list[list[int]]]:
    """Fill an index with per-worker conversations; return it and the conversations."""
    index = KvIndex()
    systems = [make_tokens(rng, 512) for _ in range(4)]
    conversations: list[list[int]] = []
    ext = 1
    for w in range(num_workers):
        worker = f"w{w}"
        events = []
        for _ in range(convs_per_worker):
            length = rng.choice((1024, 2048, 4096, 8192, 16384))
            tokens = rng.choice(systems) + make_tokens(rng, length - 512)
            conversations.append(tokens)
            n_blocks = len(tokens) // BLOCK
            ids = list(range(ext, ext + n_blocks))
            ext += n_blocks
            events.append(
                BlockStored(
                    block_hashes=ids,
                    parent_block_hash=None,
                    token_ids=tokens[: n_blocks * BLOCK],
                    block_size=BLOCK,
                )
            )
        for i in range(0, len(events), 64):
            index.apply(worker, KVEventBatch(ts=0.0, events=events[i : i + 64]))
    return index, conversations


def queries(
    conversations: list[list[int]], length: int, n: int, rng: random.Random
) -> list[list[int]]:
    out = []
    for _ in range(n):
        base = rng.choice(conversations)
        q = base[:length]
        if len(q) < length:
            q = q + make_tokens(rng, length - len(q))
        out.append(q)
    return out


def time_route(router: Router, qs: list[list[int]]) -> tuple[list[float], float]:
    t0 = time.perf_counter()
    lat = time_routes(router, qs, in_flight=IN_FLIGHT)
    return lat, len(qs) / (time.perf_counter() - t0)


def run(quick: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    lengths = (1024, 8192) if quick else (1024, 8192, 32768)
    n_queries = 300 if quick else 2000
    for num_workers in (8, 64):
        rng = random.Random(SEED + num_workers)
        convs = (8 if quick else 40) if num_workers == 8 else (2 if quick else 8)
        t0 = time.perf_counter()
        index, conversations = build_index(num_workers, convs, rng)
        build_s = time.perf_counter() - t0
        stored = index.num_blocks()
        print(
            f"# {num_workers} workers: {stored:,} stored blocks, built in {build_s:.1f}s",
            file=sys.stderr,
        )
        for length in lengths:
            qs = queries(conversations, length, n_queries, random.Random(SEED + length))
            # A long-running server's index is old-generation garbage-collector
            # state; freeze it (and the prebuilt queries) so a full collection
            # does not walk millions of ints inside the timed loop.
            gc.collect()
            gc.freeze()
            match_lat = []
            for q in qs[: n_queries // 2]:
                t1 = time.perf_counter()
                index.match_detail(q)
                match_lat.append(time.perf_counter() - t1)
            base_p50 = None
            for policy in POLICIES:
                config = RouterConfig(policy=policy, request_id_prefix="b", seed=SEED)
                router = Router(index if policy != "approx" else None, config, clock=time.monotonic)
                for w in range(num_workers):
                    router.add_worker(f"w{w}")
                time_route(router, qs[:50])  # warm-up (fills approx memory too)
                lat, rps = time_route(router, qs)
                p50, p99 = pct(lat, 50) * 1e6, pct(lat, 99) * 1e6
                if policy == "round_robin":
                    base_p50 = p50
                rows.append(
                    {
                        "workers": num_workers,
                        "stored_blocks": stored,
                        "tokens": length,
                        "policy": policy,
                        "route_p50_us": round(p50, 1),
                        "route_p99_us": round(p99, 1),
                        "routes_per_s": round(rps),
                        "p50_vs_round_robin": round(p50 / base_p50, 1) if base_p50 else None,
                        "match_p50_us": round(statistics.median(match_lat) * 1e6, 1),
                    }
                )
    return rows


def summarise_replay(result: TraceReplay) -> dict[str, float]:
    """The figures the policy table prints for one trace replay."""
    return {
        "hit_ratio": result.hit_tokens / result.prompt_tokens,
        "ttft_mean_s": statistics.mean(result.ttft_s),
        "ttft_p50_s": pct(result.ttft_s, 50),
        "ttft_p99_s": pct(result.ttft_s, 99),
        "busiest_over_mean_work": result.busiest_over_mean_work(),
    }


TRACE_POLICIES: dict[str, dict[str, Any]] = {
    "random": {"policy": "random"},
    "round_robin": {"policy": "round_robin"},
    "least_loaded": {"policy": "least_loaded"},
    "approx": {"policy": "approx"},
    "prefix_only": {"queue_weight": 0.0, "decode_weight": 0.0},
    "previous_defaults": {"prefill_weight": 1.0, "predict_on_route_ttl_s": 0.0},
    "kv_aware": {},
}


def run_trace(trace: str, num_requests: int, num_workers: int) -> list[dict[str, Any]]:
    import os
    from pathlib import Path

    default = Path(__file__).resolve().parents[1] / "tests" / "data"
    root = Path(os.environ.get("TOKENSPEED_SHARED") or default)
    path = root / "traces" / "mooncake" / f"{trace}_trace.jsonl"
    with path.open() as f:
        rows = [json.loads(line) for _, line in zip(range(num_requests), f, strict=False)]
    out = []
    for label, options in TRACE_POLICIES.items():
        config = RouterConfig(request_id_prefix="t", seed=SEED, **options)
        t0 = time.perf_counter()
        res = summarise_replay(replay_trace(rows, config, num_workers=num_workers))
        res = {k: round(v, 3) for k, v in res.items()}
        out.append(
            {"trace": trace, "requests": len(rows), "workers": num_workers, "policy": label, **res}
        )
        print(f"# {label}: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small index, fewer queries")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument(
        "--trace", choices=("conversation", "synthetic"), help="policy replay instead"
    )
    parser.add_argument("--requests", type=int, default=2000, help="trace rows to replay")
    parser.add_argument("--workers", type=int, default=8, help="workers for --trace")
    args = parser.parse_args(argv)
    header: tuple[str, ...]
    if args.trace:
        rows = run_trace(args.trace, args.requests, args.workers)
        header = (
            "trace",
            "requests",
            "workers",
            "policy",
            "hit_ratio",
            "ttft_mean_s",
            "ttft_p50_s",
            "ttft_p99_s",
            "busiest_over_mean_work",
        )
    else:
        rows = run(args.quick)
        header = (
            "workers",
            "tokens",
            "policy",
            "route_p50_us",
            "route_p99_us",
            "routes_per_s",
            "p50_vs_round_robin",
            "match_p50_us",
        )
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for row in rows:
        print(" | ".join(str(row[h]) for h in header))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
