"""Two router replicas sharing state through Redis; kill the leader, the other takes over.

Run:  .venv/bin/python examples/redis_replicas.py [redis://127.0.0.1:6379/0]

Without a URL it starts a throw-away ``redis-server`` on a free port (needs the
binary on PATH). It launches two ``tokenspeed-router serve --state URL``
processes for one worker, publishes KV events, shows that both answer
``/match`` identically, SIGKILLs the leader and shows the survivor taking the
lease and catching up with the events published meanwhile (through the
worker's replay ring). Uses cluster ``example`` (keys ``tsr:{example}:*``).
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
                               "--state", f"{url}?cluster=example&lease_ttl_s=2&replica_id=r{i}"])
             for i, p in enumerate(ports)]
    try:
        wait(lambda: all(health(p) for p in ports))
        leaders = wait(lambda: [i for i, p in enumerate(ports)
                                if (health(p) or {})["state"]["role"] == "leader"])
        leader = leaders[0]
        print(f"replica r{leader} holds the lease")

        def publish(blocks: int) -> None:
            hashes: list[BlockHash] = list(range(1, blocks + 1))
            pub.publish(KVEventBatch(time.time(), [BlockStored(
                block_hashes=hashes, parent_block_hash=None, token_ids=PROMPT[: 16 * blocks],
                block_size=16)]))

        def scores(port: int) -> dict[str, int]:
            r = httpx.post(f"http://127.0.0.1:{port}/match", json={"token_ids": PROMPT}, timeout=2)
            return dict(r.json()["scores"])

        def published_and_seen() -> bool:  # republished until the leader's subscription is up (slow joiner)
            publish(2)
            return all(scores(p).get("w0") == 2 for p in ports)

        wait(published_and_seen)
        print("both replicas:", [scores(p) for p in ports])

        procs[leader].send_signal(signal.SIGKILL)
        procs[leader].wait()
        survivor = ports[1 - leader]
        publish(4)  # published while nobody leads: the replay ring keeps it
        wait(lambda: (health(survivor) or {})["state"]["role"] == "leader")
        wait(lambda: scores(survivor).get("w0") == 4)
        state = (health(survivor) or {})["state"]
        print(f"after SIGKILL: r{1 - leader} leads (fence {state['fence']}),", scores(survivor))
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
