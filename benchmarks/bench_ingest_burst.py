"""The ingestion threads' own CPU per batch in a burst: ``RouterService`` following 8 publishers.

Run::

    .venv/bin/python benchmarks/bench_ingest_burst.py [--batches 6000]
    PYTHONPATH=/tmp/ab-main .venv/bin/python benchmarks/bench_ingest_burst.py   # another checkout

The router runs in this process (its ingestion thread(s) on loopback TCP
from ``bench_server.py``'s eight vLLM-shaped publishers); this thread
publishes ``--batches`` churn batches (32 stored + 32 removed blocks) as fast
as it can, and the figure is the CPU of the threads named ``tokenspeed-*``
(``/proc/self/task``) over that burst, per batch: the cost of the receive,
check, sequence and apply path in passes as big as a backlog makes them,
without the wake-ups of a steady rate (``bench_server.py --only cpu``).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import bench_server  # beside this file: the streamer and its batches

from tokenspeed_router.server import RouterService, ServerConfig, WorkerSpec


def _thread_cpu_s() -> dict[str, float]:
    """CPU seconds so far of each ``tokenspeed-*`` thread of this process, by name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for t in threading.enumerate():
        if t.name.startswith("tokenspeed-") and t.native_id is not None:
            fields = Path(f"/proc/self/task/{t.native_id}/stat").read_text().rsplit(")", 1)[1].split()
            out[t.name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=6000)
    args = parser.parse_args()
    streamer = bench_server.Streamer(8)
    workers = tuple(WorkerSpec(name=f"w{w}", events=p.endpoint, replay=p.replay_endpoint)
                    for w, p in enumerate(streamer.pubs))
    service = RouterService(ServerConfig(http=None, workers=workers))
    service.start()
    try:
        streamer.preload()

        def applied() -> int:
            return sum(int(w["batches_applied"]) for w in service.workers().values())

        deadline = time.monotonic() + 60
        want = sum(p.statistics().published for p in streamer.pubs)
        while applied() < want and time.monotonic() < deadline:
            threading.Event().wait(0.05)
        start, cpu0 = applied(), _thread_cpu_s()
        for i in range(args.batches):
            streamer._churn(i % 8, streamer.pubs[i % 8])
        while applied() < start + args.batches and time.monotonic() < deadline + 120:
            threading.Event().wait(0.01)
        cpu1 = _thread_cpu_s()
        per = {name: (cpu1[name] - cpu0.get(name, 0.0)) / args.batches * 1e6 for name in cpu1}
        shown = ", ".join(f"{name} {us:.1f}" for name, us in sorted(per.items()) if us > 0.05)
        print(f"{args.batches} batches in a burst: {sum(per.values()):.1f} µs a batch ({shown})")
    finally:
        service.stop()
        streamer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
