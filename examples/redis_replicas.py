"""Two active-active router replicas sharing in-flight work through Redis; kill one.

Run:  .venv/bin/python examples/redis_replicas.py [redis://127.0.0.1:6379/0]

Without a URL it starts a throw-away ``redis-server`` on a free port (needs the
binary on PATH). It launches two ``tokenspeed-router serve --state URL``
processes for one worker (the recommended set-up: each subscribes to the
worker itself, ``ingest=direct``), publishes KV events, shows that both answer
``/match`` identically, routes a request through one and shows the other
counting it as a peer's in-flight work, then SIGKILLs the first: the survivor
keeps following the worker on its own and the dead replica's work expires
(``load_ttl_s``). Uses cluster ``example`` (Pub/Sub channel ``tsr:{example}:flight``).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.events import BlockHash, BlockStored, KVEventBatch
from tokenspeed_router.events.publisher import ZmqEventPublisher

CLI = [sys.executable, "-m", "tokenspeed_router.cli", "--log-level", "WARNING"]
PROMPT = list(range(100, 164))  # 4 blocks of 16
T = TypeVar("T")


def wait(pred: Callable[[], T], timeout_s: float = 30.0) -> T:
    deadline, pause = time.monotonic() + timeout_s, threading.Event()
    while not (value := pred()):
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        pause.wait(0.05)
    return value


def health(port: int) -> dict[str, Any] | None:
    try:
        return dict(httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json())
    except httpx.HTTPError:
        return None


def main() -> None:
    redis_proc = None
    if len(sys.argv) > 1:
        url = sys.argv[1]
    else:
        port = free_tcp_port()
        redis_proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port",
                                       str(port), "--save", "", "--appendonly", "no"],
                                      stdout=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
    pub = ZmqEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    worker = f"name=w0,events={pub.endpoint},replay={pub.replay_endpoint}"
    ports = [free_tcp_port(), free_tcp_port()]
    procs = [subprocess.Popen([*CLI, "serve", "--worker", worker, "--http", f"127.0.0.1:{p}",
                               "--state", f"{url}?cluster=example&load_ttl_s=1&replica_id=r{i}"])
             for i, p in enumerate(ports)]
    try:
        wait(lambda: all(health(p) for p in ports))
        print("ingestion:", [(health(p) or {})["state"]["ingest"] for p in ports])

        def publish(blocks: int) -> None:
            hashes: list[BlockHash] = list(range(1, blocks + 1))
            pub.publish(KVEventBatch(time.time(), [BlockStored(
                block_hashes=hashes, parent_block_hash=None, token_ids=PROMPT[: 16 * blocks],
                block_size=16)]))

        def scores(port: int) -> dict[str, int]:
            r = httpx.post(f"http://127.0.0.1:{port}/match", json={"token_ids": PROMPT}, timeout=2)
            return dict(r.json()["scores"])

        def peers_in_flight(port: int) -> int:
            workers = httpx.get(f"http://127.0.0.1:{port}/workers", timeout=2).json()
            return sum(w["in_flight_peers"] for w in workers.values())

        def published_and_seen() -> bool:  # republished until both subscriptions are up (slow joiner)
            publish(2)
            return all(scores(p).get("w0") == 2 for p in ports)

        wait(published_and_seen)
        print("both replicas:", [scores(p) for p in ports])

        httpx.post(f"http://127.0.0.1:{ports[0]}/route", json={"token_ids": PROMPT, "request_id": "q0"},
                   timeout=2)
        wait(lambda: peers_in_flight(ports[1]) == 1)
        print("r1 sees r0's request (in_flight_peers 1)")

        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        publish(4)  # the survivor ingests on its own: nothing to take over
        wait(lambda: scores(ports[1]).get("w0") == 4)
        wait(lambda: peers_in_flight(ports[1]) == 0)
        print(f"after SIGKILL of r0: r1 answers {scores(ports[1])}, r0's request expired")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(10)
        pub.close()
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)


if __name__ == "__main__":
    main()
