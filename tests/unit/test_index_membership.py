"""KvIndex: every known worker is answered (zeros too), and block sizes follow restarts."""

from __future__ import annotations

import pytest

from tokenspeed_router.errors import UnknownParentError
from tokenspeed_router.events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from tokenspeed_router.events.subscriber import PublisherRestarted
from tokenspeed_router.hashing import block_hashes
from tokenspeed_router.router import IndexIngestor, KvIndex
from tokenspeed_router.router import index as index_module

CORES = ["reference", "native"] if index_module.NATIVE_AVAILABLE else ["reference"]


@pytest.fixture(autouse=True, params=CORES)
def core(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs against both index cores (``KvIndex()`` picks the parameter)."""
    monkeypatch.setattr(index_module, "_DEFAULT_CORE", request.param)
    return str(request.param)

TOKENS = list(range(1000, 1064))  # 64 tokens: 16 blocks of 4, 8 of 8, 4 of 16
ZERO_TIERS = {"gpu": 0, "cpu": 0, "storage": 0}


def stored(hashes: list[object], tokens: list[int], bs: int, parent: object = None, **kw: object) -> BlockStored:
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=bs, **kw
    )  # type: ignore[arg-type]


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(0.0, list(events))  # type: ignore[arg-type]


def chain(index: KvIndex, worker: str, bs: int, n: int, first_id: int = 1) -> list[int]:
    ids = list(range(first_id, first_id + n))
    index.apply(worker, batch(stored(ids, TOKENS[: n * bs], bs)))  # type: ignore[arg-type]
    return ids


# --- every known worker, zeros included -------------------------------------------------


def test_match_lists_every_known_worker_with_zeros() -> None:
    index = KvIndex()
    chain(index, "a", 4, 3)
    chain(index, "b", 4, 1)
    index.apply("idle", batch())  # an empty batch registers a worker too
    assert index.match(TOKENS) == {"a": 3, "b": 1, "idle": 0}
    assert index.match([7, 7, 7, 7]) == {"a": 0, "b": 0, "idle": 0}
    assert index.match([]) == {"a": 0, "b": 0, "idle": 0}
    detail = index.match_detail([7, 7, 7, 7])
    assert detail.scores == {"a": 0, "b": 0, "idle": 0}
    assert detail.tiers == {"a": ZERO_TIERS, "b": ZERO_TIERS, "idle": ZERO_TIERS}
    assert detail.block_size == {"a": 4, "b": 4}  # "idle" never stored a block: no size
    detail = index.match_detail(TOKENS)
    assert detail.scores == index.match(TOKENS)
    assert detail.tiers["a"] == {"gpu": 3, "cpu": 0, "storage": 0}
    assert all(sum(detail.tiers[w].values()) == s for w, s in detail.scores.items())


def test_cleared_workers_stay_known_removed_ones_are_forgotten() -> None:
    index = KvIndex()
    for w in ("restarted", "cleared", "emptied", "gone"):
        chain(index, w, 4, 2)
    index.clear_worker("restarted")
    index.apply("cleared", batch(AllBlocksCleared()))
    index.apply("emptied", batch(BlockRemoved(block_hashes=[1, 2])))
    index.remove_worker("gone")
    expected = {"restarted": 0, "cleared": 0, "emptied": 0}
    assert index.match(TOKENS) == expected
    assert index.match_detail(TOKENS).scores == expected
    # a cleared worker keeps reporting the block size it last used
    assert index.match_detail(TOKENS).block_size == {"restarted": 4, "cleared": 4, "emptied": 4}
    assert index.workers() == ["restarted", "cleared", "emptied"]
    # a batch refused for an unknown parent does not register a new worker
    with pytest.raises(UnknownParentError):
        index.apply("new", batch(stored([5], TOKENS[:4], 4, parent=999)))
    assert "new" not in index.match(TOKENS)
    # the answer follows snapshots and dumps
    assert KvIndex.restore(index.snapshot()).match(TOKENS) == expected
    rebuilt = KvIndex()
    for worker, batches in index.dump_events().items():
        for b in batches:
            rebuilt.apply(worker, b)
    assert rebuilt.match_detail(TOKENS) == index.match_detail(TOKENS)


def test_workers_version_changes_with_membership_only() -> None:
    index = KvIndex()
    v0 = index.workers_version
    chain(index, "a", 4, 2)
    v1 = index.workers_version
    assert v1 != v0
    index.apply("a", batch(stored([9], TOKENS[8:12], 4, parent=2)))
    index.clear_worker("a")
    assert index.workers_version == v1
    index.remove_worker("a")
    assert index.workers_version != v1


# --- block size re-established when the worker holds nothing ----------------------------


@pytest.mark.parametrize("how", ["clear_worker", "all_blocks_cleared", "removed_all", "same_batch"])
def test_block_size_follows_a_worker_that_holds_nothing(how: str) -> None:
    index = KvIndex()
    ids = chain(index, "w", 4, 4)
    assert index.block_size_of("w") == 4
    new = stored([101, 102, 103], TOKENS[:48], 16)
    if how == "clear_worker":
        index.clear_worker("w")
        index.apply("w", batch(new))
    elif how == "all_blocks_cleared":
        index.apply("w", batch(AllBlocksCleared()))
        index.apply("w", batch(new))
    elif how == "removed_all":
        index.apply("w", batch(BlockRemoved(block_hashes=ids)))
        index.apply("w", batch(new))
    else:
        index.apply("w", batch(AllBlocksCleared(), new))
    assert index.block_size_of("w") == 16
    assert index.match(TOKENS) == {"w": 3}
    assert index.match_detail(TOKENS).block_size == {"w": 16}
    assert index.statistics()["block_sizes"] == [16]
    assert index.statistics()["workers"]["w"]["block_size_mismatches"] == 0
    # the new size survives persistence
    assert KvIndex.restore(index.snapshot()).match(TOKENS) == {"w": 3}
    # single-block events on the new grid take the fast path and chain on
    index.apply("w", batch(stored([104], TOKENS[48:64], 16, parent=103)))
    assert index.match(TOKENS) == {"w": 4}


def test_restarted_publisher_with_another_block_size_matches_again() -> None:
    index = KvIndex()
    ingestor = IndexIngestor(index)
    tokens = list(range(64))
    ingestor.on_record("w", 0, batch(stored(block_hashes(tokens, 16), tokens, 16)), 1.0)
    assert index.match(tokens) == {"w": 4}
    ingestor.on_item(PublisherRestarted("w", 0, 0, 1))  # live path: cleared, still known
    assert index.match(tokens) == {"w": 0}
    ingestor.on_record("w", 1, batch(stored(block_hashes(tokens[:32], 32), tokens[:32], 32)), 2.0)
    assert index.block_size_of("w") == 32 and index.match(tokens) == {"w": 1}
    # log replay: the seq goes backwards, a restart with yet another size
    ingestor.on_record("w", 0, batch(stored(block_hashes(tokens, 8), tokens, 8)), 3.0)
    assert ingestor.status("w").restarts >= 1
    assert index.block_size_of("w") == 8 and index.match(tokens) == {"w": 8}


def test_a_worker_still_holding_blocks_keeps_its_grid() -> None:
    index = KvIndex()
    chain(index, "w", 4, 2)
    index.apply("w", batch(stored([50, 51], TOKENS[:16], 8)))  # another grid while holding blocks
    assert index.block_size_of("w") == 4
    assert index.match(TOKENS) == {"w": 2}
    assert index.statistics()["workers"]["w"]["block_size_mismatches"] == 1
    # clearing only the CPU tier leaves GPU blocks: still not empty
    index.apply("w", batch(AllBlocksCleared(medium="cpu"), stored([60], TOKENS[:8], 8)))
    assert index.block_size_of("w") == 4


def test_blocks_left_only_on_another_grid_do_not_pin_the_size() -> None:
    index = KvIndex()
    ids = chain(index, "w", 4, 2)
    index.apply("w", batch(stored([50, 51], TOKENS[:16], 8)))  # kept, unmatchable
    index.apply("w", batch(BlockRemoved(block_hashes=ids)))  # nothing matchable left
    index.apply("w", batch(stored([70, 71], TOKENS[:16], 8)))
    assert index.block_size_of("w") == 8 and index.match(TOKENS) == {"w": 2}
    index.apply("w", batch(BlockRemoved(block_hashes=[50, 51])))
    assert index.num_blocks("w") == 2


def test_partial_tail_with_its_own_block_size_is_kept_but_never_matched() -> None:
    """vLLM's cache_partial_block: a lone block whose block_size is its token count."""
    index = KvIndex()
    chain(index, "w", 16, 2)
    index.apply("w", batch(stored([9], TOKENS[32:37], 5, parent=2)))
    assert index.block_size_of("w") == 16
    assert index.num_blocks("w") == 3
    assert index.match(TOKENS) == {"w": 2}
    assert index.match(TOKENS[:37]) == {"w": 2}
    assert index.statistics()["workers"]["w"]["unmatchable_blocks"] == 1
    index.apply("w", batch(BlockRemoved(block_hashes=[9])))
    assert index.num_blocks("w") == 2 and index.statistics()["workers"]["w"]["unknown_removals"] == 0


def test_partial_tail_first_after_a_clear_does_not_reset_the_grid() -> None:
    index = KvIndex()
    chain(index, "w", 16, 2)
    index.clear_worker("w")
    index.apply("w", batch(stored([9], TOKENS[:5], 5)))  # a short prompt's partial block
    assert index.block_size_of("w") == 16
    assert index.match(TOKENS) == {"w": 0}
    index.apply("w", batch(stored([1, 2], TOKENS[:32], 16)))
    assert index.match(TOKENS) == {"w": 2}
    index.apply("w", batch(BlockRemoved(block_hashes=[9])))
    assert index.num_blocks("w") == 2


def test_a_refused_batch_leaves_the_block_size_alone() -> None:
    index = KvIndex()
    chain(index, "w", 4, 2)
    with pytest.raises(UnknownParentError):
        index.apply("w", batch(AllBlocksCleared(), stored([7, 8], TOKENS[:16], 8, parent=12345)))
    assert index.block_size_of("w") == 4
    assert index.match(TOKENS) == {"w": 2}
    assert index.statistics()["block_sizes"] == [4]
