"""The relay's state pieces: BlockSet dump == the stream, ContentHasher, SnapshotRing numbering."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from tokenspeed_router.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from tokenspeed_router.hashing import block_hashes
from tokenspeed_router.relay import BlockSet, ContentHasher, SnapshotRing
from tokenspeed_router.router import KvIndex

BS = 4
MEDIA = ("GPU", "CPU")


@dataclass
class _Blk:
    parent: int | None
    tokens: list[int]
    tiers: set[str] = field(default_factory=set)


class _EngineModel:
    """Valid random streams: chains under known parents, tier copies, leaf evictions, clears."""

    def __init__(self, seed: int, *, middle_evictions: bool = False) -> None:
        self.rng = random.Random(seed)
        self.blocks: dict[int, _Blk] = {}
        self.next_id = 1
        #: evict blocks that still have children too (engines do: the children stay held)
        self.middle_evictions = middle_evictions
        self.gone: dict[int, _Blk] = {}  # removed blocks, for chains() below them

    def _children(self, h: int) -> bool:
        return any(b.parent == h for b in self.blocks.values())

    def step(self) -> Event:
        rng, blocks = self.rng, self.blocks
        roll = rng.random()
        full = [h for h, b in blocks.items() if len(b.tokens) == BS]
        if roll < 0.5 or not blocks:
            parent = rng.choice(full) if full and rng.random() < 0.7 else None
            n = rng.randint(1, 3)
            ntok = n * BS - (rng.randint(1, BS - 1) if rng.random() < 0.2 else 0)
            tokens = [rng.randrange(50) for _ in range(ntok)]
            hashes = list(range(self.next_id, self.next_id + n))
            self.next_id += n
            medium = rng.choice(MEDIA)
            p = parent
            for i, h in enumerate(hashes):
                blocks[h] = _Blk(p, tokens[i * BS : (i + 1) * BS], {medium})
                p = h
            return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                               block_size=BS, medium=medium)
        if roll < 0.65:
            if self.gone and rng.random() < 0.3:  # an evicted block stored again
                h = rng.choice(list(self.gone))
                b = self.gone[h]
                if b.parent is None or b.parent in blocks:
                    del self.gone[h]
                    medium = rng.choice(MEDIA)
                    b.tiers = {medium}
                    blocks[h] = b
                    return BlockStored(block_hashes=[h], parent_block_hash=b.parent, token_ids=b.tokens,
                                       block_size=BS, medium=medium)
            h = rng.choice(list(blocks))
            b = blocks[h]
            if b.parent is not None and b.parent not in blocks:
                return self.step()  # a copy names its parent, which must be held
            medium = rng.choice(MEDIA)
            b.tiers.add(medium)
            return BlockStored(block_hashes=[h], parent_block_hash=b.parent, token_ids=b.tokens,
                               block_size=BS, medium=medium)
        if roll < 0.97:
            h = rng.choice(list(blocks))
            b = blocks[h]
            if len(b.tiers) > 1:
                medium = rng.choice(sorted(b.tiers))
                b.tiers.discard(medium)
                return BlockRemoved(block_hashes=[h], medium=medium)
            if self._children(h) and not self.middle_evictions:
                return self.step()
            self.gone[h] = blocks.pop(h)
            return BlockRemoved(block_hashes=[h], medium=rng.choice([None, *b.tiers]))
        blocks.clear()
        return AllBlocksCleared()

    def chains(self) -> list[list[int]]:
        out = []
        for h in self.blocks:
            tokens: list[int] = []
            cur: int | None = h
            while cur is not None:
                b = self.blocks.get(cur) or self.gone[cur]
                tokens = b.tokens + tokens
                cur = b.parent
            out.append(tokens + [999] * BS)
        return out


@pytest.mark.parametrize("middle", [False, True], ids=["leaf-evictions", "middle-evictions"])
@pytest.mark.parametrize("seed", range(6))
def test_blockset_dump_rebuilds_what_the_stream_built(seed: int, middle: bool) -> None:
    model = _EngineModel(seed, middle_evictions=middle)
    streamed, blockset = KvIndex(), BlockSet()
    for _ in range(400):
        batch = KVEventBatch(0.0, [model.step() for _ in range(model.rng.randint(1, 3))])
        streamed.apply("w", batch)
        blockset.apply(batch)
    rebuilt = KvIndex()
    rebuilt.apply("w", KVEventBatch(0.0, [AllBlocksCleared()]))
    dump = blockset.dump()
    assert dump.orphans == 0 and dump.blocks == len(model.blocks)
    rebuilt.apply("w", KVEventBatch(0.0, dump.events))
    assert rebuilt.num_blocks("w") == streamed.num_blocks("w")
    assert rebuilt.blocks_by_tier("w") == streamed.blocks_by_tier("w")
    for tokens in model.chains():
        assert rebuilt.match_detail(tokens) == streamed.match_detail(tokens)


def test_blockset_leaves_out_orphans_and_survives_cycles() -> None:
    bs = BlockSet()
    bs.apply(KVEventBatch(0.0, [
        BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(8)), block_size=BS),
        BlockStored(block_hashes=[3], parent_block_hash=77, token_ids=[1] * BS, block_size=BS),  # orphan
        BlockStored(block_hashes=[4], parent_block_hash=3, token_ids=[2] * BS, block_size=BS),  # under it
        BlockStored(block_hashes=[5], parent_block_hash=6, token_ids=[3] * BS, block_size=BS),  # a cycle
        BlockStored(block_hashes=[6], parent_block_hash=5, token_ids=[4] * BS, block_size=BS),
        BlockRemoved(block_hashes=[42]),
    ]))
    dump = bs.dump()
    assert dump.blocks == 2 and dump.orphans == 4 and bs.unknown_removals == 1
    assert isinstance(dump.events[0], AllBlocksCleared)
    assert [e.block_hashes for e in dump.events[1:] if isinstance(e, BlockStored)] == [[1, 2]]  # one run


def test_hasher_sends_content_hashes_and_drops_what_it_cannot_hash() -> None:
    hasher = ContentHasher()
    tokens = list(range(2 * BS + 2))  # two full blocks and a partial tail
    out = hasher.translate(KVEventBatch(1.0, [
        BlockStored(block_hashes=[10, 11, 12], parent_block_hash=None, token_ids=tokens, block_size=BS,
                    medium="GPU"),
        BlockStored(block_hashes=[13], parent_block_hash=12, token_ids=[5] * BS, block_size=BS),  # under tail
        BlockStored(block_hashes=[14], parent_block_hash=99, token_ids=[6] * BS, block_size=BS),  # unknown
        BlockStored(block_hashes=[15], parent_block_hash=None, token_ids=[1, 2], block_size=BS),  # bad size
    ], 3))
    contents = block_hashes(tokens, BS)
    assert out.ts == 1.0 and out.data_parallel_rank == 3
    assert out.events == [BlockStored(block_hashes=contents, parent_block_hash=None, token_ids=[],
                                      block_size=BS, medium="GPU")]
    stats = hasher.statistics()
    assert (stats.blocks_hashed, stats.blocks_unsent, stats.blocks_unhashable) == (2, 2, 1)
    child = hasher.translate(KVEventBatch(0.0, [
        BlockStored(block_hashes=[20], parent_block_hash=11, token_ids=[7] * BS, block_size=BS, medium="CPU"),
        BlockStored(block_hashes=[11], parent_block_hash=10, token_ids=tokens[BS : 2 * BS], block_size=BS,
                    medium="CPU"),
        BlockRemoved(block_hashes=[11], medium="GPU"),
        BlockRemoved(block_hashes=[12, 13, 14, 99]),
    ]))
    assert child.events == [
        BlockStored(block_hashes=block_hashes([7] * BS, BS, parent=contents[1]), parent_block_hash=contents[1],
                    token_ids=[], block_size=BS, medium="CPU"),
        BlockStored(block_hashes=[contents[1]], parent_block_hash=contents[0], token_ids=[], block_size=BS,
                    medium="CPU"),
        BlockRemoved(block_hashes=[contents[1]], medium="GPU"),
    ]


def test_ring_serves_tail_or_snapshot_numbered_below_it() -> None:
    ring = SnapshotRing(3, blocks_per_batch=2)
    for seq in range(10):
        ev = BlockStored(block_hashes=[seq + 1], parent_block_hash=None, token_ids=[seq] * BS, block_size=BS)
        batch = KVEventBatch(float(seq), [ev])
        ring.append(seq, b"payload%d" % seq, batch)
    assert [s for s, _ in ring.replay_from(8)] == [8, 9]
    assert ring.replay_from(7) == [(7, b"payload7"), (8, b"payload8"), (9, b"payload9")]
    # 7 blocks before the ring + AllBlocksCleared = 8 events = 4 batches of 2, numbered 3..6.
    answer = ring.replay_from(0)
    assert [s for s, _ in answer] == list(range(3, 10))
    snapshot = [decode_batch(p) for _, p in answer[:4]]
    assert snapshot[0].events[0] == AllBlocksCleared()
    assert [e.block_hashes[0] for b in snapshot for e in b.events if isinstance(e, BlockStored)] == list(range(1, 8))
    assert ring.replay_from(0)[:4] == answer[:4]  # cached until the ring moves
    # Only one seq free below the ring: the whole snapshot packs into that one batch.
    packed = ring.replay_from(6)
    assert [s for s, _ in packed] == [6, 7, 8, 9] and len(decode_batch(packed[0][1]).events) == 8
    stats = ring.statistics()
    assert (stats.snapshots_served, stats.base_blocks, stats.first_seq) == (3, 7, 7)
    with pytest.raises(ValueError):
        ring.append(11, b"", KVEventBatch(0.0, []))


@pytest.mark.parametrize("seed", range(8))
def test_router_at_any_seq_ends_exact_after_asking_the_ring(seed: int) -> None:
    """Whatever a router applied before (seqs [0, s)), applying the ring's answer for s
    -- a snapshot when s is older than the ring, a hole meaning "clear first" --
    leaves it equal to a router that applied the whole stream."""
    model = _EngineModel(seed)
    rng = random.Random(seed)
    capacity = rng.randint(1, 20)
    ring = SnapshotRing(capacity, blocks_per_batch=rng.randint(1, 8))
    stream: list[KVEventBatch] = []
    full = KvIndex()
    for seq in range(rng.randint(30, 120)):
        batch = KVEventBatch(float(seq), [model.step() for _ in range(rng.randint(1, 3))])
        stream.append(batch)
        full.apply("w", batch)
        ring.append(seq, encode_batch(batch), batch)
    for start in sorted({0, 1, len(stream) - capacity - 1, len(stream) - 1, *rng.sample(range(len(stream)), 5)}):
        if start < 0:
            continue
        router = KvIndex()
        for batch in stream[:start]:
            router.apply("w", batch)
        answer = ring.replay_from(start)
        if answer and answer[0][0] > start:
            router.clear_worker("w")  # the subscriber reports the hole; the ingestor clears
        assert [s for s, _ in answer] == list(range(answer[0][0], len(stream)))
        for _, payload in answer:
            router.apply("w", decode_batch(payload))
        assert router.num_blocks("w") == full.num_blocks("w"), start
        assert router.blocks_by_tier("w") == full.blocks_by_tier("w")
        for tokens in model.chains():
            assert router.match_detail(tokens) == full.match_detail(tokens)
