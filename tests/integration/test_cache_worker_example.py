"""examples/worker_publisher.py end to end: a router-side subscriber rebuilds its cache."""

from __future__ import annotations

import json
import subprocess
import sys

from support import REPO_ROOT, wait_until
from support.cache_reference import EventFolder

from tokenspeed_router.events import BatchReceived, EventSubscriber
from tokenspeed_router.router import KvIndex


def test_worker_example_stream_rebuilds_the_cache() -> None:
    cmd = [
        sys.executable,
        str(REPO_ROOT / "examples" / "worker_publisher.py"),
        "--events", "tcp://127.0.0.1:*",
        "--replay", "tcp://127.0.0.1:*",
        "--requests", "150",
        "--pages", "512",
        "--linger-s", "30",
    ]  # fmt: skip
    items = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            endpoints = json.loads(proc.stdout.readline())
            summary = json.loads(proc.stdout.readline())
            assert summary["evicted_tokens"] > 0 and summary["hit_tokens"] > 0
            # Everything was published before we connected: replay it all from seq 0.
            with EventSubscriber(
                "w0", endpoints["events"], replay_endpoint=endpoints["replay"], start_seq=0
            ) as sub:

                def caught_up() -> bool:
                    items.extend(sub.poll(0.05))
                    return sub.last_seq == summary["last_seq"]

                wait_until(caught_up, timeout_s=20, what="the worker's last batch")
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    batches = [x for x in items if isinstance(x, BatchReceived)]
    assert [b.seq for b in batches] == list(range(summary["last_seq"] + 1))
    folder = EventFolder(16)
    index = KvIndex()
    for b in batches:
        folder.apply(b.batch.events)
        index.apply("w0", b.batch)
    assert len(folder.blocks) * 16 == summary["cached_tokens"]
    folder.check_content_hashes()
    assert index.num_blocks("w0") * 16 == summary["cached_tokens"]
