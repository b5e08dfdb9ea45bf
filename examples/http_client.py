"""Route requests over the router's HTTP API, end to end on loopback, in a few seconds.

Run:  .venv/bin/python examples/http_client.py

Starts two workers' KV-event publishers (plain ``ZmqEventPublisher`` s fed with
hand-made ``BlockStored`` events: a real engine or ``examples/worker_publisher.py``
would publish these), a ``tokenspeed-router serve`` subprocess following them,
then asks ``/match`` and ``/route`` with :class:`HttpRouterClient`.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.events import BlockHash, BlockStored, KVEventBatch
from tokenspeed_router.events.publisher import ZmqEventPublisher
from tokenspeed_router.hashing import block_hashes
from tokenspeed_router.server import HttpRouterClient

BLOCK = 16


def store(pub: ZmqEventPublisher, token_ids: list[int]) -> None:
    """Tell the router this worker now caches ``token_ids`` (full blocks, from the root)."""
    hashes: list[BlockHash] = list(block_hashes(token_ids, BLOCK))
    pub.publish(KVEventBatch(time.time(), [BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=token_ids, block_size=BLOCK)]))


def main() -> int:
    system_prompt = list(range(1000, 1064))  # 4 blocks shared by every chat
    chat_a = system_prompt + list(range(2000, 2064))
    chat_b = system_prompt + list(range(3000, 3032))
    workers = [ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*") for _ in range(2)]
    port = free_tcp_port()
    cmd = [sys.executable, "-m", "tokenspeed_router.cli", "--log-level", "WARNING", "serve",
           "--http", f"127.0.0.1:{port}"]
    for i, pub in enumerate(workers):
        cmd += ["--worker", f"name=gpu{i},events={pub.endpoint},replay={pub.replay_endpoint}"]
    router = subprocess.Popen(cmd)
    try:
        with HttpRouterClient(f"http://127.0.0.1:{port}") as client:
            client.wait_ready()
            store(workers[0], chat_a)
            store(workers[1], chat_b)
            while client.match(chat_a)["scores"].get("gpu0") != 8:  # events arrive in ~1 ms
                threading.Event().wait(0.01)
            print("match chat_a  ->", client.match([*chat_a, 1, 2, 3]))
            for name, prompt in (("chat_a", chat_a + [7] * 20), ("chat_b", chat_b + [9] * 20),
                                 ("new chat", system_prompt + [5] * 40)):
                decision = client.route(prompt, request_id=f"req-{name}")
                print(f"route {name:<8} -> {decision['worker']} "
                      f"(cached {decision['matched_tokens']} of {len(prompt)} tokens)")
                client.release(decision["request_id"])
            print("workers       ->", {n: (w["state"], w["blocks"]) for n, w in client.workers().items()})
    finally:
        router.terminate()
        router.wait(10)
        for pub in workers:
            pub.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
