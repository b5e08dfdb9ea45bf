"""vllm-router ``kv_aware``, emulated from its source.

Source: github.com/vllm-project/router, ``src/policies/kv_aware.rs`` (the
revision at commit 71af994, the policy of vllm-router 0.1.17 on PyPI), with
``src/kv_index/scorer.rs``/``index.rs`` for the index it queries.

* score(w) = leading contiguous blocks of the prompt that ``w`` holds in the
  event-fed index, speculative entries included;
* the healthy worker with the highest score wins; Rust's ``max_by_key``
  returns the *last* maximum, so ties go to the last worker in order;
* only when the best score is 0: the smallest ``Worker::load()`` (requests in
  flight), ``min_by_key`` returning the first minimum; a prompt shorter than
  one block goes there too;
* speculative indexing (on by default, TTL 2 s): after the choice, the blocks
  past the best score are written into the index for the chosen worker, so
  requests arriving before its ``BlockStored`` see them.

No load term, no threshold. Emulation detail: speculative entries live in a
side table keyed by the prompt's own chained block hashes (the index's
hashes are the engine's); they expire after the TTL. The source also deletes
them on a matching ``BlockRemoved``; with a 2 s TTL that difference is at
most 2 s of credit for a block evicted right after it was written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from tokenspeed_router.hashing import block_hashes
from tokenspeed_router.sim.peers.base import PeerBackend, RouteInput

__all__ = ["SPECULATIVE_TTL_S", "VllmKvAwareBackend", "vllm_kv_aware_choice"]

#: ``KvAwareConfig::default().speculative_ttl``
SPECULATIVE_TTL_S = 2.0


def vllm_kv_aware_choice(
    workers: Sequence[str], scores: Mapping[str, int], loads: Mapping[str, int]
) -> str:
    """The worker ``kv_aware.rs`` picks: last max score, else the first least loaded."""
    best = workers[0]
    best_score = -1
    for w in workers:  # max_by_key: a later equal element replaces the earlier one
        s = scores.get(w, 0)
        if s >= best_score:
            best, best_score = w, s
    if best_score > 0:
        return best
    chosen = workers[0]
    for w in workers:  # min_by_key: the first minimum stays
        if loads.get(w, 0) < loads.get(chosen, 0):
            chosen = w
    return chosen


class VllmKvAwareBackend(PeerBackend):
    """``--policy vllm_kv_aware``."""

    name = "vllm_kv_aware"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        #: per worker: chained hash of a speculative block -> expiry (virtual seconds)
        self._speculative: dict[str, dict[int, float]] = {w: {} for w in self._workers}
        self._hashes: list[int] = []
        self._scores: dict[str, int] = {}

    def _score(self, inp: RouteInput, tokens: np.ndarray) -> dict[str, int]:
        hashes = self._hashes = [int(h) for h in block_hashes(tokens, inp.block_size)]
        out: dict[str, int] = {}
        for w in inp.workers:
            n = inp.matched_blocks.get(w, 0)
            spec = self._speculative[w]
            while n < len(hashes) and spec.get(hashes[n], -1.0) > inp.now:
                n += 1
            out[w] = n
        return out

    def choose(self, inp: RouteInput, tokens: np.ndarray) -> str:
        if inp.num_tokens < inp.block_size:
            loads = {w: inp.loads[w].requests for w in inp.workers}
            self._hashes, self._scores = [], {}
            return vllm_kv_aware_choice(inp.workers, {}, loads)
        self._scores = scores = self._score(inp, tokens)
        return vllm_kv_aware_choice(inp.workers, scores, {w: inp.loads[w].requests for w in inp.workers})

    def after_route(self, inp: RouteInput, tokens: np.ndarray, worker: str) -> None:
        hashes = self._hashes
        best = max(self._scores.values(), default=0)
        if not hashes or best >= len(hashes):
            return
        spec = self._speculative[worker]
        expiry = inp.now + SPECULATIVE_TTL_S
        for h in hashes[best:]:
            spec[h] = expiry
        if len(spec) > 4 * 65536:  # prune expired entries now and then
            self._speculative[worker] = {h: t for h, t in spec.items() if t > inp.now}

    def predicted_hit(self, inp: RouteInput, worker: str) -> int | None:
        return self._scores.get(worker, 0) * inp.block_size
