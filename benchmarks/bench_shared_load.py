"""Router replicas vs one router, same trace: what sharing in-flight work buys.

Run::

    .venv/bin/python benchmarks/bench_shared_load.py                 # 2,000 requests, 2 and 4 replicas
    .venv/bin/python benchmarks/bench_shared_load.py --trace conversation --requests 400 --json out.json

The simulator (``tokenspeed_router.sim``: real ``PrefixCache`` workers with
bounded caches and eviction, a FIFO prefill queue each, virtual time) replays
a Mooncake trace through several routing set-ups:

* **one router** — the reference: one ``Router`` sees every request;
* **N replicas, not shared** — requests split round-robin over N routers
  (as an L4 load balancer in front of N gateways would, request by
  request); each sees every KV event (active-active ingestion) but only its
  own in-flight work;
* **N replicas, load only** — each replica's real ``SharedLoad``
  (``state/load.py``) exchanges load totals, not route predictions;
* **N replicas, shared** — load totals and route predictions (the
  production default).

The replicas (``sim/replicas.py``, also behind ``simulate --replicas N``)
exchange the production messages (``SharedLoad.sync_now`` encodes,
``receive_now`` decodes and folds them into the peer view and the router's
predictions), carried by an in-memory bus on the trace's clock that delivers
each message ``--delay-ms`` after it was sent: 0 (the best sharing
can do), 2 ms (about Redis Pub/Sub's median on loopback plus the live
thread's 1 ms coalescing) and 15 ms (its tail; ``benchmarks/bench_flight.py``
measures both transports). A replica publishes on every change of its work.

Figures: TTFT p50/p99/mean, cache hit ratio and load imbalance (busiest
worker's prefill time over the mean), per set-up, from the simulator's own
report. Virtual time: the figures do not depend on this machine's speed.
First it prints the hot-path cost of sharing: CPU µs per ``route`` +
``release`` with and without a peer view (no Redis on that path).
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from pathlib import Path
from typing import Any

from harness import data_dir

from tokenspeed_router.router.router import Router, RouterConfig
from tokenspeed_router.router.scoring import WorkerLoad
from tokenspeed_router.sim.cluster import ClusterConfig, Simulator
from tokenspeed_router.sim.policies import RouterBackend
from tokenspeed_router.sim.replicas import ReplicaSet
from tokenspeed_router.sim.report import policy_metrics
from tokenspeed_router.sim.traces import TraceWindow, load_mooncake


class _StaticPeers:
    """A fixed peer view with SharedLoad's routing-thread costs (a mapping read, an Event.set)."""

    def __init__(self, workers: int) -> None:
        self.view = {f"w{i}": WorkerLoad(3, 1000, 5000) for i in range(workers)}
        self.event = threading.Event()

    def peers(self) -> dict[str, WorkerLoad]:
        return self.view

    def changed(self) -> None:  # as SharedLoad.changed (cleared by its sync thread, not here)
        if not self.event.is_set():
            self.event.set()


def route_cost(workers: int = 8, prompt_tokens: int = 1024, n: int = 2000) -> dict[str, float]:
    """CPU µs per route + release, with and without a peer view (best of 5, interleaved)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(100_000) for _ in range(prompt_tokens)] for _ in range(200)]

    def once(peers: _StaticPeers | None) -> float:
        router = Router(None, RouterConfig(), peer_load=peers)
        for i in range(workers):
            router.add_worker(f"w{i}")
        t0 = time.process_time()
        for j in range(n):
            router.release(router.route(prompts[j % len(prompts)]).request_id)
        return (time.process_time() - t0) / n * 1e6

    plain, shared = [], []
    for _ in range(5):
        plain.append(once(None))
        shared.append(once(_StaticPeers(workers)))
    return {"route_release_us": round(min(plain), 1), "with_peer_load_us": round(min(shared), 1),
            "ratio": round(min(shared) / min(plain), 3)}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    trace = data_dir("traces") / "mooncake" / f"{args.trace}_trace.jsonl"
    requests = load_mooncake(trace, TraceWindow(max_requests=args.requests, rate_scale=args.rate_scale))
    cluster = ClusterConfig(num_workers=args.workers, capacity_tokens=args.capacity_tokens, seed=1)
    rows: list[dict[str, Any]] = []
    setups: list[tuple[int, str | None, float]] = [(1, None, 0.0)]
    for n in args.replicas:
        setups += [(n, None, 0.0), (n, "load", args.delay_ms[0] / 1000)]
        setups += [(n, "all", ms / 1000) for ms in args.delay_ms]
    for k, (n, share, delay) in enumerate(setups):
        sim = Simulator(cluster)
        if n == 1:
            backend: Any = RouterBackend("kv_aware", cluster, sim)
            backend.name = "one router"
        else:
            backend = ReplicaSet(n, cluster, sim, share=share, delay_s=delay, run_id=f"bench{k}")
        t0 = time.perf_counter()
        result = sim.run(requests, backend)
        result.wall_s = time.perf_counter() - t0
        m = policy_metrics(result)
        rows.append({
            "setup": backend.name, "replicas": n, "shared": share,
            "delay_ms": delay * 1000 if share else None,
            "requests": m["requests"], "ttft_p50_s": round(m["ttft_p50_s"], 3),
            "ttft_p99_s": round(m["ttft_p99_s"], 3), "ttft_mean_s": round(m["ttft_mean_s"], 3),
            "hit_ratio": round(m["hit_ratio"], 4), "load_imbalance": round(m["load_imbalance"], 3),
            "messages": getattr(backend, "syncs", 0), "wall_s": round(result.wall_s, 1),
        })
        if isinstance(backend, ReplicaSet):
            backend.close()
        print(f"# {rows[-1]['setup']}: {result.wall_s:.1f}s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default="synthetic", choices=["synthetic", "conversation"])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--capacity-tokens", type=int, default=400_000)
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--delay-ms", "--staleness-ms", type=float, nargs="+", default=[2.0, 0.0, 15.0],
                        help="how late a replica's messages reach the others (trace time); the first "
                        "is also used for the load-only row")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    cost = route_cost()
    print(f"# hot path: route+release {cost['route_release_us']} us, with an 8-worker peer view "
          f"{cost['with_peer_load_us']} us (x{cost['ratio']})", flush=True)
    rows = run(args)
    cols = ["setup", "ttft_p50_s", "ttft_p99_s", "ttft_mean_s", "hit_ratio", "load_imbalance", "messages"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                         "route_cost": cost, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
