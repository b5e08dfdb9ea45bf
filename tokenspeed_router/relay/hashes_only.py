"""``--hashes-only``: replace token ids with the router's content hashes.

A router never needs a prompt's tokens, only the chained content hash of each
full block (DESIGN §4, :mod:`tokenspeed_router.hashing`), which it computes
from the tokens itself. The relay computes it instead, on the engine's host,
and publishes::

    BlockStored(block_hashes=[content hash, ...], parent_block_hash=<parent's content hash>,
                token_ids=[], block_size=<kept>, lora_id, medium, lora_name, cache_salt)

``token_ids=[]`` with non-empty ``block_hashes`` tells the router the ids are
already content hashes (u64): it indexes them unchanged. Removals name the
content hash of each removed block.

What cannot be expressed is dropped, never guessed (and counted):

* a partial tail block (fewer tokens than ``block_size``) never counts toward
  a match, so it is not sent; neither are blocks chained under a block that
  was not sent, nor removals of blocks that were not sent;
* a block whose parent the relay does not know (lost before it started, or
  the engine's own inconsistency) cannot be hashed: a router fed tokens would
  reject it as an unknown parent too.

Two engine blocks with the same content (same tokens, parent chain, LoRA and
salt) get the same content hash; if the engine drops one of them the router
drops the content too, so it may under-claim a block it still holds -- never
the reverse (the engine's own ids are chained by content in every engine we
know of, so this does not arise in practice).

Single owner, not thread safe. O(tokens) per stored block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenspeed_router.errors import WireError
from tokenspeed_router.events.schema import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
)
from tokenspeed_router.events.validation import token_count_ok
from tokenspeed_router.hashing import block_hashes, root_seed
from tokenspeed_router.router.index import lora_key
from tokenspeed_router.router.tiers import medium_code

__all__ = ["ContentHasher", "HasherStatistics"]


#: Per engine block: ``(content hash sent or None, tier bits held)``. A flat
#: tuple of atomic values, which Python's cyclic GC stops tracking (see
#: blockset.py); content None: not sent (partial or unhashable).
_Entry = tuple[int | None, int]


@dataclass(frozen=True, slots=True)
class HasherStatistics:
    blocks: int
    """Engine blocks currently known (sent or not)."""
    blocks_hashed: int
    blocks_unsent: int
    """Partial tails and blocks under one, not sent."""
    blocks_unhashable: int
    """Blocks whose parent was unknown."""
    events_malformed: int
    """BlockStored events whose token ids do not fit their hashes (skipped)."""


class ContentHasher:
    """Rewrites an engine's batches into content-hash batches (module docstring)."""

    def __init__(self) -> None:
        self._blocks: dict[BlockHash, _Entry] = {}
        self._hashed = 0
        self._unsent = 0
        self._unhashable = 0
        self._malformed = 0

    def clear(self) -> None:
        self._blocks.clear()

    def statistics(self) -> HasherStatistics:
        return HasherStatistics(
            len(self._blocks), self._hashed, self._unsent, self._unhashable, self._malformed
        )

    def translate(self, batch: KVEventBatch) -> KVEventBatch:
        out: list[Event] = []
        for event in batch.events:
            if isinstance(event, BlockStored):
                try:
                    stored = self._store(event)
                except WireError:
                    self._malformed += 1  # a router fed the tokens would refuse it too
                    continue
                if stored is not None:
                    out.append(stored)
            elif isinstance(event, BlockRemoved):
                removed = self._remove(event)
                if removed is not None:
                    out.append(removed)
            elif isinstance(event, AllBlocksCleared):
                self._clear(event.medium)
                out.append(event)
        return KVEventBatch(batch.ts, out, batch.data_parallel_rank)

    def _store(self, ev: BlockStored) -> BlockStored | None:
        hashes = ev.block_hashes
        n = len(hashes)
        bs = ev.block_size
        toks = ev.token_ids
        if n == 0 or bs <= 0 or not token_count_ok(n, bs, len(toks)):
            raise WireError(
                f"BlockStored with {n} hashes of block size {bs} carries {len(toks)} token ids"
            )
        code = medium_code(ev.medium)
        p = ev.parent_block_hash
        parent_content: int | None = None
        sendable = True
        if p is None:
            seed = root_seed(lora_key(ev.lora_id, ev.lora_name), ev.cache_salt)
        else:
            known = self._blocks.get(p)
            if known is None:
                self._unhashable += n
                sendable = False
                seed = 0
            elif known[0] is None:
                sendable = False
                seed = 0
            else:
                seed = parent_content = known[0]
        contents: Sequence[int] = block_hashes(toks, bs, parent=seed) if sendable else ()
        sent: list[int] = []
        for i, h in enumerate(hashes):
            content = contents[i] if i < len(contents) else None
            entry = self._blocks.get(h)
            if entry is None:
                self._blocks[h] = (content, code)
            else:
                self._blocks[h] = (entry[0], entry[1] | code)
                content = entry[0] if entry[0] == content else None
            if content is None:
                if sendable:
                    self._unsent += 1
                continue
            self._hashed += 1
            sent.append(content)
        if not sent:
            return None
        return BlockStored(
            block_hashes=list(sent), parent_block_hash=parent_content, token_ids=[],
            block_size=bs, lora_id=ev.lora_id, medium=ev.medium, lora_name=ev.lora_name,
            cache_salt=ev.cache_salt,
        )

    def _remove(self, ev: BlockRemoved) -> BlockRemoved | None:
        code = None if ev.medium is None else medium_code(ev.medium)
        contents: list[BlockHash] = []
        blocks = self._blocks
        for h in ev.block_hashes:
            entry = blocks.get(h)
            if entry is None:
                continue
            if entry[0] is not None:
                contents.append(entry[0])
            if code is not None:
                tiers = entry[1] & ~code
                if tiers:
                    blocks[h] = (entry[0], tiers)
                    continue
            del blocks[h]
        if not contents:
            return None
        return BlockRemoved(block_hashes=contents, medium=ev.medium)

    def _clear(self, medium: str | None) -> None:
        if medium is None:
            self._blocks.clear()
            return
        code = medium_code(medium)
        blocks = self._blocks
        for h, (content, tiers) in list(blocks.items()):
            if tiers & code:
                if tiers & ~code:
                    blocks[h] = (content, tiers & ~code)
                else:
                    del blocks[h]
