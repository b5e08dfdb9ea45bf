"""Content hash of token blocks: the one definition, versioned.

Every engine names its blocks with its own hash (FNV-1a, SHA-256 of pickles,
SHA-256 of u32 words, seeded or not), so the router never trusts those ids for
matching. Instead it computes a *content hash* for every block from the token
ids the events carry, and hashes incoming requests the same way. The worker
side cache (``tokenspeed_router.cache``) uses the same function for the block
hashes it publishes, so our own workers' external ids equal our content ids.

Definition (``HASH_VERSION = 1``, part of the persisted snapshot format):

* A block's tokens are encoded as unsigned 64-bit little-endian integers,
  ``block_size`` of them for a full block (fewer for a partial tail).
* ``root = XXH3_64(b"tokenspeed-router/content-hash/v1")`` when neither a LoRA
  id nor a tenant salt is given; otherwise
  ``XXH3_64(b"tokenspeed-router/content-hash/v1\\x00lora=<id>\\x00salt=<salt>")``
  with ``<id>`` the decimal LoRA id (empty when None) and ``<salt>`` the salt
  bytes (UTF-8 for str, empty when None).
* ``hash(block_0) = XXH3_64(bytes(block_0), seed=root)`` and
  ``hash(block_i) = XXH3_64(bytes(block_i), seed=hash(block_{i-1}))``.

So a block's hash depends on every token before it (chained), on the LoRA and
on the salt: a block stored under one LoRA or tenant can never match a query
for another. XXH3-64 is not a plain polynomial hash: the well-known Thue-Morse
construction that collides any ``sum(t_i * b^i) mod 2^64`` does not apply, and
finding a second prefix that collides with a given one costs a generic 2^64
search. Changing anything here is a format change: bump ``HASH_VERSION``.
"""

from __future__ import annotations

import array
import functools
from collections.abc import Iterator, Sequence
from typing import Any, NewType

import xxhash

from tokenspeed_router.errors import WireError

try:  # the compiled hash (csrc/hashing.c), bit-identical to the definition below
    from tokenspeed_router._native import hash_blocks as _native_hash_blocks
except ImportError:
    _native_hash_blocks = None  # type: ignore[assignment]

__all__ = [
    "ContentHash",
    "HASH_ALGORITHM",
    "HASH_VERSION",
    "TOKEN_BYTES",
    "block_hashes",
    "chain_hash",
    "iter_block_hashes",
    "reference_block_hashes",
    "root_seed",
    "tokens_to_bytes",
]

#: The router's own content hash of a block (this module's chain, u64), as
#: opposed to :data:`~tokenspeed_router.events.schema.BlockHash`, the opaque id
#: an engine publishes for it. Our own workers publish content hashes as their
#: ids; vLLM, SGLang and TokenSpeed do not, so the index maps one to the other.
ContentHash = NewType("ContentHash", int)

HASH_VERSION = 1
HASH_ALGORITHM = "xxh3_64 seed-chained over u64-LE tokens, v1"
TOKEN_BYTES = 8  # each token id is encoded as u64 little-endian

_DOMAIN = b"tokenspeed-router/content-hash/v1"
_xxh3_64 = xxhash.xxh3_64_intdigest
_PLAIN_ROOT = _xxh3_64(_DOMAIN)

#: ``chain_hash(block_bytes, parent_hash) -> hash``; exported for hot loops that
#: slice one buffer themselves (the index, the cache).
chain_hash = _xxh3_64


@functools.lru_cache(maxsize=4096)
def _namespaced_root(lora_id: int | None, salt: bytes | None) -> int:
    lora = b"" if lora_id is None else str(int(lora_id)).encode()
    return _xxh3_64(_DOMAIN + b"\x00lora=" + lora + b"\x00salt=" + (salt or b""))


def root_seed(lora_id: int | None = None, salt: str | bytes | None = None) -> int:
    """Seed of the first block of a chain for this LoRA/tenant namespace."""
    if lora_id is None and salt is None:
        return _PLAIN_ROOT
    if isinstance(salt, str):
        salt = salt.encode()
    return _namespaced_root(lora_id, salt)


def tokens_to_bytes(token_ids: Any) -> bytes:
    """Encode token ids as u64 little-endian bytes (the hashed representation).

    Accepts a list/tuple of ints, an ``array.array``, a numpy array, or any
    object with ``tolist()`` (e.g. a torch tensor). Raises :class:`WireError`
    for negative, too large or non-integer tokens.
    """
    if isinstance(token_ids, (bytes, bytearray, memoryview)):
        raise WireError("token_ids must be a sequence of ints, not bytes")
    dtype = getattr(token_ids, "dtype", None)
    if dtype is not None and hasattr(token_ids, "astype") and hasattr(token_ids, "tobytes"):
        kind = getattr(dtype, "kind", "")
        if kind not in ("i", "u"):
            raise WireError(f"token_ids must be integers, got dtype {dtype}")
        if kind == "i" and len(token_ids) and token_ids.min() < 0:
            raise WireError("token ids must be non-negative")
        return bytes(token_ids.astype("<u8", copy=False).tobytes())
    if dtype is not None and hasattr(token_ids, "tolist"):
        token_ids = token_ids.tolist()  # torch tensors and the like
    try:
        return array.array("Q", token_ids).tobytes()
    except OverflowError as err:
        raise WireError(f"token ids must be in [0, 2**64): {err}") from err
    except TypeError as err:
        raise WireError(f"token ids must be integers: {err}") from err


def iter_block_hashes(data: bytes, block_size: int, seed: int) -> Iterator[ContentHash]:
    """Yield the chained hash of each *full* block of ``data`` (u64-LE tokens)."""
    step = block_size * TOKEN_BYTES
    h = seed
    for off in range(0, len(data) - step + 1, step):
        h = _xxh3_64(data[off : off + step], h)
        yield ContentHash(h)


def block_hashes(
    token_ids: Sequence[int] | Any,
    block_size: int,
    *,
    parent: int | None = None,
    lora_id: int | None = None,
    salt: str | bytes | None = None,
    include_partial: bool = False,
) -> list[ContentHash]:
    """Chained content hashes of the blocks of ``token_ids``.

    ``parent`` continues an existing chain (its hash); otherwise the chain
    starts at the LoRA/salt root. A trailing partial block is hashed only when
    ``include_partial`` is true (engines such as TokenSpeed publish it).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    seed = root_seed(lora_id, salt) if parent is None else parent
    if _native_hash_blocks is not None and not include_partial:
        try:
            return _native_hash_blocks(token_ids, block_size, seed)  # type: ignore[return-value]
        except (OverflowError, TypeError, ValueError) as err:
            raise WireError(f"token ids must be ints in [0, 2**64): {err}") from err
    return reference_block_hashes(token_ids, block_size, seed, include_partial)


def reference_block_hashes(
    token_ids: Any, block_size: int, seed: int, include_partial: bool = False
) -> list[ContentHash]:
    """The pure-Python definition of :func:`block_hashes` (from a seed), for tests and fallbacks."""
    data = tokens_to_bytes(token_ids)
    out = list(iter_block_hashes(data, block_size, seed))
    tail = len(data) % (block_size * TOKEN_BYTES)
    if include_partial and tail:
        out.append(ContentHash(_xxh3_64(data[len(data) - tail :], out[-1] if out else seed)))
    return out
