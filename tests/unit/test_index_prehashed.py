"""KvIndex: BlockStored with empty token_ids and non-empty block_hashes = pre-hashed content hashes.

This is what a ``--hashes-only`` relay publishes (DESIGN §12); the router
must index the ids unchanged and match token queries against them.
"""

from __future__ import annotations

import pytest

from tokenspeed_router.errors import WireError
from tokenspeed_router.events.schema import BlockRemoved, BlockStored, KVEventBatch
from tokenspeed_router.hashing import block_hashes
from tokenspeed_router.router import KvIndex

BS = 4


def _stored(hashes: list[int], parent: int | None, *, medium: str | None = None) -> KVEventBatch:
    return KVEventBatch(0.0, [BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=[],
                                          block_size=BS, medium=medium)])


def test_prehashed_blocks_match_like_tokens() -> None:
    tokens = list(range(3 * BS))
    contents = block_hashes(tokens, BS)
    pre, ref = KvIndex(), KvIndex()
    pre.apply("w", _stored(contents[:2], None))
    pre.apply("w", _stored(contents[2:], contents[1]))
    ref.apply("w", KVEventBatch(0.0, [BlockStored(block_hashes=[11, 12, 13], parent_block_hash=None,
                                                  token_ids=tokens, block_size=BS)]))
    for query in (tokens, tokens[:BS + 1], tokens[:BS] + [99] * BS, [7] * BS):
        assert pre.match(query) == ref.match(query)
    assert pre.match(tokens) == {"w": 3}
    pre.apply("w", KVEventBatch(0.0, [BlockRemoved(block_hashes=[contents[2]])]))
    assert pre.match(tokens) == {"w": 2}


def test_prehashed_lora_namespace_is_in_the_hash() -> None:
    tokens = list(range(BS))
    index = KvIndex()
    index.apply("w", _stored(block_hashes(tokens, BS, lora_id=3), None))
    assert index.match(tokens, lora_id=3) == {"w": 1}
    assert index.match(tokens).get("w", 0) == 0


def test_prehashed_rejects_non_integer_ids() -> None:
    index = KvIndex()
    with pytest.raises(WireError):
        index.apply("w", KVEventBatch(0.0, [BlockStored(block_hashes=[b"\x01" * 8], parent_block_hash=None,
                                                        token_ids=[], block_size=BS)]))
    assert index.num_blocks("w") == 0
