"""``tokenspeed-router bench``: KvIndex ingestion, matching, removal and memory.

Run::

    tokenspeed-router bench                       # 8 and 64 workers, ~1M stored blocks
    tokenspeed-router bench --quick               # ~100k blocks, 8 workers (< 30 s)
    tokenspeed-router bench --workers 8 --blocks 1000000 --json out.json
    tokenspeed-router bench --dynamo              # also NVIDIA Dynamo's RadixTree, same workload
                                                  # (needs ai-dynamo-runtime: benchmarks/dynamo_compare.sh)

Workload (fixed seed, DESIGN/issue 4): block size 16; 4 system prompts of
512 tokens; conversations of 0.5k-40k tokens (log-uniform), each on one
worker, starting with a system prompt and stored turn by turn (one
BlockStored per turn, 8-256 blocks, parent = the previous turn's last block;
turns of all conversations interleaved in time). External block ids are
random u64 (engine-style opaque ids; identical for identical system-prompt
blocks across workers, as Dynamo requires). Variants: the same conversations
stored one block per event (as engines emit while decoding), one event per
``apply`` call and 64 per call.

Reported: ingestion blocks/s and events/s; ``match`` p50/p99 in µs *with
hashing* for 1k/8k/32k-token queries that continue a stored conversation
(deep hit on one worker, system prompt on many) and for new conversations
(system prompt only), for list and numpy token input; removal blocks/s;
memory per stored block (bytes retained by the index, counted object by
object, and the RSS delta of ingestion).

``--dynamo`` runs Dynamo's ``RadixTree`` (``ai-dynamo-runtime`` 1.6.1) in the
same process on the same events (JSON, with ``tokens_hash`` precomputed by
``compute_block_hash_for_seq`` as its publishers do — so Dynamo's ingestion
excludes hashing while ours includes it) and queries (hashed with
``compute_block_hash_for_seq``, then ``find_matches``), and prints ratios.

Extension point: routing latency sections are added through
:func:`register_section` (or a module named in ``OPTIONAL_SECTIONS`` exposing
``bench_section(ctx) -> dict``); each gets the loaded index and the queries.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenspeed_router.events.schema import BlockHash, BlockRemoved, BlockStored, KVEventBatch
from tokenspeed_router.router.index import KvIndex

__all__ = [
    "OPTIONAL_SECTIONS",
    "BenchContext",
    "Workload",
    "add_arguments",
    "build_workload",
    "register_section",
    "run",
    "run_bench",
]

BLOCK = 16
SEED = 20261129
VOCAB = 128_000
SYSTEM_PROMPTS = 4
SYSTEM_TOKENS = 512
QUERY_LENGTHS = (1024, 8192, 32768)

#: Modules tried at run time; each may expose ``bench_section(ctx) -> dict``
#: (the routing helper's place to add routing latency without touching this file).
OPTIONAL_SECTIONS: tuple[str, ...] = ("tokenspeed_router.router.bench_routing",)

_SECTIONS: list[tuple[str, Callable[[BenchContext], dict[str, Any]]]] = []

#: the clock every figure is measured with (``--clock``): process CPU time by
#: default, because shared CI machines steal wall time unpredictably
_now: Callable[[], float] = time.process_time


def register_section(name: str, fn: Callable[[BenchContext], dict[str, Any]]) -> None:
    """Add a section to every bench run (called after the index sections)."""
    _SECTIONS.append((name, fn))


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


@dataclass
class BenchContext:
    """What an extra section gets: the loaded index, the workload, the CLI args."""

    index: KvIndex
    workload: Workload
    args: argparse.Namespace


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


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def retained_bytes(index: KvIndex) -> int:
    """Bytes the index keeps alive (``KvIndex.memory_bytes``: its core's tables)."""
    return index.memory_bytes()


def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


def _lat(samples: list[float]) -> dict[str, float]:
    return {"p50_us": round(_pct(samples, 50), 1), "p99_us": round(_pct(samples, 99), 1)}


def _time_match(index: KvIndex, queries: list[Any], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        for q in queries:
            t = _now()
            index.match(q)
            out.append((_now() - t) * 1e6)
    return out


def bench_index(wl: Workload, args: argparse.Namespace) -> tuple[KvIndex, dict[str, Any]]:
    """Ingest, match, remove; returns the loaded index (before removal) and figures."""
    res: dict[str, Any] = {
        "workers": wl.workers,
        "stored_blocks": wl.stored_blocks,
        "events": len(wl.events),
        "clock": args.clock,
    }
    gc.collect()
    gc.freeze()
    index = KvIndex()
    rss0 = _rss()
    t = _now()
    apply = index.apply
    for name, batch in wl.events:
        apply(name, batch)
    dt = _now() - t
    rss1 = _rss()
    assert index.num_blocks() == wl.stored_blocks, (index.num_blocks(), wl.stored_blocks)
    res["ingest"] = {
        "seconds": round(dt, 3),
        "blocks_per_s": round(wl.stored_blocks / dt),
        "events_per_s": round(len(wl.events) / dt),
    }
    kept = retained_bytes(index)
    res["memory"] = {
        "retained_bytes_per_block": round(kept / wl.stored_blocks, 1),
        "rss_delta_bytes_per_block": round((rss1 - rss0) / wl.stored_blocks, 1),
        "distinct_blocks": index.num_distinct_blocks(),
    }
    # The same ingestion on the pure-Python reference core, measured alike.
    plain = KvIndex(core="reference")
    t = _now()
    for name, batch in wl.events:
        plain.apply(name, batch)
    dt_plain = _now() - t
    res["uncompacted"] = {
        "ingest_blocks_per_s": round(wl.stored_blocks / dt_plain),
        "retained_bytes_per_block": round(retained_bytes(plain) / wl.stored_blocks, 1),
    }
    del plain
    # matching: hashing included, list and numpy input
    match: dict[str, Any] = {}
    for kind, by_len in wl.queries.items():
        for length, qs in by_len.items():
            _time_match(index, qs[:5], 1)  # warm up
            lat = _lat(_time_match(index, qs, args.repeat))
            nq = [np.asarray(q, dtype=np.int64) for q in qs]
            lat_np = _lat(_time_match(index, nq, args.repeat))
            depth = statistics.mean(max(index.match(q).values(), default=0) for q in qs[:50])
            match[f"{kind}/{length}"] = {**lat, "numpy": lat_np, "mean_best_blocks": round(depth, 1)}
    res["match"] = match
    return index, res


def bench_one_block(wl: Workload, limit: int) -> dict[str, Any]:
    """One-block events (decode-time stores): per call, and 64 per batch."""
    events = one_block_events(wl, limit)
    out: dict[str, Any] = {"events": len(events)}
    index = KvIndex()
    t = _now()
    for name, batch in events:
        index.apply(name, batch)
    dt = _now() - t
    out["events_per_s"] = round(len(events) / dt)
    # the same events, 64 per batch per worker (one scheduler round)
    grouped: dict[str, list[Any]] = {}
    for name, batch in events:
        grouped.setdefault(name, []).extend(batch.events)
    batches = [
        (name, KVEventBatch(0.0, evs[i : i + 64])) for name, evs in grouped.items() for i in range(0, len(evs), 64)
    ]
    index = KvIndex()
    t = _now()
    for name, batch in batches:
        index.apply(name, batch)
    dt = _now() - t
    out["batched64_events_per_s"] = round(len(events) / dt)
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


# ----------------------------------------------------------------------- Dynamo


def bench_dynamo(wl: Workload, one_block_limit: int, repeat: int) -> dict[str, Any]:
    """Dynamo's RadixTree on the same workload (same process, same queries)."""
    import msgspec
    from dynamo.llm import RadixTree, compute_block_hash_for_seq

    enc = msgspec.json.encode
    wid = {name: i for i, name in enumerate(wl.names)}

    def stored_json(ev: BlockStored, event_id: int) -> bytes:
        local = compute_block_hash_for_seq(ev.token_ids, BLOCK)
        blocks = [{"block_hash": e, "tokens_hash": h} for e, h in zip(ev.block_hashes, local, strict=True)]
        data = {"stored": {"parent_hash": ev.parent_block_hash, "blocks": blocks}}
        return enc({"event_id": event_id, "data": data, "dp_rank": 0})

    res: dict[str, Any] = {"version": _dynamo_version()}
    payloads = [(wid[n], stored_json(_stored_of(b), i)) for i, (n, b) in enumerate(wl.events)]
    gc.collect()
    tree = RadixTree()
    rss0 = _rss()
    t = _now()
    for w, p in payloads:
        tree.apply_event(w, p)
    tree.find_matches([1])  # the tree runs on its own thread: wait for it to drain
    dt = _now() - t
    rss1 = _rss()
    del payloads
    res["ingest"] = {
        "seconds": round(dt, 3),
        "blocks_per_s": round(wl.stored_blocks / dt),
        "events_per_s": round(len(wl.events) / dt),
    }
    res["memory"] = {"rss_delta_bytes_per_block": round((rss1 - rss0) / wl.stored_blocks, 1)}
    match: dict[str, Any] = {}
    for kind, by_len in wl.queries.items():
        for length, qs in by_len.items():
            hash_us: list[float] = []
            find_us: list[float] = []
            total_us: list[float] = []
            for _ in range(repeat):
                for q in qs:
                    t0 = _now()
                    hs = compute_block_hash_for_seq(q, BLOCK)
                    t1 = _now()
                    tree.find_matches(hs)
                    t2 = _now()
                    hash_us.append((t1 - t0) * 1e6)
                    find_us.append((t2 - t1) * 1e6)
                    total_us.append((t2 - t0) * 1e6)
            match[f"{kind}/{length}"] = {**_lat(total_us), "hash": _lat(hash_us), "find_matches": _lat(find_us)}
    res["match"] = match
    batches, _count = removal_batches(wl, 0.2)
    ids = [_removed_ids(b) for _, b in batches]
    rem = [
        (wid[n], enc({"event_id": i, "data": {"removed": {"block_hashes": ids[i]}}, "dp_rank": 0}))
        for i, (n, _b) in enumerate(batches)
    ]
    removed = sum(map(len, ids))
    t = _now()
    for w, p in rem:
        tree.apply_event(w, p)
    tree.find_matches([1])
    dt = _now() - t
    res["removal"] = {"blocks": removed, "blocks_per_s": round(removed / dt)}
    one = one_block_events(wl, one_block_limit)
    ones = [(wid[n], stored_json(_stored_of(b), i)) for i, (n, b) in enumerate(one)]
    tree = RadixTree()
    t = _now()
    for w, p in ones:
        tree.apply_event(w, p)
    tree.find_matches([1])
    dt = _now() - t
    res["one_block"] = {"events": len(ones), "events_per_s": round(len(ones) / dt)}
    return res


def _stored_of(batch: KVEventBatch) -> BlockStored:
    ev = batch.events[0]
    assert isinstance(ev, BlockStored)
    return ev


def _removed_ids(batch: KVEventBatch) -> list[BlockHash]:
    ev = batch.events[0]
    assert isinstance(ev, BlockRemoved)
    return ev.block_hashes


def _dynamo_version() -> str:
    try:
        from importlib.metadata import version

        return version("ai-dynamo-runtime")
    except Exception:
        return "unknown"


def _ratios(ours: dict[str, Any], dyn: dict[str, Any]) -> dict[str, Any]:
    """Ours relative to Dynamo: >1 is better for throughputs, <1 is better for latency/memory."""
    out: dict[str, Any] = {
        "ingest_blocks_per_s": round(ours["ingest"]["blocks_per_s"] / dyn["ingest"]["blocks_per_s"], 2),
        "one_block_events_per_s": round(ours["one_block"]["events_per_s"] / dyn["one_block"]["events_per_s"], 2),
        "removal_blocks_per_s": round(ours["removal"]["blocks_per_s"] / dyn["removal"]["blocks_per_s"], 2),
        "memory_per_block_retained_vs_rss": round(
            ours["memory"]["retained_bytes_per_block"] / max(dyn["memory"]["rss_delta_bytes_per_block"], 1e-9), 2
        ),
    }
    for key, m in ours["match"].items():
        d = dyn["match"].get(key)
        if d:
            out[f"match_p50/{key}"] = round(m["p50_us"] / d["p50_us"], 2)
            out[f"match_p50_numpy/{key}"] = round(m["numpy"]["p50_us"] / d["p50_us"], 2)
    return out


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
    parser.add_argument("--dynamo", action="store_true", help="also run Dynamo's RadixTree (ai-dynamo-runtime)")
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON")


def _defaults(args: argparse.Namespace) -> argparse.Namespace:
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
    for name, value in (("seed", SEED), ("dynamo", False), ("json", None), ("clock", "cpu")):
        if not hasattr(args, name):
            setattr(args, name, value)
    return args


def run_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every configured section, for every worker count; returns the result rows."""
    global _now
    args = _defaults(args)
    _now = time.process_time if args.clock == "cpu" else time.perf_counter
    rows = []
    for workers in args.workers:
        wl = build_workload(workers, args.blocks, args.seed, args.queries)
        index, res = bench_index(wl, args)
        res["one_block"] = bench_one_block(wl, args.one_block_events)
        ctx = BenchContext(index, wl, args)
        for name, fn in _extra_sections():
            res[name] = fn(ctx)
        res["removal"] = bench_removal(index, wl)
        del index, ctx
        gc.unfreeze()
        gc.collect()
        if args.dynamo:
            try:
                res["dynamo"] = bench_dynamo(wl, args.one_block_events, args.repeat)
                res["ratio_vs_dynamo"] = _ratios(res, res["dynamo"])
            except ImportError as err:
                res["dynamo"] = {"error": f"ai-dynamo-runtime not importable: {err}"}
        rows.append(res)
    return rows


def _extra_sections() -> list[tuple[str, Callable[[BenchContext], dict[str, Any]]]]:
    out = list(_SECTIONS)
    for module_name in OPTIONAL_SECTIONS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        fn = getattr(module, "bench_section", None)
        if callable(fn):
            out.append((module_name.rsplit(".", 1)[-1], fn))
    return out


def _print(rows: list[dict[str, Any]]) -> None:
    for res in rows:
        print(
            f"== KvIndex, {res['workers']} workers, {res['stored_blocks']:,} stored blocks, "
            f"{res['events']:,} events, clock={res['clock']}"
        )
        ing = res["ingest"]
        print(f"ingest           {ing['blocks_per_s']:>12,} blocks/s  {ing['events_per_s']:>10,} events/s")
        ob = res["one_block"]
        print(
            f"one-block events {ob['events_per_s']:>12,} events/s (1 per call)  "
            f"{ob['batched64_events_per_s']:,} events/s (64 per call)"
        )
        print(f"removal          {res['removal']['blocks_per_s']:>12,} blocks/s")
        mem = res["memory"]
        print(
            f"memory           {mem['retained_bytes_per_block']:>12} B/block retained "
            f"({mem['rss_delta_bytes_per_block']} B/block RSS delta)"
        )
        unc = res["uncompacted"]
        print(
            f"reference core   {unc['ingest_blocks_per_s']:>12,} blocks/s ingest, "
            f"{unc['retained_bytes_per_block']} B/block retained"
        )
        dyn = res.get("dynamo", {})
        for key, m in res["match"].items():
            line = (
                f"match {key:<24} p50 {m['p50_us']:>7.1f} µs  p99 {m['p99_us']:>7.1f} µs  "
                f"(numpy p50 {m['numpy']['p50_us']:.1f})  best {m['mean_best_blocks']} blocks"
            )
            d = dyn.get("match", {}).get(key) if isinstance(dyn, dict) else None
            if d:
                line += f"  | dynamo hash+find p50 {d['p50_us']:.1f} µs ({d['hash']['p50_us']:.1f}+{d['find_matches']['p50_us']:.1f})"
            print(line)
        if "error" in dyn:
            print(f"dynamo: {dyn['error']}")
        elif dyn:
            print(
                f"dynamo {dyn['version']}: ingest {dyn['ingest']['blocks_per_s']:,} blocks/s, "
                f"one-block {dyn['one_block']['events_per_s']:,} events/s, removal "
                f"{dyn['removal']['blocks_per_s']:,} blocks/s, memory {dyn['memory']['rss_delta_bytes_per_block']} B/block (RSS)"
            )
            print("ratio ours/dynamo:", json.dumps(res["ratio_vs_dynamo"], indent=None))
        for key, value in res.items():
            if key not in {"workers", "stored_blocks", "events", "ingest", "one_block", "removal", "memory", "match", "dynamo", "ratio_vs_dynamo", "clock", "uncompacted"}:
                print(f"{key}: {json.dumps(value)}")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``tokenspeed-router bench``."""
    rows = run_bench(args)
    _print(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "kv_index", "seed": args.seed, "rows": rows}, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m tokenspeed_router.router.bench``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
