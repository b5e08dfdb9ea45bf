"""Radix tree node and page-key helpers for :mod:`tokenspeed_router.cache`.

A node holds a run of *pages*: ``key`` is a list of page tuples (``page_size``
token ids each), ``value`` the matching tensor of page ids, and
``block_hashes`` the chained content hash of each page (see
:mod:`tokenspeed_router.hashing`), computed once when the node's pages were
inserted and sliced with the node on a split. Children are keyed by their
first page tuple, so one dict lookup picks the branch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["PageKey", "TreeNode", "key_match", "paginate"]

#: One page of token ids.
PageKey = tuple[int, ...]


class TreeNode:
    """A run of cached pages. Owned and mutated by one :class:`PrefixCache` only."""

    __slots__ = (
        "block_hashes",
        "children",
        "creation_time",
        "hit_count",
        "id",
        "key",
        "last_access_time",
        "lock_ref",
        "parent",
        "priority",
        "value",
    )

    def __init__(self, node_id: int, now: int, priority: int = 0) -> None:
        self.id = node_id
        self.children: dict[PageKey, TreeNode] = {}
        self.parent: TreeNode | None = None
        self.key: list[PageKey] = []
        self.value: torch.Tensor | None = None
        self.block_hashes: list[int] = []
        self.lock_ref = 0
        self.last_access_time = now
        self.creation_time = now
        self.hit_count = 0
        self.priority = priority

    @property
    def evicted(self) -> bool:
        """True once the node's pages went back to the allocator."""
        return self.value is None

    @property
    def num_pages(self) -> int:
        return len(self.key)

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access_time < other.last_access_time

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, pages={len(self.key)}, lock_ref={self.lock_ref}, "
            f"children={len(self.children)})"
        )


def paginate(token_ids: Sequence[int] | Sequence[PageKey] | Any, page_size: int) -> list[PageKey]:
    """Cut token ids into full pages (the partial tail is dropped); pass page lists through.

    Accepts a list of ints, a tensor / ndarray (``tolist()`` is called once),
    or an already paged list of tuples (the seed's "compatible with whether
    the incoming key is paged").
    """
    if hasattr(token_ids, "tolist"):
        token_ids = token_ids.tolist()
    if not token_ids:
        return []
    if isinstance(token_ids[0], tuple):
        return list(token_ids)
    tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
    full = len(tokens) - len(tokens) % page_size
    return [tuple(tokens[i : i + page_size]) for i in range(0, full, page_size)]


def key_match(node_key: list[PageKey], pages: list[PageKey], start: int) -> int:
    """Length of the common prefix of ``node_key`` and ``pages[start:]`` (in pages)."""
    n = min(len(node_key), len(pages) - start)
    if node_key[:n] == pages[start : start + n]:
        return n
    i = 0
    while i < n and node_key[i] == pages[start + i]:
        i += 1
    return i
