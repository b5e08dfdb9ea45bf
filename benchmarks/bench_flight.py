"""How fast one replica's in-flight work reaches another: Redis Pub/Sub against Redis Streams.

Run::

    .venv/bin/python benchmarks/bench_flight.py                   # 2,000 messages at 500/s, 3 rounds
    .venv/bin/python benchmarks/bench_flight.py --messages 5000 --rate 1000 --json out.json

Two real ``SharedLoad`` instances (``state/load.py``, their own threads, as in
``serve``) share a real ``redis-server`` on loopback. Replica A's load changes
``--rate`` times a second (a route each: its totals and one route's prefix
hashes, 64 blocks, go out); replica B measures, per message, the time from
A's publish to B having decoded it into its view (both on this host's wall
clock). Changes that come faster than A's publishing thread are coalesced
into one message, as in ``serve``. Each round runs both transports, interleaved; figures are medians
over the rounds with the min-max range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from harness import RedisServer, wait_for

from tokenspeed_router.router.scoring import WorkerLoad
from tokenspeed_router.state.config import RedisStateConfig
from tokenspeed_router.state.load import SharedLoad


class _Load:
    """A replica's own load that changes on every ``step``."""

    def __init__(self, workers: int) -> None:
        self.n = 0
        self.workers = [f"w{i}" for i in range(workers)]

    def step(self) -> None:
        self.n += 1

    def __call__(self) -> dict[str, WorkerLoad]:
        return {w: WorkerLoad(self.n % 7 + i, 1000 * (self.n % 5), 4000) for i, w in enumerate(self.workers)}


def one_round(url: str, transport: str, messages: int, rate: float, run: str) -> dict[str, Any]:
    cfg = {"url": url, "cluster": run, "flight_transport": transport, "load_min_interval_s": 0.0}
    load_a = _Load(8)
    a = SharedLoad(RedisStateConfig(replica_id="a", **cfg), load_a).start()
    b = SharedLoad(RedisStateConfig(replica_id="b", **cfg), _Load(8)).start()
    try:
        wait_for(lambda: b.statistics().peers == 1, 10, "b to see a")
        hashes = list(range(1, 65))
        period = 1.0 / rate
        start = time.perf_counter()
        base = b.statistics().received
        sent_base = a.statistics().syncs
        pause = threading.Event()
        for i in range(messages):
            ahead = start + i * period - time.perf_counter()
            if ahead > 0:
                pause.wait(ahead)  # not a spin: the publishing thread needs the GIL
            load_a.step()
            a.routed(("w0",), hashes)
        wait_for(lambda: a.statistics().syncs > sent_base and not a._dirty.is_set(), 30, "a to publish")
        sent = a.statistics().syncs - sent_base
        wait_for(lambda: b.statistics().received - base >= sent, 30, "b to receive")
        stats = b.statistics()
        return {"transport": transport, "changes": messages, "sent": sent, "received": stats.received - base,
                "p50_ms": stats.lag_p50_ms, "p99_ms": stats.lag_p99_ms,
                "predictions_received": stats.predictions_received}
    finally:
        a.close()
        b.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=500.0, help="load changes per second at replica A")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    redis = RedisServer().start()
    rows: list[dict[str, Any]] = []
    try:
        for r in range(args.rounds):
            for transport in ("pubsub", "streams"):
                row = one_round(redis.url, transport, args.messages, args.rate, f"flight{r}{transport}")
                rows.append(row)
                print(f"# round {r} {transport}: p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms, "
                      f"{row['received']}/{row['sent']} received", flush=True)
    finally:
        redis.close()
    print("| transport | p50 ms (median, min-max) | p99 ms (median, min-max) |")
    print("|---|---|---|")
    summary = {}
    for transport in ("pubsub", "streams"):
        mine = [r for r in rows if r["transport"] == transport]
        p50 = [r["p50_ms"] for r in mine]
        p99 = [r["p99_ms"] for r in mine]
        summary[transport] = {"p50_ms": statistics.median(p50), "p99_ms": statistics.median(p99)}
        print(f"| {transport} | {statistics.median(p50):.2f} ({min(p50):.2f}-{max(p50):.2f}) | "
              f"{statistics.median(p99):.2f} ({min(p99):.2f}-{max(p99):.2f}) |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                         "rows": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
