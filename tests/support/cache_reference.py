"""Reference event folder for the cache tests: an index built only from KV events.

Deliberately tiny and independent of ``tokenspeed_router.router``: a dict
``block hash -> (parent hash, page tokens)`` that applies stores, removes and
clears strictly (a store under an unknown parent, a duplicate store, a removal
of an unknown block or of a block that still has children all fail), and
reconstructs the set of cached page chains. If a cache's events fold to the
cache's own content, a router can trust them.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenspeed_router.events.schema import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
)
from tokenspeed_router.hashing import block_hashes

Page = tuple[int, ...]
Chain = tuple[Page, ...]


class EventFolder:
    """Fold KV events into ``{hash: (parent, tokens)}`` and answer "which chains are cached"."""

    def __init__(self, page_size: int, lora_id: int | None = None) -> None:
        self.page_size = page_size
        self.lora_id = lora_id
        self.blocks: dict[BlockHash, tuple[BlockHash | None, Page]] = {}
        self.num_events = 0

    def apply(self, events: Iterable[Event]) -> None:
        for event in events:
            self.num_events += 1
            if isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                self._remove(event)
            elif isinstance(event, AllBlocksCleared):
                self.blocks.clear()
            else:  # pragma: no cover - the schema has three kinds
                raise AssertionError(f"unknown event {event!r}")

    def _store(self, event: BlockStored) -> None:
        assert event.block_size == self.page_size, event
        assert event.lora_id == self.lora_id, event
        assert len(event.token_ids) == len(event.block_hashes) * self.page_size, (
            "partial page stored"
        )
        parent = event.parent_block_hash
        for i, h in enumerate(event.block_hashes):
            assert isinstance(h, int) and 0 <= h < 2**64, h
            assert parent is None or parent in self.blocks, f"store under unknown parent {parent!r}"
            assert h not in self.blocks, f"block {h!r} stored twice"
            tokens = tuple(event.token_ids[i * self.page_size : (i + 1) * self.page_size])
            self.blocks[h] = (parent, tokens)
            parent = h

    def _remove(self, event: BlockRemoved) -> None:
        gone = set(event.block_hashes)
        assert len(gone) == len(event.block_hashes), "hash removed twice in one event"
        for h in gone:
            assert h in self.blocks, f"removal of unknown block {h!r}"
        for h in gone:
            del self.blocks[h]
        orphans = [h for h, (p, _) in self.blocks.items() if p in gone]
        assert not orphans, f"removed blocks {gone} still have children {orphans}"

    def chains(self) -> dict[Chain, BlockHash]:
        """``{page chain: block hash}`` for every stored block."""
        memo: dict[BlockHash, Chain] = {}

        def chain_of(h: BlockHash) -> Chain:
            if h not in memo:
                parent, tokens = self.blocks[h]
                memo[h] = (*(() if parent is None else chain_of(parent)), tokens)
            return memo[h]

        return {chain_of(h): h for h in self.blocks}

    def check_content_hashes(self) -> None:
        """Every published hash equals the router's content hash of its chain."""
        for chain, h in self.chains().items():
            tokens = [t for page in chain for t in page]
            expected = block_hashes(tokens, self.page_size, lora_id=self.lora_id)[-1]
            assert h == expected, f"hash of {chain} is {h!r}, content hash is {expected}"
