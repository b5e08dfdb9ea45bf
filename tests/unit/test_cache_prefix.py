"""PrefixCache: events, units, admit, request lifecycle, disable, reset, publishing."""

from __future__ import annotations

import pytest
import torch
from support.cache_reference import EventFolder

from tokenspeed_router.cache import (
    CacheInitParams,
    KvEventSink,
    PagedKVAllocator,
    PrefixCache,
    ReqToTokenPool,
)
from tokenspeed_router.errors import CacheError, ConfigError, OutOfPagesError, QueueFullError
from tokenspeed_router.events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from tokenspeed_router.hashing import block_hashes


def test_constructor_announces_a_clear_and_events_chain_like_the_router_hash() -> None:
    cache = PrefixCache.with_capacity(16, page_size=4)
    assert cache.take_events() == [AllBlocksCleared()]
    prompt = list(range(10, 30))  # 5 pages
    assert cache.admit(prompt[:10]) == 0  # 2 full pages + a partial one
    (first,) = cache.take_events()
    assert first == BlockStored(
        block_hashes=list(block_hashes(prompt[:8], 4)),
        parent_block_hash=None,
        token_ids=prompt[:8],
        block_size=4,
    )
    assert cache.admit(prompt) == 8
    (second,) = cache.take_events()
    assert isinstance(second, BlockStored)
    assert second.parent_block_hash == first.block_hashes[-1]
    assert second.block_hashes == block_hashes(prompt, 4)[2:]
    assert second.token_ids == prompt[8:]


def test_removals_name_exactly_the_stored_hashes_and_reset_clears() -> None:
    cache = PrefixCache.with_capacity(16, page_size=2)
    cache.admit([1, 2, 3, 4, 5, 6])
    cache.admit([1, 2, 3, 4, 9, 9])
    cache.admit([7, 7])
    events = cache.take_events()
    stored = {h for ev in events if isinstance(ev, BlockStored) for h in ev.block_hashes}
    assert len(stored) == 5
    assert cache.evict(1000) == 10
    removed = [
        h for ev in cache.take_events() if isinstance(ev, BlockRemoved) for h in ev.block_hashes
    ]
    assert sorted(removed) == sorted(stored)
    cache.admit([1, 2])
    cache.reset()
    tail = cache.take_events()
    assert isinstance(tail[-1], AllBlocksCleared)
    assert cache.total_size() == 0 and cache.page_accounting().free == 16


def test_same_page_under_different_prefixes_gets_different_hashes() -> None:
    cache = PrefixCache.with_capacity(16, page_size=2)
    cache.admit([5, 5, 5, 5])  # two identical consecutive pages
    cache.admit([6, 6, 5, 5])
    folder = EventFolder(2)
    folder.apply(cache.take_events())
    assert len(folder.blocks) == 4, "the seed's unchained hash(page) collides here"
    folder.check_content_hashes()


def test_lora_and_medium_ride_on_events_and_seed_the_chain() -> None:
    cache = PrefixCache.with_capacity(8, page_size=2, medium="GPU", lora_id=7)
    cache.admit([1, 2, 3, 4])
    cleared, stored = cache.take_events()
    assert cleared == AllBlocksCleared(medium="GPU")
    assert isinstance(stored, BlockStored)
    assert stored.lora_id == 7 and stored.medium == "GPU"
    assert stored.block_hashes == block_hashes([1, 2, 3, 4], 2, lora_id=7)
    assert stored.block_hashes != block_hashes([1, 2, 3, 4], 2)
    cache.evict(2)
    (removed,) = cache.take_events()
    assert removed == BlockRemoved(block_hashes=stored.block_hashes, medium="GPU")


def test_sizes_and_evict_count_tokens() -> None:
    cache = PrefixCache.with_capacity(32, page_size=16)
    cache.admit(list(range(50)))  # 3 full pages cached, the partial 4th freed
    assert cache.total_size() == 48 == cache.evictable_size()
    assert cache.protected_size() == 0
    assert cache.evict(1) == 48, "whole nodes go; a 1-token request evicts the 3-page node"
    assert cache.total_size() == 0


def test_evict_stops_once_enough_tokens_are_freed() -> None:
    cache = PrefixCache.with_capacity(8, page_size=16)
    for i in range(3):
        cache.admit([i] * 16)
    assert cache.evict(16) == 16, "one page of 16 tokens, not 16 pages"
    assert cache.evict(17) == 32
    assert cache.total_size() == 0


def test_match_accepts_tokens_pages_and_tensors_and_ignores_partial_tail() -> None:
    cache = PrefixCache.with_capacity(8, page_size=2)
    cache.admit([1, 2, 3, 4, 5])
    assert cache.match_prefix([1, 2, 3, 4, 5]).device_prefix_length == 4
    assert cache.match_prefix([(1, 2), (3, 4)]).device_prefix_length == 4
    assert cache.match_prefix(torch.tensor([1, 2, 3])).device_prefix_length == 2
    assert cache.match_prefix([1]).device_prefix_length == 0
    assert cache.match_prefix([]).device_indices.numel() == 0


def test_admit_when_the_request_cannot_fit() -> None:
    cache = PrefixCache.with_capacity(4, page_size=2)
    cache.admit([9, 9])
    cache.take_events()
    before = cache.cached_chains()
    with pytest.raises(OutOfPagesError):
        cache.admit(list(range(20)), strict=True)
    assert cache.cached_chains() == before and cache.take_events() == []
    assert cache.page_accounting().consistent
    # Default: evict what it must and cache the leading pages that fit.
    assert cache.admit(list(range(20))) == 0
    assert cache.total_size() == 8
    assert cache.match_prefix(list(range(20))).device_prefix_length == 8
    acc = cache.page_accounting()
    assert acc.consistent and acc.free == 0 and acc.tree == 4


def test_admit_refuses_nothing_it_can_fit_by_evicting() -> None:
    cache = PrefixCache.with_capacity(4, page_size=2)
    for i in range(10):
        cache.admit([i, i, i, i])
        acc = cache.page_accounting()
        assert acc.consistent and acc.tree == 2 * min(i + 1, 2)
    assert cache.statistics().num_admitted == 10


def test_request_lifecycle_unfinished_then_finished() -> None:
    cache = PrefixCache.with_capacity(16, page_size=2)
    cache.admit([1, 1, 2, 2])
    req = cache.begin_request([1, 1, 2, 2, 3, 3, 4])
    assert req.prefix_indices is not None and req.prefix_indices.numel() == 2
    assert cache.protected_size() == 4
    cache.extend_request(req, [4, 5, 5])
    cache.cache_unfinished_req(req)
    assert cache.protected_size() == 10 and cache.total_size() == 10
    acc = cache.page_accounting()
    assert acc.consistent and acc.requests == 0 and acc.tree == 5
    cache.extend_request(req, [6])
    assert cache.page_accounting().requests == 1
    cache.cache_finished_req(req)
    assert req.req_pool_idx is None and req.last_node is None
    assert cache.protected_size() == 0 and cache.total_size() == 10
    acc = cache.page_accounting()
    assert acc.consistent and acc.requests == 0


def test_concurrent_duplicate_requests_free_the_loser_pages() -> None:
    cache = PrefixCache.with_capacity(16, page_size=2)
    a = cache.begin_request([1, 2, 3, 4])
    b = cache.begin_request([1, 2, 3, 4])
    assert cache.page_accounting().requests == 4
    cache.cache_unfinished_req(a)
    cache.cache_unfinished_req(b)  # b's pages duplicate a's: freed, b repointed
    alloc = cache.token_to_kv_pool_allocator
    assert alloc is not None and b.req_pool_idx is not None and a.req_pool_idx is not None
    assert (
        alloc.req_to_page[b.req_pool_idx, :2].tolist()
        == alloc.req_to_page[a.req_pool_idx, :2].tolist()
    )
    assert cache.page_accounting().tree == 2 and cache.page_accounting().consistent
    cache.cache_finished_req(a, token_ids=[1, 2, 3, 4])
    cache.cache_finished_req(b, token_ids=[1, 2, 3, 4])
    acc = cache.page_accounting()
    assert acc.consistent and acc.free == 14


def test_lock_underflow_and_reset_while_locked_raise() -> None:
    cache = PrefixCache.with_capacity(8, page_size=2)
    cache.admit([1, 1])
    node = cache.match_prefix([1, 1]).last_device_node
    with pytest.raises(CacheError, match="underflow"):
        cache.dec_lock_ref(node)
    cache.inc_lock_ref(node)
    with pytest.raises(CacheError, match="locked"):
        cache.reset()
    assert cache.total_size() == 2
    cache.dec_lock_ref(node)
    cache.reset()
    assert cache.total_size() == 0


def test_insert_without_value_allocates_and_reports_cached_tokens() -> None:
    cache = PrefixCache.with_capacity(4, page_size=2)
    assert cache.insert([1, 1, 2, 2]) == 0
    assert cache.insert([1, 1, 2, 2, 3, 3]) == 4
    assert cache.page_accounting().tree == 3
    with pytest.raises(OutOfPagesError):
        cache.insert([8, 8, 9, 9])
    assert cache.page_accounting().consistent
    with pytest.raises(ValueError, match="page ids"):
        cache.insert([1, 1], torch.tensor([1, 2], dtype=torch.int32))


def test_disabled_cache_caches_nothing_and_leaks_nothing() -> None:
    alloc = PagedKVAllocator(8, 2, max_num_reqs=2, max_pages_per_req=8)
    pool = ReqToTokenPool(2, 16)
    cache = PrefixCache(
        CacheInitParams(
            disable=True,
            req_to_token_pool=pool,
            token_to_kv_pool_allocator=alloc,
            page_size=2,
            enable_kv_cache_events=True,
        )
    )
    cache.take_events()
    assert cache.admit([1, 1, 2, 2]) == 0
    assert cache.admit([1, 1, 2, 2]) == 0
    assert cache.insert([1, 1]) == 0 and cache.evict(10) == 0
    assert cache.take_events() == []
    assert alloc.num_free_pages == 8 and cache.total_size() == 0


def test_disable_finished_insert_frees_private_pages_only() -> None:
    alloc = PagedKVAllocator(8, 2, max_num_reqs=2, max_pages_per_req=8)
    cache = PrefixCache(
        CacheInitParams(
            disable=False,
            req_to_token_pool=ReqToTokenPool(2, 16),
            token_to_kv_pool_allocator=alloc,
            page_size=2,
            disable_finished_insert=True,
        )
    )
    cache.insert([1, 1])
    assert cache.admit([1, 1, 2, 2, 3]) == 2
    assert cache.total_size() == 2
    acc = cache.page_accounting()
    assert acc.consistent and acc.free == 7


def test_page_size_must_agree_with_the_allocator() -> None:
    alloc = PagedKVAllocator(8, 4, max_num_reqs=1, max_pages_per_req=2)
    with pytest.raises(ConfigError, match="disagrees"):
        PrefixCache(CacheInitParams(False, ReqToTokenPool(1, 8), alloc, page_size=2))


class FakePublisher:
    def __init__(self, fail_after: int | None = None) -> None:
        self.batches: list[KVEventBatch] = []
        self.fail_after = fail_after

    def publish(self, batch: KVEventBatch) -> int:
        if self.fail_after is not None and len(self.batches) >= self.fail_after:
            raise QueueFullError("full")
        self.batches.append(batch)
        return len(self.batches) - 1


def test_attached_publisher_gets_one_batch_per_operation() -> None:
    cache = PrefixCache.with_capacity(3, page_size=2)
    pub = FakePublisher()
    cache.attach_publisher(pub)
    assert [b.events for b in pub.batches] == [[AllBlocksCleared()]]
    cache.admit([1, 1, 2, 2])
    cache.admit([3, 3, 4, 4])  # evicts the first request: remove + store, one batch
    kinds = [[type(e).__name__ for e in b.events] for b in pub.batches[1:]]
    assert kinds == [["BlockStored"], ["BlockRemoved", "BlockStored"]]
    cache.match_prefix([3, 3])  # emits nothing, publishes nothing
    assert len(pub.batches) == 3
    assert cache.take_events() == []


def test_publish_failure_keeps_events_queued_in_order() -> None:
    cache = PrefixCache.with_capacity(8, page_size=2)
    pub = FakePublisher(fail_after=1)
    cache.attach_publisher(KvEventSink(pub, max_events_per_batch=1))
    with pytest.raises(QueueFullError):
        cache.admit([1, 1])
    assert cache.total_size() == 2, "the cache changed; its events wait"
    pub.fail_after = None
    cache.admit([2, 2])
    events = [e for b in pub.batches for e in b.events]
    assert [type(e).__name__ for e in events] == ["AllBlocksCleared", "BlockStored", "BlockStored"]
    folder = EventFolder(2)
    folder.apply(events)
    assert set(folder.chains()) == set(cache.cached_chains())


def test_snapshot_events_rebuild_the_cache() -> None:
    cache = PrefixCache.with_capacity(16, page_size=2)
    for seq in ([1, 1, 2, 2, 3, 3], [1, 1, 2, 2, 4, 4], [5, 5]):
        cache.admit(seq)
    folder = EventFolder(2)
    folder.apply(cache.snapshot_events())
    assert set(folder.chains()) == set(cache.cached_chains())
    folder.check_content_hashes()


def test_pretty_print_and_statistics() -> None:
    cache = PrefixCache.with_capacity(8, page_size=2)
    cache.admit([1, 1, 2, 2])
    cache.admit([1, 1, 2, 2])
    text = cache.pretty_print("tree")
    assert "#tokens: 4" in text and "pages=2" in text
    stats = cache.statistics()
    assert stats.hit_tokens == 4 and stats.admitted_tokens == 8 and stats.cached_tokens == 4


def test_caching_more_tokens_than_the_request_allocated_is_refused() -> None:
    cache = PrefixCache.with_capacity(8, page_size=2)
    req = cache.begin_request([1, 1, 2])
    with pytest.raises(CacheError, match="allocated 3 tokens"):
        cache.cache_unfinished_req(req, token_ids=[1, 1, 2, 2, 3, 3])
    with pytest.raises(CacheError, match="allocated 3 tokens"):
        cache.cache_finished_req(req, token_ids=[1, 1, 2, 2])
    assert cache.total_size() == 0 and cache.page_accounting().consistent
    cache.cache_finished_req(req, token_ids=[1, 1, 2])
    acc = cache.page_accounting()
    assert acc.consistent and acc.tree == 1 and acc.requests == 0


def test_cached_prefix_length_is_read_only() -> None:
    cache = PrefixCache.with_capacity(8, page_size=2, eviction_policy="lru")
    cache.admit([1, 1, 2, 2, 3, 3])
    cache.admit([4, 4])
    node = cache.match_prefix([1, 1, 2, 2, 3, 3]).last_device_node
    stamp, hits = node.last_access_time, node.hit_count
    assert cache.cached_prefix_length([1, 1, 2, 2, 9, 9]) == 4
    assert cache.cached_prefix_length([1, 1, 2, 2, 3, 3, 5]) == 6
    assert cache.cached_prefix_length([7, 7]) == 0
    assert node.last_access_time == stamp and node.hit_count == hits
    assert node.parent is cache.root_node, "no split happened"
