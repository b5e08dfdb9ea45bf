"""A worker publisher in its own process, driven line by line from stdin (server fault tests).

Run from ``tests/``: ``python -m support.server_publisher --endpoint tcp://127.0.0.1:P [--replay tcp://...]``.
Commands (one per line), each answered with ``ok <seq>`` on stdout:

* ``store SEED NUM_BLOCKS`` — a root chain of NUM_BLOCKS blocks of ``support.server.tokens(SEED, ..)``
* ``extend SEED NUM_BLOCKS MORE`` — MORE blocks chained after the first NUM_BLOCKS of SEED's chain
* ``remove SEED FIRST COUNT`` — remove blocks FIRST..FIRST+COUNT-1 of SEED's chain
* ``clear`` — AllBlocksCleared

It prints ``ready`` once bound; it is killed (SIGKILL) by the tests to simulate a crash.
"""

from __future__ import annotations

import argparse
import sys
import time

from support.server import removed, stored, tokens
from tokenspeed_router.events import AllBlocksCleared, Event, KVEventBatch
from tokenspeed_router.events.publisher import ZmqEventPublisher


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--replay")
    parser.add_argument("--buffer-steps", type=int, default=10_000)
    args = parser.parse_args()
    pub = ZmqEventPublisher(args.endpoint, replay_endpoint=args.replay, buffer_steps=args.buffer_steps)
    print("ready", pub.endpoint, pub.replay_endpoint, flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        cmd, nums = parts[0], [int(x) for x in parts[1:]]
        event: Event
        if cmd == "store":
            event = stored(tokens(nums[0], nums[1]))
        elif cmd == "extend":
            full = tokens(nums[0], nums[1] + nums[2])
            split = nums[1] * 16
            event = stored(full[split:], parent_tokens=full[:split])
        elif cmd == "remove":
            event = removed(tokens(nums[0], nums[1] + nums[2]), nums[1], nums[2])
        elif cmd == "clear":
            event = AllBlocksCleared()
        else:
            print(f"error unknown command {cmd}", flush=True)
            continue
        seq = pub.publish(KVEventBatch(time.time(), [event]))
        pub.wait_sent(5.0)
        print(f"ok {seq}", flush=True)
    pub.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
