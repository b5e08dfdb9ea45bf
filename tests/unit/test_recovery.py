"""Recovery after lost events (router/recovery.py, router/chain_record.py), against a reference engine.

The engine is ``support.lru_engine.LruEngine`` (a prefix cache, LRU by
leaves, opaque stable ids); the router side is a real RoutingCore (index,
ingestor, router). The scenario is the one of issue 33: a worker's shared
prefix was announced in batches that were lost, it is never announced
again, and requests keep extending it.
"""

from __future__ import annotations

import random

import pytest
from support.lru_engine import Fleet, LruEngine

from tokenspeed_router.events.schema import BlockRemoved, BlockStored, KVEventBatch
from tokenspeed_router.hashing import block_hashes, root_seed, tokens_to_bytes
from tokenspeed_router.router import RouterConfig
from tokenspeed_router.router.chain_record import ChainRecord
from tokenspeed_router.router.core import RoutingCore
from tokenspeed_router.router.index import KvIndex
from tokenspeed_router.router.ingest import IndexIngestor, WorkerState
from tokenspeed_router.router.recovery import OrphanPool, inferred_id, is_inferred_id

BS = 4


def _core(**kw: object) -> RoutingCore:
    return RoutingCore(RouterConfig(approx_block_size=BS, **kw), recovery_batches=3)  # type: ignore[arg-type]


def _workload(seed: int, n: int, systems: int = 2) -> list[list[int]]:
    rng = random.Random(seed)
    heads = [[rng.randrange(1000) for _ in range(3 * BS)] for _ in range(systems)]
    return [rng.choice(heads) + [rng.randrange(1000, 10**6) for _ in range(rng.randint(1, 3) * BS)]
            for _ in range(n)]


# --- the chain record ------------------------------------------------------------------


def test_chain_record_names_the_prefix_a_block_extends() -> None:
    record = ChainRecord(BS)
    prompt = list(range(5 * BS))
    root = root_seed()
    record.record(tokens_to_bytes(prompt), root)
    chain = block_hashes(prompt, BS)
    block = tokens_to_bytes(prompt[3 * BS : 4 * BS])
    assert record.parent_chain(block, root) == chain[:3]
    # a first block names nothing (its parent is the root), nor does another namespace
    assert record.parent_chain(tokens_to_bytes(prompt[:BS]), root) is None
    assert record.parent_chain(block, root_seed(7, None)) is None
    assert record.parent_chain(tokens_to_bytes([9] * BS), root) is None


def test_chain_record_refuses_to_guess_between_two_prefixes() -> None:
    record = ChainRecord(BS)
    root = root_seed()
    tail = [7] * BS
    record.record(tokens_to_bytes([1] * BS + tail), root)
    assert record.parent_chain(tokens_to_bytes(tail), root) == block_hashes([1] * BS, BS)
    record.record(tokens_to_bytes([2] * BS + tail), root)  # same block under another prefix
    assert record.parent_chain(tokens_to_bytes(tail), root) is None


def test_chain_record_is_bounded_and_prefix_closed() -> None:
    record = ChainRecord(BS, max_blocks=6)
    root = root_seed()
    old, new = list(range(4 * BS)), list(range(100, 100 + 4 * BS))
    record.record(tokens_to_bytes(old), root)
    record.record(tokens_to_bytes(new), root)
    assert len(record) == 6
    # the old chain lost its deepest blocks first: what is left still reaches the root
    assert record.parent_chain(tokens_to_bytes(old[BS : 2 * BS]), root) == block_hashes(old, BS)[:1]
    assert record.parent_chain(tokens_to_bytes(old[3 * BS :]), root) is None


# --- the orphan pool ---------------------------------------------------------------------


def test_orphan_pool_holds_chains_by_root_and_drops_a_root_with_nothing_held() -> None:
    pool = OrphanPool(max_blocks=100)
    a = BlockStored(block_hashes=[1, 2], parent_block_hash=99, token_ids=list(range(2 * BS)), block_size=BS)
    b = BlockStored(block_hashes=[3], parent_block_hash=2, token_ids=list(range(BS)), block_size=BS)
    pool.hold_store(a, 99)
    pool.hold_store(b, pool.root_of(2))
    assert pool.roots == [99] and pool.num_blocks == 3
    rest = pool.split_removal(BlockRemoved(block_hashes=[1, 55]))
    assert rest == BlockRemoved(block_hashes=[55])
    assert pool.split_removal(BlockRemoved(block_hashes=[2, 3])) is None
    assert not pool and pool.num_blocks == 0  # nothing of root 99 is held: nothing to apply later


def test_inferred_ids_are_not_engine_ids() -> None:
    assert is_inferred_id(inferred_id(12345)) and not is_inferred_id(12345)
    assert not is_inferred_id(b"\x00" * 37)


# --- the scenario ----------------------------------------------------------------


def _lost_prefix_fleet(seed: int = 1) -> tuple[Fleet, list[list[int]]]:
    """w0 announced its shared prefixes in batches that were lost; w1 never lost anything."""
    core = _core()
    engines = {"w0": LruEngine(block_size=BS, capacity_blocks=40), "w1": LruEngine(block_size=BS, capacity_blocks=40)}
    fleet = Fleet(core, engines)
    prompts = _workload(seed, 400)
    for prompt in prompts[:60]:  # warm: both engines fill and evict (the router learns their capacity)
        fleet.request(prompt)
    for prompt in prompts[60:70]:  # w0's batches are lost here (a shed backlog)
        fleet.request(prompt, to="w0", lose=True)
    return fleet, prompts


def test_a_lost_shared_prefix_is_named_from_routes_and_the_worker_returns_live() -> None:
    fleet, prompts = _lost_prefix_fleet()
    core = fleet.core
    fleet.request(prompts[70], to="w0")  # the first batch after the loss: a gap, a resync
    assert core.ingestor.state("w0") is WorkerState.RESYNCING and core.is_cold("w0")
    served = {"w0": 0, "w1": 0}
    for prompt in prompts[71:]:
        served[fleet.request(prompt)] += 1
        fleet.check_sound(prompts)
    st = core.ingestor.status("w0")
    assert st.state is WorkerState.LIVE, st
    assert st.named_parents >= 1 and st.adopted_blocks > 0
    assert served["w0"] > 50  # it kept being routed meanwhile
    assert fleet.exact(prompts), "after recovery the index equals the engine's cache"


def test_recovering_worker_is_credited_with_what_was_routed_there() -> None:
    fleet, prompts = _lost_prefix_fleet()
    core = fleet.core
    fleet.request(prompts[70], to="w0")
    assert core.ingestor.state("w0") is WorkerState.RESYNCING
    prompt = next(p for p in prompts[71:] if fleet.request(p) == "w0")  # the router sent it there
    assert core.ingestor.state("w0") is WorkerState.RESYNCING
    decision = core.route(prompt)
    credit = decision.credits.get("w0")
    assert credit is not None and credit.tokens >= len(prompt) // BS * BS - BS
    core.release(decision.request_id)


def test_an_unknown_removal_drops_every_inferred_block_and_a_store_under_the_anchor_readopts() -> None:
    core = _core()
    idx = core.index
    engine = LruEngine(block_size=BS, capacity_blocks=1000)
    fleet = Fleet(core, {"w0": engine})
    head = list(range(4 * BS))
    fleet.request(head + [50] * BS)
    fleet.publish("w0", [], lose=False)
    fleet.seq["w0"] += 1  # one batch lost: the next is a gap
    fleet.request(head + [51] * BS)  # resync; w0 is the only worker: routed (and recorded) there
    fleet.request(head + [52] * BS)  # stored under head's last block: an orphan, named from the route
    st = core.ingestor.status("w0")
    assert st.named_parents == 1 and st.inferred_blocks == 3
    assert idx.match(head)["w0"] == 4
    fleet.publish("w0", [BlockRemoved(block_hashes=[123456789])])  # an id the index cannot place
    assert core.ingestor.status("w0").inferred_blocks == 0 and idx.match(head)["w0"] == 0
    fleet.request(head + [53] * BS)  # a store under the named parent: its chain is held again
    assert core.ingestor.status("w0").inferred_blocks == 3 and idx.match(head)["w0"] == 4
    fleet.check_sound([head, head + [52] * BS, head + [53] * BS])


def test_held_back_orphans_apply_when_their_parent_is_stored_again() -> None:
    index = KvIndex()
    ingestor = IndexIngestor(index, recovery_batches=1)
    tokens = list(range(3 * BS))
    parent = BlockStored(block_hashes=[10], parent_block_hash=None, token_ids=tokens[:BS], block_size=BS)
    child = BlockStored(block_hashes=[11, 12], parent_block_hash=10, token_ids=tokens[BS:], block_size=BS)
    ingestor.on_record("w", 0, KVEventBatch(1.0, [BlockStored(block_hashes=[1], parent_block_hash=None,
                                                               token_ids=[0] * BS, block_size=BS)]), 1.0)
    ingestor.on_record("w", 2, KVEventBatch(1.0, [child]), 1.0)  # seq 1 lost: resync, then an orphan
    assert ingestor.status("w").orphan_blocks == 2 and index.match(tokens)["w"] == 0
    ingestor.on_record("w", 3, KVEventBatch(1.0, [BlockRemoved(block_hashes=[10]), parent]), 1.0)
    st = ingestor.status("w")
    assert st.orphan_blocks == 0 and st.adopted_blocks == 2 and index.match(tokens)["w"] == 3
    assert st.state is WorkerState.LIVE


def test_turnover_is_required_when_the_capacity_is_known() -> None:
    index = KvIndex()
    ingestor = IndexIngestor(index, recovery_batches=1, capacity_blocks=lambda w: 5)
    ingestor.on_record("w", 0, KVEventBatch(1.0, []), 1.0)
    for seq in range(2, 7):
        ingestor.on_record("w", seq, KVEventBatch(1.0, [BlockStored(
            block_hashes=[seq], parent_block_hash=None, token_ids=[seq] * BS, block_size=BS)]), 1.0)
        expected = WorkerState.LIVE if seq - 1 >= 5 else WorkerState.RESYNCING
        assert ingestor.state("w") is expected, seq


@pytest.mark.parametrize("seed", range(4))
def test_recovery_reaches_the_hit_ratio_of_a_run_without_the_loss(seed: int) -> None:
    prompts = _workload(seed, 500, systems=3)

    def run(loss: bool) -> float:
        core = _core()
        fleet = Fleet(core, {n: LruEngine(block_size=BS, capacity_blocks=40) for n in ("w0", "w1")})
        for prompt in prompts[:60]:
            fleet.request(prompt)
        for prompt in prompts[60:70]:
            fleet.request(prompt, to="w0", lose=loss)
        fleet.hits = fleet.tokens = 0
        for i, prompt in enumerate(prompts[70:]):
            if i == 250:
                fleet.hits = fleet.tokens = 0  # measure the second half of the steady load
            fleet.request(prompt)
        assert core.ingestor.state("w0") is WorkerState.LIVE
        return fleet.hits / fleet.tokens

    without, with_loss = run(False), run(True)
    assert with_loss >= without - 0.02, (with_loss, without)


def test_a_snapshot_leaves_inferred_blocks_out() -> None:
    """What tracks inferred blocks (to drop them at a removal the index cannot place) does not
    survive a restore, so a snapshot carries only what the engines announced."""
    core = _core()
    fleet = Fleet(core, {"w0": LruEngine(block_size=BS, capacity_blocks=1000)})
    head = list(range(4 * BS))
    fleet.request(head + [50] * BS)
    fleet.seq["w0"] += 1  # one batch lost
    fleet.request(head + [51] * BS)
    fleet.request(head + [52] * BS)
    assert core.ingestor.status("w0").inferred_blocks == 3
    index = core.index
    restored = KvIndex.restore(index.snapshot())
    assert restored.num_blocks("w0") == index.num_blocks("w0") - 3
    assert restored.match(head)["w0"] == 0 and index.match(head)["w0"] == 4
    assert restored.match(head + [52] * BS) == {"w0": 0}
