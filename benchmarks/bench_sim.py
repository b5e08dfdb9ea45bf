"""Fast-mode simulator throughput: simulated requests per wall second, per policy.

Run: ``.venv/bin/python benchmarks/bench_sim.py [--quick]``. Fixed seed; the
baseline is round_robin measured in the same run (it never touches the index),
so the ratios show what the index, the event path and the oracle's probes cost.
"""

from __future__ import annotations

import argparse
import time

from tokenspeed_router.sim import ClusterConfig, WorkloadConfig, generate_workload, run_policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="300 requests instead of 3000")
    args = parser.parse_args()
    n = 300 if args.quick else 3000
    requests = generate_workload(WorkloadConfig(num_requests=n, seed=0, session_rate_per_s=2.0))
    tokens = sum(r.input_length for r in requests)
    cluster = ClusterConfig(num_workers=8, capacity_tokens=400_000, page_size=16,
                            event_delay_s=0.01, seed=0)
    print(f"{n} requests, {tokens / 1e6:.1f} M prompt tokens, 8 workers, page 16")
    run_policy("kv_aware", requests[:20], cluster)  # warm-up: imports torch, the cache, the index
    base = None
    for policy in ("round_robin", "least_loaded", "approx", "kv_aware", "oracle"):
        t0 = time.perf_counter()
        run_policy(policy, requests, cluster)
        wall = time.perf_counter() - t0
        base = base or wall
        print(f"{policy:<13} {wall:7.2f} s  {n / wall:8.0f} req/s  {tokens / wall / 1e6:6.2f} M tok/s"
              f"  x{wall / base:.2f} of round_robin")


if __name__ == "__main__":
    main()
