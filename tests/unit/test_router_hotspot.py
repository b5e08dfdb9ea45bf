"""The default kv_aware weights must not hot-spot on the Mooncake conversation trace.

Every request of that trace starts with the same 512-token block (hash id 0),
so pure longest-prefix routing sends everything to the first worker that
served it. This test replays the first requests of the real trace through the
real Router, KvIndex and IndexIngestor: each 512-token hash id is expanded
into deterministic tokens, simulated workers keep an unbounded prefix cache,
prefill at 10k tokens/s in FIFO order, publish BlockStored events when a
prefill finishes, and the router is told of first tokens and completions on
an injected virtual clock (no sleeps).
"""

from __future__ import annotations

import heapq
import json
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support import traces_dir

from tokenspeed_router.events.schema import BlockStored, KVEventBatch
from tokenspeed_router.hashing import block_hashes
from tokenspeed_router.router.index import KvIndex
from tokenspeed_router.router.ingest import IndexIngestor, WorkerState
from tokenspeed_router.router.router import Router, RouterConfig

TRACE_BLOCK = 512
ENGINE_BLOCK = 16
PREFILL_TOKENS_PER_S = 10_000.0
TPOT_S = 0.02
NUM_REQUESTS = 400
NUM_WORKERS = 8


def load_trace(n: int) -> list[dict[str, Any]]:
    path = Path(traces_dir()) / "mooncake" / "conversation_trace.jsonl"
    with path.open() as f:
        return [json.loads(line) for _, line in zip(range(n), f, strict=False)]


def expand(hash_ids: list[int], input_length: int) -> list[int]:
    """Deterministic tokens: block ``h`` is ``h*512+1 .. h*512+512`` (prefix ids stay prefixes)."""
    tokens: list[int] = []
    for h in hash_ids:
        tokens.extend(range(h * TRACE_BLOCK + 1, h * TRACE_BLOCK + TRACE_BLOCK + 1))
    return tokens[:input_length]


@dataclass
class Result:
    requests: Counter[str] = field(default_factory=Counter)
    work: Counter[str] = field(default_factory=Counter)
    hit_tokens: int = 0
    prompt_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)

    def busiest_over_mean_work(self) -> float:
        return max(self.work.values()) / (sum(self.work.values()) / NUM_WORKERS)


def replay(trace: list[dict[str, Any]], config: RouterConfig) -> Result:
    clock = [0.0]
    index = KvIndex()
    router = Router(index, config, clock=lambda: clock[0])
    ingestor = IndexIngestor(
        index,
        clock=lambda: clock[0],
        on_state_change=lambda w, s: router.set_cold(w, s is not WorkerState.LIVE),
    )
    names = [f"w{i}" for i in range(NUM_WORKERS)]
    for name in names:
        router.add_worker(name)
    cached: dict[str, set[int]] = {n: set() for n in names}
    free_at = dict.fromkeys(names, 0.0)
    seqs = dict.fromkeys(names, 0)
    # (time, order, kind, payload): kind 0 = prefill done (+ events), 1 = request finished
    pending: list[tuple[float, int, int, Any]] = []
    order = 0
    result = Result()

    def advance(t: float) -> None:
        while pending and pending[0][0] <= t:
            when, _, kind, payload = heapq.heappop(pending)
            clock[0] = when
            if kind == 0:
                worker, request_id, event = payload
                if event is not None:
                    ingestor.on_record(worker, seqs[worker], KVEventBatch(when, [event]), when)
                    seqs[worker] += 1
                router.mark_prefill_done(request_id)
            else:
                router.release(payload)
        clock[0] = t

    for req in trace:
        arrival = req["timestamp"] / 1000.0
        advance(arrival)
        tokens = expand(req["hash_ids"], req["input_length"])
        decision = router.route(tokens)
        worker = decision.worker
        hashes = block_hashes(tokens, ENGINE_BLOCK)
        have = cached[worker]
        hit = 0
        while hit < len(hashes) and hashes[hit] in have:
            hit += 1
        have.update(hashes)
        uncached = len(tokens) - hit * ENGINE_BLOCK
        start = max(arrival, free_at[worker])
        done = start + uncached / PREFILL_TOKENS_PER_S
        free_at[worker] = done
        event = None
        if hit < len(hashes):
            event = BlockStored(
                block_hashes=hashes[hit:],
                parent_block_hash=hashes[hit - 1] if hit else None,
                token_ids=tokens[hit * ENGINE_BLOCK : len(hashes) * ENGINE_BLOCK],
                block_size=ENGINE_BLOCK,
            )
        heapq.heappush(pending, (done, order, 0, (worker, decision.request_id, event)))
        heapq.heappush(
            pending, (done + req["output_length"] * TPOT_S, order + 1, 1, decision.request_id)
        )
        order += 2
        result.requests[worker] += 1
        result.work[worker] += uncached
        result.hit_tokens += hit * ENGINE_BLOCK
        result.prompt_tokens += len(tokens)
        result.ttft_s.append(done - arrival)
    assert all(st.state is WorkerState.LIVE for st in ingestor.statuses().values())
    return result


@pytest.fixture(scope="module")
def trace() -> list[dict[str, Any]]:
    rows = load_trace(NUM_REQUESTS)
    assert all(r["hash_ids"][0] == 0 for r in rows)  # the shared first block
    return rows


@pytest.fixture(scope="module")
def default_result(trace) -> Result:  # type: ignore[no-untyped-def]
    return replay(trace, RouterConfig(request_id_prefix="k"))


def test_default_kv_aware_spreads_load_and_beats_round_robin(trace, default_result) -> None:  # type: ignore[no-untyped-def]
    kv = default_result
    rr = replay(trace, RouterConfig(policy="round_robin", request_id_prefix="r"))
    assert len(kv.requests) == NUM_WORKERS
    assert max(kv.requests.values()) <= 1.5 * NUM_REQUESTS / NUM_WORKERS
    assert kv.busiest_over_mean_work() <= 1.25
    assert kv.hit_tokens > 2 * rr.hit_tokens
    assert statistics.mean(kv.ttft_s) < 0.8 * statistics.mean(rr.ttft_s)


def test_the_load_terms_are_what_keeps_it_balanced(trace, default_result) -> None:  # type: ignore[no-untyped-def]
    # Prefix only (no queue or decode term): here only the tie-break (fewest in
    # flight) spreads requests whose best match is the shared block 0, while a
    # conversation's later turns stick to their worker however long its queue:
    # less balanced and slower than the default.
    prefix_only = replay(
        trace, RouterConfig(queue_weight=0.0, decode_weight=0.0, request_id_prefix="p")
    )
    kv = default_result
    assert prefix_only.busiest_over_mean_work() > kv.busiest_over_mean_work() + 0.1
    assert statistics.mean(prefix_only.ttft_s) > 1.2 * statistics.mean(kv.ttft_s)
