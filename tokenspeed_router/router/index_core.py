"""The seam between :class:`~tokenspeed_router.router.index.KvIndex` and the cores that hold its blocks.

Two cores implement :class:`IndexCore` with the same answers: the compiled
``tokenspeed_router._native.Core`` (csrc/) and the pure-Python
:class:`~tokenspeed_router.router.index_reference.ReferenceCore`. mypy checks
both against this Protocol (``index._new_core`` returns either as an
``IndexCore``), so a method added to one and not the other fails the lint,
not a user.

Both lock each call on their own (the native core a reader/writer lock, the
reference core a mutex): one writer thread and any number of reader threads
may call a core at once, and a caller never needs a lock of its own around it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, Protocol

__all__ = ["CoreName", "IndexCore", "RawWorkerInfo", "WorkerInfo"]

#: which core a KvIndex runs (``/health``, ``/workers``, the start-up log, a gauge)
CoreName = Literal["native", "reference"]

#: what ``IndexCore.info`` returns: the fields of :class:`WorkerInfo`, in order
RawWorkerInfo = tuple[int | None, int, int, int, int, int, int, int]


class WorkerInfo(NamedTuple):
    """One worker's counts, as a core reports them (``KvIndex._info`` names them)."""

    block_size: int | None  #: None before its first BlockStored
    blocks: int  #: external ids held (every tier copy of a block counted once)
    gpu: int  #: blocks on each tier (a block on two tiers counts in both)
    cpu: int
    storage: int
    unmatchable: int  #: blocks kept for parents and removals, never matched
    aliased: int  #: external ids naming a content another id of the worker names too
    matchable: int  #: blocks - unmatchable


class IndexCore(Protocol):
    """What KvIndex calls. Positional arguments, as the C extension takes them.

    Tier arguments are the bit codes of ``router/tiers.py``; ``root`` is the
    chain's seed (``hashing.root_seed``); external ids are ints in
    ``[-2**63, 2**64)`` or bytes, distinct by value *and* kind (``-1`` is not
    ``2**64 - 1``). Errors: ``KeyError`` for an unknown worker name,
    ``TypeError``/``ValueError``/``OverflowError`` for arguments of the wrong
    shape, ``MemoryError`` when a table cannot grow (inside ``begin()``, a
    ``rollback()`` then restores everything).
    """

    @property
    def version(self) -> int:
        """Changes whenever the set of registered workers changes."""
        ...

    def register(self, name: str, /) -> None: ...
    def unregister(self, name: str, /) -> None: ...
    def workers(self) -> list[str]: ...
    def set_block_size(self, name: str, block_size: int | None, /) -> None: ...

    def store(
        self,
        name: str,
        ext_ids: Sequence[Any],
        parent: Any,
        root: int,
        tokens: Any,
        block_size: int,
        num_full: int,
        tier: int,
        unmatchable: bool,
        /,
    ) -> tuple[int, int] | None:
        """Hash and hold one event's blocks: (new, duplicate), or None (nothing changed) for an unknown parent."""
        ...

    def store_hashed(
        self,
        name: str,
        ext_ids: Sequence[Any],
        parent: Any,
        contents: Sequence[int],
        unmatchable: bytes | None,
        tier: int,
        /,
    ) -> tuple[int, int] | None:
        """Hold blocks whose content ids are given (dumps, hashes-only relays)."""
        ...

    def remove(self, name: str, ext_ids: Sequence[Any], tier: int, unspecified: bool, /) -> tuple[int, int, int]:
        """Drop one tier of each block: (gone, unknown ids, tier mismatches)."""
        ...

    def clear(self, name: str, tier: int, /) -> int: ...
    def begin(self) -> None: ...
    def commit(self) -> None: ...
    def rollback(self) -> None: ...
    def match(self, tokens: Any, root: int, /) -> dict[str, int]: ...
    def match_detail(
        self, tokens: Any, root: int, /
    ) -> tuple[dict[str, int], dict[str, dict[str, int]], dict[str, int]]: ...
    def info(self, name: str, /) -> RawWorkerInfo: ...
    def num_distinct(self) -> int: ...
    def memory_bytes(self) -> int: ...
    def items(self, name: str, /) -> tuple[list[Any], list[int], list[int], list[int], list[int]]:
        """(external ids, contents, unmatchable positions, non-GPU positions, their tier codes)."""
        ...
