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

:meth:`BlockSet.dump` writes ``AllBlocksCleared`` then one ``BlockStored``
per block and tier, parents before children; a block whose parent is not in
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
                    events.append(
                        BlockStored(
                            block_hashes=[h], parent_block_hash=b.parent, token_ids=b.token_ids,
                            block_size=b.block_size, lora_id=b.lora_id, medium=medium,
                            lora_name=b.lora_name, cache_salt=b.cache_salt,
                        )
                    )
                done.add(h)
        return BlockSetDump(events, len(done), len(orphan))
