"""Radix tree node and page-key helpers for :mod:`tokenspeed_router.cache`.

A node holds a run of *pages*: ``key`` is a list of pages, each the
``page_size`` token ids of the page as unsigned 64-bit little-endian bytes
(the very bytes :mod:`tokenspeed_router.hashing` hashes, so a page is encoded
once; bytes are compact, compare with one memcmp and are not tracked by the
garbage collector, unlike the seed's tuples of ints), ``value`` the matching
tensor of page ids, and
``block_hashes`` the chained content hash of each page (see
:mod:`tokenspeed_router.hashing`), computed once when the node's pages were
inserted and sliced with the node on a split. Children are keyed by their
first page, so one dict lookup picks the branch.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Any

import torch

from tokenspeed_router.hashing import TOKEN_BYTES, tokens_to_bytes

__all__ = ["PageKey", "TreeNode", "key_match", "page_tokens", "paginate"]

#: One page: its token ids as u64 little-endian bytes.
PageKey = bytes


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


def paginate(
    token_ids: Sequence[int] | Sequence[tuple[int, ...]] | Any, page_size: int
) -> list[PageKey]:
    """Cut token ids into full pages of u64-LE bytes (the partial tail is dropped).

    Accepts a list of ints, a tensor / ndarray, or an already paged list of
    tuples (the seed's "compatible with whether the incoming key is paged").
    Token ids must be integers in ``[0, 2**64)``
    (:class:`~tokenspeed_router.errors.WireError` otherwise).
    """
    if isinstance(token_ids, list) and token_ids and isinstance(token_ids[0], tuple):
        return [array.array("Q", page).tobytes() for page in token_ids]
    data = tokens_to_bytes(token_ids)
    step = page_size * TOKEN_BYTES
    return [data[i : i + step] for i in range(0, len(data) - len(data) % step, step)]


def page_tokens(pages: Sequence[PageKey]) -> list[int]:
    """Token ids of a run of pages (one C call, no per-token Python loop)."""
    return array.array("Q", b"".join(pages)).tolist()


def key_match(node_key: list[PageKey], pages: list[PageKey], start: int) -> int:
    """Length of the common prefix of ``node_key`` and ``pages[start:]`` (in pages)."""
    n = min(len(node_key), len(pages) - start)
    if node_key[:n] == pages[start : start + n]:
        return n
    i = 0
    while i < n and node_key[i] == pages[start + i]:
        i += 1
    return i
