"""``tokenspeed-router bench`` stays runnable: a tiny workload through every section and the CLI."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

from tokenspeed_router.bench import cli_bench as bench
from tokenspeed_router.cli import main as cli_main
from tokenspeed_router.percentiles import percentile


def test_workload_is_deterministic_and_consistent() -> None:
    a = bench.build_workload(3, 3000, seed=7, queries=2)
    b = bench.build_workload(3, 3000, seed=7, queries=2)
    assert [(n, e.events[0].block_hashes) for n, e in a.events] == [(n, e.events[0].block_hashes) for n, e in b.events]
    assert a.stored_blocks >= 3000
    assert set(a.queries) == {"continuation", "new_conversation"}
    assert all(len(q) == length for qs in a.queries.values() for length, items in qs.items() for q in items)


def test_sections_on_a_tiny_workload() -> None:
    wl = bench.build_workload(2, 4000, queries=3)
    try:
        index, ingest = bench.bench_ingest(wl, 500)
    finally:
        gc.unfreeze()  # bench_ingest freezes the heap for stable timings
    assert ingest["blocks_per_s"] > 0 and ingest["one_block_events_per_s"] > 0
    assert index.num_blocks() == wl.stored_blocks
    match = bench.bench_match(index, wl, repeat=1)
    # continuation queries hit deeper than the shared system prompt
    assert match["continuation/8192"]["mean_best_blocks"] > 32
    assert match["new_conversation/1024"]["mean_best_blocks"] == 32
    route = bench.bench_route(index, wl, repeat=1, seed=1)
    assert set(route["1024_tokens"]) == set(bench.POLICIES)
    assert route["1024_tokens"]["round_robin"]["p50_vs_round_robin"] == 1.0
    removal = bench.bench_removal(index, wl)
    assert removal["blocks"] == removal["requested"] > 0


def test_percentile_is_nearest_rank() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == 4.0
    assert percentile([5.0], 1) == 5.0


def test_cli_bench_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    code = cli_main(
        ["bench", "--workers", "2", "--blocks", "3000", "--queries", "2", "--repeat", "1",
         "--one-block-events", "200", "--json", str(out)]
    )
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["workers"] == 2
    assert {"ingest", "match", "route", "removal"} <= set(rows[0])


def test_cli_bench_rejects_zero_workers() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tokenspeed_router.cli", "bench", "--workers", "0"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "tokenspeed-router bench: error: --workers must be at least 1, got 0"
