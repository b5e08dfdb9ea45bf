"""A two-pool (disaggregated) setup: prefill workers and a data-parallel decode worker.

Run:  .venv/bin/python examples/prefill_decode.py

The router is configured from a TOML file (``serve --config``): two prefill
workers, and one decode worker with ``dp_ranks = 2`` whose ranks publish on
port + rank (``decode/dp0``, ``decode/dp1``). ``/route`` then answers with a
``decode_worker`` and, when the decode worker would have to prefill too much
itself, a ``prefill_worker`` that computes the prompt's KV first.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.events import BlockHash, BlockStored, KVEventBatch
from tokenspeed_router.events.publisher import ZmqEventPublisher
from tokenspeed_router.hashing import block_hashes
from tokenspeed_router.server import HttpRouterClient

BLOCK = 16


def store(pub: ZmqEventPublisher, toks: list[int]) -> None:
    pub.publish(KVEventBatch(time.time(), [BlockStored(
        block_hashes=list[BlockHash](block_hashes(toks, BLOCK)), parent_block_hash=None, token_ids=toks, block_size=BLOCK)]))


def main() -> int:
    prefill = [ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*") for _ in range(2)]
    ev = free_tcp_port(consecutive=2)  # a dp_ranks=2 worker publishes on P and P+1
    rp = free_tcp_port(consecutive=2, avoid=(ev,))
    decode = [ZmqEventPublisher(f"tcp://127.0.0.1:{ev}", replay_endpoint=f"tcp://127.0.0.1:{rp}", dp_rank=r)
              for r in range(2)]
    http = free_tcp_port(avoid=(ev, ev + 1, rp, rp + 1))
    config = Path(tempfile.mkdtemp(prefix="tokenspeed-pd-")) / "router.toml"
    config.write_text(f"""
http = "127.0.0.1:{http}"
policy = "kv_aware"

[router]
local_prefill_threshold_tokens = 256   # decode prefills locally when it misses at most this much

[[workers]]
name = "prefill0"
events = "{prefill[0].endpoint}"
replay = "{prefill[0].replay_endpoint}"
role = "prefill"

[[workers]]
name = "prefill1"
events = "{prefill[1].endpoint}"
replay = "{prefill[1].replay_endpoint}"
role = "prefill"

[[workers]]
name = "decode"
events = "tcp://127.0.0.1:{ev}"
replay = "tcp://127.0.0.1:{rp}"
role = "decode"
dp_ranks = 2
""")
    router = subprocess.Popen([sys.executable, "-m", "tokenspeed_router.cli", "--log-level", "WARNING",
                               "serve", "--config", str(config)])
    try:
        with HttpRouterClient(f"http://127.0.0.1:{http}") as client:
            client.wait_ready()
            print("workers:", {n: w["role"] for n, w in client.workers().items()})
            doc = list(range(5000, 5000 + 64 * BLOCK))  # a 1,024-token document
            store(prefill[1], doc)  # prefill1 computed it before
            store(decode[1], doc[: 4 * BLOCK])  # decode/dp1 holds its first 64 tokens
            # Two publishers, two event streams: wait until the router has applied
            # both, or the route below could run before decode/dp1's blocks arrive
            # (then both decode ranks score 0 and the tie-break picks either).
            want = {"prefill1": 64, "decode/dp1": 4}
            while any(client.match(doc)["scores"].get(w) != n for w, n in want.items()):
                threading.Event().wait(0.01)
            long_turn = client.route(doc + [1] * 100, request_id="long")
            print(f"long prompt : prefill on {long_turn['prefill_worker']}, decode on "
                  f"{long_turn['decode_worker']} (worker={long_turn['worker']})")
            short = client.route(doc[: 4 * BLOCK] + [2] * 50, request_id="short")
            print(f"short prompt: prefill on {short['prefill_worker'] or short['decode_worker'] + ' (local)'}, "
                  f"decode on {short['decode_worker']}")
            for rid in ("long", "short"):
                client.release(rid)
    finally:
        router.terminate()
        router.wait(10)
        for pub in [*prefill, *decode]:
            pub.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
