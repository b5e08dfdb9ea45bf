"""Emulations of other routers' policies, for ``simulate`` policy contests.

Each peer is rebuilt from its source (file and release in each module's
docstring; docs/compare-routers.md#peer-emulations): a pure choice function over
the inputs the peer reads (unit-tested on hand-made states) and a
:class:`~tokenspeed_router.sim.peers.base.PeerBackend` that feeds it from the
simulator's real event path. Names, as ``simulate --policies`` takes them:

* ``vllm_kv_aware`` — vllm-router ``kv_aware`` (``vllm_router.py``);
* ``dynamo`` — Dynamo's default KV-router cost (``dynamo.py``);
* ``sglang_cache_aware`` — SGLang router ``cache_aware`` (``sglang.py``);
* ``llmd_precise`` — llm-d precise-prefix + KV-utilisation + queue scorers (``llm_d.py``).
"""

from __future__ import annotations

from tokenspeed_router.sim.cluster import ClusterConfig, WorkerView
from tokenspeed_router.sim.peers.base import PeerBackend
from tokenspeed_router.sim.peers.dynamo import DynamoBackend
from tokenspeed_router.sim.peers.llm_d import LlmdPreciseBackend
from tokenspeed_router.sim.peers.sglang import SglangCacheAwareBackend
from tokenspeed_router.sim.peers.vllm_router import VllmKvAwareBackend

__all__ = ["PEER_POLICIES", "PEER_VALIDATION", "PeerBackend", "make_peer_backend", "validation_label"]

_BACKENDS: dict[str, type[PeerBackend]] = {
    "vllm_kv_aware": VllmKvAwareBackend,
    "dynamo": DynamoBackend,
    "sglang_cache_aware": SglangCacheAwareBackend,
    "llmd_precise": LlmdPreciseBackend,
}

#: ``simulate --policies`` names of the peer emulations
PEER_POLICIES: tuple[str, ...] = tuple(_BACKENDS)

#: Whether each emulation was checked live against the real peer (benchmarks/peer_parity.py, the
#: table in docs/compare-routers.md#peer-emulations). Only a ``validated`` one backs a claim.
PEER_VALIDATION: dict[str, str] = {
    "vllm_kv_aware": "validated: at load, against vllm-router 0.1.17 live (benchmarks/peer_parity.py --at-load, "
                     "2026-12-06) on an agentic and a chat trace at 35 % of an 8-engine fleet's capacity, real "
                     "time: shares, hit, TTFT p50 and p99 within AT_LOAD_PEER_TOLERANCES (the light parity "
                     "cluster of 2026-12-03 had one conversation run's p90 outside); a rival in every "
                     "routing-matrix cell",
    "sglang_cache_aware": "validated: against sglang-router 0.3.2 live (benchmarks/peer_parity.py, 2026-12-03) "
                          "on conversation, synthetic and agentic: shares, hit, TTFT p50 and tail within tolerance",
    "dynamo": "unvalidated: Dynamo is not installed here; emulated from its source, never run live",
    "llmd_precise": "unvalidated: llm-d is not installed here; emulated from its source, never run live",
}


def validation_label(policy: str) -> str:
    """``validated`` or ``unvalidated`` for a peer emulation, ``""`` for any other policy."""
    status = PEER_VALIDATION.get(policy)
    return "" if status is None else status.split(":", 1)[0]


def make_peer_backend(name: str, cluster: ClusterConfig, view: WorkerView) -> PeerBackend:
    """The emulation of peer ``name`` on a fresh state."""
    return _BACKENDS[name](cluster, view)
