"""KvIndex edge cases: partial tails, atomicity, tiers, namespaces, hash shapes, snapshots."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from tokenspeed_router.errors import SnapshotError, UnknownParentError, WireError
from tokenspeed_router.events import decode_batch, encode_batch
from tokenspeed_router.events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from tokenspeed_router.hashing import block_hashes
from tokenspeed_router.router import index as index_module
from tokenspeed_router.router.index import NATIVE_AVAILABLE, KvIndex, lora_key
from tokenspeed_router.router.tiers import normalize_medium

CORES = ["reference", "native"] if NATIVE_AVAILABLE else ["reference"]


@pytest.fixture(autouse=True, params=CORES)
def core(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs against both index cores (``KvIndex()`` picks the parameter)."""
    monkeypatch.setattr(index_module, "_DEFAULT_CORE", request.param)
    return str(request.param)

BS = 4
TOKENS = list(range(100, 124))  # 6 full blocks of 4


def stored(hashes: list, tokens: list[int], parent: object = None, **kw: object) -> BlockStored:
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=kw.pop("block_size", BS), **kw
    )


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(0.0, list(events))  # type: ignore[arg-type]


def chain_index(worker: str = "w", n: int = 6, **kw: object) -> KvIndex:
    index = KvIndex()
    index.apply(worker, batch(stored(list(range(1, n + 1)), TOKENS[: n * BS], **kw)))
    return index


def test_full_chain_matches_and_stops_at_query_end() -> None:
    index = chain_index()
    assert index.match(TOKENS) == {"w": 6}
    assert index.match(TOKENS[:10]) == {"w": 2}  # trailing partial query block never counts
    assert index.match(TOKENS[:3]) == {"w": 0}  # a known worker always appears, with 0
    assert index.match([]) == {"w": 0}
    assert index.match([*TOKENS[:8], 1, 2, 3, 4, *TOKENS[12:]]) == {"w": 2}


def test_empty_index_and_unknown_worker() -> None:
    index = KvIndex()
    assert index.match(TOKENS) == {}
    assert index.num_blocks() == 0
    assert index.block_size_of("nobody") is None
    index.clear_worker("nobody")
    index.remove_worker("nobody")
    assert index.workers() == []


def test_match_accepts_numpy_tuples_and_rejects_bad_tokens() -> None:
    index = chain_index()
    assert index.match(tuple(TOKENS)) == {"w": 6}
    assert index.match(np.array(TOKENS, dtype=np.int64)) == {"w": 6}
    assert index.match(np.array(TOKENS, dtype=np.uint32)) == {"w": 6}
    assert index.match(np.array(TOKENS[:9], dtype=np.int32)) == {"w": 2}
    with pytest.raises(WireError):
        index.match([-1, 0, 1, 2, 3, 4, 5, 6])
    with pytest.raises(WireError):
        index.match(np.array([0.5] * 8))


def test_content_ids_are_the_shared_hash() -> None:
    """The index's content id of a block is hashing.block_hashes (the cache publishes those)."""
    index = KvIndex()
    ids = block_hashes(TOKENS, BS)
    index.apply("ours", batch(stored(ids, TOKENS)))  # external ids == content ids
    snap = msgspec.msgpack.decode(index.snapshot())
    (worker,) = snap["workers"]
    assert dict(zip(worker[2], worker[3], strict=True)) == {c: c for c in ids}  # entries in no set order
    assert index.match(TOKENS) == {"ours": 6}


def test_long_query_crosses_hashing_chunks() -> None:
    tokens = list(range(5000, 5000 + 16 * 300))
    index = KvIndex()
    index.apply("w", batch(stored(list(range(300)), tokens, block_size=16)))
    assert index.match(tokens) == {"w": 300}
    assert index.match(tokens[: 16 * 77 + 5]) == {"w": 77}
    other = tokens[:]
    other[16 * 200 + 3] = 1
    assert index.match(other) == {"w": 200}


def test_partial_tail_is_kept_counted_and_removable_but_never_matched() -> None:
    index = KvIndex()
    index.apply("w", batch(stored([1, 2, 3], TOKENS[:10])))  # 2 full + 2-token tail
    assert index.num_blocks("w") == 3
    assert index.match(TOKENS[:12]) == {"w": 2}
    assert index.statistics()["workers"]["w"]["unmatchable_blocks"] == 1
    index.apply("w", batch(BlockRemoved(block_hashes=[3])))
    assert index.num_blocks("w") == 2
    assert index.statistics()["workers"]["w"]["unknown_removals"] == 0


def test_children_of_a_partial_block_never_match() -> None:
    index = KvIndex()
    index.apply("w", batch(stored([1], TOKENS[:2])))
    index.apply("w", batch(stored([2], TOKENS[2:6], parent=1)))
    assert index.num_blocks("w") == 2
    assert index.match(TOKENS) == {"w": 0}


def test_unknown_parent_raises_and_leaves_index_unchanged() -> None:
    index = chain_index(n=2)
    before = index.snapshot()
    bad = batch(stored([10], TOKENS[:4]), stored([11], TOKENS[4:8], parent=999))
    with pytest.raises(UnknownParentError) as info:
        index.apply("w", bad)
    assert info.value.parent_hash == 999 and info.value.worker == "w"
    assert index.statistics()["workers"]["w"]["unknown_parents"] == 1
    assert index.num_blocks("w") == 2
    # a new worker whose first batch fails is not registered
    with pytest.raises(UnknownParentError):
        index.apply("fresh", batch(stored([1], TOKENS[:4], parent=5)))
    assert index.workers() == ["w"]
    after = msgspec.msgpack.decode(index.snapshot())
    assert _entries(after) == _entries(msgspec.msgpack.decode(before))


def _entries(snap: dict) -> list:
    """A snapshot's workers as order-free sets of (ext, content, unmatchable, tier)."""
    out = []
    for name, bs, ext, content, unm, tier_index, tier_code, _counters in snap["workers"]:
        codes = dict(zip(tier_index, tier_code, strict=True))
        out.append((name, bs, {(e, c, i in unm, codes.get(i)) for i, (e, c) in enumerate(zip(ext, content, strict=True))}))
    return out


def test_mixed_batch_whose_parent_was_just_removed_is_undone() -> None:
    index = chain_index(n=3)
    snap = index.snapshot()
    events = batch(
        stored([50, 51], [7, 7, 7, 7, 8, 8, 8, 8]),
        BlockRemoved(block_hashes=[3, 2]),
        AllBlocksCleared(medium="cpu"),
        stored([4], TOKENS[12:16], parent=3),
    )
    with pytest.raises(UnknownParentError):
        index.apply("w", events)
    assert index.match(TOKENS) == {"w": 3}
    assert index.match([7, 7, 7, 7]) == {"w": 0}
    assert index.num_blocks("w") == 3
    restored = KvIndex.restore(snap)
    assert restored.match(TOKENS) == index.match(TOKENS)
    # the same batch with the parent kept is fine
    index.apply("w", batch(BlockRemoved(block_hashes=[3]), stored([4], [0, 0, 0, 0], parent=2)))
    assert index.match(TOKENS) == {"w": 2}


def test_parent_stored_earlier_in_the_same_batch() -> None:
    index = KvIndex()
    index.apply("w", batch(stored([1, 2], TOKENS[:8]), stored([3], TOKENS[8:12], parent=2)))
    assert index.match(TOKENS) == {"w": 3}


def test_inconsistent_token_count_is_rejected_before_mutation() -> None:
    index = KvIndex()
    with pytest.raises(WireError):
        index.apply("w", batch(stored([1], TOKENS[:4]), stored([2, 3], TOKENS[:3])))
    assert index.workers() == []


def test_unknown_removal_is_counted_and_harmless() -> None:
    index = chain_index(n=2)
    stats = index.apply("w", batch(BlockRemoved(block_hashes=[77, b"x", -5])))
    assert stats.unknown_removals == 3 and stats.removed_blocks == 0
    assert index.statistics()["unknown_removals"] == 3
    assert index.match(TOKENS) == {"w": 2}


def test_removal_in_the_middle_of_a_chain_stops_the_match() -> None:
    index = chain_index(n=4)
    index.apply("w", batch(BlockRemoved(block_hashes=[2])))
    assert index.match(TOKENS) == {"w": 1}
    index.apply("w", batch(BlockRemoved(block_hashes=[1])))
    assert index.match(TOKENS) == {"w": 0}
    assert index.num_blocks("w") == 2  # blocks 3 and 4 are still held (orphans)


def test_duplicate_stores_are_idempotent() -> None:
    index = chain_index(n=3)
    stats = index.apply("w", batch(stored([1, 2, 3], TOKENS[:12])))
    assert stats.duplicate_blocks == 3 and stats.stored_blocks == 0
    assert index.num_blocks("w") == 3
    index.apply("w", batch(BlockRemoved(block_hashes=[3])))
    assert index.match(TOKENS) == {"w": 2}


def test_external_hash_shapes_int_bytes_negative() -> None:
    index = KvIndex()
    index.apply("u64", batch(stored([2**64 - 1, 2**63], TOKENS[:8])))
    index.apply("bytes", batch(stored([b"\x01" * 32], TOKENS[:4]), stored([b"\x02" * 32], TOKENS[4:8], parent=b"\x01" * 32)))
    index.apply("signed", batch(stored([-(2**63), -1], TOKENS[:8])))
    assert index.match(TOKENS) == {"u64": 2, "bytes": 2, "signed": 2}
    index.apply("bytes", batch(BlockRemoved(block_hashes=[b"\x02" * 32])))
    index.apply("signed", batch(BlockRemoved(block_hashes=[-(2**63)])))
    assert index.match(TOKENS) == {"u64": 2, "bytes": 1, "signed": 0}
    assert KvIndex.restore(index.snapshot()).match(TOKENS) == {"u64": 2, "bytes": 1, "signed": 0}


def test_engine_hashes_are_never_trusted_for_matching() -> None:
    """Two workers with different ids for the same tokens match alike; same ids, other tokens don't."""
    index = KvIndex()
    index.apply("a", batch(stored([1, 2], TOKENS[:8])))
    index.apply("b", batch(stored([901, 902], TOKENS[:8])))
    index.apply("c", batch(stored([1, 2], [9] * 8)))
    assert index.match(TOKENS) == {"a": 2, "b": 2, "c": 0}


def test_tiers_several_copies_and_best_tier_detail() -> None:
    index = chain_index(n=3)
    index.apply("w", batch(stored([1, 2], TOKENS[:8], medium="CPU")))
    assert index.blocks_by_tier("w") == {"gpu": 3, "cpu": 2, "storage": 0}
    index.apply("w", batch(BlockRemoved(block_hashes=[1, 2], medium="GPU")))
    detail = index.match_detail(TOKENS)
    assert detail.scores == {"w": 3}
    assert detail.tiers == {"w": {"gpu": 1, "cpu": 2, "storage": 0}}
    assert detail.block_size == {"w": BS}
    # a removal naming a tier the block is not on changes nothing
    index.apply("w", batch(BlockRemoved(block_hashes=[1], medium="DISK")))
    assert index.match(TOKENS) == {"w": 3}
    assert index.statistics()["workers"]["w"]["tier_mismatch_removals"] == 1
    # no medium on a block held only off-GPU: the engine says it is gone
    index.apply("w", batch(BlockRemoved(block_hashes=[1])))
    assert index.match(TOKENS) == {"w": 0}


def test_all_blocks_cleared_for_one_medium_or_all() -> None:
    index = chain_index(n=3)
    index.apply("w", batch(stored([1], TOKENS[:4], medium="cpu_pinned")))
    index.apply("w", batch(AllBlocksCleared(medium="GPU")))
    assert index.match(TOKENS) == {"w": 1}
    assert index.blocks_by_tier("w") == {"gpu": 0, "cpu": 1, "storage": 0}
    index.apply("w", batch(stored([2], TOKENS[4:8], parent=1, medium="DISK")))
    stats = index.apply("w", batch(AllBlocksCleared()))
    assert stats.cleared == 1 and stats.removed_blocks == 2
    assert index.num_blocks("w") == 0 and index.match(TOKENS) == {"w": 0}
    assert index.workers() == ["w"] and index.block_size_of("w") == BS


def test_medium_normalisation() -> None:
    assert [normalize_medium(m) for m in (None, "GPU", "gpu", "device")] == ["gpu"] * 4
    assert [normalize_medium(m) for m in ("CPU", "cpu", "CPU_PINNED", "host")] == ["cpu"] * 4
    assert [normalize_medium(m) for m in ("STORAGE", "DISK", "EXTERNAL")] == ["storage"] * 3
    before = KvIndex().statistics()["unknown_media"].get("tape", 0)
    assert normalize_medium("tape") == "storage"
    assert KvIndex().statistics()["unknown_media"]["tape"] == before + 1


def test_lora_and_salt_namespaces_are_isolated_and_inherited() -> None:
    index = KvIndex()
    index.apply("lora", batch(stored([1, 2], TOKENS[:8], lora_id=7)))
    index.apply("lora", batch(stored([3], TOKENS[8:12], parent=2)))  # child: no lora field
    index.apply("salted", batch(stored([1, 2, 3], TOKENS[:12], cache_salt="tenant-a")))
    index.apply("named", batch(stored([1], TOKENS[:4], lora_name="adapter-x")))
    index.apply("plain", batch(stored([1], TOKENS[:4])))
    assert index.match(TOKENS) == {"lora": 0, "salted": 0, "named": 0, "plain": 1}
    assert index.match(TOKENS, lora_id=7) == {"lora": 3, "salted": 0, "named": 0, "plain": 0}
    assert index.match(TOKENS, lora_id=8) == {"lora": 0, "salted": 0, "named": 0, "plain": 0}
    assert index.match(TOKENS, salt="tenant-a") == {"lora": 0, "salted": 3, "named": 0, "plain": 0}
    assert index.match(TOKENS, salt="tenant-b") == {"lora": 0, "salted": 0, "named": 0, "plain": 0}
    assert index.match(TOKENS, lora_id=7, salt="tenant-a") == {"lora": 0, "salted": 0, "named": 0, "plain": 0}
    assert index.match(TOKENS, lora_id="adapter-x") == {"lora": 0, "salted": 0, "named": 1, "plain": 0}
    assert lora_key(None, "adapter-x") == lora_key("adapter-x")
    assert lora_key(3, "ignored") == 3


def test_mixed_block_sizes_side_by_side() -> None:
    tokens = list(range(64))
    index = KvIndex()
    index.apply("small", batch(stored(list(range(8)), tokens[:32], block_size=4)))
    index.apply("big", batch(stored([1, 2, 3], tokens[:48], block_size=16)))
    index.apply("other", batch(stored([1], tokens[:8], block_size=8)))
    assert index.match(tokens) == {"small": 8, "big": 3, "other": 1}
    assert index.match(tokens[:20]) == {"small": 5, "big": 1, "other": 1}
    assert index.match_detail(tokens).block_size == {"small": 4, "big": 16, "other": 8}
    assert index.statistics()["block_sizes"] == [4, 8, 16]


def test_events_on_another_block_grid_are_kept_but_never_matched() -> None:
    """vLLM's cache_partial_block: block_size = token count, not the worker's size."""
    index = chain_index(n=2)
    index.apply("w", batch(stored([9], TOKENS[8:11], parent=2, block_size=3)))  # a partial block
    index.apply("w", batch(stored([10, 11], TOKENS[:6], block_size=3)))
    assert index.statistics()["workers"]["w"]["block_size_mismatches"] == 1
    assert index.num_blocks("w") == 5
    assert index.match(TOKENS) == {"w": 2}
    index.apply("w", batch(BlockRemoved(block_hashes=[9, 10, 11])))
    assert index.num_blocks("w") == 2


def test_aliases_one_content_under_two_external_ids() -> None:
    index = chain_index(n=1)
    index.apply("w", batch(stored([100], TOKENS[:4])))
    assert index.num_blocks("w") == 2
    index.apply("w", batch(BlockRemoved(block_hashes=[1])))
    assert index.match(TOKENS) == {"w": 1}
    index.apply("w", batch(BlockRemoved(block_hashes=[100])))
    assert index.match(TOKENS) == {"w": 0}


def test_workers_dp_ranks_slots_and_removal() -> None:
    index = KvIndex()
    for name in ("eng/dp0", "eng/dp1", "solo"):
        index.apply(name, batch(stored([1, 2], TOKENS[:8])))
    assert index.match(TOKENS) == {"eng/dp0": 2, "eng/dp1": 2, "solo": 2}
    index.clear_worker("eng/dp1")
    assert index.workers() == ["eng/dp0", "eng/dp1", "solo"]
    index.remove_worker("eng/dp0")
    assert index.workers() == ["eng/dp1", "solo"] and index.block_size_of("eng/dp0") is None
    index.apply("late", batch(stored([1], TOKENS[:4])))  # reuses the freed slot
    assert index.match(TOKENS) == {"eng/dp1": 0, "solo": 2, "late": 1}  # cleared: known, 0; removed: gone
    assert index.num_distinct_blocks() == 2


def test_snapshot_rejects_unknown_versions_and_garbage() -> None:
    index = chain_index()
    good = msgspec.msgpack.decode(index.snapshot())
    for key, value in (("version", 99), ("hash_version", 2), ("format", "other")):
        bad = dict(good, **{key: value})
        with pytest.raises(SnapshotError):
            KvIndex.restore(msgspec.msgpack.encode(bad))
    with pytest.raises(SnapshotError):
        KvIndex.restore(b"\x00garbage")
    with pytest.raises(SnapshotError):
        KvIndex.restore(index.snapshot()[:-3])


def test_dump_events_survive_the_wire_and_rebuild_the_index() -> None:
    index = chain_index(n=5)
    index.apply("w", batch(stored([1], TOKENS[:4], medium="CPU")))
    index.apply("w", batch(stored([40, 41], [5, 5, 5, 5, 6, 6])))  # partial tail
    index.apply("empty", batch(stored([1], TOKENS[:4])))
    index.apply("empty", batch(BlockRemoved(block_hashes=[1])))
    rebuilt = KvIndex()
    for worker, batches in index.dump_events().items():
        for b in batches:
            rebuilt.apply(worker, decode_batch(encode_batch(b, wire_format="map")))
    assert rebuilt.workers() == index.workers()
    assert rebuilt.block_size_of("empty") == BS and rebuilt.num_blocks("empty") == 0
    for tokens in (TOKENS, [5, 5, 5, 5, 6, 6, 6, 6]):
        assert rebuilt.match_detail(tokens) == index.match_detail(tokens)
    assert rebuilt.blocks_by_tier("w") == index.blocks_by_tier("w")
    assert rebuilt.num_blocks("w") == index.num_blocks("w") == 7


def test_apply_stats() -> None:
    index = KvIndex()
    stats = index.apply("w", batch(stored([1, 2, 3], TOKENS[:12]), BlockRemoved(block_hashes=[3, 4])))
    assert (stats.events, stats.stored_blocks, stats.removed_blocks, stats.unknown_removals) == (2, 3, 1, 1)


def test_ids_across_batches_tiers_and_cores(core: str) -> None:
    """Parents, duplicates, tiers and removals across batches; snapshots restore into either core."""
    index = KvIndex()
    index.apply("w", batch(stored([1, 2, 3], TOKENS[:12])))
    index.apply("w", batch(stored([4], TOKENS[12:16], parent=3)))  # parent already compacted
    assert index.match(TOKENS) == {"w": 4}
    stats = index.apply("w", batch(stored([2], TOKENS[4:8], parent=1)))
    assert stats.duplicate_blocks == 1 and index.num_blocks("w") == 4
    index.apply("w", batch(stored([2], TOKENS[4:8], parent=1, medium="cpu")))  # tier on a compacted id
    assert index.blocks_by_tier("w") == {"gpu": 4, "cpu": 1, "storage": 0}
    stats = index.apply("w", batch(BlockRemoved(block_hashes=[3, 999])))
    assert (stats.removed_blocks, stats.unknown_removals) == (1, 1)
    assert index.match(TOKENS) == {"w": 2}
    with pytest.raises(UnknownParentError):
        index.apply("w", batch(stored([5], [1, 1, 1, 1], parent=3)))
    index.apply("w", batch(BlockRemoved(block_hashes=[2], medium="GPU")))
    assert index.match(TOKENS) == {"w": 2}  # still on CPU
    for other in (KvIndex.restore(index.snapshot(), core="reference"), KvIndex.restore(index.snapshot())):
        assert other.match_detail(TOKENS) == index.match_detail(TOKENS)
        assert other.num_blocks("w") == index.num_blocks("w")
    index.apply("w", batch(AllBlocksCleared(medium="cpu")))
    assert index.match(TOKENS) == {"w": 1}
    index.clear_worker("w")
    assert index.num_blocks("w") == 0 and index.match(TOKENS) == {"w": 0}


def test_bytes_and_signed_ids_stay_exact() -> None:
    index = KvIndex()
    index.apply("b", batch(stored([b"a" * 16, b"b" * 16], TOKENS[:8])))
    index.apply("s", batch(stored([-3, 7, -(2**63)], TOKENS[:12])))
    index.apply("s", batch(stored([b"12"], TOKENS[12:16], parent=-(2**63))))  # b"12" is not the int 12
    assert index.match(TOKENS) == {"b": 2, "s": 4}
    index.apply("s", batch(BlockRemoved(block_hashes=[12])))
    assert index.statistics()["workers"]["s"]["unknown_removals"] == 1
    index.apply("s", batch(BlockRemoved(block_hashes=[7])))
    assert index.match(TOKENS) == {"b": 2, "s": 1}


def test_native_core_is_compact() -> None:
    """The compiled core keeps a block in far less memory than the reference's dicts."""
    if not NATIVE_AVAILABLE:
        pytest.skip("the native core is not built")
    tokens = list(range(1000, 1000 + 16 * 4000))
    ids = [(i * 0x9E3779B97F4A7C15) % 2**64 for i in range(1, 4001)]
    per_block = {}
    for kind in ("reference", "native"):
        index = KvIndex(core=kind)
        for i in range(0, 4000, 100):
            index.apply("w", batch(stored(ids[i : i + 100], tokens[i * 16 : (i + 100) * 16], parent=ids[i - 1] if i else None, block_size=16)))
        assert index.match(tokens) == {"w": 4000}
        per_block[kind] = index.memory_bytes() / 4000
    assert per_block["native"] < 80 < per_block["reference"]


def test_pre_hashed_stores_index_the_given_content_hashes() -> None:
    """A relay's --hashes-only mode (DESIGN §12): no token ids, block_hashes are content hashes."""
    ids = block_hashes(TOKENS, BS)
    index = KvIndex()
    index.apply("relay", batch(BlockStored(block_hashes=ids[:2], parent_block_hash=None, token_ids=[], block_size=BS)))
    index.apply("relay", batch(BlockStored(block_hashes=ids[2:4], parent_block_hash=ids[1], token_ids=[], block_size=BS)))
    index.apply("plain", batch(stored([7, 8, 9], TOKENS[:12])))
    assert index.match(TOKENS) == {"relay": 4, "plain": 3}
    assert index.block_size_of("relay") == BS
    index.apply("relay", batch(BlockRemoved(block_hashes=[ids[2]])))
    assert index.match(TOKENS) == {"relay": 2, "plain": 3}
    with pytest.raises(UnknownParentError):
        index.apply("relay", batch(BlockStored(block_hashes=[ids[5]], parent_block_hash=ids[4], token_ids=[], block_size=BS)))
    assert KvIndex.restore(index.snapshot()).match(TOKENS) == {"relay": 2, "plain": 3}
    # an engine's signed view of the same 64 bits names the same content
    signed = [h - 2**64 if h >= 2**63 else h for h in ids]
    index.apply("signed", batch(BlockStored(block_hashes=signed[:3], parent_block_hash=None, token_ids=[], block_size=BS)))
    assert index.match(TOKENS)["signed"] == 3
    index.apply("signed", batch(BlockRemoved(block_hashes=[signed[1]])))
    assert index.match(TOKENS)["signed"] == 1


def test_pre_hashed_stores_reject_non_u64_ids_before_any_change() -> None:
    index = KvIndex()
    for bad_ids, parent in (([b"x" * 8], None), ([2**64], None), ([-(2**63) - 1], None), ([1], b"p")):
        with pytest.raises(WireError):
            index.apply("relay", batch(BlockStored(block_hashes=bad_ids, parent_block_hash=parent, token_ids=[], block_size=BS)))
    assert index.workers() == []


def test_more_workers_than_one_mask_word() -> None:
    """Past 64 workers the native core widens its holder masks; answers stay exact."""
    index = KvIndex()
    names = [f"w{i}" for i in range(130)]
    for k, name in enumerate(names):
        index.apply(name, batch(stored(list(range(1, 2 + k % 6)), TOKENS[: (1 + k % 6) * BS])))
    assert index.match(TOKENS) == {name: 1 + k % 6 for k, name in enumerate(names)}
    for name in names[::3]:
        index.remove_worker(name)
    index.apply("w1", batch(BlockRemoved(block_hashes=[1])))
    want = {name: 1 + k % 6 for k, name in enumerate(names) if k % 3}
    want["w1"] = 0
    assert index.match(TOKENS) == want
    assert KvIndex.restore(index.snapshot(), core="reference").match(TOKENS) == want
