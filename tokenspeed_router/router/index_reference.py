"""The reference index core: plain dicts, the model a newcomer reads first.

:class:`~tokenspeed_router.router.index.KvIndex` turns KV events into calls
on a *core*; this module is one core, the compiled ``tokenspeed_router._native.Core``
(csrc/, C) is the other. Both have exactly these methods and give the
same answers (the behaviour suite and the stateful test run both and compare).
This one is the readable definition; the C one is the fast one.

Model
-----
Every block a worker stores is named twice: by the engine's *external id*
(any int or bytes, trusted only within that worker) and by the router's
*content id* (``hashing.py``: XXH3-64 chained over the tokens, so equal
prefixes have equal ids on every worker). Per worker:

* ``blocks[external id] = Block(content, matchable)`` — to find a block's
  parent and to apply removals. ``matchable`` is False for blocks a query can
  never hit: a partial tail page, blocks of another block grid, and their
  descendants. They are kept so that their removals and children still work.
* ``held[(content, matchable)] = Held(refs, tiers)`` — how many external ids
  of this worker name the content (usually 1; more are *aliases*) and on
  which tiers the worker holds it (bits: gpu=1, cpu=2, storage=4).

And one global map, ``holders[content] = {workers}`` over the matchable
blocks, so a query walks its chain once for all workers at once.

Complexity: store/remove O(blocks in the event); match O(matched depth)
hashing and lookups per distinct block size; clear O(worker's blocks).

Atomicity: between ``begin()`` and ``commit()`` every change records how to
undo itself; ``rollback()`` replays those in reverse (KvIndex uses this so a
batch that hits an unknown parent halfway changes nothing).

Threads: like the native core, every public method holds the core's lock
for its own work (one event, one query), so one writer and any number of
readers may call it at once and a reader sees a batch half applied, never a
block half stored (``router/index_core.py``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, NamedTuple, ParamSpec, TypeVar

from tokenspeed_router.hashing import chain_hash, tokens_to_bytes
from tokenspeed_router.router.index_core import RawWorkerInfo
from tokenspeed_router.router.tiers import ALL_TIERS, GPU, TIER_NAMES, best_tier

__all__ = ["ReferenceCore"]

_M64 = (1 << 64) - 1
_P = ParamSpec("_P")
_R = TypeVar("_R")


class Block(NamedTuple):
    content: int
    matchable: bool


class Held(NamedTuple):
    refs: int
    tiers: int


class _Worker:
    def __init__(self, name: str) -> None:
        self.name = name
        self.block_size: int | None = None
        self.blocks: dict[Any, Block] = {}
        self.held: dict[Block, Held] = {}


def _locked(method: Callable[Concatenate[ReferenceCore, _P], _R]) -> Callable[Concatenate[ReferenceCore, _P], _R]:
    """Run a public method under the core's lock (re-entrant: methods call each other)."""

    @functools.wraps(method)
    def locked(self: ReferenceCore, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


def _event_words(token_ids: Any) -> list[int]:
    """An event's token ids as u64 (out-of-range ids wrap: ingestion must not half-apply)."""
    return [int(t) & _M64 for t in token_ids]


class ReferenceCore:
    """Pure-Python index core; see the module docstring."""

    def __init__(self) -> None:
        self._workers: dict[str, _Worker] = {}  # in registration order
        self.holders: dict[int, set[str]] = {}
        self.version = 0
        self._undo: list[Callable[[], None]] | None = None
        self._lock = threading.RLock()

    # ---- workers

    @_locked
    def register(self, name: str) -> None:
        if name not in self._workers:
            self._workers[name] = _Worker(name)
            self.version += 1

    @_locked
    def unregister(self, name: str) -> None:
        undo, self._undo = self._undo, None  # leaving is never undone
        self.clear(name, ALL_TIERS)
        self._undo = undo
        del self._workers[name]
        self.version += 1

    @_locked
    def workers(self) -> list[str]:
        return list(self._workers)

    @_locked
    def set_block_size(self, name: str, block_size: int | None) -> None:
        self._workers[name].block_size = block_size

    # ---- undo log

    @_locked
    def begin(self) -> None:
        self._undo = []

    @_locked
    def commit(self) -> None:
        self._undo = None

    @_locked
    def rollback(self) -> None:
        undo, self._undo = self._undo or [], None
        for step in reversed(undo):
            step()

    def _put(self, d: dict[Any, Any], key: Any, value: Any) -> None:
        """``d[key] = value`` (``None`` deletes), remembering how to undo it."""
        if self._undo is not None:
            old = d.get(key)
            self._undo.append(lambda: self._put(d, key, old))
        if value is None:
            d.pop(key, None)
        else:
            d[key] = value

    def _hold(self, name: str, content: int, on: bool) -> None:
        """Add or drop ``name`` among the holders of a matchable content."""
        names = self.holders.get(content, set())
        if (name in names) == on:
            return
        if self._undo is not None:
            self._undo.append(lambda: self._hold(name, content, not on))
        if on:
            self.holders[content] = names | {name}
        elif len(names) == 1:
            del self.holders[content]
        else:
            self.holders[content] = names - {name}

    # ---- blocks

    @_locked
    def store(
        self,
        name: str,
        ext_ids: Sequence[Any],
        parent: Any,
        root: int,
        token_ids: Any,
        block_size: int,
        num_full: int,
        tier: int,
        unmatchable: bool,
    ) -> tuple[int, int] | None:
        """Hash and hold one event's blocks: ``num_full`` full blocks of
        ``block_size`` tokens, then (when there is one more id) a partial tail.

        The chain starts at the parent's content (or ``root``). Returns (new,
        duplicate) blocks, or None — having changed nothing — when the parent
        is unknown.
        """
        w = self._workers[name]
        seed = root
        if parent is not None:
            up = w.blocks.get(parent)
            if up is None:
                return None
            seed, unmatchable = up.content, unmatchable or not up.matchable
        words = _event_words(token_ids)
        contents: list[int] = []
        for i in range(len(ext_ids)):
            chunk = words[i * block_size : (i + 1) * block_size] if i < num_full else words[num_full * block_size :]
            seed = chain_hash(tokens_to_bytes(chunk), seed)
            contents.append(seed)
        flags = [unmatchable or i >= num_full for i in range(len(ext_ids))]
        return self._hold_all(w, ext_ids, contents, flags, tier)

    @_locked
    def store_hashed(
        self, name: str, ext_ids: Sequence[Any], parent: Any, contents: Sequence[int], unmatchable: bytes | None, tier: int
    ) -> tuple[int, int] | None:
        """Hold blocks whose content ids are given (dumps, hashes-only relays)."""
        w = self._workers[name]
        inherited = False
        if parent is not None:
            up = w.blocks.get(parent)
            if up is None:
                return None
            inherited = not up.matchable
        flags = [inherited or bool(unmatchable and unmatchable[i]) for i in range(len(ext_ids))]
        return self._hold_all(w, ext_ids, [int(c) for c in contents], flags, tier)

    def _hold_all(
        self, w: _Worker, ext_ids: Sequence[Any], contents: list[int], unmatchable: list[bool], tier: int
    ) -> tuple[int, int]:
        new = 0
        for e, c, unm in zip(ext_ids, contents, unmatchable, strict=True):
            new += self._hold_one(w, e, Block(c, not unm), tier)
        return new, len(ext_ids) - new

    def _hold_one(self, w: _Worker, e: Any, block: Block, tier: int) -> int:
        """1 if ``e`` is new for the worker, 0 if a duplicate (which may add a tier)."""
        prev = w.blocks.get(e)
        if prev is not None:
            dup = w.held[prev]
            if dup.tiers | tier != dup.tiers:
                self._put(w.held, prev, Held(dup.refs, dup.tiers | tier))
            return 0
        self._put(w.blocks, e, block)
        h = w.held.get(block)
        if h is None:
            self._put(w.held, block, Held(1, tier))
            if block.matchable:
                self._hold(w.name, block.content, True)
        else:  # an alias: another external id for content the worker holds
            self._put(w.held, block, Held(h.refs + 1, h.tiers | tier))
        return 1

    @_locked
    def remove(self, name: str, ext_ids: Sequence[Any], tier: int, unspecified: bool) -> tuple[int, int, int]:
        """Drop tier ``tier`` of each block; returns (gone, unknown ids, tier mismatches).

        ``unspecified``: the event named no medium, so a block held only off
        GPU is gone entirely (the engine says so).
        """
        w = self._workers[name]
        gone = unknown = mismatch = 0
        for e in ext_ids:
            try:
                r = self._drop(w, e, tier, unspecified)
            except TypeError:  # unhashable id: never stored
                r = -1
            if r < 0:
                unknown += 1
            elif r == 0 and self._mismatch:
                mismatch += 1
            gone += max(r, 0)
        return gone, unknown, mismatch

    _mismatch = False

    def _drop(self, w: _Worker, e: Any, tier: int, unspecified: bool) -> int:
        """1: the block is gone; 0: still held on another tier; -1: unknown id."""
        self._mismatch = False
        block = w.blocks.get(e)
        if block is None:
            return -1
        h = w.held[block]
        if h.refs > 1:  # another external id still names the content
            self._put(w.blocks, e, None)
            self._put(w.held, block, Held(h.refs - 1, h.tiers))
            return 1
        rm = ALL_TIERS if unspecified and not h.tiers & GPU else tier
        left = h.tiers & ~rm
        if left == h.tiers:
            self._mismatch = True
            return 0
        if left:
            self._put(w.held, block, Held(1, left))
            return 0
        self._put(w.blocks, e, None)
        self._put(w.held, block, None)
        if block.matchable:
            self._hold(w.name, block.content, False)
        return 1

    @_locked
    def clear(self, name: str, tier: int) -> int:
        """Drop tier ``tier`` (ALL_TIERS: everything) of every block; returns blocks gone."""
        w = self._workers[name]
        gone = 0
        for e, block in list(w.blocks.items()):
            if e not in w.blocks:
                continue
            h = w.held[block]
            if not h.tiers & tier:
                continue
            left = h.tiers & ~tier
            if left:
                self._put(w.held, block, Held(h.refs, left))
            else:
                gone += max(self._drop(w, e, tier, False), 0)
        return gone

    # ---- queries

    def _walk(self, token_ids: Any, root: int, detail: bool) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
        data = tokens_to_bytes(token_ids)  # raises WireError for bad tokens
        scores = dict.fromkeys(self._workers, 0)
        tiers = {n: dict.fromkeys(TIER_NAMES, 0) for n in self._workers}
        sizes = {w.block_size for w in self._workers.values() if w.block_size}
        for bs in sorted(sizes):
            alive = {n for n, w in self._workers.items() if w.block_size == bs}
            h = root
            step = bs * 8
            depth = 0
            while alive and (depth + 1) * step <= len(data):
                h = chain_hash(data[depth * step : (depth + 1) * step], h)
                alive &= self.holders.get(h, set())
                for n in alive:
                    scores[n] = depth + 1
                    if detail:
                        tiers[n][best_tier(self._workers[n].held[Block(h, True)].tiers)] += 1
                depth += 1
        return scores, tiers

    @_locked
    def match(self, token_ids: Any, root: int) -> dict[str, int]:
        return self._walk(token_ids, root, False)[0]

    @_locked
    def match_detail(
        self, token_ids: Any, root: int
    ) -> tuple[dict[str, int], dict[str, dict[str, int]], dict[str, int]]:
        scores, tiers = self._walk(token_ids, root, True)
        sizes = {n: w.block_size for n, w in self._workers.items() if w.block_size}
        return scores, tiers, sizes

    @_locked
    def info(self, name: str) -> RawWorkerInfo:
        """(block size, blocks, gpu, cpu, storage, unmatchable, aliased, matchable) of a worker."""
        w = self._workers[name]
        by_tier = [0, 0, 0]
        unmatchable = aliased = 0
        for block, h in w.held.items():
            for i in range(3):
                if h.tiers >> i & 1:
                    by_tier[i] += h.refs
            aliased += h.refs - 1
            if not block.matchable:
                unmatchable += h.refs
        n = len(w.blocks)
        gpu, cpu, storage = by_tier
        return (w.block_size, n, gpu, cpu, storage, unmatchable, aliased, n - unmatchable)

    @_locked
    def num_distinct(self) -> int:
        return len(self.holders)

    @_locked
    def items(self, name: str) -> tuple[list[Any], list[int], list[int], list[int], list[int]]:
        """(external ids, contents, unmatchable positions, non-GPU positions, their tier codes)."""
        w = self._workers[name]
        ext, contents, unm, tier_index, tier_code = [], [], [], [], []
        for i, (e, block) in enumerate(w.blocks.items()):
            ext.append(e)
            contents.append(block.content)
            if not block.matchable:
                unm.append(i)
            t = w.held[block].tiers
            if t != GPU:
                tier_index.append(i)
                tier_code.append(t)
        return ext, contents, unm, tier_index, tier_code

    @_locked
    def memory_bytes(self) -> int:
        """Bytes kept alive by the maps and the objects in them (approximate, getsizeof)."""
        import sys

        seen: set[int] = set()
        total = sys.getsizeof(self.holders)

        def add(o: Any) -> None:
            nonlocal total
            if id(o) not in seen and not (type(o) is int and -5 <= o <= 256):
                seen.add(id(o))
                total += sys.getsizeof(o)

        for c, names in self.holders.items():
            add(c)
            add(names)
        for w in self._workers.values():
            total += sys.getsizeof(w.blocks) + sys.getsizeof(w.held)
            for e, b in w.blocks.items():
                add(e)
                add(b)
                add(b.content)
            for k, h in w.held.items():
                add(k)
                add(h)
        return total
