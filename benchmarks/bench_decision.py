"""What one routing decision costs the gateway: one index walk instead of two.

Run (under the bench lock on a shared machine)::

    flock /tmp/tsr-bench.lock .venv/bin/python benchmarks/bench_decision.py            # ~1 min
    flock /tmp/tsr-bench.lock .venv/bin/python benchmarks/bench_decision.py --quick    # smoke
    .venv/bin/python benchmarks/bench_decision.py --route-only --json out.json          # Router.route alone

Workload: ``bench_router.py``'s (fixed seed, block size 16, 8 workers holding
1k-16k-token conversations that start with one of four 512-token system
prompts, fed through ``KvIndex.apply``); queries are 1k-token next turns of a
stored conversation, 256 requests kept in flight.

Rows, each the median µs per call over the queries, repeated ``--repeats``
times (median and min-max of the repeats reported). Every mode answers every
query in turn, each with its own router over the same index, so machine
noise hits all rows alike:

* ``route`` — ``Router.route`` as the hot path calls it (no explanation);
* ``route_explain`` — ``Router.route(..., explain=True)`` (what a
  ``x-tokenspeed-explain`` request will cost);
* ``gateway_two_walks`` — the gateway's old seam: ``RouterService.match``
  for the prediction, then ``RouterService.route``: two index walks;
* ``gateway_one_walk`` — ``RouterService.route`` alone: the decision carries
  the index's view (``RouteDecision.index_match``), one walk.

``--baseline-router FILE`` adds ``route_baseline``: another version's
``router/router.py`` (``git show main:tokenspeed_router/router/router.py >
/tmp/router_main.py``) loaded beside this one, over the same index, its
``route`` timed query by query with this version's, so the two are compared
in the same process and run. ``--route-only`` skips the service rows (and
uses nothing but the API older versions also have, for a run with
``PYTHONPATH`` pointing at another checkout's package).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from bench_router import SEED, build_index, queries

from tokenspeed_router.bench.cli_bench import IN_FLIGHT
from tokenspeed_router.router import Router, RouterConfig

WORKERS = 8
TOKENS = 1024


def _median_us(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e6


class _Mode:
    """One way of making the decision, with its own in-flight window (``IN_FLIGHT`` kept)."""

    def __init__(self, call: Callable[[list[int], str], Any], release: Callable[[str], Any], tag: str) -> None:
        self.call, self.release, self.tag = call, release, tag
        self.window: deque[str] = deque()
        self.seconds: list[float] = []

    def step(self, i: int, q: list[int]) -> None:
        rid = f"{self.tag}{i}"
        t0 = time.perf_counter()
        self.call(q, rid)
        self.seconds.append(time.perf_counter() - t0)
        self.window.append(rid)
        if len(self.window) > IN_FLIGHT:
            self.release(self.window.popleft())


def _router(index: Any, tag: str, module: Any = None) -> Any:
    router_type, config_type = (Router, RouterConfig) if module is None else (module.Router, module.RouterConfig)
    router = router_type(index, config_type(request_id_prefix=tag, seed=SEED), clock=time.monotonic)
    for w in range(WORKERS):
        router.add_worker(f"w{w}")
    return router


def load_baseline(path: str) -> Any:
    """Another version's ``router/router.py``, loaded beside this one (same scoring, index, hashing)."""
    spec = importlib.util.spec_from_file_location("baseline_router", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_router"] = module
    spec.loader.exec_module(module)
    return module


def _modes(index: Any, rep: int, route_only: bool, baseline: Any) -> tuple[dict[str, _Mode], list[Any]]:
    """The rows' modes: each its own router (or service) over the same loaded index."""
    plain = _router(index, f"r{rep}")
    modes = {"route": _Mode(lambda q, rid: plain.route(q, request_id=rid), plain.release, "r")}
    if baseline is not None:
        base = _router(index, f"o{rep}", baseline)
        modes["route_baseline"] = _Mode(lambda q, rid: base.route(q, request_id=rid), base.release, "o")
    services: list[Any] = []
    if route_only:
        return modes, services
    from tokenspeed_router.server import RouterService, ServerConfig

    explained = _router(index, f"e{rep}")
    modes["route_explain"] = _Mode(lambda q, rid: explained.route(q, request_id=rid, explain=True),
                                   explained.release, "e")
    two, one = RouterService(ServerConfig(http=None)), RouterService(ServerConfig(http=None))
    for service in (two, one):
        with service.locked():
            service.replace_index(index)  # the same loaded index, behind each service's locks
        services.append(service)

    def two_walks(q: list[int], rid: str) -> None:
        two.match(q)  # the old gateway seam: a prediction of its own, then the decision
        two.route(q, request_id=rid)

    modes["gateway_two_walks"] = _Mode(two_walks, two.release, "a")
    modes["gateway_one_walk"] = _Mode(lambda q, rid: one.route(q, request_id=rid), one.release, "b")
    return modes, services


def run(num_queries: int, repeats: int, route_only: bool, baseline: Any = None) -> dict[str, Any]:
    """Every mode answers every query in turn (rotating who goes first), so drift hits all alike."""
    rng = random.Random(SEED + WORKERS)
    index, conversations = build_index(WORKERS, 40 if num_queries > 500 else 8, rng)
    qs = queries(conversations, TOKENS, num_queries, random.Random(SEED + TOKENS))
    gc.collect()
    gc.freeze()
    rows: dict[str, list[float]] = {}
    for rep in range(repeats):
        modes, services = _modes(index, rep, route_only, baseline)
        order = list(modes.values())
        for i, q in enumerate(qs[:50]):  # warm-up
            for mode in order:
                mode.step(-1 - i, q)
        for mode in order:
            mode.seconds.clear()
        for i, q in enumerate(qs):
            k = i % len(order)
            for mode in order[k:] + order[:k]:
                mode.step(i, q)
        for name, mode in modes.items():
            rows.setdefault(name, []).append(_median_us(mode.seconds))
        for service in services:
            service.stop()
    import tokenspeed_router

    out: dict[str, Any] = {"package": tokenspeed_router.__file__, "workers": WORKERS, "tokens": TOKENS,
                           "queries": num_queries, "repeats": repeats, "stored_blocks": index.num_blocks(),
                           "rows": {}}
    for name, values in rows.items():
        out["rows"][name] = {"median_us": round(statistics.median(values), 1),
                             "min_us": round(min(values), 1), "max_us": round(max(values), 1),
                             "repeats_us": [round(v, 1) for v in values]}
    pairs = []
    if baseline is not None:
        pairs.append(("route_vs_baseline", "route", "route_baseline"))
    if not route_only:
        pairs += [("route_explain_vs_route", "route_explain", "route"),
                  ("gateway_one_walk_vs_two_walks", "gateway_one_walk", "gateway_two_walks")]
    out["ratios"] = {}
    for name, a, b in pairs:  # per repeat (same run, same queries), then median and min-max
        per = [x / y for x, y in zip(rows[a], rows[b], strict=True)]
        out["ratios"][name] = {"median": round(statistics.median(per), 3), "min": round(min(per), 3),
                               "max": round(max(per), 3)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="300 queries (smoke)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--route-only", action="store_true", help="the Router.route row alone")
    parser.add_argument("--baseline-router", metavar="FILE",
                        help="another version's router/router.py, timed beside this one (row route_baseline)")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    baseline = load_baseline(args.baseline_router) if args.baseline_router else None
    result = run(300 if args.quick else 2000, args.repeats, args.route_only, baseline)
    for name, row in result["rows"].items():
        print(f"{name:20s} median {row['median_us']:8.1f} us  (min {row['min_us']:.1f}, max {row['max_us']:.1f}, "
              f"{result['repeats']} repeats, {WORKERS} workers, {TOKENS}-token prompts)")
    for name, ratio in result["ratios"].items():
        print(f"{name:32s} {ratio['median']:.2f}  (min {ratio['min']:.2f}, max {ratio['max']:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
