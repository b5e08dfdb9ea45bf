"""KvIndex lab benchmark: ``tokenspeed-router bench`` plus what needs internals or Dynamo.

Run::

    .venv/bin/python benchmarks/bench_index.py --quick          # smoke, < 30 s
    .venv/bin/python benchmarks/bench_index.py                  # 8 and 64 workers, ~1M blocks
    .venv/bin/python benchmarks/bench_index.py --json out.json
    benchmarks/dynamo_compare.sh                                # side by side with NVIDIA Dynamo

On top of the library command (same workload, ``tokenspeed_router/bench/cli_bench.py``):

* memory per stored block (:func:`retained_bytes`: ``KvIndex.memory_bytes``,
  the bytes the core's tables hold), on the native core and on the
  pure-Python reference core (``KvIndex(core="reference")``), with the
  reference core's ingest speed;
* ``match`` with numpy token input;
* ``--dynamo``: Dynamo's ``RadixTree`` (``ai-dynamo-runtime`` 1.6.1) in the
  same process on the same events (JSON, with ``tokens_hash`` precomputed by
  ``compute_block_hash_for_seq`` as its publishers do — so Dynamo's ingestion
  excludes hashing while ours includes it) and queries (hashed with
  ``compute_block_hash_for_seq``, then ``find_matches``), and the ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from typing import Any

import numpy as np

from tokenspeed_router.bench import cli_bench as bench
from tokenspeed_router.bench.cli_bench import BLOCK, Workload, one_block_events, removal_batches
from tokenspeed_router.events.schema import BlockHash, BlockRemoved, BlockStored, KVEventBatch
from tokenspeed_router.percentiles import percentile
from tokenspeed_router.router.index import KvIndex


def _lat_us(seconds: list[float]) -> dict[str, float]:
    return {"p50_us": round(percentile(seconds, 50) * 1e6, 1), "p99_us": round(percentile(seconds, 99) * 1e6, 1)}


def retained_bytes(index: KvIndex) -> int:
    """Bytes the index keeps alive (native: its tables' allocations; reference: getsizeof of its maps)."""
    return index.memory_bytes()


def bench_memory(wl: Workload) -> dict[str, Any]:
    """Bytes retained per stored block on the default core and on the reference core; its ingest speed."""
    index, _ = bench.ingest_events(wl.events)
    out: dict[str, Any] = {
        "core": index.implementation,
        "retained_bytes_per_block": round(retained_bytes(index) / wl.stored_blocks, 1),
        "distinct_blocks": index.num_distinct_blocks(),
    }
    del index
    plain = KvIndex(core="reference")
    t = bench.now()
    for name, batch in wl.events:
        plain.apply(name, batch)
    dt = bench.now() - t
    out["uncompacted"] = {  # key kept for result files; it is the reference core now
        "core": "reference",
        "ingest_blocks_per_s": round(wl.stored_blocks / dt),
        "retained_bytes_per_block": round(retained_bytes(plain) / wl.stored_blocks, 1),
    }
    return out


def bench_match_numpy(wl: Workload, repeat: int) -> dict[str, Any]:
    index, _ = bench.ingest_events(wl.events)
    out: dict[str, Any] = {}
    for kind, by_len in wl.queries.items():
        for length, qs in by_len.items():
            nq = [np.asarray(q, dtype=np.int64) for q in qs]
            bench.time_matches(index, nq[:5], 1)
            out[f"{kind}/{length}"] = _lat_us(bench.time_matches(index, nq, repeat))
    return out


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
    rss0 = bench.rss_bytes() or 0
    t = bench.now()
    for w, p in payloads:
        tree.apply_event(w, p)
    tree.find_matches([1])  # the tree runs on its own thread: wait for it to drain
    dt = bench.now() - t
    rss1 = bench.rss_bytes() or 0
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
                    t0 = bench.now()
                    hs = compute_block_hash_for_seq(q, BLOCK)
                    t1 = bench.now()
                    tree.find_matches(hs)
                    t2 = bench.now()
                    hash_us.append(t1 - t0)
                    find_us.append(t2 - t1)
                    total_us.append(t2 - t0)
            match[f"{kind}/{length}"] = {**_lat_us(total_us), "hash": _lat_us(hash_us), "find_matches": _lat_us(find_us)}
    res["match"] = match
    batches, _count = removal_batches(wl, 0.2)
    ids = [_removed_ids(b) for _, b in batches]
    rem = [
        (wid[n], enc({"event_id": i, "data": {"removed": {"block_hashes": ids[i]}}, "dp_rank": 0}))
        for i, (n, _b) in enumerate(batches)
    ]
    removed = sum(map(len, ids))
    t = bench.now()
    for w, p in rem:
        tree.apply_event(w, p)
    tree.find_matches([1])
    dt = bench.now() - t
    res["removal"] = {"blocks": removed, "blocks_per_s": round(removed / dt)}
    one = one_block_events(wl, one_block_limit)
    ones = [(wid[n], stored_json(_stored_of(b), i)) for i, (n, b) in enumerate(one)]
    tree = RadixTree()
    t = bench.now()
    for w, p in ones:
        tree.apply_event(w, p)
    tree.find_matches([1])
    dt = bench.now() - t
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
        "one_block_events_per_s": round(
            ours["ingest"]["one_block_events_per_s"] / dyn["one_block"]["events_per_s"], 2
        ),
        "removal_blocks_per_s": round(ours["removal"]["blocks_per_s"] / dyn["removal"]["blocks_per_s"], 2),
        "memory_per_block_retained_vs_rss": round(
            ours["memory"]["retained_bytes_per_block"] / max(dyn["memory"]["rss_delta_bytes_per_block"], 1e-9), 2
        ),
    }
    for key, m in ours["match"].items():
        d = dyn["match"].get(key)
        if d:
            out[f"match_p50/{key}"] = round(m["p50_us"] / d["p50_us"], 2)
    for key, m in ours.get("match_numpy", {}).items():
        d = dyn["match"].get(key)
        if d:
            out[f"match_p50_numpy/{key}"] = round(m["p50_us"] / d["p50_us"], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    bench.add_arguments(parser)
    parser.add_argument("--dynamo", action="store_true", help="also run Dynamo's RadixTree (ai-dynamo-runtime)")
    args = parser.parse_args(argv)
    rows = bench.run_bench(args)
    for res in rows:
        wl = bench.build_workload(res["workers"], args.blocks, args.seed, args.queries)
        gc.collect()
        res["memory"] = bench_memory(wl)
        res["match_numpy"] = bench_match_numpy(wl, args.repeat)
        if args.dynamo:
            try:
                res["dynamo"] = bench_dynamo(wl, args.one_block_events, args.repeat)
                res["ratio_vs_dynamo"] = _ratios(res, res["dynamo"])
            except ImportError as err:
                res["dynamo"] = {"error": f"ai-dynamo-runtime not importable: {err}"}
    bench.print_rows(rows)
    for res in rows:
        print(f"== {res['workers']} workers: lab sections")
        for key in ("memory", "match_numpy", "dynamo", "ratio_vs_dynamo"):
            if key in res:
                print(f"{key}: {json.dumps(res[key])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "kv_index_lab", "seed": args.seed, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
