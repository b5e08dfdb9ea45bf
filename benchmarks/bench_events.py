"""Wire-layer benchmark: batch decoding, and publisher -> subscriber on loopback.

Run:
    .venv/bin/python benchmarks/bench_events.py           # full (about a minute)
    .venv/bin/python benchmarks/bench_events.py --quick   # smoke (a few seconds)

1. Decode throughput of real-shaped batches (fixed seed):
   * vLLM-like: tagged maps, each BlockStored carrying many blocks (one event
     per request chunk) plus per-block BlockRemoved events;
   * TokenSpeed-like: tagged arrays, one block per BlockStored (one per page).
   Reported in batches/s and blocks/s for our typed ``BatchDecoder`` beside
   msgspec's raw untyped decode of the same bytes in the same run: the raw
   decode builds plain lists/dicts and validates nothing, so it is the ceiling
   and the ratio shows what typing and validation cost.
2. Publisher -> subscriber on loopback TCP: a ``ZmqEventPublisher`` in a child
   process, an ``EventSubscriber`` here. Saturated throughput (batches/s) and
   the delivery latency distribution at a fixed rate (publish() call to
   BatchReceived, both on the wall clock of one machine).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from tokenspeed_router.events import (
    BatchDecoder,
    BatchReceived,
    BlockRemoved,
    BlockStored,
    Event,
    EventSubscriber,
    KVEventBatch,
    ZmqEventPublisher,
    encode_batch,
)
from tokenspeed_router.percentiles import percentile

SEED = 1234
BLOCK_SIZE = 16


# ------------------------------------------------------------------ workloads


def vllm_like_batches(num_batches: int, rng: random.Random) -> list[KVEventBatch]:
    """Map form: 4 stores of 32 blocks each (512 tokens) + 8 single-block removals."""
    out = []
    for i in range(num_batches):
        events: list[Event] = []
        parent: int | None = None
        for _ in range(4):
            hashes = [rng.getrandbits(64) for _ in range(32)]
            tokens = [rng.randrange(150_000) for _ in range(32 * BLOCK_SIZE)]
            events.append(BlockStored(hashes, parent, tokens, BLOCK_SIZE, medium="GPU"))
            parent = hashes[-1]
        events.extend(BlockRemoved([rng.getrandbits(64)], medium="GPU") for _ in range(8))
        out.append(KVEventBatch(1.7e9 + i, events, 0))
    return out


def tokenspeed_like_batches(num_batches: int, rng: random.Random) -> list[KVEventBatch]:
    """Array form: 64 one-page BlockStored events, chained."""
    out = []
    for i in range(num_batches):
        events: list[Event] = []
        parent: int | None = None
        for _ in range(64):
            h = rng.getrandbits(64)
            events.append(
                BlockStored([h], parent, [rng.randrange(150_000) for _ in range(BLOCK_SIZE)],
                            BLOCK_SIZE)
            )
            parent = h
        out.append(KVEventBatch(1.7e9 + i, events, 1))
    return out


def blocks_in(batch: KVEventBatch) -> int:
    return sum(
        len(e.block_hashes) for e in batch.events if isinstance(e, (BlockStored, BlockRemoved))
    )


# ------------------------------------------------------------------ decode


@dataclass
class DecodeResult:
    name: str
    wire_format: str
    payload_bytes: float
    blocks_per_batch: float
    ours_batches_s: float
    raw_batches_s: float

    @property
    def ours_blocks_s(self) -> float:
        return self.ours_batches_s * self.blocks_per_batch

    @property
    def raw_blocks_s(self) -> float:
        return self.raw_batches_s * self.blocks_per_batch

    @property
    def ratio(self) -> float:
        return self.ours_batches_s / self.raw_batches_s


def _rate(fn: Any, payloads: list[bytes], min_time_s: float) -> float:
    """Best-of-3 batches/s of ``fn`` over ``payloads`` (repeated to ``min_time_s``)."""
    best = 0.0
    for _ in range(3):
        n = 0
        start = time.perf_counter()
        while True:
            for p in payloads:
                fn(p)
            n += len(payloads)
            elapsed = time.perf_counter() - start
            if elapsed >= min_time_s:
                break
        best = max(best, n / elapsed)
    return best


def bench_decode(quick: bool) -> list[DecodeResult]:
    rng = random.Random(SEED)
    num = 50 if quick else 200
    min_time_s = 0.1 if quick else 0.5
    cases = [
        ("vllm-like", "map", vllm_like_batches(num, rng)),
        ("tokenspeed-like", "array", tokenspeed_like_batches(num, rng)),
    ]
    results = []
    for name, wire_format, batches in cases:
        payloads = [encode_batch(b, wire_format) for b in batches]  # type: ignore[arg-type]
        decoder = BatchDecoder()
        assert [decoder.decode(p) for p in payloads] == batches
        raw = msgspec.msgpack.Decoder()
        results.append(
            DecodeResult(
                name, wire_format,
                payload_bytes=statistics.mean(len(p) for p in payloads),
                blocks_per_batch=statistics.mean(blocks_in(b) for b in batches),
                ours_batches_s=_rate(decoder.decode, payloads, min_time_s),
                raw_batches_s=_rate(raw.decode, payloads, min_time_s),
            )
        )
    return results


# ---------------------------------------------------------- publisher process


def _publisher_main(
    endpoint_q: Any, go: Any, num_batches: int, rate_per_s: float, wire_format: str
) -> None:
    rng = random.Random(SEED)
    template = vllm_like_batches(1, rng)[0] if wire_format == "map" else \
        tokenspeed_like_batches(1, rng)[0]
    with ZmqEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                           wire_format=wire_format, buffer_steps=num_batches + 1000) as pub:
        endpoint_q.put((pub.endpoint, pub.replay_endpoint))
        while not go.wait(0.005):  # probes until the subscriber has seen one
            pub.publish(KVEventBatch(time.time(), []))
        interval = 0.0 if rate_per_s <= 0 else 1.0 / rate_per_s
        next_t = time.perf_counter()
        for _ in range(num_batches):
            if interval:
                next_t += interval
                pause = next_t - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
            pub.publish(KVEventBatch(time.time(), template.events, 0))
        pub.wait_sent(30)


@dataclass
class PubSubResult:
    mode: str
    wire_format: str
    num_batches: int
    batches_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    latency_max_ms: float
    resyncs: int


def bench_pubsub(num_batches: int, rate_per_s: float, wire_format: str) -> PubSubResult:
    ctx = mp.get_context("spawn")
    endpoint_q = ctx.Queue()
    go = ctx.Event()
    proc = ctx.Process(target=_publisher_main,
                       args=(endpoint_q, go, num_batches, rate_per_s, wire_format))
    proc.start()
    endpoint, replay = endpoint_q.get(timeout=60)
    sub = EventSubscriber("bench", endpoint, replay_endpoint=replay)
    latencies: list[float] = []
    first_recv = last_recv = 0.0
    resyncs = 0
    try:
        deadline = time.monotonic() + 60
        while not go.is_set():
            if sub.poll(0.05):
                go.set()
            if time.monotonic() > deadline:
                raise RuntimeError("publisher never reached the subscriber")
        while len(latencies) < num_batches:
            for item in sub.poll(1.0):
                if not isinstance(item, BatchReceived):
                    resyncs += 1
                    continue
                if not item.batch.events:
                    continue  # a probe
                now = time.time()
                if not latencies:
                    first_recv = now
                last_recv = now
                latencies.append(now - item.batch.ts)
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(latencies)}/{num_batches} batches arrived")
    finally:
        sub.close()
        proc.join(60)
    latencies.sort()
    span = max(last_recv - first_recv, 1e-9)
    # Throughput counts the first batch's own latency in the span.
    elapsed = span + latencies[0]

    def pct(q: float) -> float:
        return 1000 * percentile(latencies, 100 * q)

    return PubSubResult(
        "saturated" if rate_per_s <= 0 else f"{rate_per_s:.0f}/s",
        wire_format, num_batches, num_batches / elapsed,
        pct(0.50), pct(0.99), 1000 * latencies[-1], resyncs,
    )


# ------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)

    decode = bench_decode(args.quick)
    print("decode (typed BatchDecoder vs msgspec raw untyped decode of the same bytes)")
    print(f"{'workload':<16} {'form':<6} {'bytes':>7} {'blocks':>6} "
          f"{'batches/s':>11} {'blocks/s':>12} {'raw batches/s':>14} {'raw blocks/s':>13} "
          f"{'ours/raw':>8}")
    for r in decode:
        print(f"{r.name:<16} {r.wire_format:<6} {r.payload_bytes:>7.0f} {r.blocks_per_batch:>6.0f} "
              f"{r.ours_batches_s:>11,.0f} {r.ours_blocks_s:>12,.0f} {r.raw_batches_s:>14,.0f} "
              f"{r.raw_blocks_s:>13,.0f} {r.ratio:>8.2f}")

    n_sat = 2_000 if args.quick else 20_000
    n_paced = 500 if args.quick else 5_000
    pubsub = [
        bench_pubsub(n_sat, 0, "map"),
        bench_pubsub(n_sat, 0, "array"),
        bench_pubsub(n_paced, 1000, "map"),
    ]
    print("\npublisher (child process) -> subscriber on loopback tcp")
    print(f"{'mode':<10} {'form':<6} {'batches':>8} {'batches/s':>10} "
          f"{'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'resyncs':>7}")
    for p in pubsub:
        print(f"{p.mode:<10} {p.wire_format:<6} {p.num_batches:>8} {p.batches_s:>10,.0f} "
              f"{p.latency_p50_ms:>8.2f} {p.latency_p99_ms:>8.2f} {p.latency_max_ms:>8.2f} "
              f"{p.resyncs:>7}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "decode": [dict(vars(r), ours_blocks_s=r.ours_blocks_s,
                                raw_blocks_s=r.raw_blocks_s, ratio=r.ratio) for r in decode],
                "pubsub": [vars(p) for p in pubsub],
                "python": sys.version.split()[0],
                "msgspec": msgspec.__version__,
            }, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
