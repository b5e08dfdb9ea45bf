"""Record a router's event stream while it serves, then rebuild the index offline and compare.

Run:  .venv/bin/python examples/record_and_replay.py

``serve --record`` writes every message it receives to an event log;
``replay LOG --queries Q.jsonl`` rebuilds the index from it and answers each
query as ``POST /match`` would. The answers equal what the live router said
when recording stopped. ``inspect LOG`` summarises the log.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.events import BlockHash, BlockRemoved, BlockStored, Event, KVEventBatch
from tokenspeed_router.events.publisher import ZmqEventPublisher
from tokenspeed_router.hashing import block_hashes
from tokenspeed_router.server import HttpRouterClient

BLOCK = 16
CLI = [sys.executable, "-m", "tokenspeed_router.cli", "--log-level", "WARNING"]


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="tokenspeed-example-"))
    log = tmp / "events.tslog"
    rng = random.Random(0)
    pubs = [ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*") for _ in range(2)]
    port = free_tcp_port()
    cmd = [*CLI, "serve", "--http", f"127.0.0.1:{port}", "--record", str(log)]
    for i, pub in enumerate(pubs):
        cmd += ["--worker", f"name=w{i},events={pub.endpoint},replay={pub.replay_endpoint}"]
    router = subprocess.Popen(cmd)
    prompts = []
    try:
        with HttpRouterClient(f"http://127.0.0.1:{port}") as client:
            client.wait_ready()
            for step in range(40):  # some caching and some evicting
                pub = pubs[step % 2]
                toks = [rng.randrange(50_000) for _ in range(rng.randint(1, 6) * BLOCK)]
                hashes: list[BlockHash] = list(block_hashes(toks, BLOCK))
                events: list[Event] = [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=toks,
                                            block_size=BLOCK)]
                if step % 5 == 4:
                    events.append(BlockRemoved(block_hashes=hashes[-1:]))
                pub.publish(KVEventBatch(time.time(), events))
                prompts.append(toks)
            want = {f"w{i}": p.statistics().published - 1 for i, p in enumerate(pubs)}
            while any(client.workers()[w]["last_seq"] != s for w, s in want.items()):
                threading.Event().wait(0.01)
            live = [client.match(p) for p in prompts]
    finally:
        router.terminate()  # SIGTERM: the log is flushed and closed
        router.wait(10)
        for pub in pubs:
            pub.close()
    queries = tmp / "queries.jsonl"
    queries.write_text("".join(json.dumps({"token_ids": p}) + "\n" for p in prompts))
    out = subprocess.run([*CLI, "replay", str(log), "--queries", str(queries), "--no-progress"],
                         capture_output=True, text=True, check=True)
    replayed = [json.loads(line) for line in out.stdout.splitlines()]
    print(f"{len(live)} queries: replay answers {'==' if replayed == live else '!='} live answers")
    print(subprocess.run([*CLI, "inspect", str(log)], capture_output=True, text=True, check=True).stdout)
    return 0 if replayed == live else 1


if __name__ == "__main__":
    sys.exit(main())
