"""llm-d's precise-prefix-cache scheduling profile, emulated from its source.

Source: github.com/llm-d/llm-d-inference-scheduler,
``deploy/config/epp-precise-prefix-cache-config.yaml`` (commit 17d999e: the
profile's scorers and weights) and the scorers under
``pkg/epp/framework/plugins/scheduling/scorer/`` (``preciseprefixcache``,
``queuedepth``, ``kvcacheutilization``) with the ``max-score-picker``.

score(w) = 2 * prefix(w) + 1 * kv(w) + 1 * queue(w), the argmax wins, ties
at random (the picker shuffles), where

* prefix(w) = matched blocks / prompt blocks, from the event-fed index
  (GPU tier weight 1.0);
* kv(w) = 1 - KV-cache usage of the engine (its metric; here the blocks the
  index says it holds over its capacity);
* queue(w) = (max_q - q) / (max_q - min_q) over the engines' ``num_requests_waiting``
  (1 for every worker when all queues are equal).

The engines' metrics are read at decision time (the source scrapes them
every 50 ms or so; the emulation has no scrape lag). Speculative entries
are optional in llm-d and off in this profile.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

import numpy as np

from tokenspeed_router.sim.peers.base import PeerBackend, RouteInput

__all__ = ["KV_WEIGHT", "LlmdPreciseBackend", "PREFIX_WEIGHT", "QUEUE_WEIGHT", "llmd_choice", "llmd_scores"]

PREFIX_WEIGHT = 2.0
KV_WEIGHT = 1.0
QUEUE_WEIGHT = 1.0


def llmd_scores(
    workers: Sequence[str],
    matched_blocks: Mapping[str, int],
    prompt_blocks: int,
    kv_usage: Mapping[str, float],
    waiting: Mapping[str, int],
) -> dict[str, float]:
    """The weighted sum of the three scorers per worker."""
    qs = [waiting.get(w, 0) for w in workers]
    q_hi, q_lo = max(qs), min(qs)
    out: dict[str, float] = {}
    for w in workers:
        prefix = matched_blocks.get(w, 0) / prompt_blocks if prompt_blocks else 0.0
        kv = 1.0 - min(max(kv_usage.get(w, 0.0), 0.0), 1.0)
        queue = 1.0 if q_hi == q_lo else (q_hi - waiting.get(w, 0)) / (q_hi - q_lo)
        out[w] = PREFIX_WEIGHT * prefix + KV_WEIGHT * kv + QUEUE_WEIGHT * queue
    return out


def llmd_choice(workers: Sequence[str], scores: Mapping[str, float], rng: random.Random) -> str:
    """``max-score-picker``: the highest score, a uniform draw among equal ones."""
    best = max(scores[w] for w in workers)
    tied = [w for w in workers if scores[w] == best]
    return tied[0] if len(tied) == 1 else tied[rng.randrange(len(tied))]


class LlmdPreciseBackend(PeerBackend):
    """``--policy llmd_precise``."""

    name = "llmd_precise"

    def choose(self, inp: RouteInput, tokens: np.ndarray) -> str:
        capacity = self._cluster.capacity_tokens
        usage = {w: self.index.num_blocks(w) * inp.block_size / capacity for w in inp.workers}
        scores = llmd_scores(
            inp.workers, inp.matched_blocks, math.ceil(inp.num_tokens / inp.block_size), usage,
            {w: inp.loads[w].waiting() for w in inp.workers},
        )
        return llmd_choice(inp.workers, scores, self._rng)
