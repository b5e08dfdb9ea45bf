"""Plain records of the prefix cache: construction parameters, match results, requests, statistics.

Kept apart from :mod:`.prefix_cache` so the data an engine passes in and gets
back is readable on one screen. All are re-exported by ``tokenspeed_router.cache``
(and by ``prefix_cache``, the seed's import path).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tokenspeed_router.cache.eviction import EvictionPolicy
from tokenspeed_router.cache.pages import PagedKVAllocator, ReqToTokenPool
from tokenspeed_router.cache.tree import TreeNode

__all__ = ["CacheInitParams", "CacheStatistics", "MatchResult", "Req"]


@dataclasses.dataclass
class CacheInitParams:
    """Construction parameters (the seed's fields, then ours appended with defaults).

    ``page_size`` is taken from the allocator when one is given (they must
    agree). ``token_to_kv_pool``, ``tp_cache_group`` and ``enable_metrics``
    are accepted for signature compatibility and unused: this cache holds no
    KV tensors and runs on one rank.
    """

    disable: bool
    req_to_token_pool: ReqToTokenPool | None
    token_to_kv_pool_allocator: PagedKVAllocator | None
    page_size: int

    token_to_kv_pool: Any = None
    tp_cache_group: Any = None
    eviction_policy: str | EvictionPolicy = "lru"
    disable_finished_insert: bool = False

    enable_metrics: bool = False
    enable_kv_cache_events: bool = False
    #: ``medium`` of every event (None on the wire means GPU).
    medium: str | None = None
    #: LoRA adapter of every block this cache holds: seeds the hash chain and rides on BlockStored.
    lora_id: int | None = None


@dataclasses.dataclass(frozen=True)
class MatchResult:
    """Result of :meth:`PrefixCache.match_prefix`.

    ``device_indices`` are the tree's page ids for the matched full pages;
    ``device_prefix_length`` is the match in tokens (pages x page_size).
    """

    device_indices: torch.Tensor
    last_device_node: TreeNode
    last_host_node: TreeNode
    device_prefix_length: int = 0
    host_hit_length: int = 0


@dataclasses.dataclass(eq=False)
class Req:
    """The request state the cache reads and writes (a minimal engine ``Req``).

    ``last_node`` is the tree node the request holds a lock on (its cached
    prefix); ``req_pool_idx`` its slot in the pools; ``priority`` feeds the
    ``priority`` eviction policy.
    """

    origin_input_ids: list[int]
    output_ids: list[int] = dataclasses.field(default_factory=list)
    req_pool_idx: int | None = None
    last_node: TreeNode | None = None
    priority: int = 0
    #: Tree page ids of the request's cached prefix, refreshed by cache_unfinished_req.
    prefix_indices: torch.Tensor | None = None

    #: Set by an engine that prefills in chunks; None means prompt plus generated tokens.
    fill_ids_override: list[int] | None = None

    @property
    def fill_ids(self) -> list[int]:
        """Tokens whose KV the request has computed (what ``cache_unfinished_req`` caches)."""
        if self.fill_ids_override is not None:
            return self.fill_ids_override
        return self.origin_input_ids + self.output_ids

    @fill_ids.setter
    def fill_ids(self, value: list[int] | None) -> None:
        self.fill_ids_override = value


@dataclasses.dataclass(frozen=True)
class CacheStatistics:
    """Snapshot of a cache's sizes (tokens) and counters."""

    page_size: int
    total_pages: int
    free_pages: int
    cached_tokens: int
    evictable_tokens: int
    protected_tokens: int
    num_nodes: int
    num_admitted: int
    admitted_tokens: int
    hit_tokens: int
    evicted_tokens: int
    events_emitted: int
    events_pending: int
