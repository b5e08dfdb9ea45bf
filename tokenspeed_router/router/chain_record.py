"""What this router sent to a recovering worker, kept as chains, to name an orphan's lost parent.

After a loss (a shed backlog, a gap the replay ring could not fill) the
index drops a worker's entries and the engine never announces again what it
still holds: a shared prefix stays cached, and every later ``BlockStored``
that extends it names a parent the index does not know (an *orphan*,
``router/recovery.py``). The router itself knows better: it sent that
worker prompts, and the engine stores a prompt's blocks under the prompt's
own prefix. So, while a worker recovers, each prompt routed there is
recorded here as the chain of content ids of its full blocks (at the
worker's block size, ``hashing.py``), each block also filed under a key of
its own tokens alone. An orphan whose first block has those tokens, at a
depth ``k >= 1`` of one recorded chain, extends that chain's first ``k``
blocks: :meth:`ChainRecord.parent_chain` returns their content ids.

Exact, not a guess: a candidate is kept only if chaining the orphan's
tokens onto the candidate's parent gives the candidate's content id (the
same hash the index computes), and the chain must start at the orphan's
own LoRA/salt root. When two recorded prefixes of different content end in
blocks with the orphan's tokens, the record cannot tell which one the
engine extended, and says so (None).

Bounded: at most ``max_blocks`` blocks, least recently routed first out.
A prompt's blocks are touched leaf first and root last, so eviction takes
children before parents and every kept block's ancestors are kept.

Single owner (the router, under the routing core's router lock). O(blocks
of the prompt) per record, O(candidates x depth) per lookup.
"""

from __future__ import annotations

from collections import OrderedDict

import xxhash

from tokenspeed_router.hashing import TOKEN_BYTES, chain_hash

__all__ = ["ChainRecord", "block_key"]

_key_hash = xxhash.xxh3_64_intdigest


def block_key(block_bytes: bytes) -> int:
    """A block's tokens alone (u64-LE bytes), without its chain: the lookup key of an orphan."""
    return _key_hash(block_bytes)


class ChainRecord:
    """Routed prompts of one worker as chains of content ids (module docstring)."""

    __slots__ = ("_by_key", "_entries", "block_size", "max_blocks")

    def __init__(self, block_size: int, *, max_blocks: int = 262_144) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        #: content id -> (parent content id or the chain's root seed, key of its own tokens)
        self._entries: OrderedDict[int, tuple[int, int]] = OrderedDict()
        #: key of a block's tokens -> content ids of the recorded blocks with those tokens
        self._by_key: dict[int, set[int]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, data: bytes, root: int) -> None:
        """Record one prompt: ``data`` its tokens as u64-LE bytes, ``root`` its chain's seed."""
        step = self.block_size * TOKEN_BYTES
        full = len(data) // step
        if not full:
            return
        chain: list[tuple[int, int, int]] = []
        parent = root
        for i in range(full):
            block = data[i * step : (i + 1) * step]
            content = chain_hash(block, parent)
            chain.append((content, parent, block_key(block)))
            parent = content
        entries = self._entries
        by_key = self._by_key
        for content, up, key in reversed(chain):  # leaf first, root last: parents stay newer
            if content in entries:
                entries.move_to_end(content)
                continue
            entries[content] = (up, key)
            by_key.setdefault(key, set()).add(content)
        while len(entries) > self.max_blocks:
            content, (_, key) = entries.popitem(last=False)
            same = by_key.get(key)
            if same is not None:
                same.discard(content)
                if not same:
                    del by_key[key]

    def parent_chain(self, block_bytes: bytes, root: int) -> list[int] | None:
        """Content ids of the prefix a block with these tokens extends: ``[h_0 .. h_(k-1)]``.

        None when no recorded chain has a block with ``block_bytes`` below
        its first, or when recorded prefixes of different content do.
        """
        candidates = self._by_key.get(block_key(block_bytes))
        if not candidates:
            return None
        entries = self._entries
        found: list[int] | None = None
        for content in candidates:
            up, _ = entries[content]
            if up not in entries or chain_hash(block_bytes, up) != content:
                continue  # a first block (its parent is a root), or another key's collision
            chain = self._walk(up, root)
            if chain is None:
                continue
            if found is not None and found[-1] != chain[-1]:
                return None  # two prefixes of different content: which one is unknowable here
            found = chain
        return found

    def _walk(self, content: int, root: int) -> list[int] | None:
        """The chain from its first block down to ``content``, if it starts at ``root``."""
        entries = self._entries
        out = [content]
        up, _ = entries[content]
        while up in entries and len(out) <= len(entries):  # the bound only guards a hash cycle
            out.append(up)
            up, _ = entries[up]
        if up != root:
            return None
        out.reverse()
        return out

    def clear(self) -> None:
        self._entries.clear()
        self._by_key.clear()

