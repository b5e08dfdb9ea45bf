"""Paged radix prefix cache for a worker's KV pages, publishing exact KV events.

Written from the design of TokenSpeed's ``PrefixCache``, with
its imports supplied by :mod:`.pages`, :mod:`.eviction`, :mod:`.tree` and
:mod:`.records`, and its event bugs fixed:

* **Units.** Every size this class reports (``evictable_size``,
  ``protected_size``, ``total_size``, ``evict(num_tokens)``, ``admit``'s
  return, ``MatchResult.device_prefix_length``) counts *tokens*; only full
  pages are ever cached, so these are multiples of ``page_size``.
* **Hashes.** Each page's published block hash is
  ``hashing.chain_hash(page_tokens_u64le, parent_hash)`` chained from
  ``hashing.root_seed(lora_id)`` — exactly the router index's content hash
  (:mod:`tokenspeed_router.hashing` defines it), so for our own workers the
  external ids equal the content ids. Hashes are computed once, when a node is
  created, kept per page on the node and sliced when the node splits.
* **Events.** One ``BlockStored`` per newly created node (a run of pages, as
  SGLang does), ``parent_block_hash`` = the hash of the page before it (None
  at the root), ``token_ids`` = the node's page tokens, ``block_size`` =
  ``page_size``, plus ``lora_id`` and ``medium`` when set. One
  ``BlockRemoved`` per evicted node naming exactly its stored hashes, leaves
  first. ``AllBlocksCleared`` on every ``reset`` (including the one in the
  constructor: a fresh worker first tells routers to forget it). Splits emit
  nothing (the blocks did not change).
* **Pages never leak.** ``free + tree + live requests == total`` after any
  sequence of operations; :meth:`PrefixCache.page_accounting` returns the
  breakdown.

Complexity: match/insert walk one node per radix edge and compare pages as
tuples (O(pages) per call, no per-token Python loop); evict is
O(L log L) over the evictable leaves. Page ids stay torch tensors; ``tolist``
happens only when an event is built. Single owner: one scheduler thread.
"""

from __future__ import annotations

import array
import collections
import functools
import heapq
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch

from tokenspeed_router.cache.eviction import EvictionPolicy, make_eviction_strategy
from tokenspeed_router.cache.pages import (
    PAGE_ID_DTYPE,
    PageAccounting,
    PagedKVAllocator,
    ReqToTokenPool,
)
from tokenspeed_router.cache.records import CacheInitParams, CacheStatistics, MatchResult, Req
from tokenspeed_router.cache.sink import BatchPublisher, KvEventSink
from tokenspeed_router.cache.tree import PageKey, TreeNode, key_match, page_tokens, paginate
from tokenspeed_router.errors import CacheError, ConfigError, OutOfPagesError
from tokenspeed_router.events.schema import AllBlocksCleared, BlockRemoved, BlockStored, Event
from tokenspeed_router.hashing import chain_hash, root_seed

__all__ = ["CacheInitParams", "CacheStatistics", "MatchResult", "PrefixCache", "Req"]

logger = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _emits(
    method: Callable[Concatenate[PrefixCache, _P], _R],
) -> Callable[Concatenate[PrefixCache, _P], _R]:
    """Public mutators: when the outermost one returns, hand queued events to an attached sink."""

    @functools.wraps(method)
    def wrapper(self: PrefixCache, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        self._op_depth += 1
        try:
            result = method(self, *args, **kwargs)
        finally:
            self._op_depth -= 1
        if (
            self._op_depth == 0
            and self._sink is not None
            and len(self.kv_event_queue) >= self._flush_every
        ):
            self.flush_events()
        return result

    return wrapper


class PrefixCache:
    """Paged radix tree over KV pages (the seed's ``PrefixCache``), emitting correct KV events."""

    def __init__(self, params: CacheInitParams) -> None:
        allocator = params.token_to_kv_pool_allocator
        if allocator is not None and params.page_size not in (allocator.page_size, 0):
            raise ConfigError(
                f"page_size {params.page_size} disagrees with the allocator's {allocator.page_size}"
            )
        self.page_size = allocator.page_size if allocator is not None else params.page_size
        #: Where page ids live (the allocator's device; tree values and match results too).
        self.device = allocator.device if allocator is not None else torch.device("cpu")
        if self.page_size <= 0:
            raise ConfigError(f"page_size must be positive, got {self.page_size}")
        self.disable = params.disable
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = allocator
        self.disable_finished_insert = params.disable_finished_insert
        self.enable_kv_cache_events = params.enable_kv_cache_events
        self.medium = params.medium
        self.lora_id = params.lora_id
        self.eviction_strategy = make_eviction_strategy(params.eviction_policy)
        self.eviction_policy = self.eviction_strategy.name
        self._root_seed = root_seed(params.lora_id)
        self.kv_event_queue: list[Event] = []
        self._sink: KvEventSink | None = None
        self._flush_every = 1
        self._op_depth = 0
        self._clock = itertools.count(1)
        self._node_ids = itertools.count(0)
        self._num_admitted = 0
        self._admitted_tokens = 0
        self._hit_tokens = 0
        self._evicted_pages = 0
        self._events_emitted = 0
        self.root_node = self._new_root()
        self.evictable_leaves: set[TreeNode] = set()
        self._evictable_pages = 0
        self._protected_pages = 0
        self.reset()

    @classmethod
    def with_capacity(
        cls,
        num_pages: int,
        page_size: int = 16,
        eviction_policy: str | EvictionPolicy = "lru",
        enable_kv_cache_events: bool = True,
        medium: str | None = None,
        lora_id: int | None = None,
        *,
        max_num_reqs: int = 4,
        max_context_len: int | None = None,
        device: str | torch.device = "cpu",
        debug_checks: bool = True,
    ) -> PrefixCache:
        """A cache with its own allocator (``num_pages`` pages) and request pools.

        For callers that are not an engine (simulator, examples, tests):
        ``max_context_len`` (tokens, default ``min(num_pages * page_size,
        131072)``) bounds one request; ``max_num_reqs`` bounds requests open at
        once through :meth:`begin_request` (``admit`` uses one at a time).
        """
        if max_context_len is None:
            max_context_len = min(num_pages * page_size, 131072)
        max_pages_per_req = -(-max_context_len // page_size)
        allocator = PagedKVAllocator(
            num_pages,
            page_size,
            max_num_reqs=max_num_reqs,
            max_pages_per_req=max_pages_per_req,
            device=device,
            debug_checks=debug_checks,
        )
        pool = ReqToTokenPool(max_num_reqs, max_pages_per_req * page_size, device=device)
        return cls(
            CacheInitParams(
                disable=False,
                req_to_token_pool=pool,
                token_to_kv_pool_allocator=allocator,
                page_size=page_size,
                eviction_policy=eviction_policy,
                enable_kv_cache_events=enable_kv_cache_events,
                medium=medium,
                lora_id=lora_id,
            )
        )

    # ------------------------------------------------------------------ public API (seed)

    @_emits
    def reset(self) -> None:
        """Drop every cached block, give its pages back, and emit ``AllBlocksCleared``.

        Raises :class:`CacheError` (changing nothing) while any node is locked:
        a live request still reads those pages.
        """
        if self._protected_pages:
            raise CacheError(f"reset with {self._protected_pages * self.page_size} locked tokens")
        allocator = self.token_to_kv_pool_allocator
        if allocator is not None:
            held = self._tree_page_ids()
            if held.numel():
                allocator.free(held)
        for node in self._iter_nodes():
            node.value = None
        self.root_node = self._new_root()
        self.evictable_leaves = set()
        self._evictable_pages = 0
        self._protected_pages = 0
        if self.enable_kv_cache_events:
            self._emit(AllBlocksCleared(medium=self.medium))

    def match_prefix(
        self, key: Sequence[int] | Sequence[tuple[int, ...]] | Any, **kwargs: Any
    ) -> MatchResult:
        """Longest cached prefix of ``key`` (token ids or page tuples); full pages only.

        Touches the matched nodes (access time, ``hit_count``). When the match
        ends inside a node, the node is split so that ``last_device_node``
        covers exactly the match — the node a caller locks.
        """
        if self.disable:
            return self._empty_match_result()
        pages = paginate(key, self.page_size)
        if not pages:
            return self._empty_match_result()
        values, last = self._match(pages, count_hit=True)
        return self._match_result(values, last)

    def cached_prefix_length(self, key: Sequence[int] | Sequence[tuple[int, ...]] | Any) -> int:
        """Tokens of ``key``'s longest cached prefix (full pages), strictly read-only.

        Unlike :meth:`match_prefix` it touches no access time or hit count and
        splits nothing, so an observer (a simulator's oracle, a metrics probe)
        can look without changing what gets evicted next.
        """
        return self.cached_prefix_pages(paginate(key, self.page_size))

    def cached_prefix_pages(self, pages: list[PageKey]) -> int:
        """:meth:`cached_prefix_length` of a key already cut into page keys (``paginate``).

        For callers probing many caches with one prompt: cut it once per page size.
        """
        if self.disable:
            return 0
        node = self.root_node
        i = 0
        while i < len(pages):
            child = node.children.get(pages[i])
            if child is None:
                break
            n = key_match(child.key, pages, i)
            i += n
            if n < len(child.key):
                break
            node = child
        return i * self.page_size

    @_emits
    def insert(
        self,
        key: Sequence[int] | Sequence[tuple[int, ...]] | Any,
        value: torch.Tensor | None = None,
        *,
        priority: int = 0,
    ) -> int:
        """Cache the full pages of ``key`` with page ids ``value``; return the tokens already cached.

        ``value`` holds one page id per full page of ``key``. Pages that were
        already cached keep the tree's ids (the caller frees its duplicates, as
        ``cache_*_req`` do). When ``value`` is None the pages for the uncached
        part are allocated here (:class:`OutOfPagesError` when short: evict
        first). ``priority`` raises the priority of every node on the path.
        """
        if self.disable:
            return 0
        pages = paginate(key, self.page_size)
        if value is not None and value.numel() != len(pages):
            raise ValueError(f"insert: {len(pages)} pages but {value.numel()} page ids")
        return self._insert(pages, value, priority) * self.page_size

    @_emits
    def cache_finished_req(
        self,
        req: Req,
        token_ids: list[int] | None = None,
        delay_req_pool_release: bool = False,
    ) -> None:
        """A request finished: cache its full pages, free the rest, release its slot and lock.

        ``token_ids`` defaults to ``(origin_input_ids + output_ids)[:-1]`` (the
        last sampled token has no KV yet). Afterwards the request owns no page
        (``alloced_lens`` of its slot is 0) even if its slot release is delayed.
        """
        pool, allocator = self._pools()
        idx = self._slot_of(req)
        alloced_len = int(pool.alloced_lens[idx])
        if self.disable:
            allocator.free_req_cache(idx, alloced_len)
        else:
            if token_ids is None:
                token_ids = (req.origin_input_ids + req.output_ids)[:-1]
            pages = paginate(token_ids, self.page_size)
            self._check_allocated(len(pages), alloced_len)
            page_ids = allocator.req_to_page[idx, : len(pages)].clone()
            if self.disable_finished_insert:
                self._free_private_pages(pages, page_ids)
            else:
                self._insert(pages, page_ids, req.priority)
                tree_values, _ = self._match(pages, count_hit=False)
                if tree_values:
                    allocator.free_with_diff(torch.cat(tree_values), page_ids)
            # Pages the request already gave the tree (cache_unfinished_req) are
            # the tree's even when token_ids stops short of them.
            tree_owned = self._chain_pages(req.last_node) * self.page_size
            allocator.free_extra_pages_not_cached(idx, max(len(token_ids), tree_owned), alloced_len)
        pool.alloced_lens[idx] = 0
        if not delay_req_pool_release:
            pool.free(idx)
            req.req_pool_idx = None
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
            req.last_node = None
        req.prefix_indices = None

    @_emits
    def cache_unfinished_req(self, req: Req, token_ids: list[int] | None = None) -> None:
        """Cache a running request's full pages so far, and move its lock to the new last node.

        Where the tree already held a page under another id, the request's
        duplicate is freed and its tables are repointed at the tree's page.
        """
        if self.disable:
            return
        pool, allocator = self._pools()
        idx = self._slot_of(req)
        if token_ids is None:
            token_ids = req.fill_ids
        pages = paginate(token_ids, self.page_size)
        self._check_allocated(len(pages), int(pool.alloced_lens[idx]))
        page_ids = allocator.req_to_page[idx, : len(pages)].clone()
        self._insert(pages, page_ids, req.priority)
        tree_values, new_last = self._match(pages, count_hit=False)
        new_ids = torch.cat(tree_values) if tree_values else page_ids[:0]
        if new_ids.numel():
            diff = allocator.free_with_diff(new_ids, page_ids)
            positions = torch.nonzero(diff).flatten()
            if positions.numel():
                allocator.set_req_pages(idx, positions, new_ids[diff])
                pool.write_pages(idx, positions, new_ids[diff], self.page_size)
        self.inc_lock_ref(new_last)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.last_node = new_last
        req.prefix_indices = new_ids

    def pretty_print(self, start_str: str = "") -> str:
        """Log (DEBUG) and return an indented dump of the tree."""
        lines = [f"{start_str} #tokens: {self.total_size()}"]
        stack = [(child, 0) for child in reversed(self.root_node.children.values())]
        while stack:
            node, depth = stack.pop()
            value = node.value.tolist() if node.value is not None else None
            lines.append(
                f"{'  ' * depth}node={node.id} pages={len(node.key)} value={value} "
                f"lock_ref={node.lock_ref} hits={node.hit_count} prio={node.priority}"
            )
            stack.extend((c, depth + 1) for c in reversed(node.children.values()))
        text = "\n".join(lines)
        logger.debug("%s", text)
        return text

    def total_size(self) -> int:
        """Tokens cached in the tree (evictable + protected)."""
        return (self._evictable_pages + self._protected_pages) * self.page_size

    @_emits
    def evict(
        self, num_tokens: int, evict_callback: Callable[[TreeNode], None] | None = None
    ) -> int:
        """Evict unlocked leaves, in policy order, until ``num_tokens`` tokens are freed.

        Whole nodes go, so up to one node's worth more may be freed; parents
        that become unlocked leaves are candidates in the same call. Returns
        the tokens evicted. ``evict_callback(node)`` runs before each node's
        pages are freed (e.g. to write it back to host memory).
        """
        if self.disable or num_tokens <= 0:
            return 0
        allocator = self.token_to_kv_pool_allocator
        goal = -(-num_tokens // self.page_size)
        key = self.eviction_strategy.get_priority
        heap = [(key(node), node.id, node) for node in self.evictable_leaves]
        heapq.heapify(heap)
        evicted = 0
        if allocator is not None:
            allocator.free_group_begin()
        while evicted < goal and heap:
            _, _, node = heapq.heappop(heap)
            if node.lock_ref > 0 or node.children or node.value is None:
                continue
            if evict_callback is not None:
                evict_callback(node)
            if allocator is not None:
                allocator.append_to_later_free(node.value)
            evicted += len(node.key)
            parent = node.parent
            self._delete_leaf(node)
            if (
                parent is not None
                and parent is not self.root_node
                and parent in self.evictable_leaves
            ):
                heapq.heappush(heap, (key(parent), parent.id, parent))
        if allocator is not None:
            allocator.free_group_end()
        self._evicted_pages += evicted
        return evicted * self.page_size

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Protect ``node`` and its ancestors from eviction; return the evictable-size change (tokens)."""
        if self.disable:
            return 0
        delta = 0
        cur: TreeNode | None = node
        while cur is not None and cur.parent is not None:  # stop at any root (even a reset one)
            if cur.value is None:
                raise CacheError(f"lock on evicted node {cur.id}")
            if cur.lock_ref == 0:
                n = len(cur.key)
                self._evictable_pages -= n
                self._protected_pages += n
                delta -= n
                self.evictable_leaves.discard(cur)
            cur.lock_ref += 1
            cur = cur.parent
        return delta * self.page_size

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        """Undo one :meth:`inc_lock_ref`; return the evictable-size change (tokens)."""
        if self.disable or node is None:
            return 0
        delta = 0
        cur: TreeNode | None = node
        while cur is not None and cur.parent is not None:
            if cur.lock_ref <= 0:
                raise CacheError(f"lock_ref underflow on node {cur.id}")
            if cur.lock_ref == 1:
                n = len(cur.key)
                self._evictable_pages += n
                self._protected_pages -= n
                delta += n
                if not cur.children:
                    self.evictable_leaves.add(cur)
            cur.lock_ref -= 1
            cur = cur.parent
        return delta * self.page_size

    def evictable_size(self) -> int:
        """Tokens in unlocked nodes (reclaimable by :meth:`evict`, leaves first)."""
        return self._evictable_pages * self.page_size

    def protected_size(self) -> int:
        """Tokens in locked nodes (held by live requests)."""
        return self._protected_pages * self.page_size

    # ------------------------------------------------------------------ engine-less API

    @_emits
    def begin_request(
        self, token_ids: Sequence[int] | Any, *, priority: int = 0, strict: bool = True
    ) -> Req:
        """Start a request as an engine would: match, lock the prefix, allocate the rest.

        Takes a request slot, locks the matched prefix, evicts if the free
        list is short, allocates pages for the uncached tokens and writes the
        request's tables. ``strict`` decides what happens when the request
        cannot fit even after evicting everything evictable: raise
        :class:`OutOfPagesError` *before* evicting anything (True), or keep
        only the leading tokens that fit (False; ``origin_input_ids`` is then
        truncated to a whole number of pages). Finish it with
        :meth:`cache_finished_req` (or keep it going with
        :meth:`extend_request` / :meth:`cache_unfinished_req`).
        """
        pool, allocator = self._pools()
        tokens = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)
        max_pages = min(allocator.req_to_page.shape[1], pool.max_context_len // self.page_size)
        if len(tokens) > max_pages * self.page_size:
            if strict:
                raise OutOfPagesError(
                    f"request of {len(tokens)} tokens exceeds a row of {max_pages} pages"
                )
            tokens = tokens[: max_pages * self.page_size]
        idx = pool.alloc()
        if idx is None:
            raise OutOfPagesError(f"no free request slot (max_num_reqs={pool.size})")
        matched = self.match_prefix(tokens)
        last = matched.last_device_node
        prefix_ids = matched.device_indices
        self.inc_lock_ref(last)
        try:
            num_prefix = int(prefix_ids.numel())
            need = -(-len(tokens) // self.page_size) - num_prefix
            fit = min(need, allocator.num_free_pages + self._evictable_pages)
            if fit < need:
                if strict:
                    raise OutOfPagesError(
                        f"request of {len(tokens)} tokens needs {need} new pages; "
                        f"{allocator.num_free_pages} free + {self._evictable_pages} evictable"
                    )
                tokens = tokens[: (num_prefix + fit) * self.page_size]
            new_ids = self._alloc_pages(fit)
        except BaseException:
            self.dec_lock_ref(last)
            pool.free(idx)
            raise
        row = torch.cat([prefix_ids.to(PAGE_ID_DTYPE), new_ids])
        allocator.set_req_pages(idx, 0, row)
        pool.write_pages(idx, 0, row, self.page_size)
        pool.alloced_lens[idx] = len(tokens)
        return Req(
            origin_input_ids=tokens,
            req_pool_idx=idx,
            last_node=last,
            priority=priority,
            prefix_indices=prefix_ids,
        )

    @_emits
    def extend_request(self, req: Req, new_token_ids: Sequence[int]) -> None:
        """Append generated tokens to a running request, allocating pages as it grows.

        Evicts if needed; raises :class:`OutOfPagesError` (nothing allocated)
        when the pages cannot be found.
        """
        pool, allocator = self._pools()
        idx = self._slot_of(req)
        old_len = int(pool.alloced_lens[idx])
        new_len = old_len + len(new_token_ids)
        first = -(-old_len // self.page_size)
        need = -(-new_len // self.page_size) - first
        if first + need > min(
            allocator.req_to_page.shape[1], pool.max_context_len // self.page_size
        ):
            raise OutOfPagesError(f"request would exceed its row ({new_len} tokens)")
        if need > allocator.num_free_pages + self._evictable_pages:
            raise OutOfPagesError(
                f"extend needs {need} pages; {allocator.num_free_pages} free + "
                f"{self._evictable_pages} evictable"
            )
        new_ids = self._alloc_pages(need)
        allocator.set_req_pages(idx, first, new_ids)
        pool.write_pages(idx, first, new_ids, self.page_size)
        pool.alloced_lens[idx] = new_len
        req.output_ids.extend(new_token_ids)

    @_emits
    def admit(
        self, token_ids: Sequence[int] | Any, *, priority: int = 0, strict: bool = False
    ) -> int:
        """Serve one request start to finish; return how many of its tokens were cache hits.

        Match, allocate the uncached pages (evicting if needed), cache the full
        pages, release everything else. A request larger than the cache can
        ever hold (free + evictable pages, or ``max_context_len``) is *cached
        as far as it fits* by default — its leading pages, which is what a
        later request sharing the prefix can use — and nothing is corrupted;
        with ``strict=True`` it raises :class:`OutOfPagesError` instead, before
        evicting anything.
        """
        tokens = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)
        req = self.begin_request(tokens, priority=priority, strict=strict)
        hit = 0 if req.prefix_indices is None else int(req.prefix_indices.numel()) * self.page_size
        self.cache_finished_req(req, token_ids=req.origin_input_ids)
        self._num_admitted += 1
        self._admitted_tokens += len(tokens)
        self._hit_tokens += hit
        return hit

    # ------------------------------------------------------------------ events

    def take_events(self) -> list[Event]:
        """Drain and return the queued events, oldest first."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def attach_publisher(
        self,
        publisher: BatchPublisher | KvEventSink,
        *,
        flush_every: int = 1,
        max_events_per_batch: int = 4096,
    ) -> KvEventSink:
        """Publish this cache's events through ``publisher`` (e.g. a ``ZmqEventPublisher``).

        After each public mutating call (``admit``, ``insert``, ``evict``,
        ``reset``, ``cache_*_req``) the queued events go out as one batch (or
        several of ``max_events_per_batch``) once at least ``flush_every``
        are pending; :meth:`flush_events` sends the rest. Events already
        queued (the constructor's ``AllBlocksCleared``) are sent now. While a
        publisher is attached, do not also drain with :meth:`take_events`.
        """
        if flush_every <= 0:
            raise ValueError(f"flush_every must be positive, got {flush_every}")
        sink = (
            publisher
            if isinstance(publisher, KvEventSink)
            else KvEventSink(publisher, max_events_per_batch=max_events_per_batch)
        )
        self._sink = sink
        self._flush_every = flush_every
        self.flush_events()
        return sink

    def detach_publisher(self) -> None:
        """Stop publishing; later events stay queued for :meth:`take_events`."""
        self._sink = None

    def flush_events(self) -> list[int]:
        """Publish every queued event now; return the batch seqs.

        If the publisher raises (queue full, closed), the events it did not
        take stay queued, in order, and the error propagates: nothing is lost.
        """
        if self._sink is None or not self.kv_event_queue:
            return []
        pending = self.take_events()
        seqs: list[int] = []
        sent = 0
        try:
            for chunk in self._sink.split(pending):
                seqs.append(self._sink.publish_batch(chunk))
                sent += len(chunk)
        except BaseException:
            self.kv_event_queue = pending[sent:] + self.kv_event_queue
            raise
        return seqs

    def snapshot_events(self) -> list[Event]:
        """The whole cache as events: ``AllBlocksCleared`` then one ``BlockStored`` per node, parents first.

        A router that lost this worker's stream can rebuild its view from this
        list (the resync "dump"); it is not queued or published by itself.
        """
        events: list[Event] = [AllBlocksCleared(medium=self.medium)]
        if not self.enable_kv_cache_events:
            return events
        queue = collections.deque(self.root_node.children.values())
        while queue:
            node = queue.popleft()
            events.append(self._stored_event(node))
            queue.extend(node.children.values())
        return events

    # ------------------------------------------------------------------ accounting

    def page_accounting(self) -> PageAccounting:
        """Where every page is (free / tree / live requests); see :class:`PageAccounting`."""
        pool, allocator = self._pools()
        return PageAccounting.compute(allocator, pool, self._tree_page_ids())

    def statistics(self) -> CacheStatistics:
        """A frozen snapshot of sizes (tokens) and counters."""
        allocator = self.token_to_kv_pool_allocator
        return CacheStatistics(
            page_size=self.page_size,
            total_pages=0 if allocator is None else allocator.num_pages,
            free_pages=0 if allocator is None else allocator.num_free_pages,
            cached_tokens=self.total_size(),
            evictable_tokens=self.evictable_size(),
            protected_tokens=self.protected_size(),
            num_nodes=sum(1 for _ in self._iter_nodes()),
            num_admitted=self._num_admitted,
            admitted_tokens=self._admitted_tokens,
            hit_tokens=self._hit_tokens,
            evicted_tokens=self._evicted_pages * self.page_size,
            events_emitted=self._events_emitted,
            events_pending=len(self.kv_event_queue),
        )

    def cached_chains(self) -> dict[tuple[tuple[int, ...], ...], int]:
        """Every cached page as ``{chain of page token tuples from the root: page id}``.

        For tests and debugging (it decodes every page): a brute-force view of
        the tree's content.
        """
        out: dict[tuple[tuple[int, ...], ...], int] = {}
        stack: list[tuple[TreeNode, tuple[tuple[int, ...], ...]]] = [(self.root_node, ())]
        while stack:
            node, prefix = stack.pop()
            if node is not self.root_node and node.value is not None:
                ids = node.value.tolist()
                for page, page_id in zip(node.key, ids, strict=True):
                    prefix = (*prefix, tuple(array.array("Q", page)))
                    out[prefix] = page_id
            stack.extend((child, prefix) for child in node.children.values())
        return out

    # ------------------------------------------------------------------ internals

    def _new_root(self) -> TreeNode:
        root = TreeNode(next(self._node_ids), next(self._clock))
        root.value = torch.empty(0, dtype=PAGE_ID_DTYPE, device=self.device)
        root.lock_ref = 1
        return root

    def _pools(self) -> tuple[ReqToTokenPool, PagedKVAllocator]:
        if self.req_to_token_pool is None or self.token_to_kv_pool_allocator is None:
            raise ConfigError(
                "this operation needs req_to_token_pool and token_to_kv_pool_allocator"
            )
        return self.req_to_token_pool, self.token_to_kv_pool_allocator

    def _check_allocated(self, num_pages: int, alloced_len: int) -> None:
        """Refuse to cache pages the request never allocated (they would be page 0 or stale ids)."""
        if num_pages * self.page_size > alloced_len:
            raise CacheError(
                f"token_ids cover {num_pages} full pages but the request allocated {alloced_len} tokens"
            )

    @staticmethod
    def _slot_of(req: Req) -> int:
        if req.req_pool_idx is None:
            raise CacheError("request has no req_pool_idx (already released?)")
        return req.req_pool_idx

    def _empty_match_result(self) -> MatchResult:
        return MatchResult(
            device_indices=torch.empty(0, dtype=PAGE_ID_DTYPE, device=self.device),
            last_device_node=self.root_node,
            last_host_node=self.root_node,
            device_prefix_length=0,
            host_hit_length=0,
        )

    def _match_result(self, values: list[torch.Tensor], last: TreeNode) -> MatchResult:
        indices = (
            torch.cat(values) if values else torch.empty(0, dtype=PAGE_ID_DTYPE, device=self.device)
        )
        return MatchResult(
            device_indices=indices,
            last_device_node=last,
            last_host_node=last,
            device_prefix_length=int(indices.numel()) * self.page_size,
        )

    def _match(
        self, pages: list[PageKey], *, count_hit: bool
    ) -> tuple[list[torch.Tensor], TreeNode]:
        node = self.root_node
        node.last_access_time = next(self._clock)
        values: list[torch.Tensor] = []
        i = 0
        while i < len(pages):
            child = node.children.get(pages[i])
            if child is None:
                break
            n = key_match(child.key, pages, i)
            if n < len(child.key):
                child = self._split_node(child, n)
            child.last_access_time = next(self._clock)
            if count_hit:
                child.hit_count += 1
            assert child.value is not None
            values.append(child.value)
            node = child
            i += n
        return values, node

    def _insert(self, pages: list[PageKey], value: torch.Tensor | None, priority: int) -> int:
        """Insert ``pages``; return how many were already cached."""
        node = self.root_node
        node.last_access_time = next(self._clock)
        i = 0
        while i < len(pages):
            child = node.children.get(pages[i])
            if child is None:
                ids = self._alloc_pages(len(pages) - i, evict=False) if value is None else value[i:]
                self._add_leaf(node, pages[i:], ids, priority)
                return i
            n = key_match(child.key, pages, i)
            if n < len(child.key):
                child = self._split_node(child, n)
            child.last_access_time = next(self._clock)
            child.priority = max(child.priority, priority)
            node = child
            i += n
        return i

    def _alloc_pages(self, num_pages: int, *, evict: bool = True) -> torch.Tensor:
        allocator = self._pools()[1]
        short = num_pages - allocator.num_free_pages
        if short > 0 and evict:
            self.evict(short * self.page_size)
        return allocator.alloc_or_raise(num_pages)

    def _add_leaf(
        self, parent: TreeNode, pages: list[PageKey], value: torch.Tensor, priority: int
    ) -> None:
        if value.numel() != len(pages):
            raise ValueError(f"{len(pages)} pages but {value.numel()} page ids")
        hashes: list[int] = []
        if self.enable_kv_cache_events:
            h = self._root_seed if parent is self.root_node else parent.block_hashes[-1]
            for page in pages:  # the page bytes are exactly the hashed encoding
                h = chain_hash(page, h)
                hashes.append(h)
        node = TreeNode(next(self._node_ids), next(self._clock), priority)
        node.parent = parent
        node.key = pages
        node.value = value.to(PAGE_ID_DTYPE)
        node.block_hashes = hashes
        parent.children[pages[0]] = node
        self._evictable_pages += len(pages)
        self._update_leaf_status(node)
        self._update_leaf_status(parent)
        if self.enable_kv_cache_events:
            self._emit(self._stored_event(node))

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut ``child`` after ``split_len`` pages; the new node (the head) keeps all access data."""
        parent = child.parent
        assert parent is not None and child.value is not None
        head = TreeNode(next(self._node_ids), child.creation_time, child.priority)
        head.last_access_time = child.last_access_time
        head.hit_count = child.hit_count
        head.lock_ref = child.lock_ref
        head.parent = parent
        head.key = child.key[:split_len]
        head.value = child.value[:split_len]
        head.block_hashes = child.block_hashes[:split_len]
        child.key = child.key[split_len:]
        child.value = child.value[split_len:]
        child.block_hashes = child.block_hashes[split_len:]
        child.parent = head
        head.children = {child.key[0]: child}
        parent.children[head.key[0]] = head
        return head

    def _delete_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[0]]
        self._evictable_pages -= len(node.key)
        self.evictable_leaves.discard(node)
        self._update_leaf_status(parent)
        if self.enable_kv_cache_events and node.block_hashes:
            self._emit(BlockRemoved(block_hashes=list(node.block_hashes), medium=self.medium))
        node.value = None

    def _update_leaf_status(self, node: TreeNode) -> None:
        if node is self.root_node:
            return
        if not node.children and node.lock_ref == 0:
            self.evictable_leaves.add(node)
        else:
            self.evictable_leaves.discard(node)

    def _stored_event(self, node: TreeNode) -> BlockStored:
        parent = node.parent
        parent_hash = (
            None if parent is None or parent is self.root_node else parent.block_hashes[-1]
        )
        return BlockStored(
            block_hashes=list(node.block_hashes),
            parent_block_hash=parent_hash,
            token_ids=page_tokens(node.key),
            block_size=self.page_size,
            lora_id=self.lora_id,
            medium=self.medium,
        )

    def _emit(self, event: Event) -> None:
        self.kv_event_queue.append(event)
        self._events_emitted += 1

    def _free_private_pages(self, pages: list[PageKey], page_ids: torch.Tensor) -> None:
        """``disable_finished_insert``: free the request's pages the tree does not own."""
        allocator = self._pools()[1]
        tree_values, _ = self._match(pages, count_hit=False)
        tree_ids = torch.cat(tree_values) if tree_values else page_ids[:0]
        private = torch.ones(page_ids.numel(), dtype=torch.bool, device=page_ids.device)
        shared = tree_ids.numel()
        private[:shared] = tree_ids.to(page_ids.device) != page_ids[:shared]
        allocator.free(page_ids[private])

    @staticmethod
    def _chain_pages(node: TreeNode | None) -> int:
        """Pages from the root to the end of ``node`` (what a lock on it covers)."""
        total = 0
        while node is not None and node.parent is not None:
            total += len(node.key)
            node = node.parent
        return total

    def _iter_nodes(self) -> Iterator[TreeNode]:
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _tree_page_ids(self) -> torch.Tensor:
        values = [node.value for node in self._iter_nodes() if node.value is not None]
        return (
            torch.cat(values) if values else torch.empty(0, dtype=PAGE_ID_DTYPE, device=self.device)
        )
