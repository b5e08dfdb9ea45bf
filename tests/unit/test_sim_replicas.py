"""``simulate --replicas N``: router replicas in the simulator, sharing through the real messages.

Two replicas whose messages arrive at once decide exactly as one router
(same TTFTs, same hits: their requests reach each other one by one, so every
engine's queue clock, prediction and load is the same in both as in one
router, and the index both follow); with nothing shared they do not.
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
    m = policy_metrics(run_policy("kv_aware", requests, cluster, replicas=replicas))
    return {k: m[k] for k in ("ttft_p50_s", "ttft_p99_s", "ttft_mean_s", "hit_ratio")}


def test_replicas_sharing_instantly_decide_as_one_router() -> None:
    one = _metrics(None)
    assert _metrics(ReplicaOptions(2, 0.0, "all")) == one
    alone = _metrics(ReplicaOptions(2, 0.0, None))
    assert alone != one and alone["ttft_mean_s"] > one["ttft_mean_s"]
