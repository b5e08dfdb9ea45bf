"""Publish a few KV event batches and receive them in order, on loopback.

Run:
    .venv/bin/python examples/event_roundtrip.py

A worker-side ZmqEventPublisher binds OS-chosen ports (PUB + replay ROUTER);
a router-side EventSubscriber connects to both. ZeroMQ drops whatever a PUB
sends before the SUB connection is up (the "slow joiner"), so the subscriber
asks the publisher's replay ring for seq 0 onwards the first time it sees a
later seq: every batch arrives exactly once, in order, whatever the timing.
"""

from __future__ import annotations

import time

from tokenspeed_router.events import (
    AllBlocksCleared,
    BatchReceived,
    BlockRemoved,
    BlockStored,
    EventSubscriber,
    ZmqEventPublisher,
)

BLOCK_SIZE = 4
EVENTS = [
    [BlockStored([101, 102], None, [1, 2, 3, 4, 5, 6, 7, 8], BLOCK_SIZE, medium="GPU")],
    [BlockStored([103], 102, [9, 10, 11, 12], BLOCK_SIZE)],
    [BlockStored([201], None, [7, 7, 7], BLOCK_SIZE)],  # a partial tail block
    [BlockRemoved([103])],
    [AllBlocksCleared()],
]


def main() -> int:
    with ZmqEventPublisher(
        "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", topic="kv"
    ) as publisher:
        print(f"publisher: events on {publisher.endpoint}, replay on {publisher.replay_endpoint}")
        with EventSubscriber(
            "worker-0", publisher.endpoint,
            replay_endpoint=publisher.replay_endpoint, topic="kv",
        ) as subscriber:
            for events in EVENTS:
                seq = publisher.publish_events(events)
                print(f"published seq={seq}: {[type(e).__name__ for e in events]}")
            received: list[BatchReceived] = []
            deadline = time.monotonic() + 10
            while len(received) < len(EVENTS) and time.monotonic() < deadline:
                for item in subscriber.poll(timeout_s=0.1):
                    if isinstance(item, BatchReceived):
                        received.append(item)
                        how = "replay" if item.replayed else "live"
                        print(f"received  seq={item.seq} ({how}): {item.batch.events}")
                    else:
                        print(f"received  {item}")
            if [r.seq for r in received] != list(range(len(EVENTS))):
                print("did not receive every batch in order")
                return 1
            print(f"subscriber statistics: {subscriber.statistics()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
