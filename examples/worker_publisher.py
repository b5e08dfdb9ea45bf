"""A worker: a PrefixCache serving synthetic requests, publishing its KV events over ZeroMQ.

Run (then point a router at it, e.g. ``tokenspeed-router serve --worker
name=w0,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558``):

    .venv/bin/python examples/worker_publisher.py \\
        --events tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558 --requests 500

It binds a ZmqEventPublisher, serves ``--requests`` synthetic requests (a few
shared system prompts plus unique user turns, fixed seed) through
``PrefixCache.admit`` on a cache of ``--pages`` pages, so it evicts once full,
and publishes one event batch per request. Port 0 lets the OS choose; the
first stdout line is JSON with the resolved endpoints, the second a JSON
summary (including ``last_seq``) once the workload is done. It then keeps the
publisher open ``--linger-s`` seconds so late subscribers can replay what they
missed, and exits.
"""

from __future__ import annotations

import argparse
import json
import random
import threading

from tokenspeed_router.cache import PrefixCache
from tokenspeed_router.events.publisher import ZmqEventPublisher


def synthetic_requests(num_requests: int, seed: int, vocab: int = 32_000) -> list[list[int]]:
    """Requests sharing a handful of system prompts (the traffic a KV-aware router exploits)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(rng.randint(64, 512))] for _ in range(8)]
    return [
        rng.choice(systems) + [rng.randrange(vocab) for _ in range(rng.randint(16, 256))]
        for _ in range(num_requests)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", default="tcp://127.0.0.1:5557", help="PUB endpoint to bind")
    parser.add_argument("--replay", default=None, help="replay ROUTER endpoint to bind (optional)")
    parser.add_argument("--requests", type=int, default=200, help="synthetic requests to serve")
    parser.add_argument("--pages", type=int, default=2048, help="KV pages in the cache")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--policy", default="lru", help="eviction policy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dp-rank", type=int, default=0, help="data-parallel rank (port offset)")
    parser.add_argument("--wire-format", choices=["map", "array"], default="map")
    parser.add_argument("--interval-s", type=float, default=0.0, help="pause between requests")
    parser.add_argument("--linger-s", type=float, default=2.0, help="stay up for replays after the run")
    args = parser.parse_args(argv)

    cache = PrefixCache.with_capacity(args.pages, page_size=args.page_size, eviction_policy=args.policy)
    pause = threading.Event()  # never set: a wait() that nothing interrupts
    with ZmqEventPublisher(
        args.events,
        replay_endpoint=args.replay,
        dp_rank=args.dp_rank,
        wire_format=args.wire_format,
    ) as publisher:
        print(json.dumps({"events": publisher.endpoint, "replay": publisher.replay_endpoint}), flush=True)
        sink = cache.attach_publisher(publisher)  # one batch per admit; AllBlocksCleared first
        requests = synthetic_requests(args.requests, args.seed)
        hit_tokens = 0
        for tokens in requests:
            hit_tokens += cache.admit(tokens)
            if args.interval_s > 0:
                pause.wait(args.interval_s)
        cache.flush_events()
        stats = cache.statistics()
        summary = {
            "requests": len(requests),
            "tokens": sum(map(len, requests)),
            "hit_tokens": hit_tokens,
            "cached_tokens": stats.cached_tokens,
            "evicted_tokens": stats.evicted_tokens,
            "events": sink.num_events,
            "batches": sink.num_batches,
            "last_seq": sink.num_batches - 1,
        }
        print(json.dumps(summary), flush=True)
        pause.wait(args.linger_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
