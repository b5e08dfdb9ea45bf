"""The routing section plugged into ``tokenspeed-router bench`` runs and reports every policy."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from tokenspeed_router.events.schema import BlockStored, KVEventBatch
from tokenspeed_router.hashing import block_hashes
from tokenspeed_router.router import KvIndex
from tokenspeed_router.router.bench_routing import POLICIES, bench_section, percentile


def test_bench_section_smoke() -> None:
    index = KvIndex()
    tokens = list(range(1, 1025))
    event = BlockStored(
        block_hashes=block_hashes(tokens, 16),
        parent_block_hash=None,
        token_ids=tokens,
        block_size=16,
    )  # type: ignore[arg-type]
    index.apply("w0", KVEventBatch(0.0, [event]))
    workload = SimpleNamespace(names=["w0", "w1"], queries={"continuation": {1024: [tokens] * 5}})
    out = bench_section(
        SimpleNamespace(index=index, workload=workload, args=argparse.Namespace(repeat=1))
    )
    row = out["1024_tokens"]
    assert set(POLICIES) <= set(row)
    assert row["round_robin"]["p50_vs_round_robin"] == 1.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
