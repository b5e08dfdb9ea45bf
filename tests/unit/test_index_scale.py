"""No silent limits: fleets of thousands of workers, dozens of block sizes, churn, id kinds.

Each test runs on both cores and compares them with a brute-force model: a
worker holds a set of content ids (``hashing.reference_block_hashes``, the
pure-Python definition), and its score is how many leading blocks of the
query, in its own block size, are in that set.
"""

from __future__ import annotations

import pytest

from tokenspeed_router.events.schema import BlockRemoved, BlockStored, KVEventBatch
from tokenspeed_router.hashing import reference_block_hashes, root_seed
from tokenspeed_router.router.index import NATIVE_AVAILABLE, KvIndex

CORES = ["reference", "native"] if NATIVE_AVAILABLE else ["reference"]


class Model:
    """Brute force: per worker its block size and the set of content ids it holds."""

    def __init__(self) -> None:
        self.size: dict[str, int] = {}
        self.held: dict[str, set[int]] = {}

    def store(self, worker: str, tokens: list[int], block_size: int) -> None:
        self.size[worker] = block_size
        self.held.setdefault(worker, set()).update(reference_block_hashes(tokens, block_size, root_seed()))

    def match(self, query: list[int]) -> dict[str, int]:
        out = {}
        for worker, held in self.held.items():
            depth = 0
            for h in reference_block_hashes(query, self.size[worker], root_seed()):
                if h not in held:
                    break
                depth += 1
            out[worker] = depth
        return out


def store(index: KvIndex, model: Model, worker: str, tokens: list[int], block_size: int, first_id: int) -> None:
    """One BlockStored of every full block of ``tokens`` (ids first_id, first_id + 1, ...)."""
    n = len(tokens) // block_size
    ids = list(range(first_id, first_id + n))
    ev = BlockStored(block_hashes=ids, parent_block_hash=None, token_ids=tokens[: n * block_size], block_size=block_size)
    index.apply(worker, KVEventBatch(0.0, [ev]))
    model.store(worker, tokens[: n * block_size], block_size)


@pytest.mark.parametrize("core", CORES)
def test_two_thousand_workers_each_get_their_own_prompt_and_the_shared_prefix(core: str) -> None:
    """250 nodes x 8 DP ranks: past slot 512 (64 nodes x 8) nobody is dropped."""
    bs = 4
    shared = list(range(1, 1 + 2 * bs))  # 2 blocks every worker holds
    index, model = KvIndex(core=core), Model()
    names = [f"node{n}/dp{r}" for n in range(250) for r in range(8)]
    for i, name in enumerate(names):
        own = [100_000 + 3 * i, 100_001 + 3 * i, 100_002 + 3 * i, 7]  # one block of its own
        store(index, model, name, shared + own, bs, first_id=1)
    assert len(index.workers()) == 2000
    for i in (0, 511, 512, 513, 1023, 1999):
        name = names[i]
        query = [*shared, 100_000 + 3 * i, 100_001 + 3 * i, 100_002 + 3 * i, 7, 9, 9, 9, 9]
        got = index.match(query)
        assert got == model.match(query)
        assert got[name] == 3
        assert sum(1 for v in got.values() if v == 2) == 1999  # the shared prefix, credited to all others
    assert index.match_detail(shared).scores == dict.fromkeys(names, 2)


@pytest.mark.parametrize("core", CORES)
def test_eighty_block_sizes_are_all_matched(core: str) -> None:
    """A 65th distinct block size (and an 80th) is matched like the first."""
    index, model = KvIndex(core=core), Model()
    query = list(range(1, 400))
    for k in range(160):  # two workers per size, sizes 2..81, different depths
        bs = 2 + k % 80
        depth = 1 + (k // 80) + k % 3
        store(index, model, f"w{k}", query[: depth * bs], bs, first_id=1)
    got = index.match(query)
    assert got == model.match(query)
    assert all(v > 0 for v in got.values())
    detail = index.match_detail(query)
    assert detail.scores == got
    assert len(set(detail.block_size.values())) == 80


@pytest.mark.parametrize("core", CORES)
def test_worker_churn_reuses_slots_and_does_not_grow(core: str) -> None:
    """20,000 workers registered and removed, up to 100 at a time, next to one that stays."""
    bs = 4
    index, model = KvIndex(core=core), Model()
    store(index, model, "stays", list(range(1, 9)), bs, first_id=1)
    live: list[str] = []
    baseline = 0
    for i in range(20_000):
        name = f"tmp{i}"
        ev = BlockStored(block_hashes=[i], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=bs)
        index.apply(name, KVEventBatch(0.0, [ev]))
        live.append(name)
        if len(live) == 100:
            for gone in live:
                index.remove_worker(gone)
            live.clear()
        if i == 999:
            baseline = index.memory_bytes()
    assert index.workers() == ["stays"]
    assert index.memory_bytes() <= baseline
    assert index.match(list(range(1, 9))) == model.match(list(range(1, 9))) == {"stays": 2}
    assert index.num_distinct_blocks() == 2


@pytest.mark.parametrize("core", CORES)
def test_ids_minus_one_and_two_to_the_64_minus_one_stay_distinct(core: str) -> None:
    """Both are 0xffff...ffff as 64 bits; as external ids they name different blocks."""
    bs = 4
    index = KvIndex(core=core)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    index.apply(
        "w",
        KVEventBatch(
            0.0,
            [
                BlockStored(block_hashes=[-1], parent_block_hash=None, token_ids=a, block_size=bs),
                BlockStored(block_hashes=[2**64 - 1], parent_block_hash=None, token_ids=b, block_size=bs),
                BlockStored(block_hashes=[10], parent_block_hash=-1, token_ids=b, block_size=bs),
                BlockStored(block_hashes=[11], parent_block_hash=2**64 - 1, token_ids=a, block_size=bs),
            ],
        ),
    )
    assert index.num_blocks("w") == 4
    assert index.match(a + b) == {"w": 2}
    assert index.match(b + a) == {"w": 2}
    index.apply("w", KVEventBatch(0.0, [BlockRemoved(block_hashes=[-1])]))
    assert index.match(a + b) == {"w": 0}
    assert index.match(b + a) == {"w": 2}
    index.apply("w", KVEventBatch(0.0, [BlockRemoved(block_hashes=[2**64 - 1])]))
    assert index.num_blocks("w") == 2
    assert index.match(b + a) == {"w": 0}
    restored = KvIndex.restore(index.snapshot(), core=core)
    assert restored.num_blocks("w") == 2


@pytest.mark.parametrize("core", CORES)
def test_a_batch_that_empties_a_worker_then_fails_rolls_back_whole(core: str) -> None:
    """Removing every block, storing on another tier, then an unknown parent: all undone."""
    from tokenspeed_router.errors import UnknownParentError

    bs = 4
    index, model = KvIndex(core=core), Model()
    tokens = list(range(1, 1 + 40 * bs))
    store(index, model, "w", tokens, bs, first_id=1)

    def state() -> object:
        return index.match(tokens), index.blocks_by_tier("w"), index.num_blocks("w"), index.num_distinct_blocks()

    before = state()
    events = [
        BlockRemoved(block_hashes=list(range(1, 41))),
        BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=tokens[:bs], block_size=bs, medium="cpu"),
        BlockStored(block_hashes=[8], parent_block_hash=12345, token_ids=tokens[:bs], block_size=bs),
    ]
    with pytest.raises(UnknownParentError):
        index.apply("w", KVEventBatch(0.0, events))
    assert state() == before
    assert index.match(tokens) == model.match(tokens) == {"w": 40}
    index.apply("w", KVEventBatch(0.0, [BlockRemoved(block_hashes=list(range(1, 41)))]))  # ids all still there
    assert index.num_blocks("w") == 0
