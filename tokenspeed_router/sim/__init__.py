"""Simulated cluster and trace-driven evaluation of routing policies.

Workers are real (a :class:`~tokenspeed_router.cache.PrefixCache` each, with
finite pages and real KV events); only time is modelled (``cluster.py``).
Two modes share one event loop: *fast* (virtual clock, in-process router and
index, configurable event delay and loss) and *live* (real publishers and a
real ``tokenspeed-router serve`` on loopback, ``live.py``). Commands:
``tokenspeed-router simulate`` and ``tokenspeed-router demo``.
"""

from tokenspeed_router.sim.cluster import (
    ClusterConfig,
    CostModel,
    RouteChoice,
    RoutingBackend,
    RunResult,
    Simulator,
)
from tokenspeed_router.sim.policies import OracleBackend, RouterBackend, make_backend
from tokenspeed_router.sim.report import policy_metrics, results_document
from tokenspeed_router.sim.runner import run_policies, run_policy
from tokenspeed_router.sim.traces import (
    TokenSynthesizer,
    TraceRequest,
    TraceWindow,
    load_mooncake,
    trace_summary,
)
from tokenspeed_router.sim.workload import WorkloadConfig, generate_workload

__all__ = [
    "ClusterConfig",
    "CostModel",
    "OracleBackend",
    "RouteChoice",
    "RouterBackend",
    "RoutingBackend",
    "RunResult",
    "Simulator",
    "TokenSynthesizer",
    "TraceRequest",
    "TraceWindow",
    "WorkloadConfig",
    "generate_workload",
    "load_mooncake",
    "make_backend",
    "policy_metrics",
    "results_document",
    "run_policies",
    "run_policy",
    "trace_summary",
]
