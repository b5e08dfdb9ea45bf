"""Routing section of ``tokenspeed-router bench``: ``Router.route`` latency per policy.

Found by ``router/bench.py`` through ``OPTIONAL_SECTIONS``: it calls
:func:`bench_section` with the index already loaded by the KvIndex sections
(~1M stored blocks by default) and the same continuation queries, so the
figures are for a realistic index, not an empty one.

Each policy routes every query while keeping ``IN_FLIGHT`` requests in flight
(the oldest is released as each new one is routed), so the load terms and the
in-flight table work as in a busy server. Reported per policy and query
length: p50/p99 in µs, and the p50 ratio to ``round_robin`` (the cache-blind
floor: no hashing, no index) measured in the same run. ``kv_aware`` minus
``match_detail`` alone is the router's own overhead.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from tokenspeed_router.router.router import Router, RouterConfig

__all__ = ["IN_FLIGHT", "POLICIES", "bench_section", "percentile", "time_routes"]

IN_FLIGHT = 256
POLICIES = ("round_robin", "least_loaded", "kv_aware", "approx")


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (``p`` in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def time_routes(
    router: Router, queries: Sequence[Any], *, in_flight: int = IN_FLIGHT
) -> list[float]:
    """Seconds per ``route`` call, keeping ``in_flight`` requests outstanding."""
    window: deque[str] = deque()
    out: list[float] = []
    perf = time.perf_counter
    for q in queries:
        t0 = perf()
        decision = router.route(q)
        out.append(perf() - t0)
        window.append(decision.request_id)
        if len(window) > in_flight:
            router.release(window.popleft())
    return out


def bench_section(ctx: Any) -> dict[str, Any]:
    """Route latency per policy over ``ctx.index`` and the continuation queries."""
    index = ctx.index
    names = list(ctx.workload.names)
    queries: dict[int, list[list[int]]] = ctx.workload.queries["continuation"]
    repeat = max(1, int(getattr(ctx.args, "repeat", 1) or 1))
    seed = int(getattr(ctx.args, "seed", 0) or 0)
    result: dict[str, Any] = {"in_flight": IN_FLIGHT}
    for length, qs in sorted(queries.items()):
        if not qs:
            continue
        match_s = []
        for _ in range(repeat):
            for q in qs:
                t0 = time.perf_counter()
                index.match_detail(q)
                match_s.append(time.perf_counter() - t0)
        row: dict[str, Any] = {"match_detail_p50_us": round(percentile(match_s, 50) * 1e6, 1)}
        base = None
        for policy in POLICIES:
            config = RouterConfig(policy=policy, seed=seed, request_id_prefix="bench")
            router = Router(index if policy != "approx" else None, config)
            for name in names:
                router.add_worker(name)
            time_routes(router, qs)  # warm-up; also fills the approx memory
            lat = [t for _ in range(repeat) for t in time_routes(router, qs)]
            p50 = percentile(lat, 50) * 1e6
            base = p50 if policy == "round_robin" else base
            row[policy] = {
                "p50_us": round(p50, 1),
                "p99_us": round(percentile(lat, 99) * 1e6, 1),
                "p50_vs_round_robin": round(p50 / base, 1) if base else None,
            }
        result[f"{length}_tokens"] = row
    return result
