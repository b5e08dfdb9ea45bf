"""sglang-router ``cache_aware``, emulated from the source of the release it is compared with.

Reference: sglang-router **0.3.2** from PyPI (the ``smg`` binary), its sdist's
Rust source: ``src/policies/cache_aware.rs`` (``CacheAwarePolicy::select_worker``,
``select_worker_min_load``), ``src/policies/tree.rs`` (``Tree::insert``,
``Tree::prefix_match_with_counts``), ``src/routers/http/router.rs``
(``WorkerLoadGuard``: the load a request holds) and ``smg launch --help``
(defaults): ``--cache-threshold 0.3``, ``--balance-abs-threshold 64``,
``--balance-rel-threshold 1.5``, ``--eviction-interval-secs 60``,
``--max-tree-size 67108864``. docs/compare-routers.md has the full reading.

* loads = requests in flight per worker (``Worker::load()``, held from the
  choice to the end of the response body); the system is imbalanced when
  ``max - min > 64`` and ``max > 1.5 * min``: then the least loaded worker
  (the first minimum), and the prompt text is still inserted under it;
* else one approximate radix tree **shared by all workers** over the prompt
  *text* (characters), each node carrying the set of workers (tenants) that
  were sent text through it. The prompt is matched from the root as deep as
  it goes (a partial match inside a node ends the walk at that node);
  ``match rate = matched characters / prompt characters``. Above 0.3 the
  request goes to that node's ``last_tenant``: the worker whose insert
  *created* the node (a split node inherits it), never updated by later
  inserts through it; at or below 0.3, the least loaded worker (first
  minimum). The prompt is then inserted under the chosen worker.

No KV events: the tree is the router's own history. The tree is evicted
every 60 s down to 67M characters per worker, which a replay here never
reaches (the emulation counts each worker's characters and says so if it
ever would). The emulation renders a prompt's token ids as the text
loadgen sends for ``--prompt-format text`` (space-separated decimal ids,
engine-sim tokenizes them back), so it matches the same characters.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np

from tokenspeed_router.sim.peers.base import PeerBackend, RouteInput

__all__ = ["BALANCE_ABS_THRESHOLD", "BALANCE_REL_THRESHOLD", "CACHE_THRESHOLD", "MAX_TREE_SIZE",
           "SglangCacheAwareBackend", "SglangTree", "sglang_cache_aware_choice"]

logger = logging.getLogger(__name__)

CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5
MAX_TREE_SIZE = 67_108_864


def _shared_prefix(a: str, b: str) -> int:
    """Length of the common prefix of ``a`` and ``b`` (slice compares run in C; O(n log n))."""
    hi = min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    lo = 0  # a[:lo] == b[:lo] holds, a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _Node:
    __slots__ = ("children", "last_tenant", "tenants", "text")

    def __init__(self, text: str, last_tenant: str | None, tenants: set[str]) -> None:
        self.text = text
        self.children: dict[str, _Node] = {}
        self.last_tenant = last_tenant
        self.tenants = tenants


class SglangTree:
    """``policies/tree.rs``'s multi-tenant radix tree over characters (insert and prefix match)."""

    def __init__(self) -> None:
        self.root = _Node("", None, set())
        self.chars: dict[str, int] = {}  # tenant_char_count

    def insert(self, text: str, tenant: str) -> None:
        self.root.tenants.add(tenant)
        self.chars.setdefault(tenant, 0)
        prev, rest = self.root, text
        while rest:
            child = prev.children.get(rest[0])
            if child is None:  # a new leaf, created by (and last_tenant of) this tenant
                prev.children[rest[0]] = _Node(rest, tenant, {tenant})
                self.chars[tenant] += len(rest)
                return
            shared = _shared_prefix(rest, child.text)
            if shared < len(child.text):  # split: the new upper node inherits tenants and last_tenant
                upper = _Node(child.text[:shared], child.last_tenant, set(child.tenants))
                child.text = child.text[shared:]
                upper.children[child.text[0]] = child
                prev.children[rest[0]] = upper
                child = upper
            if tenant not in child.tenants:
                child.tenants.add(tenant)
                self.chars[tenant] += len(child.text)
            prev, rest = child, rest[shared:]

    def prefix_match(self, text: str) -> tuple[str | None, int]:
        """(the deepest matched node's ``last_tenant``, matched characters)."""
        prev, rest, matched = self.root, text, 0
        while rest:
            child = prev.children.get(rest[0])
            if child is None:
                break
            shared = _shared_prefix(rest, child.text)
            matched += shared
            prev = child
            if shared < len(child.text):
                break
            rest = rest[shared:]
        tenant = prev.last_tenant if prev.last_tenant in prev.tenants else next(iter(prev.tenants), None)
        return tenant, matched


def sglang_cache_aware_choice(
    workers: Sequence[str],
    loads: Mapping[str, int],
    match_tenant: str | None,
    matched_chars: int,
    num_chars: int,
) -> str:
    """The worker ``select_worker`` picks (see the module docstring)."""
    load = [loads.get(w, 0) for w in workers]
    hi, lo = max(load), min(load)
    least = workers[load.index(lo)]
    if hi - lo > BALANCE_ABS_THRESHOLD and hi > lo * BALANCE_REL_THRESHOLD:
        return least
    rate = matched_chars / num_chars if num_chars else 0.0
    if rate > CACHE_THRESHOLD:
        # the source's fallback when the tenant is gone: the first healthy worker
        return match_tenant if match_tenant is not None and match_tenant in workers else workers[0]  # the source's fallback when the tenant is gone: the first healthy worker
    return least


class SglangCacheAwareBackend(PeerBackend):
    """``--policy sglang_cache_aware``: sglang-router 0.3.2 ``--policy cache_aware`` with its defaults."""

    name = "sglang_cache_aware"
    needs_events = False

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._tree = SglangTree()
        self._text = ""
        self._matched: tuple[str | None, int] = (None, 0)
        self._warned = False

    def choose(self, inp: RouteInput, tokens: np.ndarray) -> str:
        self._text = text = " ".join(map(str, tokens.tolist()))
        self._matched = tenant, matched = self._tree.prefix_match(text)
        return sglang_cache_aware_choice(
            inp.workers, {w: inp.loads[w].requests for w in inp.workers}, tenant, matched, len(text))

    def after_route(self, inp: RouteInput, tokens: np.ndarray, worker: str) -> None:
        self._tree.insert(self._text, worker)
        if not self._warned and self._tree.chars.get(worker, 0) > MAX_TREE_SIZE:
            self._warned = True
            logger.warning("sglang_cache_aware: worker %s's tree passed %d characters; the real router "
                           "would evict it (every 60 s), the emulation does not", worker, MAX_TREE_SIZE)

    def predicted_hit(self, inp: RouteInput, worker: str) -> int | None:
        tenant, matched = self._matched
        if tenant != worker or not self._text:
            return 0
        return int(inp.num_tokens * matched / len(self._text))
