"""Benchmark the worker-side PrefixCache: match / insert / evict / admit, events on vs off.

Run:
    .venv/bin/python benchmarks/bench_cache.py            # 100k pages, page size 16 and 64
    .venv/bin/python benchmarks/bench_cache.py --quick    # 10k pages, a few seconds
    .venv/bin/python benchmarks/bench_cache.py --json out.json

Workload (fixed seed): requests are one of 64 shared "system prompts" (256 to
2048 tokens, Zipf-weighted) followed by a unique user part (64 to 1024 tokens),
so matches walk real radix paths and nodes split. Cases, per page size:

* ``insert``: ``insert(tokens)`` of unique requests into an empty cache
  (allocation + node creation + hashing + events), pages/s;
* ``match``: ``match_prefix`` of cached requests on a warm cache, pages/s;
* ``evict``: evicting the full cache in 1%-sized calls, pages/s;
* ``admit``: ``admit`` of the whole workload on a cache 4x smaller than the
  workload (so it evicts constantly), requests/s, with KV events off
  (baseline), on, and on with the allocator's free-validation off. The
  "x vs events off" column is the ratio in the same run: the cost of emitting
  events (chained hashing + event structs) is that ratio minus one.

Each timed case is repeated (best of ``--repeat``), timed in process CPU
seconds with torch limited to one thread; figures are CPU-only torch.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from tokenspeed_router.cache import PrefixCache

#: CPU time of this process: the benchmark runs single-threaded (torch too), and
#: CPU time is far less disturbed than wall time by other load on the machine.
_clock = time.process_time


@dataclass
class Row:
    case: str
    page_size: int
    num_pages: int
    ops: int
    pages: int
    best_s: float
    ops_per_s: float
    pages_per_s: float
    ratio_vs_baseline: float | None = None


def make_workload(num_requests: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 128_000, int(rng.integers(256, 2049))) for _ in range(64)]
    weights = 1.0 / np.arange(1, 65) ** 1.1
    weights /= weights.sum()
    picks = rng.choice(64, size=num_requests, p=weights)
    out = []
    for pick in picks:
        tail = rng.integers(0, 128_000, int(rng.integers(64, 1025)))
        out.append(np.concatenate([systems[pick], tail]).tolist())
    return out


def best_of(repeat: int, setup: Callable[[], object], run: Callable[[object], int]) -> tuple[float, int]:
    """Min wall time of ``run(setup())`` over ``repeat`` runs; returns (seconds, pages)."""
    best = float("inf")
    pages = 0
    for _ in range(repeat):
        state = setup()
        t0 = _clock()
        pages = run(state)
        best = min(best, _clock() - t0)
    return best, pages


def bench_page_size(page_size: int, num_pages: int, requests: list[list[int]], repeat: int) -> list[Row]:
    rows: list[Row] = []
    total_pages_needed = sum(len(r) // page_size for r in requests)

    def fresh(events: bool = True, checks: bool = True, pages: int = num_pages) -> PrefixCache:
        return PrefixCache.with_capacity(
            pages,
            page_size=page_size,
            enable_kv_cache_events=events,
            max_context_len=max(len(r) for r in requests) + page_size,
            debug_checks=checks,
        )

    # insert: as many unique requests as fit in the cache, into an empty cache.
    fit: list[list[int]] = []
    used = 0
    for r in requests:
        n = len(r) // page_size
        if used + n > num_pages:
            break
        fit.append(r)
        used += n

    def run_insert(cache: object) -> int:
        assert isinstance(cache, PrefixCache)
        for r in fit:
            cache.insert(r)
        cache.take_events()
        return cache.total_size() // page_size

    secs, pages = best_of(repeat, fresh, run_insert)
    rows.append(Row("insert", page_size, num_pages, len(fit), pages, secs, len(fit) / secs, pages / secs))

    warm = fresh()
    run_insert(warm)

    def run_match(cache: object) -> int:
        assert isinstance(cache, PrefixCache)
        hit = 0
        for r in fit:
            hit += cache.match_prefix(r).device_prefix_length
        return hit // page_size

    secs, pages = best_of(repeat, lambda: warm, run_match)
    rows.append(Row("match", page_size, num_pages, len(fit), pages, secs, len(fit) / secs, pages / secs))

    def full_cache() -> PrefixCache:
        cache = fresh()
        run_insert(cache)
        return cache

    step = max(1, num_pages // 100) * page_size

    def run_evict(cache: object) -> int:
        assert isinstance(cache, PrefixCache)
        calls = 0
        evicted = 0
        while cache.evictable_size():
            evicted += cache.evict(step)
            calls += 1
        cache.take_events()
        return evicted // page_size

    secs, pages = best_of(repeat, full_cache, run_evict)
    rows.append(Row("evict", page_size, num_pages, 100, pages, secs, 100 / secs, pages / secs))

    # admit under pressure: the cache holds a quarter of what the workload needs.
    small = max(64, total_pages_needed // 4)

    def run_admit(cache: object) -> int:
        assert isinstance(cache, PrefixCache)
        for r in requests:
            cache.admit(r)
            cache.take_events()
        return sum(len(r) for r in requests) // page_size

    variants = [
        ("admit events=off", dict(events=False, checks=True)),
        ("admit events=on", dict(events=True, checks=True)),
        ("admit events=on checks=off", dict(events=True, checks=False)),
    ]
    timings: dict[str, float] = {name: float("inf") for name, _ in variants}
    pages = 0
    for _ in range(repeat):  # interleave variants so machine noise hits all alike
        for name, kw in variants:
            cache = fresh(pages=small, **kw)
            t0 = _clock()
            pages = run_admit(cache)
            timings[name] = min(timings[name], _clock() - t0)
    base = timings["admit events=off"]
    for name, _ in variants:
        secs = timings[name]
        rows.append(
            Row(name, page_size, small, len(requests), pages, secs, len(requests) / secs, pages / secs, secs / base)
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, seconds")
    parser.add_argument("--num-pages", type=int, default=None, help="pages per cache (default 100000)")
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--requests", type=int, default=None, help="requests in the workload")
    parser.add_argument("--repeat", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    num_pages = args.num_pages or (10_000 if args.quick else 100_000)
    num_requests = args.requests or (200 if args.quick else 2000)
    repeat = args.repeat or (3 if args.quick else 5)
    torch.set_num_threads(1)
    requests = make_workload(num_requests, args.seed)
    warmup = PrefixCache.with_capacity(256, page_size=16)  # first torch calls pay lazy init
    for r in make_workload(8, args.seed + 1):
        warmup.admit(r)
    print(
        f"# bench_cache: {num_requests} requests ({sum(map(len, requests)) / len(requests):.0f} tokens avg), "
        f"seed {args.seed}, best of {repeat}; python {platform.python_version()}, torch {torch.__version__}"
    )
    print(f"{'case':<28} {'page':>4} {'capacity':>8} {'ops':>6} {'cpu s':>8} {'ops/s':>10} {'pages/s':>11} {'x vs events off':>15}")
    rows: list[Row] = []
    for page_size in args.page_sizes:
        for row in bench_page_size(page_size, num_pages, requests, repeat):
            rows.append(row)
            ratio = "" if row.ratio_vs_baseline is None else f"{row.ratio_vs_baseline:.2f}"
            print(
                f"{row.case:<28} {row.page_size:>4} {row.num_pages:>8} {row.ops:>6} {row.best_s:>8.3f} "
                f"{row.ops_per_s:>10.1f} {row.pages_per_s:>11.0f} {ratio:>15}"
            )
            sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
