"""Eviction policies on a crafted tree; locks; cascades; splits keep access data; bad names."""

from __future__ import annotations

import pytest

from tokenspeed_router.cache import (
    EVICTION_POLICIES,
    EvictionPolicy,
    PrefixCache,
    make_eviction_strategy,
)
from tokenspeed_router.events.schema import BlockHash, BlockRemoved, BlockStored

# Four one-page leaves under the root, admitted in order A, B, C, D with
# priorities 3, 1, 2, 0; then matched D x3, C x1, B x2. So:
#   last access  A < D < C < B      creation  A < B < C < D
#   hits         A=0 B=2 C=1 D=3    priority  A=3 B=1 C=2 D=0
LEAVES = {"A": [1, 1], "B": [2, 2], "C": [3, 3], "D": [4, 4]}
EXPECTED_ORDER = {
    "lru": "ADCB",
    "mru": "BCDA",
    "fifo": "ABCD",
    "filo": "DCBA",
    "lfu": "ACBD",
    "priority": "DBCA",
}


def crafted(policy: str) -> tuple[PrefixCache, dict[BlockHash, str]]:
    cache = PrefixCache.with_capacity(8, page_size=2, eviction_policy=policy)
    for name, prio in zip("ABCD", (3, 1, 2, 0), strict=True):
        assert cache.admit(LEAVES[name], priority=prio) == 0
    for name, times in (("D", 3), ("C", 1), ("B", 2)):
        for _ in range(times):
            assert cache.match_prefix(LEAVES[name]).device_prefix_length == 2
    names: dict[BlockHash, str] = {}
    for ev in cache.take_events():
        if isinstance(ev, BlockStored):
            names[ev.block_hashes[0]] = next(n for n, t in LEAVES.items() if t == ev.token_ids)
    return cache, names


def test_every_policy_has_an_expected_order() -> None:
    assert set(EXPECTED_ORDER) == set(EVICTION_POLICIES)


@pytest.mark.parametrize("policy", sorted(EXPECTED_ORDER))
def test_eviction_order_on_crafted_tree(policy: str) -> None:
    cache, names = crafted(policy)
    order = ""
    for _ in range(4):
        assert cache.evict(1) == 2, "evict counts tokens; one page is 2 tokens"
        (ev,) = cache.take_events()
        assert isinstance(ev, BlockRemoved)
        order += names[ev.block_hashes[0]]
    assert order == EXPECTED_ORDER[policy]
    assert cache.total_size() == 0 and cache.evict(2) == 0


@pytest.mark.parametrize("policy", sorted(EXPECTED_ORDER))
def test_locked_nodes_are_never_evicted(policy: str) -> None:
    cache, names = crafted(policy)
    locked = [cache.match_prefix(LEAVES[n]).last_device_node for n in "AC"]
    for node in locked:
        assert cache.inc_lock_ref(node) == -2
    assert cache.protected_size() == 4 and cache.evictable_size() == 4
    assert cache.evict(100) == 4
    removed = {
        names[h]
        for ev in cache.take_events()
        if isinstance(ev, BlockRemoved)
        for h in ev.block_hashes
    }
    assert removed == {"B", "D"}
    assert cache.evictable_size() == 0 and cache.total_size() == 4
    for node in locked:
        assert cache.dec_lock_ref(node) == 2
    assert cache.evictable_size() == 4 and cache.protected_size() == 0
    assert cache.evict(100) == 4
    assert cache.page_accounting().free == 8


def test_eviction_cascades_to_parents_that_become_leaves() -> None:
    cache = PrefixCache.with_capacity(8, page_size=2)
    cache.admit([5, 5, 6, 6])
    cache.admit([5, 5, 7, 7])
    cache.take_events()
    assert cache.evict(6) == 6
    removed = [ev for ev in cache.take_events() if isinstance(ev, BlockRemoved)]
    assert len(removed) == 3
    assert cache.total_size() == 0


def test_split_preserves_lock_refs_hashes_and_access_data() -> None:
    cache = PrefixCache.with_capacity(8, page_size=2)
    tokens = [1, 1, 2, 2, 3, 3, 4, 4]
    cache.admit(tokens, priority=2)
    (_, stored) = cache.take_events()
    assert isinstance(stored, BlockStored) and len(stored.block_hashes) == 4
    full = cache.match_prefix(tokens)
    node = full.last_device_node
    values = full.device_indices.tolist()
    cache.inc_lock_ref(node)
    hits, created, accessed = node.hit_count, node.creation_time, node.last_access_time
    assert hits == 1

    head = cache.match_prefix(tokens[:4]).last_device_node
    assert head is not node and node.parent is head
    assert head.lock_ref == node.lock_ref == 1
    assert head.block_hashes + node.block_hashes == stored.block_hashes
    assert head.priority == node.priority == 2
    assert head.creation_time == node.creation_time == created
    assert head.hit_count == hits + 1 and node.hit_count == hits
    assert head.last_access_time > accessed and node.last_access_time == accessed
    assert (head.value.tolist() + node.value.tolist()) == values  # type: ignore[union-attr]
    assert cache.protected_size() == 8 and cache.evictable_size() == 0
    assert cache.take_events() == [], "a split changes no block"

    assert cache.dec_lock_ref(node) == 8
    assert cache.evictable_size() == 8 and head.lock_ref == 0
    cache.evict(8)
    removed = [
        h for ev in cache.take_events() if isinstance(ev, BlockRemoved) for h in ev.block_hashes
    ]
    assert sorted(removed) == sorted(stored.block_hashes)


def test_hit_count_and_priority_are_maintained() -> None:
    cache = PrefixCache.with_capacity(8, page_size=2, eviction_policy="priority")
    cache.admit([1, 1, 2, 2], priority=1)
    cache.admit([1, 1, 3, 3], priority=5)  # raises the shared [1,1] node to 5
    shared = cache.match_prefix([1, 1]).last_device_node
    assert shared.priority == 5
    assert shared.hit_count == 2, "the second admit's match and this match"
    low = cache.match_prefix([1, 1, 2, 2]).last_device_node
    assert low.priority == 1
    cache.evict(2)
    assert cache.match_prefix([1, 1, 2, 2]).device_prefix_length == 2, (
        "low priority leaf went first"
    )
    assert cache.match_prefix([1, 1, 3, 3]).device_prefix_length == 4


def test_unknown_policy_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy 'lrux'") as info:
        PrefixCache.with_capacity(4, eviction_policy="lrux")
    for name in EVICTION_POLICIES:
        assert repr(name) in str(info.value)
    assert make_eviction_strategy("LRU").name == "lru"
    assert make_eviction_strategy(EvictionPolicy.PRIORITY).name == "priority"
