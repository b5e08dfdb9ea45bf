"""The global KV index: which worker holds which prefix blocks, exactly (DESIGN §4-5).

:class:`KvIndex` turns KV events into operations on a *core* that holds the
blocks. There are two cores with one contract and the same answers:

* ``tokenspeed_router._native.Core`` (csrc/, one C extension) — compiled, compact
  (open-addressing tables, ~60 bytes a block), its own reader/writer lock:
  the default whenever the extension is built;
* :class:`~tokenspeed_router.router.index_reference.ReferenceCore` — plain
  dicts, the readable model of the data structures; used when the extension
  is not built (with a warning in the log: it is much slower), with
  ``KvIndex(core="reference")``, or when the environment sets
  ``TOKENSPEED_ROUTER_INDEX=reference`` (read once at import, for operators
  comparing the two).

Both satisfy :class:`~tokenspeed_router.router.index_core.IndexCore` (checked
by mypy); ``KvIndex.implementation`` names the one running.

This module owns the event semantics both share: validation before any
change, block-size adoption, partial tails and foreign block grids, LoRA and
salt namespaces, pre-hashed stores, batch atomicity, counters, snapshots and
``dump_events``. Content ids are ``tokenspeed_router.hashing`` (HASH_VERSION 1).

Complexity (n = blocks in an event, d = matched depth, B = a worker's blocks)

===========================  ====================================================
``apply`` store / remove      O(n) per event (+ O(n) undo log in multi-event batches)
``match`` / ``match_detail``  O(d) hashing + one lookup per block for all workers,
                              once per distinct block size; stops at the deepest hit
``clear_worker`` / remove     O(B)
``snapshot`` / ``restore``    O(total blocks)
===========================  ====================================================

Threads
-------
Single writer: one thread calls ``apply``, ``clear_worker``, ``remove_worker``,
``restore`` into it. ``match``, ``match_detail``, ``workers``,
``block_size_of``, ``num_blocks``, ``blocks_by_tier`` and ``statistics`` may
be called from any other thread at the same time, on either core: each core
locks each event and each query on its own, so a query never waits behind a
whole batch (it may see a batch half applied, never a block half stored).
Callers need no lock of their own around the index.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
import xxhash

from tokenspeed_router.errors import SnapshotError, UnknownParentError, WireError
from tokenspeed_router.events.schema import (
    BlockRemoved,
    BlockStored,
    Event,
    KVEventBatch,
)
from tokenspeed_router.events.validation import (
    DUMP_CONTENT_KEY,
    DUMP_UNMATCHABLE_KEY,
    validate_event,
)
from tokenspeed_router.hashing import HASH_VERSION, root_seed
from tokenspeed_router.router.index_core import CoreName, IndexCore, WorkerInfo
from tokenspeed_router.router.index_reference import ReferenceCore
from tokenspeed_router.router.recovery import is_inferred_id
from tokenspeed_router.router.tiers import (
    ALL_TIERS,
    CPU,
    GPU,
    STORAGE,
    TIER_NAMES,
    known_media,
    medium_code,
)

try:
    from tokenspeed_router import _native
except ImportError:  # built without a C compiler: the reference core serves
    _native = None  # type: ignore[assignment]

__all__ = [
    "DUMP_CONTENT_KEY",
    "NATIVE_AVAILABLE",
    "SNAPSHOT_VERSION",
    "ApplyStats",
    "RawApplied",
    "KvIndex",
    "MatchDetail",
    "WorkerInfo",
    "lora_key",
]

logger = logging.getLogger(__name__)

SNAPSHOT_VERSION = 1
SNAPSHOT_FORMAT = "tokenspeed-router/kv-index"


NATIVE_AVAILABLE = _native is not None
if _native is not None:
    _native.set_media(sorted(known_media().items()))  # the raw decoder maps media as medium_code does
_DEFAULT_CORE = os.environ.get("TOKENSPEED_ROUTER_INDEX", "").strip().lower() or None

_M64 = (1 << 64) - 1
_DUMP_EVENT_BLOCKS = 256
_DUMP_PLACEHOLDER = b"tokenspeed_router.dump.block_size"
_COUNTERS = (
    "unknown_removals",
    "unknown_parents",
    "duplicate_stores",
    "tier_mismatch_removals",
    "block_size_mismatches",
)
_UNKNOWN_REMOVALS, _UNKNOWN_PARENTS, _DUPLICATES, _TIER_MISMATCHES, _BS_MISMATCHES = range(5)


class ApplyStats(NamedTuple):
    """What one ``apply`` did (counts of blocks, not bytes).

    ``blocks``: the worker's blocks held right after the batch (``num_blocks``
    then), -1 when not known (a batch refused whole). The engine belief reads
    its cache size from it on a removal (``Router.on_index_applied``) instead
    of asking the index again.
    """

    events: int
    stored_blocks: int
    duplicate_blocks: int
    removed_blocks: int
    unknown_removals: int
    cleared: int
    blocks: int = -1


class RawApplied(NamedTuple):
    """What one ``apply_raw`` did (see :meth:`KvIndex.apply_raw`).

    ``unknown_parent``: a BlockStored's parent is not held; nothing was
    applied (as ``apply`` raising :class:`UnknownParentError`). In salvage
    mode, ``rejected`` events were refused that way and the rest applied;
    ``last_clear`` / ``last_reject`` are the indexes of the last
    whole-cache clear applied and of the last refused event (-1: none).
    """

    ts: float
    stats: ApplyStats
    stores: bool
    clears_everything: bool
    unknown_parent: bool
    rejected: int
    last_clear: int
    last_reject: int


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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, the ``POST /match`` answer (DESIGN §6)."""
        return {"scores": self.scores, "block_size": self.block_size, "tiers": self.tiers}


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


_warned_fallback = False


def _new_core(kind: str | None) -> tuple[IndexCore, CoreName]:
    """The core ``kind`` names (None: the environment's choice, else native when built).

    Falling back to the reference core because the extension is not built
    logs a warning (once per process): it gives the same answers, an
    operator must still learn that the index runs many times slower.
    """
    global _warned_fallback
    if kind is None and _DEFAULT_CORE is None and not NATIVE_AVAILABLE:
        if not _warned_fallback:
            _warned_fallback = True
            logger.warning(
                "the compiled index core (tokenspeed_router._native) is not built: using the "
                "pure-Python reference core (same answers, much slower); reinstall with a C compiler"
            )
        return ReferenceCore(), "reference"
    kind = kind or _DEFAULT_CORE or "native"
    if kind == "reference":
        return ReferenceCore(), "reference"
    if kind == "native":
        if _native is None:
            raise ImportError("tokenspeed_router._native is not built (reinstall with a C compiler)")
        return _native.Core(), "native"
    raise ValueError(f"unknown index core {kind!r} (native or reference)")


class KvIndex:
    """Exact, per-worker longest-prefix index over content-hashed KV blocks.

    ``core``: ``"native"`` (default when built), ``"reference"``, or None for
    the default. Worker names are opaque strings; a DP rank is just another
    worker (``"NAME/dpR"``). Threads: see the module docstring.
    """

    def __init__(self, *, core: str | None = None) -> None:
        self._core, self.implementation = _new_core(core)
        #: True on both cores (each locks every event and query itself); kept for callers that ask
        self.concurrent_reads = True
        self._block_size: dict[str, int | None] = {}
        self._counters: dict[str, list[int]] = {}
        self._roots: dict[tuple[Any, Any], int] = {}
        #: the compiled core's raw apply (not in IndexCore: the reference core has none)
        self._raw = getattr(self._core, "apply_raw", None)
        self._raw_many = getattr(self._core, "apply_raw_many", None)
        self._plain_root = self._root(None, None)  # no LoRA, no salt: what the raw path serves

    # ------------------------------------------------------------------ workers

    def workers(self) -> list[str]:
        """Known workers, in registration order.

        A worker is known from its first applied batch (even an empty one)
        until :meth:`remove_worker`; clearing its blocks keeps it known.
        """
        return self._core.workers()

    @property
    def workers_version(self) -> int:
        """Changes whenever the set of known workers changes (cheap polling for the router)."""
        return int(self._core.version)

    def block_size_of(self, worker: str) -> int | None:
        """The worker's block size, or None before its first BlockStored.

        Set by the first BlockStored, and set again by the first BlockStored
        that arrives while the worker holds no matchable block (after a
        restart, a clear, or once everything was removed), so a worker that
        restarts with another block size matches again. While it holds no
        block this still reports the last size it used.
        """
        return self._block_size.get(worker)

    def worker_info(self, worker: str) -> WorkerInfo:
        """A known worker's counts (KeyError for an unknown one)."""
        return WorkerInfo._make(self._core.info(worker))

    def num_blocks(self, worker: str | None = None) -> int:
        """Blocks held (partial tails and every tier copy of a block counted once)."""
        if worker is None:
            return sum(self.worker_info(w).blocks for w in self._core.workers())
        if worker not in self._counters:
            return 0
        return self.worker_info(worker).blocks

    def num_distinct_blocks(self) -> int:
        """Distinct matchable content ids across all workers."""
        return int(self._core.num_distinct())

    def blocks_by_tier(self, worker: str) -> dict[str, int]:
        """Blocks per tier for one worker; a block on two tiers counts in both."""
        if worker not in self._counters:
            return dict.fromkeys(TIER_NAMES, 0)
        info = self.worker_info(worker)
        return {"gpu": info.gpu, "cpu": info.cpu, "storage": info.storage}

    def memory_bytes(self) -> int:
        """Bytes the core's tables keep (native: exact allocation; reference: getsizeof)."""
        return int(self._core.memory_bytes())

    def _register(self, worker: str) -> None:
        self._core.register(worker)
        self._block_size[worker] = None
        self._counters[worker] = [0] * len(_COUNTERS)

    def _unregister(self, worker: str) -> None:
        self._core.unregister(worker)
        del self._block_size[worker]
        del self._counters[worker]

    def _set_block_size(self, worker: str, block_size: int | None) -> None:
        self._block_size[worker] = block_size
        self._core.set_block_size(worker, block_size)

    def clear_worker(self, worker: str) -> None:
        """Drop every block of a worker (restart, resync); keep it registered."""
        if worker in self._counters:
            self._core.clear(worker, ALL_TIERS)

    def remove_worker(self, worker: str) -> None:
        """Forget a worker entirely (it left the fleet)."""
        if worker in self._counters:
            self._unregister(worker)

    # -------------------------------------------------------------------- apply

    def apply(self, worker: str, batch: KVEventBatch) -> ApplyStats:
        """Fold one decoded batch of ``worker``'s events into the index, atomically.

        Raises :class:`UnknownParentError` (and :class:`WireError` for an event
        whose token count does not fit its hashes) *without changing anything*:
        a lost event must be replayed or the worker resynced, never guessed.
        Each event is applied under its own short lock; a multi-event batch
        records an undo log so a failure halfway rolls everything back.
        """
        events = batch.events
        for ev in events:
            self._validate(worker, ev)
        created = worker not in self._counters
        if created:
            self._register(worker)
        block_size = self._block_size[worker]
        counts = [0] * len(_COUNTERS)
        logged = len(events) > 1
        if logged:
            self._core.begin()
        stored = dup = removed = unknown = cleared = 0
        try:
            for ev in events:
                if isinstance(ev, BlockStored):
                    s, d = self._store(worker, ev, counts)
                    stored += s
                    dup += d
                elif isinstance(ev, BlockRemoved):
                    gone, u, mismatch = self._core.remove(
                        worker, ev.block_hashes, medium_code(ev.medium), ev.medium is None
                    )
                    removed += gone
                    unknown += u
                    counts[_UNKNOWN_REMOVALS] += u
                    counts[_TIER_MISMATCHES] += mismatch
                else:
                    code = ALL_TIERS if ev.medium is None else medium_code(ev.medium)
                    removed += self._core.clear(worker, code)
                    cleared += 1
        except BaseException as err:
            if logged:
                self._core.rollback()
            if created:
                self._unregister(worker)
            else:
                self._set_block_size(worker, block_size)
                if isinstance(err, UnknownParentError):
                    self._counters[worker][_UNKNOWN_PARENTS] += 1
            raise
        if logged:
            self._core.commit()
        mine = self._counters[worker]
        counts[_DUPLICATES] += dup
        for i, v in enumerate(counts):
            mine[i] += v
        return ApplyStats(len(events), stored, dup, removed, unknown, cleared, self.worker_info(worker).blocks)

    def apply_raw(self, worker: str, payload: bytes, *, salvage: bool = False) -> RawApplied | None:
        """Apply an undecoded msgpack batch in the compiled core, or say None (nothing changed).

        The common case -- the three events in either wire form, int or bytes
        ids, a known ``medium``, no LoRA/salt/extra keys, every store on the
        worker's current block grid, the worker already known -- is read and
        applied in C without a Python object per block and without the GIL
        (csrc/ingest_decode.c). Anything else, malformed bytes included,
        returns None before any change: decode it and call :meth:`apply`,
        which decides exactly as always. Same atomicity and counters as
        :meth:`apply`; ``salvage=True`` applies event by event instead,
        skipping stores whose parent is unknown (``IndexIngestor``'s salvage).
        """
        raw = self._raw
        if raw is None:
            return None
        bs = self._block_size.get(worker)
        if bs is None:  # an unknown worker, or one without a block grid yet
            return None
        got = raw(worker, payload, bs, self._plain_root, salvage)
        return None if got is None else self._raw_applied(worker, got)

    def _raw_applied(self, worker: str, got: tuple[Any, ...]) -> RawApplied:
        """The counters and the answer of one batch the compiled core's raw path took."""
        (ts, events, stored, dup, removed, unknown, cleared, mismatch, flags, refused, rejected, last_clear,
         last_reject, blocks) = got
        mine = self._counters[worker]
        if refused:
            mine[_UNKNOWN_PARENTS] += 1
            stats = ApplyStats(events, 0, 0, 0, 0, 0)
        else:
            mine[_UNKNOWN_REMOVALS] += unknown
            mine[_TIER_MISMATCHES] += mismatch
            mine[_DUPLICATES] += dup
            mine[_UNKNOWN_PARENTS] += rejected
            stats = ApplyStats(events, stored, dup, removed, unknown, cleared, blocks)
        return RawApplied(
            ts, stats, bool(flags & 1), bool(flags & 2), bool(refused), rejected, last_clear, last_reject
        )

    def apply_raw_many(self, jobs: Sequence[tuple[str, bytes]]) -> list[RawApplied | Exception | None]:
        """:meth:`apply_raw` each ``(worker, payload)`` in order, as one call.

        Stops after the first job the raw path cannot take (its entry is None,
        nothing of it changed), that was refused whole (``unknown_parent``) or
        that ran out of memory (the :class:`MemoryError` in its place, nothing
        of it applied): the caller decides what that batch needs (the typed
        path, a resync and a salvage) before the jobs after it, which are not
        tried. So the answer has one entry per job tried, never more than
        ``len(jobs)``, and every job before the last entry was applied. On the
        compiled core the run is one native call that gives the GIL away once
        (``Core.apply_raw_many``), not once per batch.
        """
        many = self._raw_many
        if many is None:
            return [None] if jobs else []
        names: list[str] = []
        payloads: list[bytes] = []
        sizes: list[int] = []
        block_size = self._block_size
        for worker, payload in jobs:
            bs = block_size.get(worker)
            if bs is None:  # an unknown worker or no block grid yet: the typed path decides
                break
            names.append(worker)
            payloads.append(payload)
            sizes.append(bs)
        out: list[RawApplied | Exception | None] = []
        if names:
            for worker, got in zip(names, many(names, payloads, sizes, self._plain_root), strict=False):
                if got is None or isinstance(got, Exception):
                    out.append(got)
                    break
                applied = self._raw_applied(worker, got)
                out.append(applied)
                if applied.unknown_parent:
                    break
        if len(out) == len(names) < len(jobs) and (not out or (isinstance(out[-1], RawApplied)
                                                     and not out[-1].unknown_parent)):
            out.append(None)  # the job that stopped the run: not taken, nothing of it changed
        return out

    def _validate(self, worker: str, ev: Event) -> None:
        """Reject a malformed event before anything of the batch is applied."""
        validate_event(ev, f"worker {worker!r}: ")

    def _store(self, worker: str, ev: BlockStored, counts: list[int]) -> tuple[int, int]:
        """One BlockStored: pick the block grid, then let the core hash and hold it."""
        hashes = ev.block_hashes
        n = len(hashes)
        num = len(ev.token_ids)
        ebs = ev.block_size
        xk = ev.extra_keys
        dumped = type(xk) is dict and DUMP_CONTENT_KEY in xk
        prehashed = num == 0
        bs = self._block_size[worker]
        if bs is None:
            self._set_block_size(worker, ebs)
            bs = ebs
        elif (
            ebs != bs
            and (dumped or prehashed or not (n == 1 and ebs < bs and num < bs))
            and self.worker_info(worker).matchable == 0
        ):
            # The worker holds no matchable block: it restarted or was cleared,
            # maybe with another block size. Adopt the event's. A lone block
            # shorter than both sizes and of a smaller size is instead a partial
            # tail of the current grid (vLLM's cache_partial_block sends
            # ``block_size`` = its token count), which must not reset the grid.
            self._set_block_size(worker, ebs)
            bs = ebs
        parent = ev.parent_block_hash
        code = medium_code(ev.medium)
        if dumped:
            marks = bytearray(n)
            for i in xk.get(DUMP_UNMATCHABLE_KEY, ()):
                marks[i] = 1
            contents = [c & _M64 for c in xk[DUMP_CONTENT_KEY]]
            got = self._core.store_hashed(worker, hashes, parent, contents, bytes(marks), code)
        elif prehashed:
            flags = b"\x01" * n if ebs != bs else None  # another grid: kept, never matched
            if flags:
                counts[_BS_MISMATCHES] += 1
            contents = [int(h) & _M64 for h in hashes]  # type: ignore[arg-type]  # ints: validated
            got = self._core.store_hashed(worker, hashes, parent, contents, flags, code)
        else:
            unmatchable = False
            if ebs != bs and not (n == 1 and num < bs):
                # Another block grid (e.g. vLLM's partial-block events): keep the
                # blocks for parents and removals, never match them.
                counts[_BS_MISMATCHES] += 1
                unmatchable = True
                bs = ebs
            root = self._root(lora_key(ev.lora_id, ev.lora_name), ev.cache_salt) if parent is None else 0
            got = self._core.store(
                worker, hashes, parent, root, ev.token_ids, bs, min(num // bs, n), code, unmatchable
            )
        if got is None:
            raise UnknownParentError(worker, parent)
        return got

    def _root(self, lora: Any, salt: Any) -> int:
        key = (lora, salt)
        r = self._roots.get(key)
        if r is None:
            r = root_seed(lora_key(lora), salt)
            if len(self._roots) < 4096:
                self._roots[key] = r
        return r

    # -------------------------------------------------------------------- match

    def match(
        self, token_ids: Sequence[int] | Any, lora_id: int | str | None = None, salt: str | bytes | None = None
    ) -> dict[str, int]:
        """Leading full blocks of ``token_ids`` each worker holds (any tier).

        Every known worker appears, in registration order, with 0 when it
        holds no leading block of the request. Hashes the request lazily:
        hashing stops at the first block no worker holds.
        """
        try:
            return self._core.match(token_ids, self._root(lora_id, salt))
        except (TypeError, ValueError, OverflowError) as err:
            raise WireError(f"token_ids must be ints in [0, 2**64): {err}") from err

    def match_detail(
        self, token_ids: Sequence[int] | Any, lora_id: int | str | None = None, salt: str | bytes | None = None
    ) -> MatchDetail:
        """``match`` plus each worker's matched blocks by best tier and block sizes.

        ``scores`` is exactly ``match``'s answer; ``tiers`` has the same keys,
        each with all three tier names, summing to the score; ``block_size``
        lists every known worker whose block size is known.
        """
        try:
            scores, tiers, sizes = self._core.match_detail(token_ids, self._root(lora_id, salt))
        except (TypeError, ValueError, OverflowError) as err:
            raise WireError(f"token_ids must be ints in [0, 2**64): {err}") from err
        return MatchDetail(scores, tiers, sizes)

    # ------------------------------------------------------------ observability

    def statistics(self) -> dict[str, Any]:
        """Counters for operators: blocks per worker and tier, anomalies seen."""
        from tokenspeed_router.router.tiers import unknown_media

        workers: dict[str, Any] = {}
        for name in self._core.workers():
            info = self.worker_info(name)
            workers[name] = {
                "block_size": self._block_size.get(name),
                "blocks": info.blocks,
                "tiers": {"gpu": info.gpu, "cpu": info.cpu, "storage": info.storage},
                "unmatchable_blocks": info.unmatchable,
                "aliased_blocks": info.aliased,
                **dict(zip(_COUNTERS, self._counters.get(name, [0] * 5), strict=True)),
            }
        return {
            "workers": workers,
            "num_workers": len(workers),
            "stored_blocks": sum(w["blocks"] for w in workers.values()),
            "distinct_blocks": self.num_distinct_blocks(),
            "block_sizes": sorted({w["block_size"] for w in workers.values() if w["block_size"]}),
            "unknown_removals": sum(w["unknown_removals"] for w in workers.values()),
            "unknown_parents": sum(w["unknown_parents"] for w in workers.values()),
            "unknown_media": unknown_media(),
            "hash_version": HASH_VERSION,
            "core": self.implementation,
        }

    # ---------------------------------------------------------------- snapshots

    def snapshot(self) -> bytes:
        """Serialise the whole index (msgspec msgpack, versioned, O(total blocks)).

        The format is the same for both cores: either restores the other's.
        Entries are listed in no particular order. Blocks the ingestor inferred
        (``router/recovery.py``) are left out: what tracks them (to drop them
        at a removal the index cannot place) does not survive a restore.
        """
        snaps = []
        for name in self._core.workers():
            ext, content, unmatchable, tier_index, tier_code = _without_inferred(*self._core.items(name))
            snaps.append(
                _WorkerSnap(
                    name=name,
                    block_size=self._block_size.get(name),
                    ext=ext,
                    content=content,
                    unmatchable=unmatchable,
                    tier_index=tier_index,
                    tier_code=tier_code,
                    counters=list(self._counters[name]),
                )
            )
        return _ENCODER.encode(
            _Snapshot(format=SNAPSHOT_FORMAT, version=SNAPSHOT_VERSION, hash_version=HASH_VERSION, workers=snaps)
        )

    @classmethod
    def restore(cls, data: bytes | bytearray | memoryview, *, core: str | None = None) -> KvIndex:
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
        index = cls(core=core)
        for w in snap.workers:
            if len(w.ext) != len(w.content) or len(w.tier_index) != len(w.tier_code):
                raise SnapshotError(f"corrupt KvIndex snapshot: worker {w.name!r} lists differ in length")
            if w.name in index._counters:
                raise SnapshotError(f"corrupt KvIndex snapshot: worker {w.name!r} twice")
            index._register(w.name)
            index._set_block_size(w.name, w.block_size)
            try:
                index._load(w)
            except (IndexError, TypeError, ValueError, OverflowError) as err:
                raise SnapshotError(f"corrupt KvIndex snapshot: {err}") from err
            index._counters[w.name] = [*w.counters, 0, 0, 0, 0, 0][:5]
        return index

    def _load(self, w: _WorkerSnap) -> None:
        n = len(w.ext)
        codes = [GPU] * n
        for i, code in zip(w.tier_index, w.tier_code, strict=True):
            if not 0 < code <= ALL_TIERS:
                raise SnapshotError(f"corrupt KvIndex snapshot: tier code {code}")
            codes[i] = code
        flags = bytearray(n)
        for i in w.unmatchable:
            flags[i] = 1
        by_code: dict[int, list[int]] = {}
        for i, code in enumerate(codes):
            by_code.setdefault(code, []).append(i)
        for code, idx in by_code.items():
            ext = [w.ext[i] for i in idx]
            contents = [w.content[i] & _M64 for i in idx]
            got = self._core.store_hashed(w.name, ext, None, contents, bytes(flags[i] for i in idx), code)
            if got is not None and got[1]:  # None only for an unknown parent: there is none here
                raise SnapshotError(f"corrupt KvIndex snapshot: worker {w.name!r} repeats external ids")

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
        for name in self._core.workers():
            block_size = self._block_size.get(name)
            bs = block_size or 1
            ext, content, unmatchable, tier_index, tier_code = self._core.items(name)
            unm = set(unmatchable)
            codes = dict(zip(tier_index, tier_code, strict=True))
            events: list[Event] = []
            for bit, medium in ((GPU, "gpu"), (CPU, "cpu"), (STORAGE, "storage")):
                idx = [i for i in range(len(ext)) if codes.get(i, GPU) & bit]
                for start in range(0, len(idx), _DUMP_EVENT_BLOCKS):
                    part = idx[start : start + _DUMP_EVENT_BLOCKS]
                    n = len(part)
                    extra: dict[str, Any] = {DUMP_CONTENT_KEY: [content[i] for i in part]}
                    neg = [k for k, i in enumerate(part) if i in unm]
                    if neg:
                        extra[DUMP_UNMATCHABLE_KEY] = neg
                    events.append(
                        BlockStored(
                            block_hashes=[ext[i] for i in part],
                            parent_block_hash=None,
                            token_ids=[0] * ((n - 1) * bs + 1),
                            block_size=bs,
                            medium=medium,
                            extra_keys=extra,
                        )
                    )
            if not events and block_size is not None:
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
            out[name] = batches or [KVEventBatch(0.0, [])]
        return out


def _without_inferred(
    ext: list[Any], content: list[int], unmatchable: list[int], tier_index: list[int], tier_code: list[int]
) -> tuple[list[Any], list[int], list[int], list[int], list[int]]:
    """A worker's items (``IndexCore.items``) less its inferred ids, positions renumbered."""
    keep = [i for i, x in enumerate(ext) if not is_inferred_id(x)]
    if len(keep) == len(ext):
        return ext, content, unmatchable, tier_index, tier_code
    pos = {old: new for new, old in enumerate(keep)}
    pairs = [(pos[i], c) for i, c in zip(tier_index, tier_code, strict=True) if i in pos]
    return (
        [ext[i] for i in keep],
        [content[i] for i in keep],
        [pos[i] for i in unmatchable if i in pos],
        [p for p, _ in pairs],
        [c for _, c in pairs],
    )


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

