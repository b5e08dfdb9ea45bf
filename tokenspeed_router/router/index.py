"""The global KV index: which worker holds which prefix blocks, exactly (DESIGN §4-5).

Structure
---------
Every block gets a *content id* computed here (``tokenspeed_router.hashing``:
XXH3-64 chained from the parent's content id, the chain rooted in the
LoRA/salt namespace); the engine's own block hash is only an *external id*
used to find parents and apply removals. The state is flat dicts and
arrays, no per-block objects:

* ``holders: dict[content_id, int]`` (global) — bitmask of the workers that
  hold the block on any tier (bit = worker slot). A match walks the query's
  chain with one lookup per block for all workers at once and ANDs masks.
* per worker ``ext: dict[external_id, content_id]`` — O(1) parent resolution
  and removal. Blocks that can never match a query (a partial tail page,
  blocks stored under a different block size, their descendants) are stored
  as ``~content_id`` (negative) and stay out of ``holders``. Once the dict
  holds ``compact_min`` entries (and a quarter of the compacted ones), its
  int ids move into sorted u64 arrays with a Bloom filter in front
  (``_ColdExt``: 19 B per block instead of ~75 B for a dict entry and its
  key; O(log B) lookups, tombstones on removal).
* per worker ``tiers: dict[content_id, code]`` only for blocks not held on
  GPU alone (code bits: gpu=1, cpu=2, storage=4), and ``refs`` only for
  content published under several external ids by one worker (aliases).

Complexity (n = blocks in a batch, d = matched depth, W = workers, B = a worker's blocks)

===========================  ====================================================
``apply`` store / remove      O(n) (C-speed bulk dict updates on the common path)
``apply`` unknown parent      O(1) check before any mutation (O(n) undo in mixed batches)
``match`` / ``match_detail``  O(d) hashing + lookups, once per distinct block size;
                              hashing stops at the deepest block any worker holds
``clear_worker`` / remove     O(B)
compaction (amortised)        O(log B) per block (a stable sort merges two sorted runs)
``snapshot`` / ``restore``    O(total blocks)
===========================  ====================================================

Who may mutate
--------------
Single writer: exactly one thread or task calls ``apply``, ``clear_worker``,
``remove_worker`` (the router service's ingest loop, DESIGN §6; STYLE §5).
``match``/``match_detail``/``statistics`` only read and take no lock; call them
from that same thread (or hold the writer's lock) — dicts are not safe to
iterate while another thread resizes them. Pure: no I/O, no clock, no logging
above DEBUG on the hot path.
"""

from __future__ import annotations

import array
import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, repeat
from typing import Any, NamedTuple

import msgspec
import numpy as np
import xxhash

from tokenspeed_router.errors import SnapshotError, UnknownParentError, WireError
from tokenspeed_router.events.schema import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
)
from tokenspeed_router.hashing import HASH_VERSION, chain_hash, root_seed, tokens_to_bytes
from tokenspeed_router.router.tiers import (
    ALL_TIERS,
    CPU,
    GPU,
    STORAGE,
    TIER_NAMES,
    best_tier,
    medium_code,
)

__all__ = [
    "DUMP_CONTENT_KEY",
    "SNAPSHOT_VERSION",
    "ApplyStats",
    "KvIndex",
    "MatchDetail",
    "lora_key",
]

logger = logging.getLogger(__name__)

SNAPSHOT_VERSION = 1
SNAPSHOT_FORMAT = "tokenspeed-router/kv-index"

#: ``extra_keys`` marker of the events ``dump_events`` writes: they carry the
#: content ids themselves (the index keeps no token ids), see ``dump_events``.
DUMP_CONTENT_KEY = "tokenspeed_router.content_ids"
DUMP_UNMATCHABLE_KEY = "tokenspeed_router.unmatchable"

_M64 = (1 << 64) - 1
_X = chain_hash
_and = operator.and_
_FIRST_CHUNK_BLOCKS = 32  # query hashing starts with this many blocks, then doubles
_NUMPY_SPLIT_MIN = 6  # below this many blocks, slicing beats a numpy round trip
_DUMP_EVENT_BLOCKS = 256
_DUMP_PLACEHOLDER = b"tokenspeed_router.dump.block_size"
_VDTYPES: dict[int, np.dtype[Any]] = {}


class ApplyStats(NamedTuple):
    """What one ``apply`` did (counts of blocks, not bytes)."""

    events: int
    stored_blocks: int
    duplicate_blocks: int
    removed_blocks: int
    unknown_removals: int
    cleared: int


@dataclass(frozen=True, slots=True)
class MatchDetail:
    """``match`` plus where the matched blocks live.

    ``scores`` names every known worker (0 when it matches nothing).
    ``tiers[w]`` (same keys, always all three tier names) attributes each of
    the ``scores[w]`` leading blocks to its best tier (gpu > cpu > storage),
    so a worker's tier counts sum to its score. ``block_size`` names every
    known worker's block size (omitted only for a worker that never stored a
    block), so callers can turn blocks into tokens.
    """

    scores: dict[str, int]
    tiers: dict[str, dict[str, int]]
    block_size: dict[str, int]


def lora_key(lora_id: int | str | None, lora_name: str | None = None) -> int | None:
    """The integer LoRA namespace of an event or query.

    Engines send a numeric ``lora_id`` (vLLM's deprecated field), a
    ``lora_name`` (vLLM 0.33), or both; the numeric id wins. A name maps to a
    stable 63-bit id derived from it, so a query may pass either form
    (``match(tokens, lora_id="my-adapter")``).
    """
    if lora_id is not None:
        if isinstance(lora_id, str):
            return _name_key(lora_id)
        return int(lora_id)
    if lora_name is not None:
        return _name_key(lora_name)
    return None


def _name_key(name: str) -> int:
    return xxhash.xxh3_64_intdigest(b"tokenspeed-router/lora-name\x00" + name.encode()) >> 1


def _vdtype(step: int) -> np.dtype[Any]:
    dt = _VDTYPES.get(step)
    if dt is None:
        dt = _VDTYPES[step] = np.dtype(f"V{step}")
    return dt


def _split(buf: Any, step: int, count: int) -> list[bytes]:
    """Cut ``count`` consecutive ``step``-byte blocks out of a buffer, at C speed."""
    if count < _NUMPY_SPLIT_MIN:
        mv = bytes(buf) if not isinstance(buf, bytes) else buf
        return [mv[i : i + step] for i in range(0, count * step, step)]
    return np.frombuffer(buf, dtype=_vdtype(step), count=count).tolist()  # type: ignore[no-any-return]


def _event_tokens(token_ids: Sequence[int]) -> Any:
    """u64-LE buffer of an event's tokens; never raises (ingest must not half-apply)."""
    try:
        return array.array("Q", token_ids)
    except (OverflowError, TypeError):
        # Out-of-range ids (a malformed engine): wrap into u64 deterministically.
        # Such blocks can only match queries carrying the same wrapped ids.
        return array.array("Q", [int(t) & _M64 for t in token_ids])


def _query_tokens(token_ids: Any, start: int, stop: int) -> Any:
    """u64-LE buffer of ``token_ids[start:stop]`` (list, tuple, numpy, tensor)."""
    part = token_ids[start:stop]
    if type(part) is list or type(part) is tuple:
        try:
            return array.array("Q", part)
        except (OverflowError, TypeError):
            pass  # fall through for the precise WireError
    return tokens_to_bytes(part)


_ONE_STORED = ApplyStats(1, 1, 0, 0, 0, 0)
#: media spellings that mean "GPU" on the one-block fast path
_FAST_MEDIA: dict[str | None, bool] = {None: True, "GPU": True, "gpu": True}


class _Worker:
    """One worker's (or DP rank's) slice of the index."""

    __slots__ = (
        "bit",
        "block_size",
        "block_size_mismatches",
        "cold",
        "compact_at",
        "duplicate_stores",
        "ext",
        "name",
        "refs",
        "slot",
        "tier_mismatch_removals",
        "tiers",
        "unknown_parents",
        "unknown_removals",
        "unm",
    )

    def __init__(self, name: str, slot: int, bit: int) -> None:
        self.name = name
        self.slot = slot
        self.bit = bit
        self.block_size: int | None = None
        #: external id -> content id (>= 0: matchable; < 0: ~content, never matched);
        #: recent writes — older int ids move to ``cold`` (see ``KvIndex._compact``)
        self.ext: dict[BlockHash, int] = {}
        self.cold: _ColdExt | None = None
        self.compact_at = 0
        #: content id -> tier code, only where the code is not GPU alone
        self.tiers: dict[int, int] = {}
        #: content id -> number of *extra* external ids naming it (aliases)
        self.refs: dict[int, int] = {}
        #: unmatchable content ids held (negative values), for alias detection
        self.unm: set[int] = set()
        self.unknown_removals = 0
        self.unknown_parents = 0
        self.duplicate_stores = 0
        self.tier_mismatch_removals = 0
        self.block_size_mismatches = 0


_MISSING: Any = object()
_u64 = np.uint64
_BLOOM_A_INT = 0x9E3779B97F4A7C15  # odd 64-bit multipliers (Fibonacci hashing)
_BLOOM_B_INT = 0xC2B2AE3D27D4EB4F
_BLOOM_A = np.uint64(_BLOOM_A_INT)
_BLOOM_B = np.uint64(_BLOOM_B_INT)
_INT_ONLY = {int}


def _u64_array(ids: Sequence[Any]) -> np.ndarray[Any, Any] | None:
    """``ids`` as a u64 array when they are all ints in [0, 2**64), else None.

    The type check comes first: numpy would parse ``b"12"`` as the number 12.
    """
    if set(map(type, ids)) != _INT_ONLY:
        return None
    try:
        return np.array(ids, dtype=np.uint64)
    except OverflowError:
        return None


class _ColdExt:
    """Compacted part of a worker's external-id map: sorted u64 arrays, 17 B per block.

    Holds ``external id -> content id`` for ids that are ints in [0, 2**64)
    and matchable contents; everything else stays in the worker's dict.
    Removals leave tombstones (``alive``) until the next compaction.
    """

    __slots__ = ("alive", "bloom", "keys", "live", "shift", "vals")

    def __init__(self, keys: np.ndarray[Any, Any], vals: np.ndarray[Any, Any]) -> None:
        self.keys = keys
        self.vals = vals
        self.alive = np.ones(len(keys), dtype=np.bool_)
        self.live = len(keys)
        # A Bloom filter (16 bits per id, two probes, ~1.5 % false positives)
        # answers "not compacted" without a binary search: every store asks.
        bits = max(64, 1 << (16 * len(keys)).bit_length())
        self.shift = 64 - (bits.bit_length() - 1)
        flags = np.zeros(bits, dtype=np.bool_)
        for pos in self._bloom_positions(keys):
            flags[pos] = True
        self.bloom = np.packbits(flags, bitorder="little")

    def _bloom_positions(self, keys: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], ...]:
        shift = np.uint64(self.shift)
        return ((keys * _BLOOM_A) >> shift, (keys * _BLOOM_B) >> shift)

    def _maybe(self, e: int) -> bool:
        bloom = self.bloom
        shift = self.shift
        p = (e * _BLOOM_A_INT & _M64) >> shift
        if not bloom[p >> 3] >> (p & 7) & 1:
            return False
        p = (e * _BLOOM_B_INT & _M64) >> shift
        return bool(bloom[p >> 3] >> (p & 7) & 1)

    def _find(self, e: object) -> int:
        if type(e) is not int or e < 0 or e > _M64 or not self._maybe(e):
            return -1
        keys = self.keys
        # np.uint64: a Python int would make numpy compare as int64 or objects (O(n)).
        i = int(keys.searchsorted(_u64(e)))
        if i < len(keys) and int(keys[i]) == e and self.alive[i]:
            return i
        return -1

    def get(self, e: object) -> int | None:
        i = self._find(e)
        return None if i < 0 else int(self.vals[i])

    def pop(self, e: object) -> int | None:
        i = self._find(e)
        if i < 0:
            return None
        self.alive[i] = False
        self.live -= 1
        return int(self.vals[i])

    def pop_many(self, hashes: Sequence[BlockHash]) -> list[int | None]:
        """``pop`` for many ids with one vectorised probe."""
        out: list[int | None] = [None] * len(hashes)
        pos = [i for i, e in enumerate(hashes) if type(e) is int and 0 <= e <= _M64]
        if not pos:
            return out
        keys = self.keys
        probe = np.array([hashes[i] for i in pos], dtype=np.uint64)
        idx = np.minimum(keys.searchsorted(probe), len(keys) - 1)
        hit = np.flatnonzero((keys[idx] == probe) & self.alive[idx])
        if not len(hit):
            return out
        # an id repeated in one event is popped once (its first occurrence)
        slots, first = np.unique(idx[hit], return_index=True)
        hit = hit[first]
        self.alive[slots] = False
        self.live -= len(slots)
        for k, c in zip(hit.tolist(), self.vals[slots].tolist(), strict=True):
            out[pos[k]] = c
        return out

    def any_of(self, hashes: Sequence[BlockHash]) -> bool:
        """Whether any of ``hashes`` is a live key (one vectorised probe)."""
        probe = _u64_array(hashes)
        if probe is None:
            ks = [e for e in hashes if type(e) is int and 0 <= e <= _M64]
            if not ks:
                return False
            probe = np.array(ks, dtype=np.uint64)
        bloom = self.bloom
        p1, p2 = self._bloom_positions(probe)
        maybe = ((bloom[p1 >> np.uint64(3)] >> (p1 & np.uint64(7)).astype(np.uint8)) & 1).astype(np.bool_)
        maybe &= ((bloom[p2 >> np.uint64(3)] >> (p2 & np.uint64(7)).astype(np.uint8)) & 1).astype(np.bool_)
        if not maybe.any():
            return False
        probe = probe[maybe]
        keys = self.keys
        probe.sort()  # increasing keys let numpy narrow each binary search
        idx = np.minimum(keys.searchsorted(probe), len(keys) - 1)
        return bool(((keys[idx] == probe) & self.alive[idx]).any())

    def items(self) -> list[tuple[int, int]]:
        alive = self.alive
        return list(zip(self.keys[alive].tolist(), self.vals[alive].tolist(), strict=True))

    def values(self) -> list[int]:
        return self.vals[self.alive].tolist()  # type: ignore[no-any-return]

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.vals.nbytes + self.alive.nbytes + self.bloom.nbytes)


class _Journal:
    """Prior values of everything a mixed batch touched, to undo it on failure."""

    __slots__ = ("block_size", "ext", "held", "refs", "tiers", "unm")

    def __init__(self, ws: _Worker) -> None:
        self.block_size = ws.block_size
        self.ext: dict[BlockHash, int] = {}
        self.tiers: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.unm: dict[int, bool] = {}
        self.held: dict[int, bool] = {}


def _ext_get(ws: _Worker, e: BlockHash) -> int | None:
    c = ws.ext.get(e)
    if c is None and ws.cold is not None:
        return ws.cold.get(e)
    return c


def _ext_len(ws: _Worker) -> int:
    return len(ws.ext) + (ws.cold.live if ws.cold is not None else 0)


def _ext_items(ws: _Worker) -> list[tuple[BlockHash, int]]:
    items: list[tuple[BlockHash, int]] = list(ws.ext.items())
    if ws.cold is not None:
        items.extend(ws.cold.items())
    return items


def _ext_del(ws: _Worker, e: BlockHash) -> None:
    if ws.ext.pop(e, None) is None and ws.cold is not None:
        ws.cold.pop(e)


class KvIndex:
    """Exact, per-worker longest-prefix index over content-hashed KV blocks.

    Single writer (see the module docstring). Worker names are opaque
    strings; a DP rank is just another worker (``"NAME/dpR"``).
    """

    #: a worker's recent-writes dict is compacted into sorted arrays once it
    #: holds this many entries (and a quarter of the compacted ones)
    compact_min = 2048

    def __init__(self, *, compact_min: int | None = None) -> None:
        """``compact_min``: see the class attribute; ``sys.maxsize`` never compacts
        (fastest ingest, ~155 instead of ~100 bytes per block)."""
        if compact_min is not None:
            self.compact_min = compact_min
        self._holders: dict[int, int] = {}
        self._workers: dict[str, _Worker] = {}
        self._names: list[str | None] = []
        self._bits: list[int] = []
        self._free: list[int] = []
        #: block size -> mask of the workers using it (queries hash once per size)
        self._size_masks: dict[int, int] = {}
        self._roots: dict[tuple[int | None, str | bytes | None], int] = {}
        self._workers_version = 0

    # ------------------------------------------------------------------ workers

    def workers(self) -> list[str]:
        """Known workers, in registration order.

        A worker is known from its first applied batch (even an empty one)
        until :meth:`remove_worker`; clearing its blocks keeps it known.
        """
        return list(self._workers)

    @property
    def workers_version(self) -> int:
        """Changes whenever the set of known workers changes (cheap polling for the router)."""
        return self._workers_version

    def block_size_of(self, worker: str) -> int | None:
        """The worker's block size, or None before its first BlockStored.

        Set by the first BlockStored, and set again by the first BlockStored
        that arrives while the worker holds no matchable block (after a
        restart, a clear, or once everything was removed), so a worker that
        restarts with another block size matches again. While it holds no
        block this still reports the last size it used.
        """
        ws = self._workers.get(worker)
        return None if ws is None else ws.block_size

    def num_blocks(self, worker: str | None = None) -> int:
        """Blocks held (partial tails and every tier copy of a block counted once)."""
        if worker is None:
            return sum(_ext_len(ws) for ws in self._workers.values())
        ws = self._workers.get(worker)
        return 0 if ws is None else _ext_len(ws)

    def num_distinct_blocks(self) -> int:
        """Distinct matchable content ids across all workers."""
        return len(self._holders)

    def blocks_by_tier(self, worker: str) -> dict[str, int]:
        """Blocks per tier for one worker; a block on two tiers counts in both."""
        out = dict.fromkeys(TIER_NAMES, 0)
        ws = self._workers.get(worker)
        if ws is None:
            return out
        not_gpu = 0
        for c, code in ws.tiers.items():
            k = 1 + ws.refs.get(c, 0)
            if not code & GPU:
                not_gpu += k
            if code & CPU:
                out["cpu"] += k
            if code & STORAGE:
                out["storage"] += k
        out["gpu"] = _ext_len(ws) - not_gpu
        return out

    def _register(self, name: str) -> _Worker:
        if self._free:
            slot = self._free.pop()
            self._names[slot] = name
        else:
            slot = len(self._names)
            self._names.append(name)
            self._bits.append(1 << slot)
        ws = _Worker(name, slot, self._bits[slot])
        self._workers[name] = ws
        self._workers_version += 1
        return ws

    def _unregister(self, ws: _Worker) -> None:
        self._set_block_size(ws, None)
        del self._workers[ws.name]
        self._workers_version += 1
        self._names[ws.slot] = None
        self._free.append(ws.slot)

    def _set_block_size(self, ws: _Worker, block_size: int | None) -> None:
        if ws.block_size is not None:
            m = self._size_masks[ws.block_size] & ~ws.bit
            if m:
                self._size_masks[ws.block_size] = m
            else:
                del self._size_masks[ws.block_size]
        ws.block_size = block_size
        if block_size is not None:
            self._size_masks[block_size] = self._size_masks.get(block_size, 0) | ws.bit

    def clear_worker(self, worker: str) -> None:
        """Drop every block of a worker (restart, resync); keep it registered."""
        ws = self._workers.get(worker)
        if ws is not None:
            self._clear_all(ws, None)

    def remove_worker(self, worker: str) -> None:
        """Forget a worker entirely (it left the fleet); its slot is reused."""
        ws = self._workers.get(worker)
        if ws is not None:
            self._clear_all(ws, None)
            self._unregister(ws)

    # -------------------------------------------------------------------- apply

    def apply(self, worker: str, batch: KVEventBatch) -> ApplyStats:
        """Fold one decoded batch of ``worker``'s events into the index, atomically.

        Raises :class:`UnknownParentError` (and :class:`WireError` for an event
        whose token count does not fit its hashes) *without changing anything*:
        a lost event must be replayed or the worker resynced, never guessed.
        """
        events = batch.events
        ws = self._workers.get(worker)
        if ws is not None and len(events) == 1 and type(events[0]) is BlockStored:
            done = self._store_one_block(ws, events[0])
            if done is not None:
                if len(ws.ext) >= ws.compact_at:
                    self._compact(ws)
                return done
        created = ws is None
        if ws is None:
            ws = self._register(worker)
        try:
            jr = self._prevalidate(ws, events)
        except BaseException:
            if created:
                self._unregister(ws)
            raise
        stored = dup = removed = unknown = cleared = 0
        try:
            for ev in events:
                if jr is None and type(ev) is BlockStored:
                    one = self._store_one_block(ws, ev)  # parents were checked above
                    if one is not None:
                        stored += 1
                        continue
                if isinstance(ev, BlockStored):
                    s, d = self._store(ws, ev, jr)
                    stored += s
                    dup += d
                elif isinstance(ev, BlockRemoved):
                    r, u = self._remove(ws, ev, jr)
                    removed += r
                    unknown += u
                else:
                    removed += self._clear_all(ws, ev.medium, jr)
                    cleared += 1
        except BaseException:
            if jr is not None:
                self._undo(ws, jr)
            if created:
                self._unregister(ws)
            raise
        if len(ws.ext) >= ws.compact_at:
            self._compact(ws)
        return ApplyStats(len(events), stored, dup, removed, unknown, cleared)

    def _compact(self, ws: _Worker) -> None:
        """Move a worker's int external ids from its dict into sorted u64 arrays.

        Why: a dict entry plus its int key costs ~75 B per block, the arrays
        17 B. Runs after a successful ``apply`` only (never inside a batch's
        journal), when the dict reaches ``max(compact_min, compacted / 4)``
        entries, so each id is merged O(log) times (a stable sort of two
        sorted runs is a linear merge).
        """
        cold = ws.cold
        live = cold.live if cold is not None else 0
        threshold = max(self.compact_min, live // 4)
        if len(ws.ext) < threshold:
            ws.compact_at = threshold
            return
        keep: dict[BlockHash, int] = {}
        nk = _u64_array(list(ws.ext.keys()))
        nv = _u64_array(list(ws.ext.values())) if nk is not None else None
        if nk is None or nv is None:  # some ids are bytes or signed, or blocks unmatchable
            ks: list[int] = []
            vs: list[int] = []
            for e, c in ws.ext.items():
                if type(e) is int and 0 <= e <= _M64 and c >= 0:
                    ks.append(e)
                    vs.append(c)
                else:
                    keep[e] = c
            nk = np.array(ks, dtype=np.uint64)
            nv = np.array(vs, dtype=np.uint64)
        if len(nk):
            if cold is not None and live:
                nk = np.concatenate((cold.keys[cold.alive], nk))
                nv = np.concatenate((cold.vals[cold.alive], nv))
            order = np.argsort(nk, kind="stable")
            nk = nk[order]
            nv = nv[order]
            ws.cold = _ColdExt(nk, nv)
            ws.ext = keep
        ws.compact_at = max(self.compact_min, (ws.cold.live if ws.cold is not None else 0) // 4, len(ws.ext) * 2)

    def _store_one_block(self, ws: _Worker, ev: BlockStored) -> ApplyStats | None:
        """Fast path for the commonest event while decoding: one new full GPU block.

        Returns None (having changed nothing) whenever the general path is needed.
        """
        hashes = ev.block_hashes
        toks = ev.token_ids
        bs = ws.block_size
        if (
            len(hashes) != 1
            or len(toks) != bs
            or ev.block_size != bs
            or type(ev.extra_keys) is dict  # dumped content ids (vLLM sends a list here)
            or _FAST_MEDIA.get(ev.medium) is None
        ):
            return None
        ext = ws.ext
        cold = ws.cold
        e = hashes[0]
        if e in ext or (cold is not None and cold.get(e) is not None):
            return None
        p = ev.parent_block_hash
        if p is None:
            h = self._root(lora_key(ev.lora_id, ev.lora_name), ev.cache_salt)
        else:
            pc = ext.get(p)
            if pc is None and cold is not None:
                pc = cold.get(p)
            if pc is None:
                ws.unknown_parents += 1
                raise UnknownParentError(ws.name, p)
            if pc < 0:
                return None
            h = pc
        try:
            c = _X(array.array("Q", toks), h)
        except (OverflowError, TypeError):
            return None
        if c in self._holders:
            return None
        self._holders[c] = ws.bit
        ext[e] = c
        return _ONE_STORED

    def _prevalidate(self, ws: _Worker, events: Sequence[Event]) -> _Journal | None:
        """Check a batch before touching anything; say whether it needs a journal.

        Store-only batches (the common case) are checked exactly here: every
        parent must be known now or stored earlier in the batch. When a
        removal or clear precedes a store with a parent, whether that parent
        is still known depends on tiers and aliases, so the batch is applied
        under a journal and undone if a parent turns out unknown.
        """
        ext = ws.ext
        cold = ws.cold
        added: set[BlockHash] | None = set() if len(events) > 1 else None
        mutated = False
        journal = False
        for ev in events:
            if isinstance(ev, BlockStored):
                n = len(ev.block_hashes)
                bs = ev.block_size
                num = len(ev.token_ids)
                if num == 0 and n and bs > 0:
                    # Pre-hashed (a --hashes-only relay): the ids are content hashes.
                    if not all(type(e) is int and -(1 << 63) <= e <= _M64 for e in ev.block_hashes):
                        raise WireError(
                            f"worker {ws.name!r}: BlockStored without token ids needs u64 content hashes"
                        )
                elif n == 0 or bs <= 0 or not (n - 1) * bs < num <= n * bs:
                    raise WireError(
                        f"worker {ws.name!r}: BlockStored with {n} hashes of block size "
                        f"{bs} carries {num} token ids"
                    )
                xk = ev.extra_keys
                if type(xk) is dict and DUMP_CONTENT_KEY in xk:
                    ids = xk[DUMP_CONTENT_KEY]
                    bad = xk.get(DUMP_UNMATCHABLE_KEY, [])
                    if (
                        not isinstance(ids, list)
                        or len(ids) != n
                        or not all(type(c) is int for c in ids)
                        or not isinstance(bad, list)
                        or not all(type(i) is int and 0 <= i < n for i in bad)
                    ):
                        raise WireError(f"worker {ws.name!r}: malformed dumped content ids")
                p = ev.parent_block_hash
                if p is not None:
                    if mutated:
                        journal = True
                    elif (
                        p not in ext
                        and (added is None or p not in added)
                        and (cold is None or cold.get(p) is None)
                    ):
                        ws.unknown_parents += 1
                        raise UnknownParentError(ws.name, p)
                if added is not None:
                    added.update(ev.block_hashes)
            elif isinstance(ev, (BlockRemoved, AllBlocksCleared)):
                mutated = True
            else:
                raise WireError(f"worker {ws.name!r}: not a KV event: {type(ev).__name__}")
        return _Journal(ws) if journal else None

    def _root(self, lora: int | None, salt: str | bytes | None) -> int:
        key = (lora, salt)
        r = self._roots.get(key)
        if r is None:
            r = root_seed(lora, salt)
            if len(self._roots) < 4096:
                self._roots[key] = r
        return r

    def _store(self, ws: _Worker, ev: BlockStored, jr: _Journal | None) -> tuple[int, int]:
        """Hash and insert one BlockStored; returns (new blocks, duplicates)."""
        ext = ws.ext
        hashes = ev.block_hashes
        n = len(hashes)
        toks = ev.token_ids
        num = len(toks)
        code = medium_code(ev.medium)
        bs = ws.block_size
        ebs = ev.block_size
        xk = ev.extra_keys
        dumped = type(xk) is dict and DUMP_CONTENT_KEY in xk
        prehashed = num == 0  # --hashes-only relay: block_hashes are content hashes
        if bs is None:
            self._set_block_size(ws, ebs)
            bs = ebs
        elif (
            ebs != bs
            and (dumped or prehashed or not (n == 1 and ebs < bs and num < bs))
            and _ext_len(ws) <= len(ws.unm)
        ):
            # The worker holds no matchable block (``_ext_len == len(unm)`` means
            # every entry is an unaliased unmatchable one): it restarted or was
            # cleared, maybe with another block size. Adopt the event's. A lone
            # block shorter than both sizes and of a smaller size is instead a
            # partial tail of the current grid (vLLM's cache_partial_block sends
            # ``block_size`` = its token count), which must not reset the grid.
            self._set_block_size(ws, ebs)
            bs = ebs
        p = ev.parent_block_hash
        if p is None:
            neg = False
            h = self._root(lora_key(ev.lora_id, ev.lora_name), ev.cache_salt)
        else:
            pc = _ext_get(ws, p)
            if pc is None:
                ws.unknown_parents += 1
                raise UnknownParentError(ws.name, p)
            neg = pc < 0
            h = ~pc if neg else pc
        if dumped:
            cs = [int(c) & _M64 for c in xk[DUMP_CONTENT_KEY]]
            for i in xk.get(DUMP_UNMATCHABLE_KEY, ()):
                cs[i] = ~cs[i]
        elif prehashed:
            cs = [int(e) & _M64 for e in hashes]
        else:
            if ebs != bs and not (n == 1 and num < bs):
                # Another block grid (e.g. vLLM's partial-block events): keep the
                # blocks for parents and removals, never match them.
                ws.block_size_mismatches += 1
                neg = True
                bs = ebs
            nfull = num // bs
            if nfull > n:  # only possible on the foreign-grid path above
                nfull = n
            step = bs * 8
            buf = _event_tokens(toks)
            cs = []
            ap = cs.append
            if nfull:
                for chunk in _split(buf, step, nfull):
                    h = _X(chunk, h)
                    ap(h)
            if nfull < n:
                tail = buf[nfull * bs :].tobytes()
                ap(~_X(tail, h))  # a partial tail never matches
            if neg:
                cs = [c if c < 0 else ~c for c in cs]
        full = n if cs[-1] >= 0 else n - 1  # a partial tail goes through _hold
        if (
            jr is None
            and full
            and cs[0] >= 0
            and cs[full - 1] >= 0
            and code == GPU
            and ext.keys().isdisjoint(hashes)
            and self._holders.keys().isdisjoint(cs[:full] if full < n else cs)
            and (ws.cold is None or not ws.cold.any_of(hashes))
        ):
            # Fresh blocks of a GPU-only store (the common case): bulk C updates.
            before = len(ext)
            ext.update(zip(hashes[:full], cs[:full], strict=True) if full < n else zip(hashes, cs, strict=True))
            if len(ext) == before + full:
                self._holders.update(zip(cs[:full] if full < n else cs, repeat(ws.bit)))
                if full == n:
                    return n, 0
                new = full + self._hold(ws, hashes[-1], cs[-1], code, None)
                return new, n - new
            for e in hashes[:full]:  # an id repeated inside the event: take the careful path
                ext.pop(e, None)
        new = 0
        for e, c in zip(hashes, cs, strict=True):
            new += self._hold(ws, e, c, code, jr)
        return new, n - new

    def _hold(self, ws: _Worker, e: BlockHash, c: int, code: int, jr: _Journal | None) -> int:
        """Record that ``ws`` holds content ``c`` as external ``e`` on tier ``code``."""
        ext = ws.ext
        tiers = ws.tiers
        prev = _ext_get(ws, e)
        if prev is not None:
            ws.duplicate_stores += 1
            cur = tiers.get(prev, GPU)
            if cur | code != cur:
                if jr is not None and prev not in jr.tiers:
                    jr.tiers[prev] = cur
                tiers[prev] = cur | code
            return 0
        if jr is not None:
            if e not in jr.ext:
                jr.ext[e] = _MISSING
            self._journal_content(ws, jr, c)
        ext[e] = c
        if c >= 0:
            holders = self._holders
            m = holders.get(c)
            if m is None:
                holders[c] = ws.bit
                fresh = True
            elif m & ws.bit:
                fresh = False
            else:
                holders[c] = m | ws.bit
                fresh = True
        elif c in ws.unm:
            fresh = False
        else:
            ws.unm.add(c)
            fresh = True
        if fresh:
            if code != GPU:
                tiers[c] = code
        else:
            ws.refs[c] = ws.refs.get(c, 0) + 1
            cur = tiers.get(c, GPU)
            if cur | code != cur:
                tiers[c] = cur | code
        return 1

    def _journal_content(self, ws: _Worker, jr: _Journal, c: int) -> None:
        if c in jr.tiers or c in jr.refs or c in jr.held:
            return
        jr.tiers[c] = ws.tiers.get(c, _MISSING)
        jr.refs[c] = ws.refs.get(c, _MISSING)
        if c >= 0:
            jr.held[c] = bool(self._holders.get(c, 0) & ws.bit)
        else:
            jr.held[c] = c in ws.unm

    def _undo(self, ws: _Worker, jr: _Journal) -> None:
        """Restore everything a failed batch changed (see :class:`_Journal`)."""
        for e, prior in jr.ext.items():
            if prior is _MISSING:
                ws.ext.pop(e, None)
            else:
                ws.ext[e] = prior
        for c, t in jr.tiers.items():
            if t is _MISSING:
                ws.tiers.pop(c, None)
            else:
                ws.tiers[c] = t
        for c, r in jr.refs.items():
            if r is _MISSING:
                ws.refs.pop(c, None)
            else:
                ws.refs[c] = r
        for c, held in jr.held.items():
            if c < 0:
                if held:
                    ws.unm.add(c)
                else:
                    ws.unm.discard(c)
                continue
            m = self._holders.get(c, 0)
            m = m | ws.bit if held else m & ~ws.bit
            if m:
                self._holders[c] = m
            else:
                self._holders.pop(c, None)
        if ws.block_size != jr.block_size:
            self._set_block_size(ws, jr.block_size)

    def _remove(self, ws: _Worker, ev: BlockRemoved, jr: _Journal | None) -> tuple[int, int]:
        """Apply one BlockRemoved; returns (blocks gone, unknown external ids)."""
        medium = ev.medium
        hashes = ev.block_hashes
        if jr is None and not ws.tiers and not ws.refs and medium_code(medium) == GPU:
            # Fast path: a GPU-only worker without aliases (the common case).
            ext = ws.ext
            holders = self._holders
            bit = ws.bit
            keep = ~bit
            removed = unknown = 0
            found = list(map(ext.pop, hashes, repeat(None)))
            cold = ws.cold
            if cold is not None and None in found:
                missing = [i for i, c in enumerate(found) if c is None]
                for i, c in zip(missing, cold.pop_many([hashes[i] for i in missing]), strict=True):
                    found[i] = c
            for c in found:
                if c is None:
                    unknown += 1
                elif c >= 0:
                    m = holders[c]
                    if m == bit:
                        del holders[c]
                    else:
                        holders[c] = m & keep
                    removed += 1
                else:
                    ws.unm.discard(c)
                    removed += 1
            ws.unknown_removals += unknown
            return removed, unknown
        removed = unknown = 0
        code = medium_code(medium)
        for e in hashes:
            r = self._drop(ws, e, code, medium is None, jr)
            if r < 0:
                unknown += 1
            else:
                removed += r
        return removed, unknown

    def _drop(self, ws: _Worker, e: BlockHash, code: int, unspecified: bool, jr: _Journal | None) -> int:
        """Remove tier ``code`` of external block ``e``: 1 if it is gone, 0 if not, -1 unknown."""
        c = _ext_get(ws, e)
        if c is None:
            ws.unknown_removals += 1
            return -1
        if jr is not None:
            if e not in jr.ext:
                jr.ext[e] = c
            self._journal_content(ws, jr, c)
        r = ws.refs.get(c)
        if r:
            # Another external id of this worker still names the content.
            _ext_del(ws, e)
            if r == 1:
                del ws.refs[c]
            else:
                ws.refs[c] = r - 1
            return 1
        cur = ws.tiers.get(c, GPU)
        rm = code
        if unspecified and not cur & GPU:
            rm = ALL_TIERS  # no medium named: the engine says the block is gone
        left = cur & ~rm
        if left == cur:
            ws.tier_mismatch_removals += 1
            return 0
        if left:
            if left == GPU:
                del ws.tiers[c]
            else:
                ws.tiers[c] = left
            return 0
        _ext_del(ws, e)
        ws.tiers.pop(c, None)
        if c >= 0:
            m = self._holders[c] & ~ws.bit
            if m:
                self._holders[c] = m
            else:
                del self._holders[c]
        else:
            ws.unm.discard(c)
        return 1

    def _clear_all(self, ws: _Worker, medium: str | None, jr: _Journal | None = None) -> int:
        """AllBlocksCleared (of one medium, or all when None); returns blocks gone."""
        if medium is not None or jr is not None:
            code = ALL_TIERS if medium is None else medium_code(medium)
            gone = 0
            for e, c in _ext_items(ws):
                cur = ws.tiers.get(c, GPU)
                if not cur & code:
                    continue
                left = cur & ~code
                if left:
                    # The block stays on its other tiers (for every alias at once).
                    if jr is not None:
                        self._journal_content(ws, jr, c)
                    if left == GPU:
                        del ws.tiers[c]
                    else:
                        ws.tiers[c] = left
                else:
                    gone += max(self._drop(ws, e, code, False, jr), 0)
            return gone
        holders = self._holders
        bit = ws.bit
        keep = ~bit
        values: Any = ws.ext.values()
        if ws.cold is not None:
            values = [*values, *ws.cold.values()]
        for c in values:
            if c >= 0:
                m = holders.get(c)
                if m is None:
                    continue  # an alias already cleared it
                if m == bit:
                    del holders[c]
                elif m & bit:
                    holders[c] = m & keep
        gone = _ext_len(ws)
        ws.ext = {}
        ws.cold = None
        ws.compact_at = 0
        ws.tiers = {}
        ws.refs = {}
        ws.unm = set()
        return gone

    # -------------------------------------------------------------------- match

    def match(
        self, token_ids: Sequence[int] | Any, lora_id: int | str | None = None, salt: str | bytes | None = None
    ) -> dict[str, int]:
        """Leading full blocks of ``token_ids`` each worker holds (any tier).

        Every known worker (see :meth:`workers`) appears, in registration
        order, with 0 when it holds no leading block of the request (also when
        it holds no block at all). Hashes the request with the index's
        content hash, lazily: hashing stops at the first block no remaining
        worker holds, so the cost follows the matched depth, not the prompt
        length.
        """
        scores = dict.fromkeys(self._workers, 0)
        if self._holders:
            seed = self._root(lora_key(lora_id), salt)
            for bs, group in self._size_masks.items():
                self._walk(token_ids, bs, group, seed, scores, None)
        return scores

    def match_detail(
        self, token_ids: Sequence[int] | Any, lora_id: int | str | None = None, salt: str | bytes | None = None
    ) -> MatchDetail:
        """``match`` plus each worker's matched blocks by best tier and block sizes.

        ``scores`` is exactly ``match``'s answer (every known worker, zeros
        included); ``tiers`` has the same keys, each with all three tier names
        (``{"gpu": 0, "cpu": 0, "storage": 0}`` for a score of 0), summing to
        the score; ``block_size`` lists every known worker whose block size is
        known (a worker that never stored a block has none).
        """
        workers = self._workers
        scores = dict.fromkeys(workers, 0)
        tiers = {name: dict.fromkeys(TIER_NAMES, 0) for name in workers}
        if self._holders:
            seed = self._root(lora_key(lora_id), salt)
            for bs, group in self._size_masks.items():
                chain: list[int] = []
                part: dict[str, int] = {}
                self._walk(token_ids, bs, group, seed, part, chain)
                for name, score in part.items():
                    wtiers = workers[name].tiers
                    counts = tiers[name]
                    if not wtiers:
                        counts["gpu"] = score
                    else:
                        for c in chain[:score]:
                            counts[best_tier(wtiers.get(c, GPU))] += 1
                scores.update(part)
        sizes = {n: ws.block_size for n, ws in workers.items() if ws.block_size is not None}
        return MatchDetail(scores, tiers, sizes)

    def _walk(
        self,
        token_ids: Any,
        bs: int,
        group: int,
        seed: int,
        scores: dict[str, int],
        chain: list[int] | None,
    ) -> None:
        nfull = len(token_ids) // bs
        if not nfull:
            return
        get = self._holders.get
        names = self._names
        step = bs * 8
        h = seed
        alive = group
        depth = 0
        start = 0
        size = _FIRST_CHUNK_BLOCKS
        while start < nfull:
            stop = min(nfull, start + size)
            buf = _query_tokens(token_ids, start * bs, stop * bs)
            hs: list[int] = []
            ap = hs.append
            for chunk in _split(buf, step, stop - start):
                h = _X(chunk, h)
                ap(h)
            acc = list(accumulate(map(get, hs, repeat(0)), _and, initial=alive))
            if chain is not None:
                chain.extend(hs)
            last = acc[-1]
            if last != alive:
                prev = alive
                for k in range(1, len(acc)):
                    cur = acc[k]
                    if cur != prev:
                        dead = prev & ~cur
                        at = depth + k - 1
                        while dead:
                            low = dead & -dead
                            if at:
                                scores[names[low.bit_length() - 1]] = at  # type: ignore[index]
                            dead ^= low
                        if not cur:
                            return
                        prev = cur
                alive = last
            depth += stop - start
            start = stop
            size *= 2
        while alive:
            low = alive & -alive
            scores[names[low.bit_length() - 1]] = depth  # type: ignore[index]
            alive ^= low

    # ------------------------------------------------------------ observability

    def statistics(self) -> dict[str, Any]:
        """Counters for operators: blocks per worker and tier, anomalies seen."""
        from tokenspeed_router.router.tiers import unknown_media

        workers: dict[str, Any] = {}
        for name, ws in self._workers.items():
            workers[name] = {
                "block_size": ws.block_size,
                "blocks": _ext_len(ws),
                "tiers": self.blocks_by_tier(name),
                "unmatchable_blocks": len(ws.unm) + sum(ws.refs.get(c, 0) for c in ws.unm),
                "aliased_blocks": sum(ws.refs.values()),
                "unknown_removals": ws.unknown_removals,
                "unknown_parents": ws.unknown_parents,
                "duplicate_stores": ws.duplicate_stores,
                "tier_mismatch_removals": ws.tier_mismatch_removals,
                "block_size_mismatches": ws.block_size_mismatches,
            }
        return {
            "workers": workers,
            "num_workers": len(workers),
            "stored_blocks": self.num_blocks(),
            "distinct_blocks": len(self._holders),
            "block_sizes": sorted(self._size_masks),
            "unknown_removals": sum(w["unknown_removals"] for w in workers.values()),
            "unknown_parents": sum(w["unknown_parents"] for w in workers.values()),
            "unknown_media": unknown_media(),
            "hash_version": HASH_VERSION,
        }

    # ---------------------------------------------------------------- snapshots

    def snapshot(self) -> bytes:
        """Serialise the whole index (msgspec msgpack, versioned, O(total blocks))."""
        snaps = []
        for ws in self._workers.values():
            items = _ext_items(ws)
            keys = [e for e, _ in items]
            vals = [c for _, c in items]
            neg = [i for i, c in enumerate(vals) if c < 0]
            for i in neg:
                vals[i] = ~vals[i]
            tier_idx: list[int] = []
            tier_code: list[int] = []
            if ws.tiers:
                for i, (_e, c) in enumerate(items):
                    t = ws.tiers.get(c)
                    if t is not None:
                        tier_idx.append(i)
                        tier_code.append(t)
            snaps.append(
                _WorkerSnap(
                    name=ws.name,
                    block_size=ws.block_size,
                    ext=keys,
                    content=vals,
                    unmatchable=neg,
                    tier_index=tier_idx,
                    tier_code=tier_code,
                    counters=[
                        ws.unknown_removals,
                        ws.unknown_parents,
                        ws.duplicate_stores,
                        ws.tier_mismatch_removals,
                        ws.block_size_mismatches,
                    ],
                )
            )
        return _ENCODER.encode(
            _Snapshot(format=SNAPSHOT_FORMAT, version=SNAPSHOT_VERSION, hash_version=HASH_VERSION, workers=snaps)
        )

    @classmethod
    def restore(cls, data: bytes | bytearray | memoryview, *, compact_min: int | None = None) -> KvIndex:
        """Rebuild an index from ``snapshot()`` bytes; SnapshotError if unusable."""
        try:
            snap = _DECODER.decode(data)
        except msgspec.MsgspecError as err:
            raise SnapshotError(f"corrupt KvIndex snapshot: {err}") from err
        if snap.format != SNAPSHOT_FORMAT:
            raise SnapshotError(f"not a KvIndex snapshot: format {snap.format!r}")
        if snap.version != SNAPSHOT_VERSION:
            raise SnapshotError(f"unsupported KvIndex snapshot version {snap.version} (want {SNAPSHOT_VERSION})")
        if snap.hash_version != HASH_VERSION:
            raise SnapshotError(
                f"snapshot uses content hash v{snap.hash_version}, this build v{HASH_VERSION}: "
                "rebuild the index from events"
            )
        index = cls(compact_min=compact_min)
        for w in snap.workers:
            if len(w.ext) != len(w.content) or len(w.tier_index) != len(w.tier_code):
                raise SnapshotError(f"corrupt KvIndex snapshot: worker {w.name!r} lists differ in length")
            if w.name in index._workers:
                raise SnapshotError(f"corrupt KvIndex snapshot: worker {w.name!r} twice")
            ws = index._register(w.name)
            index._set_block_size(ws, w.block_size)
            vals = w.content
            try:
                for i in w.unmatchable:
                    vals[i] = ~vals[i]
                codes = dict(zip(w.tier_index, w.tier_code, strict=True))
                for i, (e, c) in enumerate(zip(w.ext, vals, strict=True)):
                    code = codes.get(i, GPU)
                    if not 0 < code <= ALL_TIERS:
                        raise SnapshotError(f"corrupt KvIndex snapshot: tier code {code}")
                    index._hold(ws, e, c, code, None)
            except (IndexError, TypeError) as err:
                raise SnapshotError(f"corrupt KvIndex snapshot: {err}") from err
            if len(ws.ext) != len(w.ext):  # checked before compaction below
                raise SnapshotError(f"corrupt KvIndex snapshot: worker {w.name!r} repeats external ids")
            counters = [*w.counters, 0, 0, 0, 0, 0][:5]
            (
                ws.unknown_removals,
                ws.unknown_parents,
                ws.duplicate_stores,
                ws.tier_mismatch_removals,
                ws.block_size_mismatches,
            ) = counters
            index._compact(ws)
        return index

    def dump_events(self) -> dict[str, list[KVEventBatch]]:
        """Per worker, batches that rebuild this index when applied to an empty one.

        The index keeps content ids, not token ids, so the dumped BlockStored
        events carry their content ids in ``extra_keys[DUMP_CONTENT_KEY]``
        (``apply`` uses them instead of hashing; ``token_ids`` is a
        placeholder of valid length). Every event has ``parent_block_hash =
        None``, so any order rebuilds the same state; GPU copies come first,
        then CPU, then storage (a second tier is a duplicate store that adds
        the tier). A worker without blocks gets one empty batch so that it
        is registered again (with a placeholder block stored and removed when
        its block size is known).
        """
        out: dict[str, list[KVEventBatch]] = {}
        for ws in self._workers.values():
            bs = ws.block_size or 1
            events: list[Event] = []
            for bit, medium in ((GPU, "gpu"), (CPU, "cpu"), (STORAGE, "storage")):
                items = [(e, c) for e, c in _ext_items(ws) if ws.tiers.get(c, GPU) & bit]
                for start in range(0, len(items), _DUMP_EVENT_BLOCKS):
                    part = items[start : start + _DUMP_EVENT_BLOCKS]
                    n = len(part)
                    extra: dict[str, Any] = {DUMP_CONTENT_KEY: [c if c >= 0 else ~c for _, c in part]}
                    neg = [i for i, (_, c) in enumerate(part) if c < 0]
                    if neg:
                        extra[DUMP_UNMATCHABLE_KEY] = neg
                    events.append(
                        BlockStored(
                            block_hashes=[e for e, _ in part],
                            parent_block_hash=None,
                            token_ids=[0] * ((n - 1) * bs + 1),
                            block_size=bs,
                            medium=medium,
                            extra_keys=extra,
                        )
                    )
            if not events and ws.block_size is not None:
                # No blocks, but a known block size: store and drop a placeholder.
                events = [
                    BlockStored(
                        block_hashes=[_DUMP_PLACEHOLDER],
                        parent_block_hash=None,
                        token_ids=[0],
                        block_size=bs,
                        extra_keys={DUMP_CONTENT_KEY: [0], DUMP_UNMATCHABLE_KEY: [0]},
                    ),
                    BlockRemoved(block_hashes=[_DUMP_PLACEHOLDER]),
                ]
            batches = [KVEventBatch(0.0, events[i : i + 64]) for i in range(0, len(events), 64)]
            out[ws.name] = batches or [KVEventBatch(0.0, [])]
        return out


class _WorkerSnap(msgspec.Struct, array_like=True):
    name: str
    block_size: int | None
    ext: list[int | bytes]
    content: list[int]
    unmatchable: list[int]
    tier_index: list[int]
    tier_code: list[int]
    counters: list[int]


class _Snapshot(msgspec.Struct):
    format: str
    version: int
    hash_version: int
    workers: list[_WorkerSnap]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Snapshot)

