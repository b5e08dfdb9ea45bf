"""Memory soak: tens of millions of store/remove events through a real ``serve``.

Run::

    .venv/bin/python benchmarks/soak.py --events 2000000          # a couple of minutes
    .venv/bin/python benchmarks/soak.py                           # 20 M events (the long run)
    .venv/bin/python benchmarks/soak.py --events 500000 --json out.json

What it does: ``--workers`` real ``ZmqEventPublisher`` s on loopback (this
process) feed one ``tokenspeed-router serve`` subprocess. Each worker keeps a
bounded live set of ``--live`` conversations: every step stores a new
conversation (a root event and a child event chained under it, fresh token ids
and fresh block ids every time, so a leak keyed on anything new shows) and
evicts the oldest one (child first, as engines evict leaves). After the live
set fills, the index size is constant; so should the router's memory be.

The publisher stays at most ``--window`` batches ahead of what the router has
applied (it polls ``GET /workers``), so nothing is lost to high-water marks
and the run measures memory, not drops. A sampler thread reads the serve
process's resident set size (``/proc/PID/status``) every ``--sample-s``.

Figures: events applied, events/s, blocks held (must be constant), RSS at the
end of warm-up (``--warmup`` fraction of the events, default 20 %), RSS at the
end, max after warm-up, growth % (end vs warm-up; target: within 10 %) and
the RSS slope after warm-up in MB/hour (dynamo#10774 grew ~20 GB/h), and the
growth over the second half of the events (a leak keeps growing there; an
allocator settling after warm-up does not).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import Serve, rss_bytes, wait_for

from tokenspeed_router.events import BlockRemoved, BlockStored, KVEventBatch
from tokenspeed_router.events.publisher import ZmqEventPublisher

BLOCK = 16


@dataclass
class Sample:
    t_s: float
    events: int
    rss: int


@dataclass
class WorkerFeed:
    """One worker's bounded live set of two-event conversations."""

    index: int
    blocks_per_event: int
    live: int
    next_conv: int = 0
    convs: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (root ids, child ids)

    def step(self) -> list[Any]:
        """Store one new conversation and, once full, evict the oldest: 2 or 4 events."""
        c = self.next_conv
        self.next_conv += 1
        n = self.blocks_per_event
        base = (self.index << 40) | (c * 2 * n)
        root_ids = list(range(base, base + n))
        child_ids = list(range(base + n, base + 2 * n))
        tok = (c * 2 * n * BLOCK) % 2_000_000_000
        events: list[Any] = [
            BlockStored(block_hashes=root_ids, parent_block_hash=None,
                        token_ids=list(range(tok, tok + n * BLOCK)), block_size=BLOCK),
            BlockStored(block_hashes=child_ids, parent_block_hash=root_ids[-1],
                        token_ids=list(range(tok + n * BLOCK, tok + 2 * n * BLOCK)), block_size=BLOCK),
        ]
        self.convs.append((root_ids, child_ids))
        if len(self.convs) > self.live:
            old_root, old_child = self.convs.pop(0)
            events.append(BlockRemoved(block_hashes=old_child))
            events.append(BlockRemoved(block_hashes=old_root))
        return events


def _router_view(serve: Serve) -> tuple[dict[str, int | None], int, int]:
    """Per worker last seq applied, total events applied, total blocks held."""
    ws = serve.get("/workers")
    seqs = {name: w["last_seq"] for name, w in ws.items()}
    return seqs, sum(w["events_applied"] for w in ws.values()), sum(w["blocks"] for w in ws.values())


def run(args: argparse.Namespace) -> dict[str, Any]:
    feeds = [WorkerFeed(i, args.blocks_per_event, args.live) for i in range(args.workers)]
    pubs = [ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                              buffer_steps=max(10_000, 4 * args.window), hwm=1_000_000)
            for _ in feeds]
    workdir = Path(tempfile.mkdtemp(prefix="soak-"))
    spec = [a for i, p in enumerate(pubs)
            for a in ("--worker", f"name=w{i},events={p.endpoint},replay={p.replay_endpoint}")]
    serve = Serve(spec, log_dir=workdir).start()
    samples: list[Sample] = []
    applied = [0]
    stop = threading.Event()

    def sampler() -> None:
        t0 = time.monotonic()
        next_report = 30.0
        while not stop.is_set():
            s = Sample(time.monotonic() - t0, applied[0], rss_bytes(serve.pid))
            samples.append(s)
            if s.t_s >= next_report:  # progress for long runs
                next_report += 30.0
                print(f"# {s.t_s:.0f}s: {s.events:,} events applied, RSS {s.rss / 2**20:.1f} MB",
                      file=sys.stderr, flush=True)
            stop.wait(args.sample_s)

    thread = threading.Thread(target=sampler, name="rss-sampler", daemon=True)
    published_events = 0
    steps_per_batch = max(1, args.events_per_batch // 4)
    t0 = time.perf_counter()
    try:
        thread.start()
        last_poll = 0.0
        since_poll = 0
        ahead_ok = True
        pause = threading.Event()
        while published_events < args.events:
            if ahead_ok:
                for feed, pub in zip(feeds, pubs, strict=True):
                    events: list[Any] = []
                    for _ in range(steps_per_batch):
                        events.extend(feed.step())
                    pub.publish(KVEventBatch(time.time(), events))
                    published_events += len(events)
                since_poll += 1
            now = time.perf_counter()
            if not ahead_ok or now - last_poll > 0.05 or since_poll >= args.window // 2:
                since_poll = 0
                seqs, applied[0], _blocks = _router_view(serve)
                last_poll = now
                behind = max(p.statistics().next_seq - 1 - (seqs.get(f"w{i}") or -1)
                             for i, p in enumerate(pubs))
                ahead_ok = behind < args.window
                if not ahead_ok:
                    pause.wait(0.005)
        want = {f"w{i}": p.statistics().next_seq - 1 for i, p in enumerate(pubs)}

        def caught_up() -> bool:
            seqs, applied[0], _ = _router_view(serve)
            return all(seqs.get(n) == s for n, s in want.items())

        wait_for(caught_up, 600, "the router to apply every batch", interval_s=0.05)
        elapsed = time.perf_counter() - t0
        seqs, total_applied, blocks = _router_view(serve)
        applied[0] = total_applied
        samples.append(Sample(samples[-1].t_s if samples else 0.0, total_applied, rss_bytes(serve.pid)))
        workers = serve.get("/workers")
        rejected = sum(w["events_rejected"] for w in workers.values())
        resyncs = sum(w["resyncs"] for w in workers.values())
        gaps = sum(w["gaps"] for w in workers.values())
        alive = serve.alive()
    finally:
        stop.set()
        thread.join(5)
        serve.close()
        for p in pubs:
            p.close()
    return summarise(args, samples, total_applied, published_events, elapsed, blocks,
                     rejected=rejected, resyncs=resyncs, gaps=gaps, alive=alive)


def summarise(args: argparse.Namespace, samples: list[Sample], applied: int, published: int,
              elapsed_s: float, blocks: int, **extra: Any) -> dict[str, Any]:
    warm_events = args.warmup * applied
    after = [s for s in samples if s.events >= warm_events and s.rss]
    warm = after[0] if after else samples[-1]
    end = samples[-1]
    peak = max((s.rss for s in after), default=end.rss)
    slope = 0.0
    if len(after) >= 3 and after[-1].t_s > after[0].t_s:
        n = len(after)
        mt = sum(s.t_s for s in after) / n
        mr = sum(s.rss for s in after) / n
        var = sum((s.t_s - mt) ** 2 for s in after)
        slope = sum((s.t_s - mt) * (s.rss - mr) for s in after) / var if var else 0.0
    half = next((s for s in samples if s.events >= applied / 2 and s.rss), end)
    mb = 1024 * 1024
    return {
        "events_published": published,
        "events_applied": applied,
        "elapsed_s": round(elapsed_s, 1),
        "events_per_s": round(applied / elapsed_s) if elapsed_s else 0,
        "workers": args.workers,
        "live_conversations_per_worker": args.live,
        "blocks_held_end": blocks,
        "blocks_held_expected": args.workers * args.live * 2 * args.blocks_per_event,
        "rss_start_mb": round(samples[0].rss / mb, 1) if samples else None,
        "rss_warm_mb": round(warm.rss / mb, 1),
        "rss_end_mb": round(end.rss / mb, 1),
        "rss_peak_after_warm_mb": round(peak / mb, 1),
        "growth_pct": round(100.0 * (end.rss - warm.rss) / warm.rss, 2) if warm.rss else None,
        "slope_mb_per_h": round(slope * 3600 / mb, 1),
        "rss_half_mb": round(half.rss / mb, 1),
        "growth_second_half_pct": round(100.0 * (end.rss - half.rss) / half.rss, 2) if half.rss else None,
        "samples": [(round(s.t_s, 2), s.events, s.rss) for s in samples],
        **extra,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=20_000_000, help="store+remove events to send")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--live", type=int, default=5_000, help="live conversations per worker")
    parser.add_argument("--blocks-per-event", type=int, default=4)
    parser.add_argument("--events-per-batch", type=int, default=32)
    parser.add_argument("--window", type=int, default=2_000, help="max batches ahead of the router")
    parser.add_argument("--warmup", type=float, default=0.2, help="fraction of events counted as warm-up")
    parser.add_argument("--sample-s", type=float, default=1.0)
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    result = run(args)
    table = {k: v for k, v in result.items() if k != "samples"}
    width = max(len(k) for k in table)
    for key, value in table.items():
        print(f"{key:<{width}}  {value}")
    verdict = result["growth_pct"] is not None and abs(result["growth_pct"]) <= 10.0
    print(f"{'flat within 10% after warm-up':<{width}}  {'yes' if verdict else 'NO'}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
