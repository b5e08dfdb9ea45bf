"""Emulations of other routers' policies, for ``simulate`` policy contests.

Each peer is rebuilt from its published source (file and revision in each
module's docstring, and in docs/simulation.md): a pure choice function over
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

__all__ = ["PEER_POLICIES", "PeerBackend", "make_peer_backend"]

_BACKENDS: dict[str, type[PeerBackend]] = {
    "vllm_kv_aware": VllmKvAwareBackend,
    "dynamo": DynamoBackend,
    "sglang_cache_aware": SglangCacheAwareBackend,
    "llmd_precise": LlmdPreciseBackend,
}

#: ``simulate --policies`` names of the peer emulations
PEER_POLICIES: tuple[str, ...] = tuple(_BACKENDS)


def make_peer_backend(name: str, cluster: ClusterConfig, view: WorkerView) -> PeerBackend:
    """The emulation of peer ``name`` on a fresh state."""
    return _BACKENDS[name](cluster, view)
