"""Stateful property test of PrefixCache against brute-force references.

Random requests (shared prefixes, branches, finished and unfinished), manual
locks, evictions under memory pressure and resets drive a small cache (few
pages, tiny alphabet, so prefixes collide and nodes split all the time).
After every step:

1. the tree equals a reference dict ``{page chain: page id}``: prefix closed,
   page ids stable while cached, hits equal the longest cached prefix, only
   unprotected chains disappear, inserts add exactly the request's pages;
2. an index rebuilt *only from the emitted events* holds exactly the cached
   chains, and every published hash is the router's content hash;
3. page accounting: free + tree + live requests == total, nothing leaked,
   nothing owned twice.
"""

from __future__ import annotations

import array

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)
from support.cache_reference import Chain, EventFolder

from tokenspeed_router.cache import EVICTION_POLICIES, PrefixCache, Req, TreeNode
from tokenspeed_router.errors import CacheError, OutOfPagesError

PAGE_SIZE = 2
NUM_PAGES = 14
MAX_REQS = 4
MAX_CONTEXT = 32

_PREFIXES = [(), (1, 1), (1, 2, 3, 1), (2, 2, 2, 2, 1, 3)]
token_lists = st.builds(
    lambda head, tail: [*head, *tail],
    st.sampled_from(_PREFIXES),
    st.lists(st.integers(1, 3), max_size=14),
)


def pages_of(tokens: list[int]) -> list[tuple[int, ...]]:
    full = len(tokens) - len(tokens) % PAGE_SIZE
    return [tuple(tokens[i : i + PAGE_SIZE]) for i in range(0, full, PAGE_SIZE)]


def prefixes(pages: list[tuple[int, ...]] | tuple[tuple[int, ...], ...]) -> set[Chain]:
    return {tuple(pages[: i + 1]) for i in range(len(pages))}


def chain_of(node: TreeNode) -> Chain:
    parts = []
    cur: TreeNode | None = node
    while cur is not None and cur.parent is not None:
        parts.append(tuple(tuple(array.array("Q", page)) for page in cur.key))
        cur = cur.parent
    return tuple(page for part in reversed(parts) for page in part)


class CacheMachine(RuleBasedStateMachine):
    locks = Bundle("locks")

    def __init__(self) -> None:
        super().__init__()
        self.cache: PrefixCache
        self.model: dict[Chain, int] = {}
        self.folder = EventFolder(PAGE_SIZE)
        self.live: list[Req] = []
        self.lock_nodes: list[TreeNode] = []

    @initialize(policy=st.sampled_from(sorted(EVICTION_POLICIES)))
    def start(self, policy: str) -> None:
        self.cache = PrefixCache.with_capacity(
            NUM_PAGES,
            page_size=PAGE_SIZE,
            eviction_policy=policy,
            max_num_reqs=MAX_REQS,
            max_context_len=MAX_CONTEXT,
        )

    # ------------------------------------------------------------ helpers

    def protected(self) -> set[Chain]:
        out: set[Chain] = set()
        for node in [
            *self.lock_nodes,
            *(r.last_node for r in self.live if r.last_node is not None),
        ]:
            out |= prefixes(chain_of(node))
        return out

    def longest_cached(self, pages: list[tuple[int, ...]]) -> int:
        k = 0
        while k < len(pages) and tuple(pages[: k + 1]) in self.model:
            k += 1
        return k

    def apply_diff(self, *, may_add: set[Chain], protected: set[Chain]) -> set[Chain]:
        """Validate the tree's change against the model, then adopt it; return removed chains."""
        now = self.cache.cached_chains()
        removed = set(self.model) - set(now)
        added = set(now) - set(self.model)
        assert not (removed & protected), f"evicted protected chains {removed & protected}"
        assert added <= may_add, f"unexpected chains cached {added - may_add}"
        for chain in set(now) & set(self.model):
            assert now[chain] == self.model[chain], f"page id of {chain} changed"
        self.model = now
        return removed

    # ------------------------------------------------------------ rules

    @rule(tokens=token_lists)
    def match(self, tokens: list[int]) -> None:
        pages = pages_of(tokens)
        k = self.longest_cached(pages)
        result = self.cache.match_prefix(tokens)
        assert result.device_prefix_length == k * PAGE_SIZE
        expected = [self.model[tuple(pages[: i + 1])] for i in range(k)]
        assert result.device_indices.tolist() == expected
        assert chain_of(result.last_device_node) == tuple(pages[:k])
        self.apply_diff(may_add=set(), protected=self.protected())

    @rule(tokens=token_lists, priority=st.integers(0, 2))
    def admit(self, tokens: list[int], priority: int) -> None:
        pages = pages_of(tokens)
        k = self.longest_cached(pages)
        protected = self.protected() | prefixes(pages[:k])
        evicted_before = self.cache.statistics().evicted_tokens
        hit = self.cache.admit(tokens, priority=priority)
        assert hit == k * PAGE_SIZE
        if self.cache.statistics().evicted_tokens > evicted_before:
            event("admit evicted under pressure")
        self.apply_diff(may_add=prefixes(pages), protected=protected)
        j = self.longest_cached(pages)
        assert j >= k
        if j < len(pages):
            # Truncated: only possible when everything evictable was evicted.
            event("admit truncated")
            survivors = set(self.model) - prefixes(pages[:j]) - protected
            assert not survivors, f"truncated admit left evictable chains {survivors}"

    @precondition(lambda self: len(self.live) < MAX_REQS - 1)
    @rule(tokens=token_lists)
    def begin(self, tokens: list[int]) -> None:
        pages = pages_of(tokens)
        k = self.longest_cached(pages)
        protected = self.protected() | prefixes(pages[:k])
        before = self.cache.page_accounting()
        try:
            req = self.cache.begin_request(tokens)
        except OutOfPagesError:
            event("begin out of pages")
            assert self.cache.cached_chains() == self.model, "failed begin changed the tree"
            assert self.cache.page_accounting() == before
            return
        self.live.append(req)
        self.apply_diff(may_add=set(), protected=protected)
        assert req.prefix_indices is not None
        assert req.prefix_indices.tolist() == [self.model[tuple(pages[: i + 1])] for i in range(k)]
        assert self.cache.token_to_kv_pool_allocator is not None
        row = self.cache.token_to_kv_pool_allocator.req_to_page[req.req_pool_idx]
        assert row[:k].tolist() == req.prefix_indices.tolist()

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new=st.lists(st.integers(1, 3), min_size=1, max_size=6))
    def extend(self, data: st.DataObject, new: list[int]) -> None:
        req = data.draw(st.sampled_from(self.live))
        protected = self.protected()
        try:
            self.cache.extend_request(req, new)
        except OutOfPagesError:
            assert self.cache.cached_chains() == self.model
            return
        self.apply_diff(may_add=set(), protected=protected)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def cache_unfinished(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.live))
        pages = pages_of(req.fill_ids)
        self.cache.cache_unfinished_req(req)
        self.apply_diff(may_add=prefixes(pages), protected=self.protected())
        assert req.last_node is not None
        assert chain_of(req.last_node) == tuple(pages)
        assert set(prefixes(pages)) <= set(self.model)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.live))
        self.live.remove(req)
        pages = pages_of(req.fill_ids[:-1])
        self.cache.cache_finished_req(req)
        assert req.req_pool_idx is None and req.last_node is None
        self.apply_diff(may_add=prefixes(pages), protected=self.protected())
        assert set(prefixes(pages)) <= set(self.model)

    @rule(target=locks, tokens=token_lists)
    def lock(self, tokens: list[int]) -> TreeNode:
        node = self.cache.match_prefix(tokens).last_device_node
        self.cache.inc_lock_ref(node)
        self.lock_nodes.append(node)
        return node

    @rule(node=consumes(locks))
    def unlock(self, node: TreeNode) -> None:
        if node not in self.lock_nodes:
            return  # already released by drain
        self.lock_nodes.remove(node)
        self.cache.dec_lock_ref(node)

    @rule(num_tokens=st.integers(0, NUM_PAGES * PAGE_SIZE))
    def evict(self, num_tokens: int) -> None:
        protected = self.protected()
        evictable_before = self.cache.evictable_size()
        evicted = self.cache.evict(num_tokens)
        removed = self.apply_diff(may_add=set(), protected=protected)
        assert evicted == len(removed) * PAGE_SIZE
        assert evicted >= min(num_tokens, evictable_before)
        if removed:
            event("explicit evict removed blocks")
        if evicted < num_tokens:
            assert self.cache.evictable_size() == 0

    @rule()
    def reset(self) -> None:
        if self.protected():
            event("reset refused while locked")
            with pytest.raises(CacheError):
                self.cache.reset()
            assert self.cache.cached_chains() == self.model
            return
        self.cache.reset()
        assert self.cache.cached_chains() == {}
        self.model = {}

    # ------------------------------------------------------------ invariants

    @invariant()
    def tree_matches_model(self) -> None:
        if not hasattr(self, "cache"):
            return
        chains = self.cache.cached_chains()
        assert chains == self.model
        for chain in chains:
            assert chain[:-1] == () or chain[:-1] in chains, f"{chain} cached without its parent"
        assert len(set(chains.values())) == len(chains), "a page id cached twice"
        cache = self.cache
        assert cache.total_size() == len(chains) * PAGE_SIZE
        assert cache.evictable_size() + cache.protected_size() == cache.total_size()
        assert cache.protected_size() == len(self.protected()) * PAGE_SIZE

    @invariant()
    def events_rebuild_the_cache(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.folder.apply(self.cache.take_events())
        assert set(self.folder.chains()) == set(self.model)
        self.folder.check_content_hashes()

    @invariant()
    def pages_are_accounted(self) -> None:
        if not hasattr(self, "cache"):
            return
        acc = self.cache.page_accounting()
        assert acc.consistent, acc
        assert acc.tree == len(self.model)
        allocator = self.cache.token_to_kv_pool_allocator
        assert allocator is not None and acc.free == allocator.num_free_pages
        for req in self.live:
            assert req.req_pool_idx is not None
            row = allocator.req_to_page[req.req_pool_idx]
            held = -(-len(req.fill_ids) // PAGE_SIZE)
            assert bool((row[:held] > 0).all())
            # The request's cached prefix reads the tree's pages, not its own duplicates.
            assert req.last_node is not None
            chain = chain_of(req.last_node)
            expect_ids = [self.model[chain[: i + 1]] for i in range(len(chain))]
            assert row[: len(chain)].tolist() == expect_ids
            slots = self.cache.req_to_token_pool.req_to_token[req.req_pool_idx]  # type: ignore[union-attr]
            expect = (row[:held, None].long() * PAGE_SIZE + torch.arange(PAGE_SIZE)).flatten()
            assert slots[: held * PAGE_SIZE].tolist() == expect.tolist()

    @rule()
    def drain(self) -> None:
        """Finish every request and drop every lock: then nothing may be held, and reset frees all."""
        for req in self.live:
            self.cache.cache_finished_req(req)
        for node in self.lock_nodes:
            self.cache.dec_lock_ref(node)
        self.live = []
        self.lock_nodes = []
        acc = self.cache.page_accounting()
        assert acc.consistent and acc.requests == 0, acc
        assert self.cache.protected_size() == 0
        self.cache.reset()
        self.model = {}
        assert self.cache.page_accounting().free == NUM_PAGES


CacheMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheStateful = CacheMachine.TestCase
