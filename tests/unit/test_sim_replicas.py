"""``simulate --replicas N``: router replicas in the simulator, sharing through the real messages.

Two replicas whose messages arrive at once decide exactly as one router
(same TTFTs, same hits: load totals and route predictions are all a router
knows besides the index, which both follow); with nothing shared they do not.
"""

from __future__ import annotations

from support import traces_dir

from tokenspeed_router.sim.cluster import ClusterConfig
from tokenspeed_router.sim.report import policy_metrics
from tokenspeed_router.sim.runner import ReplicaOptions, run_policy
from tokenspeed_router.sim.traces import TraceWindow, load_mooncake


def _metrics(replicas: ReplicaOptions | None) -> dict[str, float]:
    requests = load_mooncake(traces_dir() / "mooncake" / "synthetic_trace.jsonl", TraceWindow(max_requests=80))
    cluster = ClusterConfig(num_workers=4, capacity_tokens=200_000, seed=1)
    # Cost model v1: replicas share load totals and route predictions, which is all v1 knows;
    # v2's per-engine queue clocks are not shared, so replicas under v2 only approximate one router.
    m = policy_metrics(run_policy("kv_aware", requests, cluster, replicas=replicas,
                                  router_options={"cost_model": "v1"}))
    return {k: m[k] for k in ("ttft_p50_s", "ttft_p99_s", "ttft_mean_s", "hit_ratio")}


def test_replicas_sharing_instantly_decide_as_one_router() -> None:
    one = _metrics(None)
    assert _metrics(ReplicaOptions(2, 0.0, "all")) == one
    alone = _metrics(ReplicaOptions(2, 0.0, None))
    assert alone != one and alone["ttft_mean_s"] > one["ttft_mean_s"]
