"""The public surface is pinned: adding or dropping an export is a deliberate change here.

Each subpackage's ``__all__`` is what DESIGN.md names (its Python API, §5)
plus what users of the commands and the embedding API need (the types their
calls take and return). Internals stay importable from their modules, never
from the package. Like Trio's ``test_exports``: the package namespace holds
exactly ``__all__`` plus its submodules, so an accidental import cannot widen it.
"""

from __future__ import annotations

import importlib
import types

import pytest

import tokenspeed_router

EXPORTS: dict[str, list[str]] = {
    "tokenspeed_router.cache": [
        "BatchPublisher",
        "CacheInitParams",
        "CacheStatistics",
        "EVICTION_POLICIES",
        "EvictionPolicy",
        "EvictionStrategy",
        "KvEventSink",
        "MatchResult",
        "PageAccounting",
        "PagedKVAllocator",
        "PrefixCache",
        "Req",
        "ReqToTokenPool",
        "TreeNode",
        "make_eviction_strategy",
    ],
    "tokenspeed_router.doctor": ["CHECK_NAMES", "Check", "DoctorReport", "EngineReport"],
    "tokenspeed_router.engine_sim": [
        "Engine",
        "EngineConfig",
        "EngineStatistics",
        "EventOutlet",
        "NUMBER_LIMIT",
        "OutletConfig",
        "SimRequest",
        "SimTokenizer",
        "TimingModel",
    ],
    "tokenspeed_router.events": [
        "AllBlocksCleared",
        "BatchDecoder",
        "BatchReceived",
        "BlockHash",
        "BlockRemoved",
        "BlockStored",
        "END_SEQ",
        "Event",
        "EventLogReader",
        "EventLogWriter",
        "EventSubscriber",
        "KVEventBatch",
        "KvcapRecord",
        "LogRecord",
        "PublisherRestarted",
        "PublisherStatistics",
        "QueueFullPolicy",
        "ResyncNeeded",
        "SequenceTracker",
        "SubscriberGroup",
        "SubscriberItem",
        "SubscriberStatistics",
        "VerdictKind",
        "ZmqEventPublisher",
        "decode_batch",
        "encode_batch",
        "offset_endpoint_port",
        "open_event_source",
        "read_kvcap",
    ],
    "tokenspeed_router.router": [
        "CandidateCost",
        "CreditSource",
        "IndexIngestor",
        "KvIndex",
        "LoadProvider",
        "MatchDetail",
        "POLICY_NAMES",
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
    ],
    "tokenspeed_router.server": [
        "ApiLimits",
        "HttpRouterClient",
        "RouterService",
        "ServerConfig",
        "WorkerSpec",
        "ZmqApiServer",
        "ZmqRouterClient",
        "create_app",
        "load_server_config",
    ],
    "tokenspeed_router.sim": [
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
    ],
    "tokenspeed_router.state": [
        "FencedError",
        "GenerationError",
        "IndexHost",
        "IngestionControl",
        "LocalIndexHost",
        "RedisStateConfig",
        "RedisStateReplica",
        "StateHealth",
        "StateKeys",
        "WarmStartReport",
        "create_ingest_sink",
    ],
}

#: DESIGN.md §5 "Python API (contract)": these must stay importable as written there.
CONTRACT: dict[str, list[str]] = {
    "tokenspeed_router.events": [
        "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch", "decode_batch",
        "encode_batch", "ZmqEventPublisher", "EventSubscriber", "EventLogWriter", "EventLogReader",
    ],
    "tokenspeed_router.router": ["KvIndex", "Router"],
    "tokenspeed_router.cache": ["PrefixCache", "CacheInitParams"],
}


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_exports_are_pinned(name: str) -> None:
    module = importlib.import_module(name)
    assert sorted(module.__all__) == EXPORTS[name]
    assert len(set(module.__all__)) == len(module.__all__), "duplicate in __all__"
    for attr in module.__all__:
        assert getattr(module, attr, None) is not None, f"{name}.{attr} in __all__ but missing"


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_namespace_is_exactly_all_plus_submodules(name: str) -> None:
    module = importlib.import_module(name)
    public = {
        attr for attr, value in vars(module).items()
        if not attr.startswith("_") and not isinstance(value, types.ModuleType) and attr != "annotations"
    }
    assert public == set(module.__all__)


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_contract_names_are_exported(name: str) -> None:
    module = importlib.import_module(name)
    assert set(CONTRACT[name]) <= set(module.__all__)


def test_top_level_stays_light() -> None:
    assert tokenspeed_router.__all__ == ["__version__"]
