"""KvIndex against a brute-force reference, driven by random event streams.

The reference keeps, per worker, every block as its full token prefix (plus
namespace, tiers and whether it is a full block) and answers a query by
comparing token lists; the index must give the same ``match``,
``match_detail``, block counts and tier counts after every step, across
workers with different block sizes and external-hash styles (u64, bytes,
signed, small counters), DP-rank names, tiers, LoRAs and salts, partial
tails, mixed batches whose parent disappears (atomic rejection), restarts
and removals. Snapshot/restore and dump_events must answer identically.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field
from typing import Any

import msgspec
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tokenspeed_router.errors import UnknownParentError
from tokenspeed_router.events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
)
from tokenspeed_router.router.index import NATIVE_AVAILABLE, KvIndex, MatchDetail, lora_key

#: worker -> (block size, external hash style)
WORKERS = {"a": (2, "u64"), "b": (2, "bytes"), "eng/dp0": (3, "signed"), "eng/dp1": (2, "small")}
MEDIA = {None: "gpu", "GPU": "gpu", "cpu": "cpu", "CPU_PINNED": "cpu", "DISK": "storage", "weird": "storage"}
MAIN_CORE = "native" if NATIVE_AVAILABLE else "reference"
NAMESPACES = [(None, None), (1, None), (None, "tenant"), (1, "tenant")]
TIER_ORDER = ("gpu", "cpu", "storage")


@dataclass
class RefBlock:
    ns: tuple[int | None, str | None]
    prefix: tuple[int, ...]
    matchable: bool
    tiers: set[str] = field(default_factory=set)


def ext_id(worker: str, block: RefBlock, counters: dict[Any, int]) -> Any:
    """A deterministic engine-style id for a block (same content -> same id)."""
    style = WORKERS[worker][1]
    digest = hashlib.sha256(repr((block.ns, block.prefix, block.matchable)).encode()).digest()
    if style == "u64":
        return int.from_bytes(digest[:8], "little")
    if style == "bytes":
        return digest[:12]
    if style == "signed":
        return int.from_bytes(digest[:8], "big", signed=True)
    key = (worker, block.ns, block.prefix, block.matchable)
    return counters.setdefault(key, len(counters) + 1)


class Reference:
    """Brute force: blocks are token prefixes, a match compares lists."""

    def __init__(self) -> None:
        self.workers: dict[str, dict[Any, RefBlock]] = {}

    def apply(self, worker: str, events: list[Event]) -> None:
        blocks = copy.deepcopy(self.workers.get(worker, {}))
        bs = WORKERS[worker][0]
        for ev in events:
            if isinstance(ev, BlockStored):
                if ev.parent_block_hash is None:
                    ns: tuple[int | None, str | None] = (ev.lora_id, ev.cache_salt)
                    prefix: tuple[int, ...] = ()
                    ok = True
                else:
                    parent = blocks.get(ev.parent_block_hash)
                    if parent is None:
                        raise UnknownParentError(worker, ev.parent_block_hash)
                    ns, prefix, ok = parent.ns, parent.prefix, parent.matchable
                tier = MEDIA[ev.medium]
                for i, e in enumerate(ev.block_hashes):
                    chunk = tuple(ev.token_ids[i * bs : (i + 1) * bs])
                    prefix = prefix + chunk
                    ok = ok and len(chunk) == bs
                    held = blocks.get(e)
                    if held is None:
                        blocks[e] = RefBlock(ns, prefix, ok, {tier})
                    else:
                        held.tiers.add(tier)
            elif isinstance(ev, BlockRemoved):
                for e in ev.block_hashes:
                    held = blocks.get(e)
                    if held is None:
                        continue
                    if ev.medium is None and "gpu" not in held.tiers:
                        held.tiers.clear()
                    else:
                        held.tiers.discard(MEDIA[ev.medium])
                    if not held.tiers:
                        del blocks[e]
            else:
                assert isinstance(ev, AllBlocksCleared)
                if ev.medium is None:
                    blocks.clear()
                else:
                    for e, held in list(blocks.items()):
                        held.tiers.discard(MEDIA[ev.medium])
                        if not held.tiers:
                            del blocks[e]
        self.workers[worker] = blocks

    def match_detail(self, tokens: list[int], lora: int | None, salt: str | None) -> MatchDetail:
        scores: dict[str, int] = {}
        tiers: dict[str, dict[str, int]] = {}
        for worker, blocks in self.workers.items():
            bs = WORKERS[worker][0]
            by_prefix: dict[tuple[int, ...], set[str]] = {}
            for b in blocks.values():
                if b.matchable and b.ns == (lora, salt):
                    by_prefix.setdefault(b.prefix, set()).update(b.tiers)
            counts = dict.fromkeys(TIER_ORDER, 0)
            k = 0
            while (k + 1) * bs <= len(tokens):
                held = by_prefix.get(tuple(tokens[: (k + 1) * bs]))
                if not held:
                    break
                counts[next(t for t in TIER_ORDER if t in held)] += 1
                k += 1
            scores[worker] = k  # every known worker, 0 when nothing matches
            tiers[worker] = counts
        sizes = {w: WORKERS[w][0] for w in self.workers}
        return MatchDetail(scores, tiers, sizes)


def _state(index: KvIndex) -> Any:
    """Everything a batch may change, order-insensitive (counters excluded)."""
    raw = msgspec.msgpack.decode(index.snapshot())
    workers = {}
    for name, bs, ext, content, unmatchable, tier_index, tier_code, _counters in raw["workers"]:
        codes = dict(zip(tier_index, tier_code, strict=True))
        blocks = {e: (c, i in unmatchable, codes.get(i)) for i, (e, c) in enumerate(zip(ext, content, strict=True))}
        workers[name] = (bs, blocks)
    return workers, index.num_distinct_blocks(), sorted((w, index.block_size_of(w)) for w in index.workers())


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = KvIndex(core=MAIN_CORE)
        self.pure = KvIndex(core="reference")  # the readable core, compared step by step
        self.ref = Reference()
        self.counters: dict[Any, int] = {}
        self.rejected = 0

    # ---- helpers

    def _store_event(self, worker: str, data: st.DataObject, parent_ext: Any) -> BlockStored:
        bs = WORKERS[worker][0]
        blocks = self.ref.workers.get(worker, {})
        if parent_ext is not None and parent_ext in blocks:
            parent = blocks[parent_ext]
            ns, prefix, ok = parent.ns, parent.prefix, parent.matchable
            lora, salt = data.draw(st.sampled_from(NAMESPACES))  # ignored: parent's namespace wins
        else:
            lora, salt = data.draw(st.sampled_from(NAMESPACES))
            ns, prefix, ok = (lora, salt), (), True
        n = data.draw(st.integers(1, 3))
        partial = data.draw(st.integers(0, bs - 1)) if data.draw(st.booleans()) else 0
        num = n * bs - partial
        toks = data.draw(st.lists(st.integers(0, 2), min_size=num, max_size=num))
        hashes = []
        for i in range(n):
            chunk = tuple(toks[i * bs : (i + 1) * bs])
            prefix = prefix + chunk
            ok = ok and len(chunk) == bs
            hashes.append(ext_id(worker, RefBlock(ns, prefix, ok), self.counters))
        medium = data.draw(st.sampled_from(list(MEDIA)))
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent_ext,
            token_ids=toks,
            block_size=bs,
            lora_id=lora,
            cache_salt=salt,
            medium=medium,
        )

    def _parent(self, worker: str, data: st.DataObject) -> Any:
        blocks = list(self.ref.workers.get(worker, {}))
        choice = data.draw(st.integers(0, 9))
        if choice < 3 or not blocks:
            return None
        if choice == 9:
            return 987654321 if WORKERS[worker][1] != "bytes" else b"unknown-parent"
        return data.draw(st.sampled_from(blocks))

    def _apply(self, worker: str, events: list[Event]) -> None:
        try:
            self.ref.apply(worker, events)
        except UnknownParentError:
            for index in (self.index, self.pure):
                before = _state(index)
                try:
                    index.apply(worker, KVEventBatch(0.0, events))
                except UnknownParentError:
                    self.rejected += 1
                else:
                    raise AssertionError("index accepted a batch with an unknown parent") from None
                assert _state(index) == before, "rejected batch changed the index"
            return
        stats = self.index.apply(worker, KVEventBatch(0.0, events))
        assert self.pure.apply(worker, KVEventBatch(0.0, events)) == stats

    # ---- rules

    @rule(worker=st.sampled_from(list(WORKERS)), data=st.data())
    def store(self, worker: str, data: st.DataObject) -> None:
        self._apply(worker, [self._store_event(worker, data, self._parent(worker, data))])

    @rule(worker=st.sampled_from(list(WORKERS)), data=st.data())
    def store_chain_batch(self, worker: str, data: st.DataObject) -> None:
        """Several stores in one batch, the second under the first's last block."""
        first = self._store_event(worker, data, self._parent(worker, data))
        events: list[Event] = [first]
        ahead = Reference()
        ahead.workers = copy.deepcopy(self.ref.workers)
        try:
            ahead.apply(worker, [first])
        except UnknownParentError:
            pass
        else:
            # ids of the second event come from the state after the first
            saved, self.ref = self.ref, ahead
            try:
                events.append(self._store_event(worker, data, first.block_hashes[-1]))
            finally:
                self.ref = saved
        self._apply(worker, events)

    @rule(worker=st.sampled_from(list(WORKERS)), data=st.data())
    def remove(self, worker: str, data: st.DataObject) -> None:
        blocks = list(self.ref.workers.get(worker, {}))
        chosen = data.draw(st.lists(st.sampled_from(blocks), max_size=3, unique=True)) if blocks else []
        if data.draw(st.booleans()):
            chosen.append(123456789 if WORKERS[worker][1] != "bytes" else b"never-stored")
        medium = data.draw(st.sampled_from(list(MEDIA)))
        self._apply(worker, [BlockRemoved(block_hashes=chosen, medium=medium)])

    @rule(worker=st.sampled_from(list(WORKERS)), data=st.data())
    def remove_then_store(self, worker: str, data: st.DataObject) -> None:
        """A mixed batch: removals, then a store whose parent may just have gone."""
        blocks = list(self.ref.workers.get(worker, {}))
        if not blocks:
            return
        victim = data.draw(st.sampled_from(blocks))
        medium = data.draw(st.sampled_from(list(MEDIA)))
        store = self._store_event(worker, data, victim)
        events: list[Event] = [BlockRemoved(block_hashes=[victim], medium=medium), store]
        if data.draw(st.booleans()):
            events.insert(0, self._store_event(worker, data, None))
        self._apply(worker, events)

    @rule(worker=st.sampled_from(list(WORKERS)), medium=st.sampled_from([None, "GPU", "cpu", "DISK"]))
    def clear(self, worker: str, medium: str | None) -> None:
        self._apply(worker, [AllBlocksCleared(medium=medium)])

    @rule(worker=st.sampled_from(list(WORKERS)))
    def restart(self, worker: str) -> None:
        self.index.clear_worker(worker)
        self.pure.clear_worker(worker)
        if worker in self.ref.workers:
            self.ref.workers[worker] = {}

    @rule(worker=st.sampled_from(list(WORKERS)))
    def leave(self, worker: str) -> None:
        self.index.remove_worker(worker)
        self.pure.remove_worker(worker)
        self.ref.workers.pop(worker, None)

    @rule()
    def roundtrip(self) -> None:
        """A restored snapshot and a rebuild from dump_events answer identically."""
        restored = KvIndex.restore(self.index.snapshot(), core=MAIN_CORE)
        crossed = KvIndex.restore(self.index.snapshot(), core="reference")
        rebuilt = KvIndex(core=MAIN_CORE)
        for worker, batches in self.index.dump_events().items():
            for batch in batches:
                rebuilt.apply(worker, batch)
        for other in (restored, crossed, rebuilt):
            assert sorted(other.workers()) == sorted(self.index.workers())
            for worker in self.index.workers():
                assert other.num_blocks(worker) == self.index.num_blocks(worker)
                assert other.blocks_by_tier(worker) == self.index.blocks_by_tier(worker)
            for tokens, lora, salt in self._queries():
                assert other.match_detail(tokens, lora, salt) == self.index.match_detail(tokens, lora, salt)
        self.index = restored if len(self.index.workers()) % 2 else rebuilt

    # ---- invariants

    def _queries(self) -> list[tuple[list[int], int | None, str | None]]:
        out: list[tuple[list[int], int | None, str | None]] = [([], None, None), ([0, 1, 2, 0, 1, 2], None, None)]
        for blocks in self.ref.workers.values():
            for b in list(blocks.values())[:12]:
                lora, salt = b.ns
                out.append((list(b.prefix), lora, salt))
                out.append(([*b.prefix, 0, 1, 2, 0], lora, salt))
                out.append((list(b.prefix), None if lora else 1, salt))
        return out

    @invariant()
    def cores_agree(self) -> None:
        """The compiled core and the reference hold the same state."""
        assert _state(self.index) == _state(self.pure)
        keys = ("block_size", "blocks", "tiers", "unmatchable_blocks", "aliased_blocks")
        mine, pure = self.index.statistics()["workers"], self.pure.statistics()["workers"]
        assert {w: [s[k] for k in keys] for w, s in mine.items()} == {w: [s[k] for k in keys] for w, s in pure.items()}

    @invariant()
    def same_answers(self) -> None:
        assert sorted(self.index.workers()) == sorted(self.ref.workers)
        for worker, blocks in self.ref.workers.items():
            assert self.index.num_blocks(worker) == len(blocks)
            by_tier = dict.fromkeys(TIER_ORDER, 0)
            for b in blocks.values():
                for t in b.tiers:
                    by_tier[t] += 1
            assert self.index.blocks_by_tier(worker) == by_tier
        for tokens, lora, salt in self._queries():
            expected = self.ref.match_detail(tokens, lora, salt)
            got = self.index.match_detail(tokens, lora, salt)
            assert got.scores == expected.scores, (tokens, lora, salt)
            assert got.tiers == expected.tiers, (tokens, lora, salt)
            assert self.index.match(tokens, lora, salt) == expected.scores
            # the same query as a LoRA name string must map to the same namespace
            if lora is not None:
                assert lora_key(lora) == lora


IndexMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestIndexStateful = IndexMachine.TestCase
