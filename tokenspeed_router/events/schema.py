"""KV event wire structs: the single definition of the schema (DESIGN §3).

Engines publish the same three events in two encodings:

* tagged **maps** ``{"type": "BlockStored", ...}`` (vLLM 0.33, SGLang 0.5) —
  the public classes below, decoded straight from msgpack;
* tagged **arrays** ``["BlockStored", hashes, parent, tokens, block_size, ...]``
  (TokenSpeed 0.1.1, older vLLM) — private subclasses that reuse the very same
  fields with ``array_like=True``, so there is one field list, in one place.

Field order is protocol for the array form: new fields are appended at the end
with a default, never reordered or renamed (msgspec schema evolution rules).
The optional BlockStored tail follows the order Dynamo's decoder reads:
lora_id, medium, lora_name, extra_keys, block_mm_infos, cache_salt. Unknown
map keys and unknown trailing array elements are ignored by msgspec.

Block hashes are opaque publisher ids: unsigned or signed 64-bit ints, or
bytes digests (vLLM with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "KVEventBatch",
]

#: An engine's opaque block id (its "external" id: vLLM and TokenSpeed send ints,
#: vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 32-byte digests). Not our
#: content hash (``tokenspeed_router.hashing.ContentHash``); the index maps one
#: to the other per worker.
BlockHash = int | bytes


class BlockStored(msgspec.Struct, tag=True, tag_field="type", frozen=True, omit_defaults=True):
    """Blocks entered a worker's cache, chained under ``parent_block_hash``.

    ``token_ids`` holds ``block_size`` tokens per hash; the last block may be
    shorter (a partial tail, published by TokenSpeed).
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Any = None
    block_mm_infos: Any = None
    cache_salt: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, tag_field="type", frozen=True, omit_defaults=True):
    """Blocks left a worker's cache (on the given medium; None means GPU)."""

    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, tag_field="type", frozen=True, omit_defaults=True):
    """The worker dropped its whole cache (on the given medium, or all of it)."""

    medium: str | None = None


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, frozen=True):
    """Batch envelope ``[ts, events, data_parallel_rank]``.

    The third field is called ``attn_dp_rank`` by TokenSpeed and SGLang; it is
    the same position. It is always encoded (nil when unknown) because some
    consumers decode the envelope as a fixed 3-tuple.
    """

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


# --- array-form twins: same fields, positional encoding -----------------------


class _BlockStoredArray(BlockStored, array_like=True, tag="BlockStored", frozen=True):
    pass


class _BlockRemovedArray(BlockRemoved, array_like=True, tag="BlockRemoved", frozen=True):
    pass


class _AllBlocksClearedArray(AllBlocksCleared, array_like=True, tag="AllBlocksCleared", frozen=True):
    pass


_ArrayEvent = _BlockStoredArray | _BlockRemovedArray | _AllBlocksClearedArray


class _ArrayFormBatch(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


EVENT_TAGS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
