"""Worker-side paged radix prefix cache (torch) that publishes exact KV events.

``PrefixCache.with_capacity(num_pages)`` gives a ready cache; ``admit(tokens)``
serves a request end to end; ``take_events()`` drains the ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` events, or ``attach_publisher(pub)``
sends them through a ``ZmqEventPublisher``. Published block hashes are the
router's content hashes (:mod:`tokenspeed_router.hashing`). Sizes are in tokens.
"""

from tokenspeed_router.cache.eviction import (
    EVICTION_POLICIES,
    EvictionPolicy,
    EvictionStrategy,
    make_eviction_strategy,
)
from tokenspeed_router.cache.pages import PageAccounting, PagedKVAllocator, ReqToTokenPool
from tokenspeed_router.cache.prefix_cache import PrefixCache
from tokenspeed_router.cache.records import CacheInitParams, CacheStatistics, MatchResult, Req
from tokenspeed_router.cache.sink import BatchPublisher, KvEventSink
from tokenspeed_router.cache.tree import TreeNode

__all__ = [
    "EVICTION_POLICIES",
    "BatchPublisher",
    "CacheInitParams",
    "CacheStatistics",
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
]
