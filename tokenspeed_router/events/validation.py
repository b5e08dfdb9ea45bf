"""What a well-formed KV event is (DESIGN §3): the one definition every reader of events uses.

The type system (``events/schema.py``, msgspec) already guarantees field
types; this module checks what types cannot say: a BlockStored names at least
one block of a positive size, carries as many token ids as its blocks can
hold (the last block may be partial), or none at all with 64-bit content
hashes for ids and parent (a pre-hashed event, from a ``--hashes-only`` relay,
DESIGN §12), or, when it is one of ``KvIndex.dump_events``' own (its
``extra_keys`` carry :data:`DUMP_CONTENT_KEY`), one 64-bit content id per block.

Who calls it: ``events/codec.py`` on every decoded event (a malformed event
fails its batch's decode) and ``KvIndex.apply`` on every event before it
changes anything (events built in Python never went through a decoder). The
codec adds its own bounds on sizes (``MAX_*_PER_*``), a guard on what one
frame may make us allocate, not a property of an event. The compiled core
(csrc/) checks its arguments again only as far as memory safety needs
(counts that fit the buffers, ids that fit 64 bits): it trusts this module
for meaning.
"""

from __future__ import annotations

from tokenspeed_router.errors import WireError
from tokenspeed_router.events.schema import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["DUMP_CONTENT_KEY", "DUMP_UNMATCHABLE_KEY", "is_hash64", "token_count_ok", "validate_event"]

_M64 = (1 << 64) - 1

#: ``extra_keys`` marker of the events ``KvIndex.dump_events`` writes: they carry
#: the content ids themselves (the index keeps no token ids). Checked here, with
#: every other rule, so that a subscriber refuses a malformed one before its seq
#: can move anything.
DUMP_CONTENT_KEY = "tokenspeed_router.content_ids"
DUMP_UNMATCHABLE_KEY = "tokenspeed_router.unmatchable"


def is_hash64(x: object) -> bool:
    """An int in the u64 or i64 range (engines send hashes either way; i64 ones wrap to u64)."""
    return type(x) is int and -(1 << 63) <= x <= _M64


def token_count_ok(num_blocks: int, block_size: int, num_tokens: int) -> bool:
    """``num_tokens`` fills ``num_blocks`` blocks of ``block_size``, the last one possibly partially."""
    return (num_blocks - 1) * block_size < num_tokens <= num_blocks * block_size


def validate_event(event: object, context: str = "") -> None:
    """Raise :class:`WireError` unless ``event`` is a well-formed KV event.

    ``context`` prefixes the message (``"worker 'w': "``), so that an
    operator learns whose event it was.
    """
    if isinstance(event, BlockStored):
        n = len(event.block_hashes)
        bs = event.block_size
        if n == 0 or bs <= 0:
            raise WireError(f"{context}BlockStored with {n} hashes of block size {bs}")
        num = len(event.token_ids)
        if num == 0:
            p = event.parent_block_hash
            if not all(map(is_hash64, event.block_hashes)) or not (p is None or is_hash64(p)):
                raise WireError(f"{context}BlockStored without token ids needs 64-bit integer content hashes")
        elif not token_count_ok(n, bs, num):
            raise WireError(
                f"{context}BlockStored has {n} block hashes of size {bs} but {num} token ids "
                f"(expected {(n - 1) * bs + 1}..{n * bs})"
            )
        xk = event.extra_keys
        if type(xk) is dict and DUMP_CONTENT_KEY in xk:
            ids = xk[DUMP_CONTENT_KEY]
            bad = xk.get(DUMP_UNMATCHABLE_KEY, [])
            if (
                not isinstance(ids, list)
                or len(ids) != n
                or not all(is_hash64(c) for c in ids)
                or not isinstance(bad, list)
                or not all(type(i) is int and 0 <= i < n for i in bad)
            ):
                raise WireError(f"{context}malformed dumped content ids")
    elif not isinstance(event, (BlockRemoved, AllBlocksCleared)):
        raise WireError(f"{context}not a KV event: {type(event).__name__}")
