"""Global KV index and routing policies (pure: no I/O, never imports torch).

* :class:`KvIndex` — which worker holds which prefix blocks, fed by KV events.
* :class:`IndexIngestor` — folds subscriber items / recorded batches into the
  index and tracks each worker's lifecycle (live, resyncing, stale).
* :class:`RoutingCore` — the index, its ingestor and the router wired once:
  what ``serve``, ``simulate``, ``replay`` and the state backend all run.
* :class:`Router` — picks a worker, or a prefill/decode pair, per request by
  a cost that weighs uncached prefill work against load (:class:`RouterConfig`).
* :class:`RouteDecision` — its answer: the ``POST /route`` fields plus each
  worker's :class:`PrefixCredit` and the index's view from the one walk, and,
  when asked, a :class:`RouteExplanation` of every :class:`CandidateCost`.
"""

from tokenspeed_router.router.core import RoutingCore
from tokenspeed_router.router.decision import (
    CandidateCost,
    CreditSource,
    PrefixCredit,
    RouteDecision,
    RouteExplanation,
)
from tokenspeed_router.router.index import KvIndex, MatchDetail
from tokenspeed_router.router.ingest import IndexIngestor, WorkerState, WorkerStatus
from tokenspeed_router.router.router import (
    LoadProvider,
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
    "CandidateCost",
    "CreditSource",
    "IndexIngestor",
    "KvIndex",
    "LoadProvider",
    "MatchDetail",
    "Policy",
    "PrefixCredit",
    "RouteDecision",
    "RouteExplanation",
    "Router",
    "RouterConfig",
    "RouterStatistics",
    "RoutingCore",
    "WorkerInfo",
    "WorkerLoad",
    "WorkerRole",
    "WorkerState",
    "WorkerStatus",
]
