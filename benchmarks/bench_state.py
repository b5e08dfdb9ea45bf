"""Benchmark the Redis state backend: append throughput, warm start, follower lag.

Run::

    .venv/bin/python benchmarks/bench_state.py            # ~1M blocks (about a minute)
    .venv/bin/python benchmarks/bench_state.py --quick    # ~100k blocks (seconds)
    .venv/bin/python benchmarks/bench_state.py --url redis://127.0.0.1:6379/0

Without ``--url`` it starts its own ``redis-server`` (no persistence) on a free
loopback port. Everything runs in one process (leader, followers, Redis
client threads share one GIL), so the figures are a floor, not a ceiling.

Measured, with fixed seeds, in one run:

1. **append**: batches/s and blocks/s from the leader's ``submit`` to the
   stream (fenced Lua append, ``append_batch`` entries per round trip), and
   until the leader's own follower has applied them to its index;
2. **warm start** of a new replica for N blocks: latest snapshot + stream tail,
   versus rebuilding from the whole stream (the baseline), and their ratio;
3. **lag**: leader accept -> applied in a follower replica's index, p50/p99,
   at a steady paced rate.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.events import BlockHash, BlockStored, KVEventBatch, encode_batch
from tokenspeed_router.events.subscriber import BatchReceived
from tokenspeed_router.state import LocalIndexHost, RedisStateConfig, RedisStateReplica

BLOCK_SIZE = 16
BLOCKS_PER_BATCH = 16
NUM_WORKERS = 8


@contextmanager
def redis_server() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found: install it or pass --url")
    port = free_tcp_port()
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "no", "--dir", tmp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            import redis

            client = redis.Redis(port=port)
            deadline = time.monotonic() + 15
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    threading.Event().wait(0.05)
            client.close()
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(10)


def make_items(num_batches: int, seed: int, start: int = 0) -> list[BatchReceived]:
    """Each batch stores a fresh 16-block chain (16 tokens per block) on one of 8 workers."""
    rng = random.Random(seed)
    items = []
    for i in range(start, start + num_batches):
        w = i % NUM_WORKERS
        tokens = [rng.randrange(1, 100_000) for _ in range(BLOCK_SIZE * BLOCKS_PER_BATCH)]
        hashes: list[BlockHash] = list(range(i * BLOCKS_PER_BATCH + 1, (i + 1) * BLOCKS_PER_BATCH + 1))
        batch = KVEventBatch(0.0, [BlockStored(block_hashes=hashes, parent_block_hash=None,
                                               token_ids=tokens, block_size=BLOCK_SIZE)])
        payload = encode_batch(batch)
        items.append(BatchReceived(f"w{w}", i // NUM_WORKERS, batch, payload, b"", 0.0, 0, False))
    return items


def config(url: str, name: str, cluster: str) -> RedisStateConfig:
    return RedisStateConfig(url=url, cluster=cluster, replica_id=name, maxlen=10_000_000,
                            snapshot_every_batches=10**9, snapshot_every_s=1e9,
                            buffer_size=1_000_000, lease_ttl_s=10.0)


def wait_for(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        pause.wait(0.001)


def start_leader(url: str, cluster: str) -> RedisStateReplica:
    leader = RedisStateReplica(config(url, "leader", cluster), LocalIndexHost())
    leader.start()
    wait_for(lambda: leader.is_leader, 30, "the lease")
    return leader


def bench_append_and_warm(url: str, num_batches: int, tail_fraction: float) -> dict[str, Any]:
    items = make_items(num_batches, seed=1)
    leader = start_leader(url, "warm")
    t0 = time.perf_counter()
    for item in items:
        leader.submit(item)
    wait_for(lambda: leader.writer.appended >= num_batches, 600, "appends")
    t_append = time.perf_counter() - t0
    wait_for(lambda: leader.applier.entries_applied >= num_batches, 600, "leader's follower")
    t_applied = time.perf_counter() - t0
    blocks = leader.host.index.num_blocks()

    # baseline: a new replica rebuilds from the whole stream (only the empty seed snapshot)
    rebuild = RedisStateReplica(config(url, "rebuild", "warm"), LocalIndexHost())
    r_report = rebuild.start()
    rebuild.close()

    # snapshot of everything so far, then a tail after it
    t_snap0 = time.perf_counter()
    leader.write_snapshot_soon()
    wait_for(lambda: leader.follower.snapshots_written >= 1, 600, "snapshot")
    t_snapshot = time.perf_counter() - t_snap0
    tail = make_items(int(num_batches * tail_fraction), seed=2, start=num_batches)
    for item in tail:
        leader.submit(item)
    total = num_batches + len(tail)
    wait_for(lambda: leader.applier.entries_applied >= total, 600, "tail")
    warm = RedisStateReplica(config(url, "warm", "warm"), LocalIndexHost())
    w_report = warm.start()
    same = warm.host.index.num_blocks() == leader.host.index.num_blocks()
    meta = warm.follower._store.meta()
    warm.close()
    leader.close()
    return {
        "batches": num_batches,
        "blocks": blocks,
        "append_s": t_append,
        "append_batches_per_s": num_batches / t_append,
        "append_blocks_per_s": num_batches * BLOCKS_PER_BATCH / t_append,
        "leader_applied_s": t_applied,
        "leader_applied_blocks_per_s": num_batches * BLOCKS_PER_BATCH / t_applied,
        "snapshot_write_s": t_snapshot,
        "snapshot_bytes": meta.num_bytes if meta else None,
        "rebuild_s": r_report.total_s,
        "rebuild_blocks": r_report.num_blocks,
        "warm_s": w_report.total_s,
        "warm_load_s": w_report.load_s,
        "warm_tail_entries": w_report.tail_entries,
        "warm_blocks": w_report.num_blocks,
        "warm_equals_leader": same,
        "rebuild_over_warm": r_report.total_s / w_report.total_s,
    }


def bench_lag(url: str, rate_per_s: float, duration_s: float) -> dict[str, Any]:
    leader = start_leader(url, "lag")
    follower = RedisStateReplica(config(url, "follower", "lag"), LocalIndexHost())
    follower.start()
    n = int(rate_per_s * duration_s)
    items = make_items(n, seed=3)
    pause = threading.Event()
    t0 = time.perf_counter()
    for i, item in enumerate(items):
        due = t0 + i / rate_per_s
        delay = due - time.perf_counter()
        if delay > 0:
            pause.wait(delay)
        leader.submit(item)
    wait_for(lambda: follower.applier.entries_applied >= n, 120, "follower")
    p50, p99 = follower.applier.apply_lag_percentiles()
    lp50, lp99 = leader.applier.apply_lag_percentiles()
    follower.close()
    leader.close()
    return {"rate_batches_per_s": rate_per_s, "batches": n,
            "follower_lag_p50_ms": (p50 or 0) * 1000, "follower_lag_p99_ms": (p99 or 0) * 1000,
            "leader_lag_p50_ms": (lp50 or 0) * 1000, "leader_lag_p99_ms": (lp99 or 0) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="~100k blocks instead of ~1M")
    parser.add_argument("--url", help="use this Redis instead of starting one (it is written to)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    num_batches = 6_250 if args.quick else 62_500  # x16 blocks
    with (contextmanager(lambda: iter([args.url]))() if args.url else redis_server()) as url:
        warm = bench_append_and_warm(url, num_batches, tail_fraction=0.02)
        lag = bench_lag(url, rate_per_s=1000.0, duration_s=1.0 if args.quick else 3.0)
    print(f"append   {warm['batches']} batches x {BLOCKS_PER_BATCH} blocks: "
          f"{warm['append_batches_per_s']:,.0f} batches/s, {warm['append_blocks_per_s']:,.0f} blocks/s "
          f"(applied by the leader's own follower: {warm['leader_applied_blocks_per_s']:,.0f} blocks/s)")
    print(f"snapshot {warm['blocks']:,} blocks: written in {warm['snapshot_write_s']:.2f} s, "
          f"{(warm['snapshot_bytes'] or 0) / 1e6:.1f} MB")
    print(f"warm     {warm['warm_blocks']:,} blocks: snapshot + {warm['warm_tail_entries']} tail "
          f"entries in {warm['warm_s']:.2f} s (load {warm['warm_load_s']:.2f} s) vs rebuild from "
          f"the whole stream {warm['rebuild_s']:.2f} s -> {warm['rebuild_over_warm']:.1f}x faster"
          f" (identical: {warm['warm_equals_leader']})")
    print(f"lag      at {lag['rate_batches_per_s']:.0f} batches/s: follower p50 "
          f"{lag['follower_lag_p50_ms']:.2f} ms, p99 {lag['follower_lag_p99_ms']:.2f} ms "
          f"(leader's own index p50 {lag['leader_lag_p50_ms']:.2f} ms, "
          f"p99 {lag['leader_lag_p99_ms']:.2f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"append_warm": warm, "lag": lag}, f, indent=2)


if __name__ == "__main__":
    main()
