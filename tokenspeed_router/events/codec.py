"""Encode and decode KV event batches, both wire forms (DESIGN §3).

Decoding is strict about types and tolerant about evolution: unknown map keys
and unknown trailing array elements are ignored, an event with an unknown tag
is skipped and counted (a newer engine's event kind must not poison the whole
batch), anything else malformed raises :class:`WireError` naming what was
expected and what came. Nothing else ever escapes ``decode``.

Keep one :class:`BatchDecoder` per thread or socket: msgspec decoders are
cheap to use and not free to build.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec

from tokenspeed_router.errors import WireError
from tokenspeed_router.events.schema import (
    EVENT_TAGS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
    _AllBlocksClearedArray,
    _ArrayEvent,
    _ArrayFormBatch,
    _BlockRemovedArray,
    _BlockStoredArray,
    _RawBatch,
)
from tokenspeed_router.events.validation import validate_event

__all__ = [
    "BatchDecoder",
    "WireFormat",
    "check_event",
    "decode_batch",
    "encode_batch",
    "only_unknown_events",
    "validate_event",
]

WireFormat = Literal["map", "array"]

#: Upper bound on the number of events in one batch and blocks in one event;
#: real engines stay far below (vLLM: one event per request chunk).
MAX_EVENTS_PER_BATCH = 1_000_000
MAX_BLOCKS_PER_EVENT = 1_000_000

_ARRAY_HEADS = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}
_MAP_HEADS = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}


def check_event(event: Event) -> None:
    """A decoded event: well formed (``events/validation.py``) and within the wire's size bounds."""
    if isinstance(event, (BlockStored, BlockRemoved)) and len(event.block_hashes) > MAX_BLOCKS_PER_EVENT:
        raise WireError(
            f"{type(event).__name__} carries {len(event.block_hashes)} blocks, limit {MAX_BLOCKS_PER_EVENT}"
        )
    validate_event(event)


_PUBLIC: dict[type, type] = {
    _BlockStoredArray: BlockStored,
    _BlockRemovedArray: BlockRemoved,
    _AllBlocksClearedArray: AllBlocksCleared,
}


def _public(event: Event) -> Event:
    """Turn an array-form twin into the public class (same fields, same values)."""
    cls = _PUBLIC.get(type(event))
    if cls is None:
        return event
    return cls(*msgspec.structs.astuple(event))  # type: ignore[no-any-return]


class BatchDecoder:
    """Decode payloads into :class:`KVEventBatch`, whatever form the engine used."""

    def __init__(self, *, validate: bool = True) -> None:
        self._validate = validate
        self._map = msgspec.msgpack.Decoder(KVEventBatch)
        self._array = msgspec.msgpack.Decoder(_ArrayFormBatch)
        self._raw = msgspec.msgpack.Decoder(_RawBatch)
        self._map_event = msgspec.msgpack.Decoder(Event)
        self._array_event = msgspec.msgpack.Decoder(_ArrayEvent)
        self._any = msgspec.msgpack.Decoder()
        #: events skipped because their tag is not one we know (counted, not fatal)
        self.unknown_events = 0

    def decode(self, payload: bytes | bytearray | memoryview) -> KVEventBatch:
        """Decode one payload; raise :class:`WireError` on anything malformed."""
        try:
            batch = self._decode_typed(payload)
        except WireError:
            raise
        except Exception as err:  # msgspec raises DecodeError/ValidationError; be total
            raise WireError(f"undecodable KV event batch: {err}") from err
        if not math.isfinite(batch.ts):
            raise WireError(f"batch timestamp must be finite, got {batch.ts}")
        if len(batch.events) > MAX_EVENTS_PER_BATCH:
            raise WireError(f"batch has {len(batch.events)} events, limit {MAX_EVENTS_PER_BATCH}")
        if self._validate:
            for event in batch.events:
                check_event(event)
        return batch

    def _decode_typed(self, payload: bytes | bytearray | memoryview) -> KVEventBatch:
        try:
            return self._map.decode(payload)
        except msgspec.ValidationError:
            pass
        try:
            arr = self._array.decode(payload)
            return KVEventBatch(arr.ts, [_public(ev) for ev in arr.events], arr.data_parallel_rank)
        except msgspec.ValidationError:
            pass
        # Mixed forms or unknown tags: go event by event for a precise answer.
        raw = self._raw.decode(payload)
        events: list[Event] = []
        for item in raw.events:
            event = self._decode_event(bytes(item))
            if event is not None:
                events.append(event)
        return KVEventBatch(raw.ts, events, raw.data_parallel_rank)

    def _decode_event(self, data: bytes) -> Event | None:
        head = data[0] if data else -1
        decoder: Any
        if head in _MAP_HEADS:
            decoder = self._map_event
        elif head in _ARRAY_HEADS:
            decoder = self._array_event
        else:
            raise WireError(f"event must be a tagged map or array, got msgpack type byte {head:#x}")
        try:
            return _public(decoder.decode(data))
        except msgspec.ValidationError as err:
            tag = self._tag_of(data)
            if isinstance(tag, str) and tag not in EVENT_TAGS:
                self.unknown_events += 1
                return None
            raise WireError(f"malformed {tag or 'event'}: {err}") from err

    def _tag_of(self, data: bytes) -> object:
        try:
            obj = self._any.decode(data)
        except msgspec.DecodeError:
            return None
        if isinstance(obj, dict):
            return obj.get("type")
        if isinstance(obj, list) and obj:
            return obj[0]
        return None


_default_decoder = BatchDecoder()


def decode_batch(payload: bytes | bytearray | memoryview) -> KVEventBatch:
    """Decode one payload with a shared decoder (use BatchDecoder per thread)."""
    return _default_decoder.decode(payload)


_raw_batch_decoder = msgspec.msgpack.Decoder(_RawBatch)


def only_unknown_events(batch: KVEventBatch, payload: bytes | bytearray | memoryview | None) -> bool:
    """Whether ``batch`` (decoded from ``payload``) lost every event it carried to unknown tags.

    Such a batch (a newer engine's event kinds only, or a stray frame) has
    nothing to apply and proves nothing about the stream: it must not move
    the sequence state (``events/sequencing.py``: a *filler*). A batch that
    carried no event at all is an ordinary, valid batch. Cheap: only an empty
    result is looked at again.
    """
    if batch.events or payload is None:
        return False
    try:
        return len(_raw_batch_decoder.decode(payload).events) > 0
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False


_encoder = msgspec.msgpack.Encoder()


def _stored_map(ev: BlockStored) -> dict[str, Any]:
    # vLLM's decoder requires lora_id, medium and lora_name (no defaults there),
    # so they are always written; later optional keys only when set.
    out: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": ev.block_hashes,
        "parent_block_hash": ev.parent_block_hash,
        "token_ids": ev.token_ids,
        "block_size": ev.block_size,
        "lora_id": ev.lora_id,
        "medium": ev.medium,
        "lora_name": ev.lora_name,
    }
    if ev.extra_keys is not None:
        out["extra_keys"] = ev.extra_keys
    if ev.block_mm_infos is not None:
        out["block_mm_infos"] = ev.block_mm_infos
    if ev.cache_salt is not None:
        out["cache_salt"] = ev.cache_salt
    return out


def _event_map(ev: Event) -> dict[str, Any]:
    if isinstance(ev, BlockStored):
        return _stored_map(ev)
    if isinstance(ev, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": ev.block_hashes, "medium": ev.medium}
    if ev.medium is None:
        return {"type": "AllBlocksCleared"}
    return {"type": "AllBlocksCleared", "medium": ev.medium}


def _event_array(ev: Event) -> list[Any]:
    fields = msgspec.structs.astuple(ev)
    n = len(fields)
    floor = 4 if isinstance(ev, BlockStored) else 0  # required fields are always written
    while n > floor and fields[n - 1] is None:
        n -= 1
    return [type(ev).__struct_config__.tag, *fields[:n]]


def encode_batch(batch: KVEventBatch, wire_format: WireFormat = "map") -> bytes:
    """Encode a batch as vLLM/SGLang tagged maps (default) or TokenSpeed arrays."""
    if wire_format == "map":
        events: list[Any] = [_event_map(ev) for ev in batch.events]
    elif wire_format == "array":
        events = [_event_array(ev) for ev in batch.events]
    else:
        raise ValueError(f"wire_format must be 'map' or 'array', got {wire_format!r}")
    return _encoder.encode([batch.ts, events, batch.data_parallel_rank])
