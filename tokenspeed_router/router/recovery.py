"""A worker's way back after lost events: orphans held back, chains named, inferred blocks.

When a worker's events are lost beyond what its replay ring can give back (a
backlog shed under overload, a gap older than the ring, a store under an
unknown parent), :class:`~tokenspeed_router.router.ingest.IndexIngestor`
drops its entries and the worker goes ``resyncing``. The engine keeps what
it holds and never announces it again, so a prefix it keeps using (a shared
system prompt) would stay unknown for as long as the engine runs, and every
block it later stores under that prefix would be refused as an orphan. This
module is what the ingestor keeps per recovering worker instead:

* **Orphans are held back, not dropped** (:class:`OrphanPool`). A
  ``BlockStored`` whose parent the index does not know is kept, in arrival
  order, with every later event that builds on it (stores under its blocks,
  removals of its blocks), grouped by the unknown block at the top of its
  chain (its *root*). When the root becomes known -- the engine stores it
  again, or its chain is named (next point) -- the root's events are applied
  in their original order, as if the parent had never been lost. Until then
  nothing of them is matchable: their content ids chain through the unknown
  root.
* **A lost parent is named from what was routed there.** The router records
  the prompts it sends to a recovering worker (``router/chain_record.py``).
  An orphan whose first block continues exactly one recorded chain at depth
  ``k >= 1`` names its parent: the first ``k`` blocks of that chain. The
  parent is then stored under its own external id (its later removal is
  exact), and its ancestors, whose external ids the engine never repeats,
  under *inferred* ids (:func:`inferred_id`). The parent's chain is kept as an
  *anchor* (external id -> content ids), so a later store under the same
  parent names it again at once, after another loss too.
* **Inferred blocks are held only while nothing says otherwise.** The store
  under the parent proves the engine held the whole chain at that moment (an
  engine computes a block under its entire prefix). A removal the index cannot
  place (an external id it does not know) may be one of them, so every such
  removal drops all of the worker's inferred blocks at once; the next store
  under an anchor adopts them again. So the index never claims an inferred
  block after any removal that could have named it.

Single owner (the ingestor), like the index: not thread safe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tokenspeed_router.events.schema import BlockRemoved, BlockStored, Event
from tokenspeed_router.events.validation import DUMP_CONTENT_KEY

__all__ = [
    "INFERRED_ID_PREFIX",
    "OrphanPool",
    "WorkerRecovery",
    "content_store",
    "inferred_id",
    "is_inferred_id",
]

#: External ids the router gives blocks it inferred (ancestors of a named parent):
#: bytes no engine publishes (ids are u64/i64 ints or digests; this is a 29-byte tag + 8).
INFERRED_ID_PREFIX = b"\x00tokenspeed-router/inferred\x00\x00"


def inferred_id(content: int) -> bytes:
    """The inferred external id of a block whose content id is ``content``."""
    return INFERRED_ID_PREFIX + (content & ((1 << 64) - 1)).to_bytes(8, "big")


def is_inferred_id(ext: object) -> bool:
    """Whether ``ext`` is one of :func:`inferred_id`'s (never an engine's)."""
    return type(ext) is bytes and len(ext) == len(INFERRED_ID_PREFIX) + 8 and ext.startswith(INFERRED_ID_PREFIX)


def content_store(ext_ids: list[Any], contents: list[int], block_size: int) -> BlockStored:
    """A store of blocks whose content ids are known (``KvIndex.apply`` takes them as given)."""
    return BlockStored(
        block_hashes=ext_ids,
        parent_block_hash=None,
        token_ids=[0] * ((len(ext_ids) - 1) * block_size + 1),
        block_size=block_size,
        extra_keys={DUMP_CONTENT_KEY: contents},
    )


class OrphanPool:
    """Events held back because their chain starts at an unknown block (module docstring).

    ``ops[root]`` are the held events of one root, in arrival order;
    ``_root_of[ext]`` names the root of every block held here (ids of held
    stores, until a removal of every tier drops them).
    """

    __slots__ = ("_blocks", "_held", "_ops", "_root_of", "max_blocks")

    def __init__(self, *, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self._ops: OrderedDict[Any, list[Event]] = OrderedDict()
        self._root_of: dict[Any, Any] = {}
        #: root -> its blocks still held (a root none of whose blocks is held is dropped)
        self._held: dict[Any, set[Any]] = {}
        self._blocks = 0

    def __bool__(self) -> bool:
        return bool(self._ops)

    @property
    def num_blocks(self) -> int:
        """Blocks held back (stored, not removed since)."""
        return len(self._root_of)

    @property
    def roots(self) -> list[Any]:
        """The unknown blocks the held chains start at, oldest first."""
        return list(self._ops)

    def root_of(self, ext: Any) -> Any | None:
        """The root a held block's chain starts at; None when ``ext`` is not held here."""
        try:
            return self._root_of.get(ext)
        except TypeError:  # an unhashable id was never held
            return None

    def waits_on(self, ext: Any) -> bool:
        """Whether held chains start at ``ext`` (its store makes them applicable)."""
        try:
            return ext in self._ops
        except TypeError:
            return False

    def first_store(self, root: Any) -> BlockStored | None:
        """The first held store under ``root`` (its parent is the root): what can name the root."""
        for op in self._ops.get(root, ()):
            if isinstance(op, BlockStored):
                return op
        return None

    def hold_store(self, event: BlockStored, root: Any) -> list[Any]:
        """Hold ``event`` under ``root``; returns the roots dropped to stay within ``max_blocks``."""
        self._ops.setdefault(root, []).append(event)
        held = self._held.setdefault(root, set())
        for h in event.block_hashes:
            self._root_of[h] = root
            held.add(h)
        self._blocks += len(event.block_hashes)
        dropped: list[Any] = []
        while self._blocks > self.max_blocks and len(self._ops) > 1:
            oldest = next(iter(self._ops))
            self.take(oldest)
            dropped.append(oldest)
        return dropped

    def split_removal(self, event: BlockRemoved) -> BlockRemoved | None:
        """Hold the part of a removal that names held blocks; return the rest (None: nothing left)."""
        root_of = self._root_of
        mine: dict[Any, list[Any]] = {}
        rest: list[Any] = []
        for h in event.block_hashes:
            root = self.root_of(h)
            if root is None:
                rest.append(h)
            else:
                mine.setdefault(root, []).append(h)
                if event.medium is None:  # gone from every tier it was held on: no longer held here
                    del root_of[h]
                    self._held[root].discard(h)
        for root, ids in mine.items():
            if self._held[root]:
                self._ops[root].append(BlockRemoved(block_hashes=ids, medium=event.medium))
            else:  # nothing of that chain is held any more: nothing to apply later
                self.take(root)
        if not rest:
            return None
        if len(rest) == len(event.block_hashes):
            return event
        return BlockRemoved(block_hashes=rest, medium=event.medium)

    def take(self, root: Any) -> list[Event]:
        """Stop holding ``root``'s events and return them, in arrival order."""
        ops = self._ops.pop(root, [])
        self._held.pop(root, None)
        for op in ops:
            if isinstance(op, BlockStored):
                self._blocks -= len(op.block_hashes)
                for h in op.block_hashes:
                    if self._root_of.get(h) == root:
                        del self._root_of[h]
        return ops

    def clear(self) -> int:
        """Drop everything held; returns how many blocks were held."""
        n = len(self._root_of)
        self._ops.clear()
        self._root_of.clear()
        self._held.clear()
        self._blocks = 0
        return n


@dataclass(slots=True)
class WorkerRecovery:
    """What the ingestor keeps for one worker from a loss until nothing is held back or watched.

    ``anchors``: external id of a named parent -> the content ids of its
    chain, first block to the parent (LRU, at most ``max_anchors``; an anchor
    goes when the engine removes its block). ``stored_since_loss``: blocks the
    engine stored since the last loss (held back or applied): the turnover
    that proves everything older evicted or announced again, once it reaches
    the engine's capacity.
    """

    pool: OrphanPool
    max_anchors: int = 4096
    anchors: OrderedDict[Any, list[int]] = field(default_factory=OrderedDict)
    #: blocks stored under a named parent (at any depth) -> that parent: a store under any of
    #: them proves the parent's whole chain held again
    under: dict[Any, Any] = field(default_factory=dict)
    stored_since_loss: int = 0

    def anchor_of(self, ext: Any) -> Any | None:
        """The named parent ``ext`` is, or descends from (None: neither)."""
        try:
            if ext in self.anchors:
                return ext
            return self.under.get(ext)
        except TypeError:
            return None

    def stored_under(self, parent: Any, ids: Iterable[Any]) -> None:
        anchor = self.anchor_of(parent)
        if anchor is not None:
            for h in ids:
                self.under[h] = anchor

    def anchor(self, ext: Any, chain: list[int]) -> None:
        try:
            self.anchors[ext] = chain
            self.anchors.move_to_end(ext)
        except TypeError:
            return
        while len(self.anchors) > self.max_anchors:
            self.anchors.popitem(last=False)

    def anchor_chain(self, ext: Any) -> list[int] | None:
        try:
            return self.anchors.get(ext)
        except TypeError:
            return None

    def forget_anchors(self, ids: Iterable[Any]) -> None:
        """Blocks the engine removed: no longer named parents, nor below one."""
        anchors, under = self.anchors, self.under
        if not anchors and not under:
            return
        for h in ids:
            try:
                anchors.pop(h, None)
                under.pop(h, None)
            except TypeError:
                continue

    @property
    def settled(self) -> bool:
        """Nothing held back and no anchor to watch: the worker needs no recovery bookkeeping."""
        return not self.pool and not self.anchors
