"""Simulated cluster and trace-driven evaluation of routing policies.

Workers are real (a :class:`~tokenspeed_router.cache.PrefixCache` each, with
finite pages and real KV events); only time is modelled (``cluster.py``).
Two modes share one event loop: *fast* (virtual clock, in-process router and
index, configurable event delay and loss) and *live* (real publishers and a
real ``tokenspeed-router serve`` on loopback, ``live.py``). Commands:
``tokenspeed-router simulate`` and ``tokenspeed-router demo --sim`` (``demo.py``).
"""

from tokenspeed_router.sim.cluster import (
    ClusterConfig,
    CostModel,
    RunResult,
    Simulator,
)
from tokenspeed_router.sim.report import policy_metrics
from tokenspeed_router.sim.runner import run_policies, run_policy
from tokenspeed_router.sim.shapes import WorkloadConfig, generate_workload
from tokenspeed_router.sim.traces import (
    TraceRequest,
    TraceWindow,
    load_mooncake,
)

__all__ = [
    "ClusterConfig",
    "CostModel",
    "RunResult",
    "Simulator",
    "TraceRequest",
    "TraceWindow",
    "WorkloadConfig",
    "generate_workload",
    "load_mooncake",
    "policy_metrics",
    "run_policies",
    "run_policy",
]
