"""The KvIndex benchmark stays runnable: a tiny workload through every index section and the CLI."""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

from tokenspeed_router.cli import main as cli_main
from tokenspeed_router.router import bench


def test_workload_is_deterministic_and_consistent() -> None:
    a = bench.build_workload(3, 3000, seed=7, queries=2)
    b = bench.build_workload(3, 3000, seed=7, queries=2)
    assert [(n, e.events[0].block_hashes) for n, e in a.events] == [(n, e.events[0].block_hashes) for n, e in b.events]
    assert a.stored_blocks >= 3000
    assert set(a.queries) == {"continuation", "new_conversation"}
    assert all(len(q) == length for qs in a.queries.values() for length, items in qs.items() for q in items)


def test_index_sections_on_a_tiny_workload() -> None:
    wl = bench.build_workload(2, 4000, queries=3)
    args = argparse.Namespace(repeat=1, clock="cpu")
    try:
        index, res = bench.bench_index(wl, args)
    finally:
        gc.unfreeze()  # bench_index freezes the heap for stable timings
    assert res["ingest"]["blocks_per_s"] > 0
    assert index.num_blocks() == wl.stored_blocks
    assert res["memory"]["retained_bytes_per_block"] > 16
    # continuation queries hit deeper than the shared system prompt
    assert res["match"]["continuation/8192"]["mean_best_blocks"] > 32
    assert res["match"]["new_conversation/1024"]["mean_best_blocks"] == 32
    assert bench.bench_one_block(wl, 500)["events"] == 500
    removal = bench.bench_removal(index, wl)
    assert removal["blocks"] == removal["requested"] > 0


def test_cli_bench_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    code = cli_main(
        ["bench", "--workers", "2", "--blocks", "3000", "--queries", "2", "--repeat", "1",
         "--one-block-events", "200", "--json", str(out)]
    )
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["workers"] == 2 and "dynamo" not in rows[0]
