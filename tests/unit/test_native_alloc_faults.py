"""Allocation failure at every allocation site of the compiled core: MemoryError, index unchanged.

``_native._fail_alloc_after(k)`` makes the k-th allocation of the extension
from now on fail (csrc/common.h: every malloc/calloc/realloc/mmap of csrc/
goes through it; inert unless armed). Each operation KvIndex drives the core
with -- apply (stores with aliases, tiers, bytes ids and parents; removes;
clears; multi-event batches; a table big enough to be mapped), apply_raw
(both modes), a new worker (the 65th too), match (lists, buffers, a wide
fleet), snapshot, dump_events, restore -- is run with k = 1, 2, ... until it
completes without reaching the k-th allocation: every smaller k must raise
MemoryError and leave the whole index as it was (entries, tiers, counters,
match answers).
"""

from __future__ import annotations

import array
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from tokenspeed_router.events import BlockRemoved, BlockStored, KVEventBatch
from tokenspeed_router.events.schema import AllBlocksCleared
from tokenspeed_router.router.index import NATIVE_AVAILABLE, KvIndex

pytestmark = pytest.mark.skipif(not NATIVE_AVAILABLE, reason="the compiled core is not built")

if NATIVE_AVAILABLE:
    from tokenspeed_router import _native

BS = 4
MAX_K = 400  # no operation below makes this many allocations


def _stored(ids: list[Any], parent: Any, first: int, *, medium: str | None = None, extra: int = 0) -> BlockStored:
    return BlockStored(block_hashes=ids, parent_block_hash=parent,
                       token_ids=list(range(first, first + len(ids) * BS + extra)), block_size=BS, medium=medium)


def _base() -> KvIndex:
    """Two workers with every kind of entry: aliases, other tiers, bytes and negative ids, a partial tail."""
    index = KvIndex(core="native")
    index.apply("w0", KVEventBatch(1.0, [
        _stored([1, 2, 3], None, 0),
        _stored([b"x" * 32, -7], 3, 100, medium="cpu"),
        _stored([10, 11], None, 0),  # an alias of blocks 1, 2 (same tokens, other ids)
        _stored([20], 11, 500, extra=-1),  # a partial tail: unmatchable
        _stored(list(range(1000, 1040)), None, 60000),  # a long chain that aliases below re-store
    ]))
    index.apply("w1", KVEventBatch(1.0, [_stored([1, 2], None, 0, medium="disk"), _stored([5], 2, 900)]))
    return index


def _fleet() -> KvIndex:
    """64 workers: the next one widens every holder mask by a word; a query takes the wide path."""
    index = _base()
    for i in range(62):
        index.apply(f"f{i}", KVEventBatch(1.0, [_stored([1, 2], None, 0)]))
    return index


PROMPTS = [list(range(12)), list(range(8)) + list(range(100, 108)), list(range(4 * BS))]


def _state(index: KvIndex) -> Any:
    out = []
    for name in index.workers():
        ext, content, unm, tier_index, tier_code = index._core.items(name)
        codes = dict(zip(tier_index, tier_code, strict=True))
        entries = sorted((repr(e), c, i in set(unm), codes.get(i, 1))
                         for i, (e, c) in enumerate(zip(ext, content, strict=True)))
        out.append((name, index.block_size_of(name), entries, tuple(index.worker_info(name))))
    stats = index.statistics()
    stats.pop("unknown_media")
    return out, stats, index.num_distinct_blocks(), [index.match_detail(p) for p in PROMPTS]


def _raw(events: list[Any]) -> bytes:
    return msgspec.msgpack.encode([2.0, events])


def _ev(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, **fields}


def _toks(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


OPERATIONS: dict[str, Callable[[KvIndex], Any]] = {
    "store": lambda ix: ix.apply("w0", KVEventBatch(2.0, [_stored(list(range(30, 60)), None, 3000)])),
    "store_alias_tier": lambda ix: ix.apply("w0", KVEventBatch(2.0, [_stored([40, 41, 42], None, 0, medium="disk")])),
    # 40 GPU aliases: the aux table grows block by block, so the event fails halfway
    "store_gpu_aliases": lambda ix: ix.apply("w0", KVEventBatch(2.0, [_stored(list(range(2000, 2040)), None, 60000)])),
    "raw_gpu_aliases": lambda ix: ix.apply_raw("w0", _raw([
        ["BlockStored", list(range(3000, 3040)), None, _toks(60000, 40 * BS), BS]])),
    "store_bytes_parent": lambda ix: ix.apply("w1", KVEventBatch(2.0, [_stored([b"p", b"q"], 5, 7000)])),
    "store_new_worker": lambda ix: ix.apply("w2", KVEventBatch(2.0, [_stored([1, 2], None, 0)])),
    "store_prehashed": lambda ix: ix.apply("w0", KVEventBatch(2.0, [
        BlockStored(block_hashes=[70, 71], parent_block_hash=None, token_ids=[], block_size=BS)])),
    "remove": lambda ix: ix.apply("w0", KVEventBatch(2.0, [BlockRemoved(block_hashes=[1, 10, 99, b"x" * 32])])),
    "clear_tier": lambda ix: ix.apply("w0", KVEventBatch(2.0, [AllBlocksCleared(medium="cpu")])),
    "clear_all": lambda ix: ix.apply("w1", KVEventBatch(2.0, [AllBlocksCleared()])),
    "batch": lambda ix: ix.apply("w0", KVEventBatch(2.0, [
        _stored(list(range(80, 120)), None, 9000), BlockRemoved(block_hashes=[2, 3, 10]),
        AllBlocksCleared(medium="cpu"), _stored([121, 122], 119, 12000, medium="cpu"),
    ])),
    "raw_store": lambda ix: ix.apply_raw("w0", _raw([
        _ev("BlockStored", block_hashes=list(range(200, 240)), parent_block_hash=None,
            token_ids=_toks(20000, 40 * BS), block_size=BS)])),
    "raw_store_bytes_alias": lambda ix: ix.apply_raw("w0", _raw([
        ["BlockStored", [b"m", b"n", 12], None, _toks(0, 3 * BS), BS, None, "ssd"]])),
    "raw_batch": lambda ix: ix.apply_raw("w0", _raw([
        _ev("BlockStored", block_hashes=[300, 301], parent_block_hash=3, token_ids=_toks(30000, 2 * BS),
            block_size=BS),
        ["BlockRemoved", [1, 2, 77]], ["AllBlocksCleared", "cpu"],
        _ev("BlockStored", block_hashes=list(range(310, 330)), parent_block_hash=301,
            token_ids=_toks(31000, 20 * BS), block_size=BS)])),
    "raw_refused": lambda ix: ix.apply_raw("w0", _raw([
        _ev("BlockStored", block_hashes=[400], parent_block_hash=None, token_ids=_toks(40000, BS), block_size=BS),
        _ev("BlockStored", block_hashes=[401], parent_block_hash=999, token_ids=_toks(40100, BS), block_size=BS)])),
    "raw_salvage": lambda ix: ix.apply_raw("w1", _raw([
        _ev("BlockStored", block_hashes=[500, 501], parent_block_hash=None, token_ids=_toks(50000, 2 * BS),
            block_size=BS),
        _ev("BlockStored", block_hashes=[502], parent_block_hash=998, token_ids=_toks(50100, BS), block_size=BS),
        ["BlockRemoved", [5]]]), salvage=True),
    "raw_remove": lambda ix: ix.apply_raw("w0", _raw([["BlockRemoved", [1, 2, 3, 4]]])),
    # tables of 2 MiB and more are mapped (table.c: big_zalloc's mmap path)
    "store_huge_table": lambda ix: ix.apply("w1", KVEventBatch(2.0, [_stored(list(range(10**6, 10**6 + 300_000)),
                                                                             None, 0)])),
    "match_buffer": lambda ix: ix.match(array.array("Q", range(64))),
    "clear_worker": lambda ix: ix.clear_worker("w0"),
    "remove_worker": lambda ix: ix.remove_worker("w1"),
    "match": lambda ix: ix.match_detail(list(range(64))),
    "snapshot": lambda ix: ix.snapshot(),
    "dump_events": lambda ix: ix.dump_events(),
    "restore": lambda ix: _state(KvIndex.restore(ix.snapshot(), core="native")),
}


NO_ALLOCATION = {"clear_all", "clear_worker", "remove_worker"}


#: operations on a fleet of 64 workers (the base above has 2)
FLEET_OPERATIONS: dict[str, Callable[[KvIndex], Any]] = {
    "store_65th_worker": lambda ix: ix.apply("w64", KVEventBatch(2.0, [_stored([1, 2, 3], None, 0)])),
    "match_wide_fleet": lambda ix: ix.match_detail(list(range(12))),
}


def test_the_hook_is_inert_unless_armed() -> None:
    assert _native._fail_alloc_after(0) == 0
    assert _native._fail_alloc_after(5) == 0
    assert _native._fail_alloc_after(0) == 5  # armed, nothing allocated meanwhile, now off again
    with pytest.raises(ValueError):
        _native._fail_alloc_after(-1)


@pytest.mark.parametrize("name", sorted(OPERATIONS) + sorted(FLEET_OPERATIONS))
def test_every_allocation_failure_leaves_the_index_unchanged(name: str) -> None:
    op = OPERATIONS.get(name) or FLEET_OPERATIONS[name]
    base = _base if name in OPERATIONS else _fleet
    want = op(base())  # what the operation answers when nothing fails
    failed = 0
    for k in range(1, MAX_K):
        index = base()
        before = _state(index)
        _native._fail_alloc_after(k)
        try:
            got = op(index)
        except MemoryError:
            assert _native._fail_alloc_after(0) == 0, "MemoryError without the injected failure"
            assert _state(index) == before, f"{name}: allocation {k} failed and the index changed"
            failed += 1
            continue
        finally:
            left = _native._fail_alloc_after(0)
        assert left > 0, f"{name}: allocation {k} failed, yet the call answered {got!r}"
        assert repr(got) == repr(want)
        break
    else:
        pytest.fail(f"{name} still failed at allocation {MAX_K}")
    # the few that allocate nothing cannot fail this way (a whole-cache clear, dropping a
    # worker: they free tables)
    assert (failed == 0) == (name in NO_ALLOCATION), f"{name}: {failed} allocations"


def _run_jobs() -> list[tuple[str, bytes]]:
    """A run for ``apply_raw_many``: stores on both workers, a removal, a bytes-id store (Python objects)."""
    return [
        ("w0", _raw([_ev("BlockStored", block_hashes=list(range(600, 640)), parent_block_hash=None,
                         token_ids=_toks(61000, 40 * BS), block_size=BS)])),
        ("w1", _raw([["BlockStored", [b"r", b"s"], None, _toks(62000, 2 * BS), BS]])),
        ("w0", _raw([["BlockRemoved", [600, 601, 1]], _ev("BlockStored", block_hashes=[650, 651],
                                                         parent_block_hash=639, token_ids=_toks(63000, 2 * BS),
                                                         block_size=BS)])),
    ]


def test_an_allocation_failure_in_a_run_stops_it_at_that_batch_with_nothing_of_it_applied() -> None:
    jobs = _run_jobs()
    clean = _base()
    want = clean.apply_raw_many(jobs)
    assert len(want) == len(jobs) and all(not isinstance(w, Exception) and w is not None for w in want)
    failed = 0
    for k in range(1, MAX_K):
        index = _base()
        _native._fail_alloc_after(k)
        try:
            got = index.apply_raw_many(jobs)
        except MemoryError:  # before anything was applied (the call's own bookkeeping)
            assert _native._fail_alloc_after(0) == 0
            assert _state(index) == _state(_base())
            failed += 1
            continue
        finally:
            left = _native._fail_alloc_after(0)
        if left > 0:  # nothing failed: the whole run as without the fault
            assert repr(got) == repr(want) and _state(index) == _state(clean)
            break
        failed += 1
        assert isinstance(got[-1], MemoryError) and all(not isinstance(g, Exception) for g in got[:-1])
        # the batches before it applied, it did not: applying it and the rest now ends where the clean run did
        for worker, payload in jobs[len(got) - 1:]:
            index.apply_raw(worker, payload)
        assert _state(index) == _state(clean), f"allocation {k}: a batch was half applied"
    else:
        pytest.fail(f"apply_raw_many still failed at allocation {MAX_K}")
    assert failed > 0
