"""Codec round trips in both wire forms, plus evolution tolerance."""

from __future__ import annotations

import msgspec
import pytest

from tokenspeed_router.errors import WireError
from tokenspeed_router.events import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

BATCHES = [
    KVEventBatch(1.5, [], None),
    KVEventBatch(
        2.0,
        [
            BlockStored([2**64 - 1, 2**63], None, list(range(32)), 16),
            BlockStored([-(2**63), -1], 5, list(range(20)), 16, lora_id=7, medium="CPU"),
            BlockStored([b"\x00" * 32], b"\x01" * 32, [1, 2, 3], 4, lora_name="x",
                        extra_keys=[None, ["mm", 1]], cache_salt="tenant"),
            BlockRemoved([1, 2, 3]),
            BlockRemoved([b"ab"], medium="STORAGE"),
            AllBlocksCleared(),
            AllBlocksCleared(medium="GPU"),
        ],
        3,
    ),
]


@pytest.mark.parametrize("wire_format", ["map", "array"])
@pytest.mark.parametrize("batch", BATCHES)
def test_round_trip(batch: KVEventBatch, wire_format: str) -> None:
    payload = encode_batch(batch, wire_format)  # type: ignore[arg-type]
    assert decode_batch(payload) == batch
    envelope = msgspec.msgpack.decode(payload)
    assert len(envelope) == 3  # rank always written, as consumers expect a 3-tuple
    for item in envelope[1]:
        assert isinstance(item, dict if wire_format == "map" else list)


def test_unknown_fields_and_keys_are_ignored() -> None:
    enc = msgspec.msgpack.encode
    array_event = ["BlockStored", [1], None, [1, 2], 2, None, "GPU", None, None, None, None, "new"]
    map_event = {"type": "BlockRemoved", "block_hashes": [1], "group_idx": 0, "future": {"x": 1}}
    batch = decode_batch(enc([1.0, [array_event, map_event], 0, "trailing"]))
    assert batch.events == [BlockStored([1], None, [1, 2], 2, medium="GPU"), BlockRemoved([1])]


def test_unknown_event_tag_is_skipped_and_counted() -> None:
    decoder = BatchDecoder()
    payload = msgspec.msgpack.encode([1.0, [{"type": "BlockUpdated", "x": 1}, ["AllBlocksCleared"]]])
    assert decoder.decode(payload).events == [AllBlocksCleared()]
    assert decoder.unknown_events == 1


@pytest.mark.parametrize(
    "obj",
    [
        [1.0, [["BlockStored", [1, 2], None, [1, 2, 3], 2]]],  # 2 hashes, 3 tokens: fine
        [1.0, [["BlockStored", [1, 2], None, [1], 2]]],  # too few tokens
        [1.0, [["BlockStored", [], None, [], 2]]],  # no hashes
        [1.0, [["BlockStored", [1], None, [1], 0]]],  # block_size 0
        [float("nan"), []],
        [1.0, [{"type": "BlockRemoved", "block_hashes": "nope"}]],
        {"ts": 1.0},
        "junk",
    ],
)
def test_malformed_raises_wire_error_only(obj: object) -> None:
    payload = msgspec.msgpack.encode(obj)
    try:
        decode_batch(payload)
    except WireError:
        return
    assert obj == [1.0, [["BlockStored", [1, 2], None, [1, 2, 3], 2]]]


def test_encode_rejects_unknown_format() -> None:
    with pytest.raises(ValueError):
        encode_batch(BATCHES[0], "json")  # type: ignore[arg-type]
