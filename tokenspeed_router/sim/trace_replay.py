"""Replay Mooncake-style trace rows through the routing core (``router/core.py``).

A deliberately small cluster model, shared by the hot-spot test
(``tests/unit/test_router_hotspot.py``) and ``benchmarks/bench_router.py`` (it
lives in the package so that both import it the installed way): each 512-token
hash id becomes 512 deterministic tokens, workers keep an *unbounded* prefix
cache of 16-token blocks, prefill FIFO at ``prefill_tokens_per_s``, publish
``BlockStored`` when a prefill ends (the router hears the first token then)
and finish after ``output_length * tpot_s``; TTFT = queueing + own uncached
prefill. Time is a virtual clock injected into the core (no sleeps). The simulator (``tokenspeed_router.sim``) is the full model with
bounded caches and eviction; this one isolates the routing decision.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tokenspeed_router.events.schema import BlockHash, BlockStored, KVEventBatch
from tokenspeed_router.hashing import block_hashes
from tokenspeed_router.router.core import RoutingCore
from tokenspeed_router.router.ingest import WorkerState
from tokenspeed_router.router.router import RouterConfig

__all__ = ["ENGINE_BLOCK", "TRACE_BLOCK", "TraceReplay", "expand_hash_ids", "replay_trace"]

TRACE_BLOCK = 512
ENGINE_BLOCK = 16


def expand_hash_ids(hash_ids: Iterable[int], input_length: int) -> list[int]:
    """Deterministic tokens: block ``h`` is ``h*512+1 .. h*512+512`` (prefix ids stay prefixes)."""
    tokens: list[int] = []
    for h in hash_ids:
        tokens.extend(range(h * TRACE_BLOCK + 1, (h + 1) * TRACE_BLOCK + 1))
    return tokens[:input_length]


@dataclass
class TraceReplay:
    """What one replay measured, per worker and per request."""

    num_workers: int
    requests: Counter[str] = field(default_factory=Counter)
    work: Counter[str] = field(default_factory=Counter)
    hit_tokens: int = 0
    prompt_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    worker_states: dict[str, WorkerState] = field(default_factory=dict)

    def busiest_over_mean_work(self) -> float:
        return max(self.work.values()) / (sum(self.work.values()) / self.num_workers)


def replay_trace(
    rows: Iterable[dict[str, Any]],
    config: RouterConfig,
    *,
    num_workers: int = 8,
    prefill_tokens_per_s: float = 10_000.0,
    tpot_s: float = 0.02,
) -> TraceReplay:
    """Route every row in arrival order and model its prefill; see the module docstring."""
    clock = [0.0]
    core = RoutingCore(config, clock=lambda: clock[0])
    names = [f"w{i}" for i in range(num_workers)]
    for name in names:
        core.add_worker(name)
    cached: dict[str, set[int]] = {n: set() for n in names}
    free_at = dict.fromkeys(names, 0.0)
    seqs = dict.fromkeys(names, 0)
    # (time, order, kind, payload): kind 0 = prefill done (+ events), 1 = request finished
    pending: list[tuple[float, int, int, Any]] = []
    result = TraceReplay(num_workers=num_workers)
    for i, req in enumerate(rows):
        arrival = req["timestamp"] / 1000.0
        while pending and pending[0][0] <= arrival:
            when, _, kind, payload = heapq.heappop(pending)
            clock[0] = when
            if kind == 0:
                worker, request_id, event = payload
                if event is not None:
                    core.apply_record(worker, seqs[worker], KVEventBatch(when, [event]), when)
                    seqs[worker] += 1
                core.mark_prefill_done(request_id)
            else:
                core.release(payload)
        clock[0] = arrival
        tokens = expand_hash_ids(req["hash_ids"], req["input_length"])
        decision = core.route(tokens)
        worker = decision.worker
        hashes = block_hashes(tokens, ENGINE_BLOCK)
        have = cached[worker]
        hit = 0
        while hit < len(hashes) and hashes[hit] in have:
            hit += 1
        have.update(hashes)
        uncached = len(tokens) - hit * ENGINE_BLOCK
        done = max(arrival, free_at[worker]) + uncached / prefill_tokens_per_s
        free_at[worker] = done
        event = None
        if hit < len(hashes):
            stored: list[BlockHash] = list(hashes[hit:])
            event = BlockStored(
                block_hashes=stored,
                parent_block_hash=hashes[hit - 1] if hit else None,
                token_ids=tokens[hit * ENGINE_BLOCK : len(hashes) * ENGINE_BLOCK],
                block_size=ENGINE_BLOCK,
            )
        heapq.heappush(pending, (done, 2 * i, 0, (worker, decision.request_id, event)))
        heapq.heappush(
            pending, (done + req["output_length"] * tpot_s, 2 * i + 1, 1, decision.request_id)
        )
        result.requests[worker] += 1
        result.work[worker] += uncached
        result.hit_tokens += hit * ENGINE_BLOCK
        result.prompt_tokens += len(tokens)
        result.ttft_s.append(done - arrival)
    result.worker_states = {name: st.state for name, st in core.statuses().items()}
    return result
