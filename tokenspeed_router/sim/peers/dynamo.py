"""Dynamo's default KV router cost, emulated from its source.

Source: github.com/ai-dynamo/dynamo, ``lib/kv-router/src/scheduling/selector/default.rs``
(``DefaultWorkerScorer::worker_logit``, ``minimum_cost_index``) and
``scheduling/config.rs`` (defaults), at commit 07a6c9c (2026).

In blocks of the engine's block size ``bs``, for a request of ``R`` blocks::

    credit(w)  = overlap_score_credit * decay(w) * device_overlap(w)      # + host/disk tiers
    prefill(w) = prefill_load_scale * max(active_prefill_tokens(w) / bs + R - credit(w), 0)
    cost(w)    = prefill(w) + decode_blocks(w) + R + decode_active_request_weight * requests(w)

with the defaults ``overlap_score_credit = 1``, ``overlap_score_credit_decay = 0``
(so ``decay = 1``), ``prefill_load_scale = 1``, ``decode_active_request_weight = 0``,
``router_temperature = 0`` (argmin; ties broken uniformly at random, reservoir
style), predictions off (``router_predicted_ttl_secs = None``).
``active_prefill_tokens``: uncached tokens of requests routed to ``w`` whose
prefill has not completed; ``decode_blocks``: blocks of the requests in
flight there (``R`` is added as the request's potential decode blocks).
The emulation omits the linear decay of the running prefill's tokens
(``prefill_tracker.rs``), which needs the engine's prefill rate.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

import numpy as np

from tokenspeed_router.sim.peers.base import PeerBackend, RouteInput

__all__ = ["DynamoBackend", "dynamo_costs", "dynamo_choice"]

OVERLAP_SCORE_CREDIT = 1.0
PREFILL_LOAD_SCALE = 1.0
DECODE_ACTIVE_REQUEST_WEIGHT = 0.0


def dynamo_costs(
    workers: Sequence[str],
    request_blocks: int,
    overlap: Mapping[str, int],
    prefill_tokens: Mapping[str, int],
    decode_blocks: Mapping[str, int],
    requests: Mapping[str, int],
    block_size: int,
) -> dict[str, float]:
    """``worker_logit`` per worker with the default weights."""
    out: dict[str, float] = {}
    for w in workers:
        credit = OVERLAP_SCORE_CREDIT * overlap.get(w, 0)
        raw = prefill_tokens.get(w, 0) / block_size + request_blocks
        prefill = PREFILL_LOAD_SCALE * max(raw - credit, 0.0)
        out[w] = prefill + decode_blocks.get(w, 0) + request_blocks + DECODE_ACTIVE_REQUEST_WEIGHT * requests.get(w, 0)
    return out


def dynamo_choice(workers: Sequence[str], costs: Mapping[str, float], rng: random.Random) -> str:
    """``minimum_cost_index``: the lowest cost; equal costs replace the choice with probability 1/k."""
    best = workers[0]
    best_cost = math.inf
    ties = 0
    for w in workers:
        c = costs[w]
        if c < best_cost:
            best, best_cost, ties = w, c, 1
        elif c == best_cost:
            ties += 1
            if rng.randrange(ties) == 0:
                best = w
    return best


class DynamoBackend(PeerBackend):
    """``--policy dynamo``."""

    name = "dynamo"

    def choose(self, inp: RouteInput, tokens: np.ndarray) -> str:
        r = math.ceil(inp.num_tokens / inp.block_size)
        loads = inp.loads
        costs = dynamo_costs(
            inp.workers, r, inp.matched_blocks,
            {w: loads[w].prefill_tokens() for w in inp.workers},
            {w: loads[w].blocks for w in inp.workers},
            {w: loads[w].requests for w in inp.workers},
            inp.block_size,
        )
        return dynamo_choice(inp.workers, costs, self._rng)
