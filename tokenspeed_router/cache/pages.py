"""Paged KV allocator and request-to-token pool: who owns which KV page.

The prefix cache never touches KV tensors; it moves *page ids* between three
owners, and this module is the bookkeeping for two of them:

* the allocator's free list (:class:`PagedKVAllocator`),
* live requests, through their row of ``req_to_page`` (pages) and
  ``req_to_token`` (token slots) in :class:`ReqToTokenPool`,
* the radix tree (``prefix_cache.py``), which owns the pages of cached blocks.

Page ids run from 1 to ``num_pages``; page 0 is the padding page, never
allocated, so a zeroed table entry means "no page". Token slot ``s`` of page
``p`` is ``p * page_size + s``, the layout attention kernels index with.

Everything is a torch tensor on ``device`` (CPU in tests); the free list is a
preallocated stack, so ``alloc``/``free`` of ``k`` pages cost O(k) tensor work
and no Python loop over pages. With ``debug_checks`` (default on) every free is
validated — out of range, double free, duplicate ids raise :class:`CacheError`
— because a page freed twice is silent KV corruption later. Single owner: one
scheduler thread mutates these objects.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from tokenspeed_router.errors import CacheError, OutOfPagesError

__all__ = ["PAGE_ID_DTYPE", "PageAccounting", "PagedKVAllocator", "ReqToTokenPool"]

logger = logging.getLogger(__name__)

#: dtype of page ids everywhere in ``cache/`` (tables, tree values, match results).
PAGE_ID_DTYPE = torch.int32


def _as_page_ids(page_ids: torch.Tensor) -> torch.Tensor:
    return page_ids.reshape(-1).to(torch.int64)


class PagedKVAllocator:
    """Page-granular allocator of KV slots plus the request-to-page table.

    ``req_to_page[req_pool_idx, i]`` is the page holding tokens
    ``[i * page_size, (i + 1) * page_size)`` of that request; ``req_to_page_cpu``
    mirrors it on the host (engines read it without a device sync). Both are
    written together by :meth:`set_req_pages`.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        max_num_reqs: int,
        max_pages_per_req: int,
        device: str | torch.device = "cpu",
        debug_checks: bool = True,
    ) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(
                f"num_pages and page_size must be positive, got {num_pages}, {page_size}"
            )
        if max_num_reqs <= 0 or max_pages_per_req <= 0:
            raise ValueError("max_num_reqs and max_pages_per_req must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        self.debug_checks = debug_checks
        self.req_to_page = torch.zeros(
            (max_num_reqs, max_pages_per_req), dtype=PAGE_ID_DTYPE, device=self.device
        )
        self.req_to_page_cpu = torch.zeros((max_num_reqs, max_pages_per_req), dtype=PAGE_ID_DTYPE)
        self._free_stack = torch.empty(num_pages, dtype=PAGE_ID_DTYPE, device=self.device)
        self._is_free = torch.zeros(num_pages + 1, dtype=torch.bool, device=self.device)
        self._num_free = 0
        self._later_free: list[torch.Tensor] = []
        self.clear()

    # --- accounting -------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        """Pages on the free list right now."""
        return self._num_free

    def available_size(self) -> int:
        """Free capacity in tokens (``num_free_pages * page_size``)."""
        return self._num_free * self.page_size

    def free_mask(self) -> torch.Tensor:
        """Bool tensor of length ``num_pages + 1``: True where the page is free (index 0 is padding)."""
        return self._is_free.clone()

    def clear(self) -> None:
        """Return every page to the free list (engine flush); tables are zeroed."""
        # Descending stack: pops hand out low ids first, which keeps dumps readable.
        self._free_stack.copy_(
            torch.arange(self.num_pages, 0, -1, dtype=PAGE_ID_DTYPE, device=self.device)
        )
        self._is_free.fill_(True)
        self._is_free[0] = False
        self._num_free = self.num_pages
        self._later_free.clear()
        self.req_to_page.zero_()
        self.req_to_page_cpu.zero_()

    # --- alloc / free -----------------------------------------------------

    def alloc(self, num_pages: int) -> torch.Tensor | None:
        """Take ``num_pages`` pages off the free list; None (nothing taken) when short.

        Returning None rather than raising is the engine convention: the
        scheduler then evicts from the prefix cache and retries.
        """
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if num_pages > self._num_free:
            return None
        start = self._num_free - num_pages
        out = self._free_stack[start : self._num_free].flip(0).clone()
        self._num_free = start
        self._is_free[out.long()] = False
        return out

    def alloc_or_raise(self, num_pages: int) -> torch.Tensor:
        """Like :meth:`alloc` but raise :class:`OutOfPagesError` when short."""
        out = self.alloc(num_pages)
        if out is None:
            raise OutOfPagesError(f"asked for {num_pages} pages, {self._num_free} free")
        return out

    def free(self, page_ids: torch.Tensor) -> None:
        """Put pages back on the free list (validated when ``debug_checks``)."""
        ids = _as_page_ids(page_ids)
        k = int(ids.numel())
        if k == 0:
            return
        if self.debug_checks:
            self._check_freeable(ids)
        self._free_stack[self._num_free : self._num_free + k] = ids.to(PAGE_ID_DTYPE)
        self._num_free += k
        self._is_free[ids] = True

    def _check_freeable(self, ids: torch.Tensor) -> None:
        if bool((ids < 1).any()) or bool((ids > self.num_pages).any()):
            raise CacheError(f"page ids out of range [1, {self.num_pages}]: {ids.tolist()}")
        if bool(self._is_free[ids].any()):
            twice = ids[self._is_free[ids]].tolist()
            raise CacheError(f"double free of pages {twice}")
        if ids.numel() > 1 and int(torch.unique(ids).numel()) != int(ids.numel()):
            raise CacheError(f"duplicate page ids in one free: {ids.tolist()}")

    def free_group_begin(self) -> None:
        """Start collecting frees (optional: :meth:`append_to_later_free` works without it)."""
        self._later_free.clear()

    def append_to_later_free(self, page_ids: torch.Tensor) -> None:
        """Queue pages to be freed at :meth:`free_group_end` (one free for a whole eviction)."""
        if page_ids.numel():
            self._later_free.append(page_ids.reshape(-1))

    def free_group_end(self) -> None:
        """Free everything queued since the last group end, in one call."""
        if self._later_free:
            pending = torch.cat(self._later_free)
            self._later_free.clear()
            self.free(pending)

    # --- request rows -----------------------------------------------------

    def set_req_pages(
        self, req_pool_idx: int, positions: torch.Tensor | int, page_ids: torch.Tensor
    ) -> None:
        """Write ``page_ids`` into the request's row at ``positions`` (a start index or an index tensor)."""
        ids = page_ids.reshape(-1).to(PAGE_ID_DTYPE)
        if isinstance(positions, int):
            end = positions + int(ids.numel())
            if end > self.req_to_page.shape[1]:
                raise CacheError(
                    f"request needs {end} pages, row holds {self.req_to_page.shape[1]}"
                )
            self.req_to_page[req_pool_idx, positions:end] = ids.to(self.device)
            self.req_to_page_cpu[req_pool_idx, positions:end] = ids.cpu()
        else:
            pos = positions.reshape(-1).long()
            self.req_to_page[req_pool_idx, pos.to(self.device)] = ids.to(self.device)
            self.req_to_page_cpu[req_pool_idx, pos.cpu()] = ids.cpu()

    def free_with_diff(
        self, new_prefix_page_ids: torch.Tensor, page_ids: torch.Tensor
    ) -> torch.Tensor:
        """Free the request's pages that the tree already held under other ids.

        After inserting a request's pages, the tree answers with its own page
        for every position; where that differs from the request's page the
        request computed a duplicate, which is freed here. Returns the bool
        mask of differing positions (same length as the inputs).
        """
        if new_prefix_page_ids.numel() != page_ids.numel():
            raise CacheError(
                f"free_with_diff: {new_prefix_page_ids.numel()} tree pages vs {page_ids.numel()} request pages"
            )
        diff = new_prefix_page_ids.to(page_ids.device) != page_ids
        self.free(page_ids[diff])
        return diff

    def free_extra_pages_not_cached(
        self, req_pool_idx: int, seq_len: int, alloced_len: int
    ) -> None:
        """Free the request's pages past its last full page of ``seq_len`` tokens.

        The tree only caches full pages; the partial tail page and any page
        allocated ahead (``alloced_len`` > ``seq_len``) go back to the free list.
        """
        first = seq_len // self.page_size
        end = -(-alloced_len // self.page_size)
        if end > first:
            self.free(self.req_to_page[req_pool_idx, first:end])

    def free_req_cache(self, req_pool_idx: int, alloced_len: int) -> None:
        """Free every page of the request's row (used when the prefix cache is disabled)."""
        end = -(-alloced_len // self.page_size)
        if end > 0:
            self.free(self.req_to_page[req_pool_idx, :end])


class ReqToTokenPool:
    """Request slots: per slot a row of token slot indices and the allocated length.

    ``req_to_token[req_pool_idx, t]`` is the KV slot of token ``t``;
    ``alloced_lens[req_pool_idx]`` is how many tokens of KV the request owns
    (its row holds ``ceil(alloced_len / page_size)`` pages). A slot with
    ``alloced_lens == 0`` owns no pages.
    """

    def __init__(
        self, max_num_reqs: int, max_context_len: int, device: str | torch.device = "cpu"
    ) -> None:
        if max_num_reqs <= 0 or max_context_len <= 0:
            raise ValueError("max_num_reqs and max_context_len must be positive")
        self.device = torch.device(device)
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros(
            (max_num_reqs, max_context_len), dtype=torch.int32, device=self.device
        )
        self.alloced_lens = torch.zeros(max_num_reqs, dtype=torch.int64)
        self._live = torch.zeros(max_num_reqs, dtype=torch.bool)
        self._free_slots = list(range(max_num_reqs - 1, -1, -1))

    @property
    def size(self) -> int:
        """Number of request slots."""
        return int(self._live.numel())

    def available_size(self) -> int:
        """Free request slots."""
        return len(self._free_slots)

    def alloc(self) -> int | None:
        """Take a request slot; None when all are in use."""
        if not self._free_slots:
            return None
        idx = self._free_slots.pop()
        self._live[idx] = True
        self.alloced_lens[idx] = 0
        return idx

    def free(self, req_pool_idx: int) -> None:
        """Release a slot; its pages must already have been handed back."""
        if not bool(self._live[req_pool_idx]):
            raise CacheError(f"request slot {req_pool_idx} freed twice")
        self._live[req_pool_idx] = False
        self.alloced_lens[req_pool_idx] = 0
        self._free_slots.append(req_pool_idx)

    def live_mask(self) -> torch.Tensor:
        """Bool tensor: True for slots in use."""
        return self._live.clone()

    def clear(self) -> None:
        """Release every slot (engine flush)."""
        self._live.zero_()
        self.alloced_lens.zero_()
        self._free_slots = list(range(self.size - 1, -1, -1))

    def write_pages(
        self,
        req_pool_idx: int,
        positions: torch.Tensor | int,
        page_ids: torch.Tensor,
        page_size: int,
    ) -> None:
        """Write the token slots of ``page_ids`` at page ``positions`` of the request's row."""
        ids = page_ids.reshape(-1).to(device=self.device, dtype=torch.int64)
        if ids.numel() == 0:
            return
        offsets = torch.arange(page_size, device=self.device)
        slots = (ids[:, None] * page_size + offsets).flatten().to(torch.int32)
        if isinstance(positions, int):
            start = positions * page_size
            end = min(start + int(slots.numel()), self.max_context_len)
            self.req_to_token[req_pool_idx, start:end] = slots[: end - start]
        else:
            pos = positions.reshape(-1).to(device=self.device, dtype=torch.int64)
            cols = (pos[:, None] * page_size + offsets).flatten()
            keep = cols < self.max_context_len
            self.req_to_token[req_pool_idx, cols[keep]] = slots[keep]


@dataclasses.dataclass(frozen=True)
class PageAccounting:
    """Where every KV page is: the invariant ``free + tree + requests == total``.

    ``requests`` counts pages held privately by live requests (pages a request
    shares with the tree count once, as tree pages). ``leaked`` pages are owned
    by nobody; ``conflicting`` pages are on the free list yet still owned;
    ``duplicated`` pages are owned twice (two tree nodes, or two requests).
    All three must be zero.
    """

    total: int
    free: int
    tree: int
    requests: int
    leaked: int
    conflicting: int
    duplicated: int

    @property
    def consistent(self) -> bool:
        return (
            self.free + self.tree + self.requests == self.total
            and self.leaked == 0
            and self.conflicting == 0
            and self.duplicated == 0
        )

    @staticmethod
    def compute(
        allocator: PagedKVAllocator, pool: ReqToTokenPool, tree_page_ids: torch.Tensor
    ) -> PageAccounting:
        """Count owners per page with vectorised bincounts (a check, not a hot path)."""
        n = allocator.num_pages + 1
        free = allocator.free_mask().cpu()
        tree_counts = torch.bincount(_as_page_ids(tree_page_ids).cpu(), minlength=n)
        live = pool.live_mask()
        rows = allocator.req_to_page_cpu[live].to(torch.int64)
        pages_held = (-(-pool.alloced_lens[live] // allocator.page_size)).clamp(max=rows.shape[1])
        cols = torch.arange(rows.shape[1])
        held_ids = rows[cols[None, :] < pages_held[:, None]]
        req_counts = torch.bincount(held_ids, minlength=n)
        tree = tree_counts > 0
        private = (req_counts > 0) & ~tree
        owned = tree | (req_counts > 0)
        owned[0] = False
        duplicated = int((tree_counts > 1).sum()) + int(((req_counts > 1) & ~tree).sum())
        padding_held = int(tree_counts[0]) + int(req_counts[0])
        return PageAccounting(
            total=allocator.num_pages,
            free=int(free.sum()),
            tree=int(tree[1:].sum()),
            requests=int(private[1:].sum()),
            leaked=int((~(free | owned))[1:].sum()),
            conflicting=int((free & owned).sum()) + padding_held,
            duplicated=duplicated,
        )
