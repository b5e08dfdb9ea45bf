"""One definition of a well-formed event: the decoder and KvIndex.apply refuse the same ones."""

from __future__ import annotations

import pytest

from tokenspeed_router.errors import WireError
from tokenspeed_router.events import decode_batch, encode_batch
from tokenspeed_router.events.schema import BlockRemoved, BlockStored, KVEventBatch
from tokenspeed_router.events.validation import validate_event
from tokenspeed_router.router.index import KvIndex

GOOD = [
    BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(7)), block_size=4),
    BlockStored(block_hashes=[1, -5], parent_block_hash=None, token_ids=[], block_size=4),  # pre-hashed
    BlockRemoved(block_hashes=[1]),
]
BAD = [
    BlockStored(block_hashes=[], parent_block_hash=None, token_ids=[1], block_size=4),
    BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1], block_size=0),
    BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(4)), block_size=4),
    BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=list(range(5)), block_size=4),
    BlockStored(block_hashes=[b"x" * 8], parent_block_hash=None, token_ids=[], block_size=4),
    BlockStored(block_hashes=[1], parent_block_hash=b"p", token_ids=[], block_size=4),
]


@pytest.mark.parametrize("event", GOOD)
def test_well_formed_events_pass_everywhere(event: object) -> None:
    validate_event(event)
    decode_batch(encode_batch(KVEventBatch(0.0, [event])))  # type: ignore[list-item]
    KvIndex().apply("w", KVEventBatch(0.0, [event]))  # type: ignore[list-item]


@pytest.mark.parametrize("event", BAD)
def test_malformed_events_are_refused_by_the_decoder_and_the_index(event: BlockStored) -> None:
    with pytest.raises(WireError):
        validate_event(event)
    with pytest.raises(WireError):
        decode_batch(encode_batch(KVEventBatch(0.0, [event])))
    index = KvIndex()
    with pytest.raises(WireError, match="worker 'w': "):
        index.apply("w", KVEventBatch(0.0, [event]))
    assert index.workers() == []
    with pytest.raises(WireError, match="not a KV event"):
        index.apply("w", KVEventBatch(0.0, ["nonsense"]))  # type: ignore[list-item]
