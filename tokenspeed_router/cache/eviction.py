"""Eviction strategies: which unlocked leaf of the radix tree goes first.

A strategy maps a node to a sort key; the cache evicts the smallest key first
(ties broken by node id, so eviction order is deterministic). Times are the
cache's *logical* clock (a counter bumped on every node access), not wall
time: two accesses never tie and tests replay exactly.

=========  ======================================  ==============================
policy     key (smallest evicted first)            keeps
=========  ======================================  ==============================
lru        last access                             recently used prefixes
lfu        (hit count, last access)                often hit prefixes
fifo       creation                                young entries
mru        -last access                            old entries (scan resistance)
filo       -creation                               old entries
priority   (priority, last access)                 high-priority requests' prefixes
=========  ======================================  ==============================

``hit_count`` is raised by every ``match_prefix`` that reaches a node;
``priority`` is set by ``insert(..., priority=p)`` / ``Req.priority`` and is
the max over the requests that went through the node.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar, Protocol

__all__ = [
    "EVICTION_POLICIES",
    "EvictableNode",
    "EvictionPolicy",
    "EvictionStrategy",
    "FIFOStrategy",
    "FILOStrategy",
    "LFUStrategy",
    "LRUStrategy",
    "MRUStrategy",
    "PriorityStrategy",
    "make_eviction_strategy",
]


class EvictableNode(Protocol):
    """What a strategy reads from a tree node."""

    last_access_time: int
    creation_time: int
    hit_count: int
    priority: int


class EvictionPolicy(str, enum.Enum):
    """Valid policy names (``eviction_policy=`` accepts these or their string values)."""

    LRU = "lru"
    LFU = "lfu"
    FIFO = "fifo"
    MRU = "mru"
    FILO = "filo"
    PRIORITY = "priority"


class EvictionStrategy:
    """Base class: ``get_priority(node)`` returns a sortable key, smallest evicted first."""

    name: ClassVar[str] = ""

    def get_priority(self, node: EvictableNode) -> Any:
        raise NotImplementedError


class LRUStrategy(EvictionStrategy):
    name = "lru"

    def get_priority(self, node: EvictableNode) -> int:
        return node.last_access_time


class LFUStrategy(EvictionStrategy):
    name = "lfu"

    def get_priority(self, node: EvictableNode) -> tuple[int, int]:
        return (node.hit_count, node.last_access_time)


class FIFOStrategy(EvictionStrategy):
    name = "fifo"

    def get_priority(self, node: EvictableNode) -> int:
        return node.creation_time


class MRUStrategy(EvictionStrategy):
    name = "mru"

    def get_priority(self, node: EvictableNode) -> int:
        return -node.last_access_time


class FILOStrategy(EvictionStrategy):
    name = "filo"

    def get_priority(self, node: EvictableNode) -> int:
        return -node.creation_time


class PriorityStrategy(EvictionStrategy):
    name = "priority"

    def get_priority(self, node: EvictableNode) -> tuple[int, int]:
        return (node.priority, node.last_access_time)


EVICTION_POLICIES: dict[str, type[EvictionStrategy]] = {
    cls.name: cls
    for cls in (
        LRUStrategy,
        LFUStrategy,
        FIFOStrategy,
        MRUStrategy,
        FILOStrategy,
        PriorityStrategy,
    )
}


def make_eviction_strategy(policy: str | EvictionPolicy) -> EvictionStrategy:
    """Build the strategy named ``policy`` (case-insensitive); ValueError lists the valid names."""
    name = policy.value if isinstance(policy, EvictionPolicy) else str(policy).strip().lower()
    strategy_type = EVICTION_POLICIES.get(name)
    if strategy_type is None:
        valid = ", ".join(repr(p) for p in EVICTION_POLICIES)
        raise ValueError(f"unknown eviction policy {policy!r}; valid policies: {valid}")
    return strategy_type()
