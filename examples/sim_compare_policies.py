"""Compare routing policies on a synthetic workload with the Python API.

Run: ``.venv/bin/python examples/sim_compare_policies.py`` (about 10 s).
Builds a small generated workload (shared system prompts, chats, agent loops),
replays it on 4 simulated workers with real prefix caches for three policies,
and prints hit ratio and TTFT for each.
"""

from tokenspeed_router.sim import (
    ClusterConfig,
    CostModel,
    WorkloadConfig,
    generate_workload,
    policy_metrics,
    run_policies,
)


def main() -> None:
    requests = generate_workload(WorkloadConfig(num_requests=400, seed=1, session_rate_per_s=1.5))
    cluster = ClusterConfig(num_workers=4, capacity_tokens=100_000, page_size=16,
                            cost=CostModel(prefill_tokens_per_s=10_000), event_delay_s=0.01)
    runs = run_policies(("round_robin", "kv_aware", "oracle"), requests, cluster,
                        router_options={"prefill_weight": 2.0, "predict_on_route_ttl_s": 15.0})
    for name, run in runs.items():
        m = policy_metrics(run)
        print(f"{name:<12} hit {m['hit_ratio']:6.1%}  TTFT p50 {m['ttft_p50_s']:.2f} s  "
              f"p99 {m['ttft_p99_s']:.2f} s  imbalance {m['load_imbalance']:.2f}")


if __name__ == "__main__":
    main()
