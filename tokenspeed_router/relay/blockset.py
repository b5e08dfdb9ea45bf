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

**Held blocks below a removed one.** An engine may evict a block from the
middle of a chain and keep the blocks after it; a router keeps those (their
content ids were chained through the removed block) and, when the engine
stores the block again, matches the whole chain again. So a removed block
is kept here as a *ghost* (not held, but still the parent of held blocks),
and the dump writes each ghost a held block needs as a store followed, after
every store, by its ``BlockRemoved``: a router fed the dump holds what a
router fed every event holds. Ghosts no held block needs are pruned once
they outnumber the held blocks (amortised O(1) per removal).

Single owner, not thread safe. O(blocks in the event) per event, O(n) dump.
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import Any

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


#: One block is a flat tuple ``(parent, tokens, block_size, lora_id, lora_name,
#: cache_salt, code, medium[, code, medium ...])``: one (tier code, medium as
#: the engine spelled it) pair per tier held. Flat and atomic on purpose:
#: Python's cyclic GC stops tracking such a tuple at its first collection,
#: instead of re-scanning every live block on every collection (dataclass
#: blocks made apply 5x slower at 100k blocks); nested containers would keep
#: it tracked. A change builds a new tuple.
_Block = tuple[Any, ...]
_PARENT, _TOKENS, _BS, _LORA, _LNAME, _SALT, _MEDIA = range(7)


def _media(block: _Block) -> list[tuple[int, str | None]]:
    return list(zip(block[_MEDIA::2], block[_MEDIA + 1 :: 2], strict=True))


def _with_media(block: _Block, media: list[tuple[int, str | None]]) -> _Block:
    return block[:_MEDIA] + tuple(x for pair in media for x in pair)


def _pack(token_ids: list[int]) -> bytes | tuple[int, ...]:
    try:
        return array.array("Q", token_ids).tobytes()
    except (OverflowError, TypeError):  # not u64: keep them as they came
        return tuple(token_ids)


def _num_tokens(tokens: bytes | tuple[int, ...]) -> int:
    return len(tokens) // 8 if isinstance(tokens, bytes) else len(tokens)


def _unpack(tokens: bytes | tuple[int, ...]) -> list[int]:
    if isinstance(tokens, bytes):
        out = array.array("Q")
        out.frombytes(tokens)
        return out.tolist()
    return list(tokens)


#: Blocks per dumped BlockStored: a chain goes out as one event per run of this
#: many blocks (a router applies one multi-block event much faster than as
#: many single-block ones).
_RUN_BLOCKS = 256


class _Run:
    """Consecutive blocks of one chain, same tier and namespace: one BlockStored."""

    __slots__ = ("first", "hashes", "medium", "num_tokens", "parts")

    def __init__(self, h: BlockHash, b: _Block, medium: str | None) -> None:
        self.first = b
        self.medium = medium
        self.hashes = [h]
        self.parts = [b[_TOKENS]]
        self.num_tokens = _num_tokens(b[_TOKENS])

    def extends(self, h: BlockHash, b: _Block, medium: str | None) -> bool:
        f = self.first
        n = _num_tokens(b[_TOKENS])
        return (
            b[_PARENT] == self.hashes[-1]
            and medium == self.medium
            and len(self.hashes) < _RUN_BLOCKS
            and b[_BS] == f[_BS]
            and b[_LORA:_MEDIA] == f[_LORA:_MEDIA]
            # token ids: all present and the run so far made of full blocks, or all pre-hashed
            and (self.num_tokens == len(self.hashes) * f[_BS] and n > 0 if self.num_tokens else n == 0)
        )

    def add(self, h: BlockHash, b: _Block) -> None:
        self.hashes.append(h)
        self.parts.append(b[_TOKENS])
        self.num_tokens += _num_tokens(b[_TOKENS])

    def event(self) -> BlockStored:
        f = self.first
        parts = self.parts
        if all(type(p) is bytes for p in parts):
            tokens = _unpack(b"".join(parts))  # one conversion per run, not per block
        else:
            tokens = [t for p in parts for t in _unpack(p)]
        return BlockStored(
            block_hashes=self.hashes, parent_block_hash=f[_PARENT], token_ids=tokens,
            block_size=f[_BS], lora_id=f[_LORA], medium=self.medium,
            lora_name=f[_LNAME], cache_salt=f[_SALT],
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
    #: removed blocks that may still be the parent of held ones (module docstring)
    _ghosts: dict[BlockHash, _Block] = field(default_factory=dict)
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
        self._ghosts.clear()

    def _store(self, ev: BlockStored) -> None:
        bs = ev.block_size
        toks = ev.token_ids
        code = medium_code(ev.medium)
        parent = ev.parent_block_hash
        blocks = self._blocks
        lora_id, lora_name, salt, medium = ev.lora_id, ev.lora_name, ev.cache_salt, ev.medium
        ghosts = self._ghosts
        for i, h in enumerate(ev.block_hashes):
            known = blocks.get(h)
            if known is None:
                if ghosts:
                    ghosts.pop(h, None)
                tokens = _pack(toks[i * bs : (i + 1) * bs]) if toks else b""
                blocks[h] = (parent, tokens, bs, lora_id, lora_name, salt, code, medium)
            elif code not in known[_MEDIA::2]:
                blocks[h] = (*known, code, medium)
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
                media = [m for m in _media(block) if m[0] != code]
                if media:
                    blocks[h] = _with_media(block, media)
                    continue
            self._bury(h, block)

    def _bury(self, h: BlockHash, block: _Block) -> None:
        """Drop a held block, keeping it as a ghost (held blocks below it may need it)."""
        del self._blocks[h]
        ghosts = self._ghosts
        ghosts[h] = block
        if len(ghosts) > max(1024, len(self._blocks)):
            self._prune_ghosts()

    def _prune_ghosts(self) -> None:
        """Keep only the ghosts some held block descends from."""
        blocks, ghosts = self._blocks, self._ghosts
        needed: dict[BlockHash, _Block] = {}
        for b in blocks.values():
            parent = b[_PARENT]
            while parent is not None and parent not in blocks and parent not in needed:
                ghost = ghosts.get(parent)
                if ghost is None:
                    break
                needed[parent] = ghost
                parent = ghost[_PARENT]
        self._ghosts = needed

    def _clear(self, medium: str | None) -> None:
        if medium is None:
            self.clear()
            return
        code = medium_code(medium)
        blocks = self._blocks
        for h, block in list(blocks.items()):
            if code not in block[_MEDIA::2]:
                continue
            media = [m for m in _media(block) if m[0] != code]
            if media:
                blocks[h] = _with_media(block, media)
            else:
                self._bury(h, block)

    def dump(self) -> BlockSetDump:
        """The whole set as events (see the module docstring)."""
        blocks, ghosts = self._blocks, self._ghosts
        events: list[Event] = [AllBlocksCleared()]
        runs: list[_Run] = []
        done: set[BlockHash] = set()
        orphan: set[BlockHash] = set()
        revived: list[BlockHash] = []  # ghosts written as stores, removed again at the end
        for start in blocks:
            if start in done or start in orphan:
                continue
            chain = [start]
            in_chain = {start}
            parent = blocks[start][_PARENT]
            while parent is not None and parent not in done:
                up = blocks.get(parent)
                if up is None:
                    up = ghosts.get(parent)
                if parent in orphan or up is None or parent in in_chain:
                    orphan.update(chain)  # missing ancestor (or a cycle: bad input)
                    chain = []
                    break
                chain.append(parent)
                in_chain.add(parent)
                parent = up[_PARENT]
            for h in reversed(chain):
                b = blocks.get(h)
                if b is None:  # a ghost: stored as it was, removed after every store
                    b = ghosts[h]
                    revived.append(h)
                for medium in b[_MEDIA + 1 :: 2]:
                    run = runs[-1] if runs else None
                    if run is not None and run.extends(h, b, medium):
                        run.add(h, b)
                    else:
                        runs.append(_Run(h, b, medium))
                done.add(h)
        events.extend(run.event() for run in runs)
        by_medium: dict[str | None, list[BlockHash]] = {}
        for h in revived:  # every tier it was written on
            for medium in ghosts[h][_MEDIA + 1 :: 2]:
                by_medium.setdefault(medium, []).append(h)
        events.extend(BlockRemoved(block_hashes=hs, medium=m) for m, hs in by_medium.items())
        held_orphans = sum(1 for h in orphan if h in blocks)
        return BlockSetDump(events, len(done) - len(revived), held_orphans)
