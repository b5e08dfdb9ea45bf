"""PagedKVAllocator and ReqToTokenPool: allocation, frees, request rows, accounting."""

from __future__ import annotations

import pytest
import torch

from tokenspeed_router.cache import PageAccounting, PagedKVAllocator, ReqToTokenPool
from tokenspeed_router.errors import CacheError, OutOfPagesError


def make(num_pages: int = 8, page_size: int = 4) -> PagedKVAllocator:
    return PagedKVAllocator(num_pages, page_size, max_num_reqs=2, max_pages_per_req=8)


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def test_alloc_hands_out_distinct_nonzero_pages_and_none_when_short() -> None:
    alloc = make()
    got = alloc.alloc(5)
    assert got is not None and got.dtype == torch.int32
    assert sorted(got.tolist()) == [1, 2, 3, 4, 5]
    assert alloc.num_free_pages == 3 and alloc.available_size() == 12
    assert alloc.alloc(4) is None
    assert alloc.num_free_pages == 3, "a failed alloc takes nothing"
    with pytest.raises(OutOfPagesError, match="asked for 4 pages, 3 free"):
        alloc.alloc_or_raise(4)
    empty = alloc.alloc(0)
    assert empty is not None and empty.numel() == 0


def test_free_returns_pages_and_rejects_double_free_out_of_range_and_duplicates() -> None:
    alloc = make()
    got = alloc.alloc_or_raise(3)
    alloc.free(got[:1])
    assert alloc.num_free_pages == 6
    with pytest.raises(CacheError, match="double free"):
        alloc.free(got[:1])
    with pytest.raises(CacheError, match="out of range"):
        alloc.free(ids(0))
    with pytest.raises(CacheError, match="out of range"):
        alloc.free(ids(9))
    with pytest.raises(CacheError, match="duplicate"):
        alloc.free(torch.stack([got[1], got[1]]))
    assert alloc.num_free_pages == 6, "rejected frees change nothing"
    again = alloc.alloc_or_raise(6)
    assert set(again.tolist()) | set(got[1:].tolist()) == set(range(1, 9))


def test_free_group_frees_queued_pages_once_at_the_end() -> None:
    alloc = make()
    got = alloc.alloc_or_raise(4)
    alloc.free_group_begin()
    alloc.append_to_later_free(got[:2])
    alloc.append_to_later_free(got[2:])
    assert alloc.num_free_pages == 4
    alloc.free_group_end()
    assert alloc.num_free_pages == 8
    alloc.free_group_end()  # nothing queued: a no-op
    assert alloc.num_free_pages == 8


def test_free_with_diff_frees_only_the_requests_duplicates() -> None:
    alloc = make()
    tree = alloc.alloc_or_raise(2)
    mine = alloc.alloc_or_raise(3)
    new_prefix = torch.cat([tree, mine[2:]])  # the tree already held positions 0 and 1
    diff = alloc.free_with_diff(new_prefix, mine)
    assert diff.tolist() == [True, True, False]
    assert alloc.num_free_pages == 8 - 2 - 1
    with pytest.raises(CacheError, match="vs"):
        alloc.free_with_diff(tree, mine)


def test_request_rows_extra_pages_and_free_req_cache() -> None:
    alloc = make(num_pages=8, page_size=4)
    pages = alloc.alloc_or_raise(3)
    alloc.set_req_pages(1, 0, pages)
    assert alloc.req_to_page[1, :3].tolist() == pages.tolist()
    assert alloc.req_to_page_cpu[1, :3].tolist() == pages.tolist()
    # 9 tokens allocated (3 pages), 8 cached: the partial third page is freed.
    alloc.free_extra_pages_not_cached(1, seq_len=8, alloced_len=9)
    assert alloc.num_free_pages == 6
    alloc.set_req_pages(1, torch.tensor([0]), pages[2:])
    assert alloc.req_to_page[1, 0].item() == pages[2].item()
    with pytest.raises(CacheError, match="row holds"):
        alloc.set_req_pages(0, 7, alloc.alloc_or_raise(2))
    alloc2 = make()
    row = alloc2.alloc_or_raise(3)
    alloc2.set_req_pages(0, 0, row)
    alloc2.free_req_cache(0, alloced_len=10)
    assert alloc2.num_free_pages == 8


def test_clear_returns_everything() -> None:
    alloc = make()
    alloc.alloc_or_raise(8)
    alloc.clear()
    assert alloc.num_free_pages == 8
    assert alloc.free_mask()[1:].all() and not alloc.free_mask()[0]


def test_req_to_token_pool_slots_and_token_slots() -> None:
    pool = ReqToTokenPool(max_num_reqs=2, max_context_len=8)
    a, b = pool.alloc(), pool.alloc()
    assert {a, b} == {0, 1} and pool.alloc() is None and pool.available_size() == 0
    assert a is not None
    pool.write_pages(a, 0, ids(3, 5), page_size=4)
    assert pool.req_to_token[a].tolist() == [12, 13, 14, 15, 20, 21, 22, 23]
    pool.write_pages(a, torch.tensor([1]), ids(2), page_size=4)
    assert pool.req_to_token[a, 4:].tolist() == [8, 9, 10, 11]
    pool.alloced_lens[a] = 7
    pool.free(a)
    assert pool.alloced_lens[a] == 0 and pool.available_size() == 1
    with pytest.raises(CacheError, match="freed twice"):
        pool.free(a)
    assert pool.live_mask().tolist() == [a != 0, a != 1]


def test_page_accounting_counts_owners() -> None:
    alloc = make()
    pool = ReqToTokenPool(2, 32)
    tree = alloc.alloc_or_raise(2)
    slot = pool.alloc()
    assert slot is not None
    private = alloc.alloc_or_raise(3)
    alloc.set_req_pages(slot, 0, torch.cat([tree, private]))  # shares the tree's 2 pages
    pool.alloced_lens[slot] = 18  # 5 pages (the last partial)
    acc = PageAccounting.compute(alloc, pool, tree)
    assert acc == PageAccounting(
        total=8, free=3, tree=2, requests=3, leaked=0, conflicting=0, duplicated=0
    )
    assert acc.consistent
    alloc.alloc_or_raise(1)  # taken by nobody: a leak
    leak = PageAccounting.compute(alloc, pool, tree)
    assert leak.leaked == 1 and not leak.consistent
