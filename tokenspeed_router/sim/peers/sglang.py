"""SGLang router ``cache_aware``, emulated from its source.

Source: github.com/sgl-project/sglang, ``sgl-router/src/policies/cache_aware.rs``
(``CacheAwarePolicy::select_worker``, commit 026f853; the policy of
sglang-router 0.3.2), defaults from ``sgl-router`` ``CliArgs::default``:
``cache_threshold = 0.3``, ``balance_abs_threshold = 64``,
``balance_rel_threshold = 1.5``, ``eviction_interval = 120`` s,
``max_tree_size = 67,108,864``.

* loads = requests in flight per worker (``Worker::load()``); the system is
  imbalanced when ``max - min > 64`` and ``max > 1.5 * min``: then the least
  loaded worker (first minimum), and the prompt is still inserted into its tree;
* else the approximate tree (what the router itself routed, per worker):
  match rate = matched / prompt length; above 0.3 the worker with the longest
  match, otherwise the worker with the smallest tree; the prompt is inserted
  under the chosen worker.

No KV events: the tree is the router's own history. Emulation details: the
tree is kept at the engine's block granularity (the source matches
characters; at most one block of difference), and trees are evicted by size
only, which at the default size never happens in a trace replay. Among equal
matches the first worker in order wins (the source takes a tenant of the
deepest node).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from tokenspeed_router.hashing import ContentHash
from tokenspeed_router.router.scoring import ApproxPrefixStore
from tokenspeed_router.sim.peers.base import PeerBackend, RouteInput

__all__ = ["BALANCE_ABS_THRESHOLD", "BALANCE_REL_THRESHOLD", "CACHE_THRESHOLD", "SglangCacheAwareBackend",
           "sglang_cache_aware_choice"]

CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5


def sglang_cache_aware_choice(
    workers: Sequence[str],
    loads: Mapping[str, int],
    matched_tokens: Mapping[str, int],
    tree_sizes: Mapping[str, int],
    num_tokens: int,
) -> str:
    """The worker ``select_worker`` picks (see the module docstring)."""
    load = [loads.get(w, 0) for w in workers]
    hi, lo = max(load), min(load)
    if hi - lo > BALANCE_ABS_THRESHOLD and hi > lo * BALANCE_REL_THRESHOLD:
        return workers[load.index(lo)]
    best = workers[0]
    for w in workers:
        if matched_tokens.get(w, 0) > matched_tokens.get(best, 0):
            best = w
    rate = matched_tokens.get(best, 0) / num_tokens if num_tokens else 0.0
    if rate > CACHE_THRESHOLD:
        return best
    smallest = workers[0]
    for w in workers:
        if tree_sizes.get(w, 0) < tree_sizes.get(smallest, 0):
            smallest = w
    return smallest


class SglangCacheAwareBackend(PeerBackend):
    """``--policy sglang_cache_aware``."""

    name = "sglang_cache_aware"
    needs_events = False

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._tree = ApproxPrefixStore(block_size=self.block_size, ttl_s=1e18, max_blocks=67_108_864)
        self._hashes: list[ContentHash] = []
        self._matched: dict[str, int] = {}

    def choose(self, inp: RouteInput, tokens: np.ndarray) -> str:
        self._hashes = hashes = self._tree.hash_prompt(tokens)
        matched = self._tree.match(hashes, inp.workers, inp.now)
        self._matched = {w: b * inp.block_size for w, b in matched.items()}
        sizes = {w: self._tree.num_blocks(w) for w in inp.workers}
        return sglang_cache_aware_choice(
            inp.workers, {w: inp.loads[w].requests for w in inp.workers}, self._matched, sizes, inp.num_tokens
        )

    def after_route(self, inp: RouteInput, tokens: np.ndarray, worker: str) -> None:
        self._tree.record(worker, self._hashes, inp.now)

    def predicted_hit(self, inp: RouteInput, worker: str) -> int | None:
        return self._matched.get(worker, 0)
