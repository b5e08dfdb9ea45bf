"""``tokenspeed-router bench``: KvIndex ingestion, matching, routing and removal speed.

Run::

    tokenspeed-router bench                       # 8 and 64 workers, ~1M stored blocks
    tokenspeed-router bench --quick               # ~100k blocks, 8 workers (< 30 s)
    tokenspeed-router bench --workers 8 --blocks 1000000 --json out.json

Workload (fixed seed): block size 16; 4 system prompts of 512 tokens;
conversations of 0.5k-40k tokens (log-uniform), each on one worker, starting
with a system prompt and stored turn by turn (one BlockStored per turn, 8-256
blocks, parent = the previous turn's last block; turns of all conversations
interleaved in time). External block ids are random u64 (engine-style opaque
ids; identical for identical system-prompt blocks across workers). The same
turns are also stored one block per event, as engines emit while decoding.

Reported, per worker count: ingestion blocks/s and events/s (turn batches and
one-block events); ``match`` p50/p99 in µs *with hashing* for 1k/8k/32k-token
queries that continue a stored conversation (deep hit on one worker, the
system prompt on many) and for new conversations (system prompt only);
``RoutingCore.route`` p50/p99 per policy with ``IN_FLIGHT`` requests outstanding,
and its ratio to ``round_robin`` (the cache-blind floor) measured in the same
run; removal blocks/s; the RSS growth of ingestion per stored block.

Only public APIs are used (``KvIndex``, ``RoutingCore``). The lab version, with a
side-by-side run of NVIDIA Dynamo's RadixTree, memory counted object by
object and the uncompacted index, is ``benchmarks/bench_index.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.events.schema import BlockHash, BlockRemoved, BlockStored, KVEventBatch
from tokenspeed_router.percentiles import percentile
from tokenspeed_router.router.core import RoutingCore
from tokenspeed_router.router.index import KvIndex
from tokenspeed_router.router.router import RouterConfig

__all__ = [
    "IN_FLIGHT",
    "POLICIES",
    "Workload",
    "add_arguments",
    "ingest_events",
    "now",
    "print_rows",
    "rss_bytes",
    "time_matches",
    "build_workload",
    "one_block_events",
    "removal_batches",
    "run",
    "run_bench",
    "time_routes",
]

BLOCK = 16
SEED = 20261129
VOCAB = 128_000
SYSTEM_PROMPTS = 4
SYSTEM_TOKENS = 512
QUERY_LENGTHS = (1024, 8192, 32768)
#: requests kept in flight while timing ``route`` (the oldest is released as
#: each new one is routed), so the load terms work as in a busy server
IN_FLIGHT = 256
#: policies timed by the routing section; ``round_robin`` first (the baseline)
POLICIES = ("round_robin", "least_loaded", "kv_aware", "approx")

#: the clock every figure is measured with (``--clock``): process CPU time by
#: default, because shared CI machines steal wall time unpredictably
_now: Callable[[], float] = time.process_time


def now() -> float:
    """The clock chosen by ``--clock`` (for callers timing beside this module)."""
    return _now()


# --------------------------------------------------------------------- workload


@dataclass
class Conversation:
    worker: int
    tokens: list[int]
    #: external ids of every block (system prompt blocks shared per prompt)
    ext: list[BlockHash]
    #: (first block, last block exclusive) of each stored turn
    turns: list[tuple[int, int]]


@dataclass
class Workload:
    """Everything a run needs, generated once from the seed."""

    workers: int
    names: list[str]
    conversations: list[Conversation]
    #: (worker name, batch with one BlockStored per turn), in time order
    events: list[tuple[str, KVEventBatch]]
    stored_blocks: int
    queries: dict[str, dict[int, list[list[int]]]] = field(default_factory=dict)


def build_workload(workers: int, blocks: int, seed: int = SEED, queries: int = 100) -> Workload:
    """The fixed-seed workload described in the module docstring."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(1, VOCAB, SYSTEM_TOKENS).tolist() for _ in range(SYSTEM_PROMPTS)]
    sys_blocks = SYSTEM_TOKENS // BLOCK
    sys_ext = [rng.integers(0, 2**64, sys_blocks, dtype=np.uint64).tolist() for _ in range(SYSTEM_PROMPTS)]
    names = [f"w{i}" for i in range(workers)]
    conversations: list[Conversation] = []
    prompts: list[int] = []
    timed: list[tuple[float, int, int]] = []  # (time, conversation, turn)
    total = 0
    while total < blocks:
        worker = int(rng.integers(workers))
        s = int(rng.integers(SYSTEM_PROMPTS))
        length = int(math.exp(rng.uniform(math.log(512), math.log(40960))))
        nblk = max(length // BLOCK, sys_blocks + 8)
        body = rng.integers(1, VOCAB, nblk * BLOCK - SYSTEM_TOKENS).tolist()
        ext: list[BlockHash] = [*sys_ext[s], *rng.integers(0, 2**64, nblk - sys_blocks, dtype=np.uint64).tolist()]
        turns = []
        pos = sys_blocks
        while pos < nblk:
            stop = min(nblk, pos + int(rng.integers(8, 257)))
            turns.append((pos, stop))
            pos = stop
        total += nblk - sys_blocks
        ci = len(conversations)
        conversations.append(Conversation(worker, systems[s] + body, ext, turns))
        prompts.append(s)
        t0 = float(rng.uniform(0, 1000))
        for k in range(len(turns)):
            timed.append((t0 + 5.0 * k, ci, k))
    timed.sort()
    # The first conversation (in time) with a given prompt on a worker stores
    # the prompt's blocks too; later ones chain under the cached prompt.
    has_prompt: set[tuple[int, int]] = set()
    events: list[tuple[str, KVEventBatch]] = []
    for _t, ci, k in timed:
        conv = conversations[ci]
        if k == 0 and (conv.worker, prompts[ci]) not in has_prompt:
            has_prompt.add((conv.worker, prompts[ci]))
            conv.turns[0] = (0, conv.turns[0][1])
            total += sys_blocks
        a, b = conv.turns[k]
        events.append((names[conv.worker], KVEventBatch(0.0, [_stored(conv, a, b)])))
    wl = Workload(workers, names, conversations, events, total)
    wl.queries = _make_queries(conversations, systems, rng, queries)
    return wl


def _stored(conv: Conversation, a: int, b: int) -> BlockStored:
    return BlockStored(
        block_hashes=conv.ext[a:b],
        parent_block_hash=conv.ext[a - 1] if a else None,
        token_ids=conv.tokens[a * BLOCK : b * BLOCK],
        block_size=BLOCK,
    )


def _make_queries(
    conversations: list[Conversation], systems: list[list[int]], rng: np.random.Generator, n: int
) -> dict[str, dict[int, list[list[int]]]]:
    by_len = sorted(conversations, key=lambda c: len(c.tokens))
    cont: dict[int, list[list[int]]] = {}
    fresh: dict[int, list[list[int]]] = {}
    for length in QUERY_LENGTHS:
        pool = [c for c in by_len if len(c.tokens) >= length // 2] or by_len[-max(1, len(by_len) // 10) :]
        cont[length] = []
        fresh[length] = []
        for _ in range(n):
            conv = pool[int(rng.integers(len(pool)))]
            keep = min(len(conv.tokens), length - 256)
            cont[length].append(conv.tokens[:keep] + rng.integers(1, VOCAB, length - keep).tolist())
            s = systems[int(rng.integers(len(systems)))]
            fresh[length].append(s + rng.integers(1, VOCAB, length - len(s)).tolist())
    return {"continuation": cont, "new_conversation": fresh}


def one_block_events(wl: Workload, limit: int) -> list[tuple[str, KVEventBatch]]:
    """The same turns, in the same order, one block per event (up to ``limit`` events)."""
    out: list[tuple[str, KVEventBatch]] = []
    for name, batch in wl.events:
        ev = batch.events[0]
        assert isinstance(ev, BlockStored)
        parent: BlockHash | None = ev.parent_block_hash
        for i, e in enumerate(ev.block_hashes):
            one = BlockStored(
                block_hashes=[e],
                parent_block_hash=parent,
                token_ids=ev.token_ids[i * BLOCK : (i + 1) * BLOCK],
                block_size=BLOCK,
            )
            out.append((name, KVEventBatch(0.0, [one])))
            parent = e
            if len(out) >= limit:
                return out
    return out


# ------------------------------------------------------------------ measuring


def _lat_us(seconds: list[float]) -> dict[str, float]:
    return {"p50_us": round(percentile(seconds, 50) * 1e6, 1), "p99_us": round(percentile(seconds, 99) * 1e6, 1)}


def rss_bytes() -> int | None:
    """Resident set size in bytes (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def ingest_events(events: Sequence[tuple[str, KVEventBatch]]) -> tuple[KvIndex, float]:
    index = KvIndex()
    apply = index.apply
    t = _now()
    for name, batch in events:
        apply(name, batch)
    return index, _now() - t


def time_matches(index: KvIndex, queries: Sequence[Any], repeat: int) -> list[float]:
    """Seconds per ``match`` call (hashing included), ``repeat`` passes."""
    out = []
    for _ in range(repeat):
        for q in queries:
            t = _now()
            index.match(q)
            out.append(_now() - t)
    return out


def time_routes(router: RoutingCore, queries: Sequence[Any], *, in_flight: int = IN_FLIGHT) -> list[float]:
    """Seconds per ``route`` call, keeping ``in_flight`` requests outstanding."""
    window: deque[str] = deque()
    out: list[float] = []
    for q in queries:
        t0 = _now()
        decision = router.route(q)
        out.append(_now() - t0)
        window.append(decision.request_id)
        if len(window) > in_flight:
            router.release(window.popleft())
    return out


def bench_ingest(wl: Workload, one_block_limit: int) -> tuple[KvIndex, dict[str, Any]]:
    """Turn batches and one-block events; returns the loaded index."""
    gc.collect()
    gc.freeze()  # the workload is old-generation data in a long-running server
    rss0 = rss_bytes()
    index, dt = ingest_events(wl.events)
    rss1 = rss_bytes()
    if index.num_blocks() != wl.stored_blocks:
        raise RuntimeError(f"index holds {index.num_blocks()} blocks, expected {wl.stored_blocks}")
    res: dict[str, Any] = {
        "blocks_per_s": round(wl.stored_blocks / dt),
        "events_per_s": round(len(wl.events) / dt),
        "rss_bytes_per_block": None if rss0 is None or rss1 is None else round((rss1 - rss0) / wl.stored_blocks, 1),
    }
    ones = one_block_events(wl, one_block_limit)
    _, dt_one = ingest_events(ones)
    res["one_block_events_per_s"] = round(len(ones) / dt_one)
    return index, res


def bench_match(index: KvIndex, wl: Workload, repeat: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, by_len in wl.queries.items():
        for length, qs in by_len.items():
            time_matches(index, qs[:5], 1)  # warm up
            lat = _lat_us(time_matches(index, qs, repeat))
            best = [max(index.match(q).values(), default=0) for q in qs[:50]]
            out[f"{kind}/{length}"] = {**lat, "mean_best_blocks": round(sum(best) / len(best), 1)}
    return out


def bench_route(index: KvIndex, wl: Workload, repeat: int, seed: int) -> dict[str, Any]:
    """``route`` latency per policy on the loaded index, continuation queries."""
    out: dict[str, Any] = {}
    for length, qs in sorted(wl.queries["continuation"].items()):
        row: dict[str, Any] = {}
        base = None
        for policy in POLICIES:
            config = RouterConfig(policy=policy, seed=seed, request_id_prefix="bench")
            router = RoutingCore(config, index=index)  # the core serve runs, on the loaded index
            for name in wl.names:
                router.add_worker(name)
            time_routes(router, qs)  # warm-up; also fills the approx store
            lat = [t for _ in range(repeat) for t in time_routes(router, qs)]
            p50 = percentile(lat, 50)
            base = p50 if base is None else base
            row[policy] = {**_lat_us(lat), "p50_vs_round_robin": round(p50 / base, 1) if base else None}
        out[f"{length}_tokens"] = row
    return out


def removal_batches(wl: Workload, fraction: float) -> tuple[list[tuple[str, KVEventBatch]], int]:
    """BlockRemoved events (leaf first, <=256 ids) for ``fraction`` of the conversations."""
    out: list[tuple[str, KVEventBatch]] = []
    count = 0
    step = max(1, round(1 / fraction))
    for conv in wl.conversations[::step]:
        a = conv.turns[0][0]
        b = conv.turns[-1][1]
        ids = conv.ext[a:b][::-1]
        count += len(ids)
        name = wl.names[conv.worker]
        for i in range(0, len(ids), 256):
            out.append((name, KVEventBatch(0.0, [BlockRemoved(block_hashes=ids[i : i + 256])])))
    return out, count


def bench_removal(index: KvIndex, wl: Workload) -> dict[str, Any]:
    batches, count = removal_batches(wl, 0.2)
    before = index.num_blocks()
    t = _now()
    for name, batch in batches:
        index.apply(name, batch)
    dt = _now() - t
    gone = before - index.num_blocks()
    return {"blocks": gone, "requested": count, "blocks_per_s": round(gone / dt)}


# ------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``tokenspeed-router bench``."""
    parser.add_argument("--workers", type=int, nargs="+", default=None, help="worker counts (default 8 64)")
    parser.add_argument("--blocks", type=int, default=None, help="stored blocks (default 1000000)")
    parser.add_argument("--queries", type=int, default=None, help="queries per length (default 100)")
    parser.add_argument("--repeat", type=int, default=None, help="passes over the queries (default 3)")
    parser.add_argument(
        "--one-block-events", type=int, default=None, help="events in the one-block variant (default 200000)"
    )
    parser.add_argument("--seed", type=int, default=SEED, help="workload seed")
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: process CPU time, all threads (default; robust on loaded machines); wall: perf_counter",
    )
    parser.add_argument("--quick", action="store_true", help="~100k blocks, 8 workers, few queries (< 30 s)")
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON")


def _defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill unset sizes (``--quick`` picks the small ones) and reject impossible ones."""
    quick = bool(getattr(args, "quick", False))
    for name, full, small in (
        ("workers", [8, 64], [8]),
        ("blocks", 1_000_000, 100_000),
        ("queries", 100, 30),
        ("repeat", 3, 2),
        ("one_block_events", 200_000, 30_000),
    ):
        if getattr(args, name, None) is None:
            setattr(args, name, small if quick else full)
    for name, value in (("seed", SEED), ("json", None), ("clock", "cpu")):
        if not hasattr(args, name):
            setattr(args, name, value)
    if any(w < 1 for w in args.workers):
        raise ConfigError(f"--workers must be at least 1, got {' '.join(map(str, args.workers))}")
    for name in ("blocks", "queries", "repeat", "one_block_events"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def run_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every section, for every worker count; returns the result rows."""
    global _now
    args = _defaults(args)
    _now = time.process_time if args.clock == "cpu" else time.perf_counter
    rows = []
    for workers in args.workers:
        wl = build_workload(workers, args.blocks, args.seed, args.queries)
        try:
            index, ingest = bench_ingest(wl, args.one_block_events)
            res: dict[str, Any] = {
                "workers": workers,
                "stored_blocks": wl.stored_blocks,
                "events": len(wl.events),
                "clock": args.clock,
                "ingest": ingest,
                "match": bench_match(index, wl, args.repeat),
                "route": bench_route(index, wl, args.repeat, args.seed),
                "removal": bench_removal(index, wl),
            }
        finally:
            gc.unfreeze()
            gc.collect()
        rows.append(res)
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    for res in rows:
        print(
            f"== KvIndex, {res['workers']} workers, {res['stored_blocks']:,} stored blocks, "
            f"{res['events']:,} events, clock={res['clock']}"
        )
        ing = res["ingest"]
        print(f"ingest           {ing['blocks_per_s']:>12,} blocks/s  {ing['events_per_s']:>10,} events/s")
        print(f"one-block events {ing['one_block_events_per_s']:>12,} events/s")
        print(f"removal          {res['removal']['blocks_per_s']:>12,} blocks/s")
        if ing["rss_bytes_per_block"] is not None:
            print(f"memory           {ing['rss_bytes_per_block']:>12} B/block (RSS growth of ingestion)")
        for key, m in res["match"].items():
            print(
                f"match {key:<24} p50 {m['p50_us']:>7.1f} µs  p99 {m['p99_us']:>7.1f} µs  "
                f"best {m['mean_best_blocks']} blocks"
            )
        for length, row in res["route"].items():
            for policy, m in row.items():
                print(
                    f"route {length:<13} {policy:<12} p50 {m['p50_us']:>7.1f} µs  p99 {m['p99_us']:>7.1f} µs  "
                    f"({m['p50_vs_round_robin']}x round_robin)"
                )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``tokenspeed-router bench``."""
    rows = run_bench(args)
    print_rows(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "kv_index", "seed": args.seed, "rows": rows}, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m tokenspeed_router.bench.cli_bench``."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
