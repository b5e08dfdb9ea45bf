"""Routing decision latency: ``Router.route`` per policy, 8 and 64 workers, loaded index.

Run::

    .venv/bin/python benchmarks/bench_router.py            # full (~1 min)
    .venv/bin/python benchmarks/bench_router.py --quick    # smoke (~10 s)
    .venv/bin/python benchmarks/bench_router.py --json out.json

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
from collections import deque
from typing import Any

from tokenspeed_router.events.schema import BlockStored, KVEventBatch
from tokenspeed_router.router import KvIndex, Router, RouterConfig

BLOCK = 16
SEED = 20261129
IN_FLIGHT = 256
POLICIES = ("round_robin", "least_loaded", "kv_aware", "approx")


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


def queries(conversations: list[list[int]], length: int, n: int, rng: random.Random) -> list[list[int]]:
    out = []
    for _ in range(n):
        base = rng.choice(conversations)
        q = base[:length]
        if len(q) < length:
            q = q + make_tokens(rng, length - len(q))
        out.append(q)
    return out


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p / 100 * len(values)))]


def time_route(router: Router, qs: list[list[int]]) -> tuple[list[float], float]:
    window: deque[str] = deque()
    lat: list[float] = []
    perf = time.perf_counter
    t_start = perf()
    for q in qs:
        t0 = perf()
        d = router.route(q)
        lat.append(perf() - t0)
        window.append(d.request_id)
        if len(window) > IN_FLIGHT:
            router.release(window.popleft())
    elapsed = perf() - t_start
    return lat, len(qs) / elapsed


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
        print(f"# {num_workers} workers: {stored:,} stored blocks, built in {build_s:.1f}s", file=sys.stderr)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small index, fewer queries")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    rows = run(args.quick)
    header = ("workers", "tokens", "policy", "route_p50_us", "route_p99_us", "routes_per_s",
              "p50_vs_round_robin", "match_p50_us")
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
