"""Route requests over the router's ZeroMQ API (msgpack request/reply), end to end on loopback.

Run:  .venv/bin/python examples/zmq_client.py

Same setup as ``http_client.py`` with ``serve --zmq-api`` and an auth token:
the ZMQ API is the low-latency path for a gateway that routes every request.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.events import BlockHash, BlockStored, KVEventBatch
from tokenspeed_router.events.publisher import ZmqEventPublisher
from tokenspeed_router.hashing import block_hashes
from tokenspeed_router.server import HttpRouterClient, ZmqRouterClient

BLOCK = 16
TOKEN = "example-token"


def main() -> int:
    docs = {i: list(range(10_000 * (i + 1), 10_000 * (i + 1) + 8 * BLOCK)) for i in range(3)}
    workers = [ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*") for _ in range(3)]
    http_port, zmq_api = free_tcp_port(), f"tcp://127.0.0.1:{free_tcp_port()}"
    cmd = [sys.executable, "-m", "tokenspeed_router.cli", "--log-level", "WARNING", "serve",
           "--http", f"127.0.0.1:{http_port}", "--zmq-api", zmq_api]
    for i, pub in enumerate(workers):
        cmd += ["--worker", f"name=w{i},events={pub.endpoint},replay={pub.replay_endpoint}"]
    router = subprocess.Popen(cmd, env={**os.environ, "TOKENSPEED_ROUTER_AUTH_TOKEN": TOKEN})
    try:
        with HttpRouterClient(f"http://127.0.0.1:{http_port}", auth_token=TOKEN) as http:
            http.wait_ready()
        for i, pub in enumerate(workers):  # worker i caches document i
            pub.publish(KVEventBatch(time.time(), [BlockStored(
                block_hashes=list[BlockHash](block_hashes(docs[i], BLOCK)), parent_block_hash=None,
                token_ids=docs[i], block_size=BLOCK)]))
        with ZmqRouterClient(zmq_api, auth_token=TOKEN, timeout_s=5) as client:
            # every worker's events applied (each stream is its own; one arriving says nothing of the others)
            while any(client.match(doc)["scores"].get(f"w{i}") != len(doc) // BLOCK for i, doc in docs.items()):
                threading.Event().wait(0.01)
            n = 1000
            t0 = time.perf_counter()
            chosen = []
            for k in range(n):
                doc = docs[k % 3]
                d = client.route([*doc, k], request_id=f"q{k}")
                chosen.append(d["worker"] == f"w{k % 3}")
                client.release(d["request_id"])
            elapsed = time.perf_counter() - t0
            print(f"{n} route+release round trips in {elapsed:.2f}s "
                  f"({2 * n / elapsed:.0f} calls/s on one synchronous client)")
            print(f"requests sent to the worker caching their document: {sum(chosen)}/{n}")
            print("workers:", {name: w["blocks"] for name, w in client.workers().items()})
    finally:
        router.terminate()
        router.wait(10)
        for pub in workers:
            pub.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
