"""One engine's block set, folded from its events, dumped back as events.

The relay keeps this as the state *before* the oldest batch of its replay
ring, so that "dump + ring" is exactly the engine's event history folded
(the ZeroMQ guide's Clone pattern: snapshot, then the updates after it).

Semantics mirror :class:`tokenspeed_router.router.KvIndex` for one worker,
so that a router fed the dump ends where a router fed every event ends:

* ``BlockStored`` stores each block under its id with its parent (the event's
  parent for the first block, the previous block for the others), its slice
  of ``token_ids`` (possibly a partial tail, or empty for pre-hashed content
  ids from a ``--hashes-only`` relay) and its tier; storing a known id again
  adds the tier;
* ``BlockRemoved`` drops the named tier, or every tier when no medium is
  named; a block without tiers is gone; unknown ids are counted, not errors;
* ``AllBlocksCleared`` empties one tier, or everything.

:meth:`BlockSet.dump` writes ``AllBlocksCleared`` then ``BlockStored``
events, parents before children, a chain's consecutive blocks of one tier
grouped into one event (up to 256 blocks); a block whose parent is not in
the set (its chain was never complete here) is left out with its
descendants, since a router would reject it as an unknown parent anyway.

Single owner, not thread safe. O(blocks in the event) per event, O(n) dump.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenspeed_router.events.schema import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
)
from tokenspeed_router.router.tiers import medium_code

__all__ = ["BlockSet", "BlockSetDump"]


@dataclass(slots=True)
class _Block:
    parent: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    cache_salt: str | None
    media: dict[int, str | None]
    """tier code -> the medium string the engine used for it."""


#: Blocks per dumped BlockStored: a chain goes out as one event per run of this
#: many blocks (a router applies one multi-block event much faster than as
#: many single-block ones).
_RUN_BLOCKS = 256


class _Run:
    """Consecutive blocks of one chain, same tier and namespace: one BlockStored."""

    __slots__ = ("first", "hashes", "medium", "tokens")

    def __init__(self, h: BlockHash, b: _Block, medium: str | None) -> None:
        self.first = b
        self.medium = medium
        self.hashes = [h]
        self.tokens = list(b.token_ids)

    def extends(self, h: BlockHash, b: _Block, medium: str | None) -> bool:
        f = self.first
        return (
            b.parent == self.hashes[-1]
            and medium == self.medium
            and len(self.hashes) < _RUN_BLOCKS
            and b.block_size == f.block_size
            and (b.lora_id, b.lora_name, b.cache_salt) == (f.lora_id, f.lora_name, f.cache_salt)
            # token ids: all present and the run so far made of full blocks, or all pre-hashed
            and (
                len(self.tokens) == len(self.hashes) * f.block_size and len(b.token_ids) > 0
                if self.tokens
                else not b.token_ids
            )
        )

    def add(self, h: BlockHash, b: _Block) -> None:
        self.hashes.append(h)
        self.tokens.extend(b.token_ids)

    def event(self) -> BlockStored:
        f = self.first
        return BlockStored(
            block_hashes=self.hashes, parent_block_hash=f.parent, token_ids=self.tokens,
            block_size=f.block_size, lora_id=f.lora_id, medium=self.medium,
            lora_name=f.lora_name, cache_salt=f.cache_salt,
        )


@dataclass(frozen=True, slots=True)
class BlockSetDump:
    events: list[Event]
    """``AllBlocksCleared`` then the stores, parents first."""
    blocks: int
    """Blocks written."""
    orphans: int
    """Blocks left out: some ancestor is missing from the set."""


@dataclass(slots=True)
class BlockSet:
    """Blocks by id (see the module docstring)."""

    _blocks: dict[BlockHash, _Block] = field(default_factory=dict)
    unknown_removals: int = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            self.apply_event(event)

    def apply_event(self, event: Event) -> None:
        if isinstance(event, BlockStored):
            self._store(event)
        elif isinstance(event, BlockRemoved):
            self._remove(event.block_hashes, event.medium)
        elif isinstance(event, AllBlocksCleared):
            self._clear(event.medium)

    def clear(self) -> None:
        self._blocks.clear()

    def _store(self, ev: BlockStored) -> None:
        bs = ev.block_size
        toks = ev.token_ids
        code = medium_code(ev.medium)
        parent = ev.parent_block_hash
        blocks = self._blocks
        for i, h in enumerate(ev.block_hashes):
            known = blocks.get(h)
            if known is None:
                blocks[h] = _Block(
                    parent, list(toks[i * bs : (i + 1) * bs]) if toks else [], bs,
                    ev.lora_id, ev.lora_name, ev.cache_salt, {code: ev.medium},
                )
            else:
                known.media.setdefault(code, ev.medium)
            parent = h

    def _remove(self, hashes: list[BlockHash], medium: str | None) -> None:
        blocks = self._blocks
        code = None if medium is None else medium_code(medium)
        for h in hashes:
            block = blocks.get(h)
            if block is None:
                self.unknown_removals += 1
                continue
            if code is not None:
                block.media.pop(code, None)
                if block.media:
                    continue
            del blocks[h]

    def _clear(self, medium: str | None) -> None:
        if medium is None:
            self._blocks.clear()
            return
        code = medium_code(medium)
        gone = []
        for h, block in self._blocks.items():
            block.media.pop(code, None)
            if not block.media:
                gone.append(h)
        for h in gone:
            del self._blocks[h]

    def dump(self) -> BlockSetDump:
        """The whole set as events (see the module docstring)."""
        blocks = self._blocks
        events: list[Event] = [AllBlocksCleared()]
        runs: list[_Run] = []
        done: set[BlockHash] = set()
        orphan: set[BlockHash] = set()
        for start in blocks:
            if start in done or start in orphan:
                continue
            chain = [start]
            in_chain = {start}
            parent = blocks[start].parent
            while parent is not None and parent not in done:
                if parent in orphan or parent not in blocks or parent in in_chain:
                    orphan.update(chain)  # missing ancestor (or a cycle: bad input)
                    chain = []
                    break
                chain.append(parent)
                in_chain.add(parent)
                parent = blocks[parent].parent
            for h in reversed(chain):
                b = blocks[h]
                for medium in b.media.values():
                    run = runs[-1] if runs else None
                    if run is not None and run.extends(h, b, medium):
                        run.add(h, b)
                    else:
                        runs.append(_Run(h, b, medium))
                done.add(h)
        events.extend(run.event() for run in runs)
        return BlockSetDump(events, len(done), len(orphan))
