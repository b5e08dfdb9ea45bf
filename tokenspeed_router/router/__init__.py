"""Global KV index and routing policies (pure: no I/O, never imports torch).

* :class:`KvIndex` — which worker holds which prefix blocks, fed by KV events.
* :class:`IndexIngestor` — folds subscriber items / recorded batches into the
  index and tracks each worker's lifecycle (live, resyncing, stale).
* :class:`Router` — picks a worker, or a prefill/decode pair, per request by
  a cost that weighs uncached prefill work against load (:class:`RouterConfig`).
"""

from tokenspeed_router.router.index import KvIndex, MatchDetail
from tokenspeed_router.router.ingest import IndexIngestor, WorkerState, WorkerStatus
from tokenspeed_router.router.router import (
    LoadProvider,
    RouteDecision,
    Router,
    RouterConfig,
    RouterStatistics,
    WorkerInfo,
    WorkerRole,
)
from tokenspeed_router.router.scoring import Policy, WorkerLoad

#: Policy names accepted by ``RouterConfig(policy=...)``.
POLICY_NAMES: tuple[str, ...] = tuple(p.value for p in Policy)

__all__ = [
    "POLICY_NAMES",
    "IndexIngestor",
    "KvIndex",
    "LoadProvider",
    "MatchDetail",
    "Policy",
    "RouteDecision",
    "Router",
    "RouterConfig",
    "RouterStatistics",
    "WorkerInfo",
    "WorkerLoad",
    "WorkerRole",
    "WorkerState",
    "WorkerStatus",
]
