"""Fault matrix: inject each fault into a real cluster, report detection and recovery.

Run::

    .venv/bin/python benchmarks/faults.py --quick              # every fault, small volumes (minutes)
    .venv/bin/python benchmarks/faults.py                      # full volumes (1 M fuzzed frames, ...)
    .venv/bin/python benchmarks/faults.py --quick --only loss_1pct,dup --json out.json

The cluster is real: ``--engines`` engines, each a ``PrefixCache`` (torch,
CPU) publishing its own KV events through a real ``ZmqEventPublisher`` on
loopback, and one or two ``tokenspeed-router serve`` subprocesses (with a
real ``redis-server`` for the ``--state`` rows). Frame faults are injected by
a proxy between an engine's PUB socket and the router (the replay path stays
direct, as on a real network where only the stream is lossy); process faults
by SIGKILL / SIGSTOP / restarts of the real processes.

For each fault the table reports:

* **injected** — what was done, and how much;
* **detected** — what the router noticed, from its own counters (``/workers``,
  ``/health``): gaps, duplicates, restarts, malformed frames, 4xx answers;
* **recovered** — every router is serving, every engine stream is ``live`` and
  the router has applied each engine's last batch;
* **truth** — the index equals the engines' truth after recovery: for every
  prompt of the workload, ``/match`` gives each engine exactly the number of
  leading blocks that engine's own cache holds (read from the cache's radix
  tree, not from the events), and each engine's block count in ``/workers``
  equals its cache's;
* **crashes** — router processes that died without being killed (and ingest
  loops that stopped);
* **lost** — accepted batches (numbered by ``publish()``) the router has not
  applied after recovery.

Trailing loss (the last frames of a burst) is only detectable when the next
batch arrives (engines send no heartbeat), so every row ends with a clean
tail of traffic before the checks, as live traffic would provide.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import zmq
from harness import RedisServer, Serve, data_dir, rss_bytes, wait_for

from tokenspeed_router.cache import PrefixCache
from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
)
from tokenspeed_router.events.kvcap import read_kvcap
from tokenspeed_router.events.publisher import ZmqEventPublisher
from tokenspeed_router.hashing import block_hashes

BLOCK = 16
NUM_PAGES = 48  # small: the workload evicts
STATE_OPTS = "lease_ttl_s=1.5&read_block_ms=50&backoff_max_s=0.2&snapshot_every_s=2&ingest=stream"


# --------------------------------------------------------------------------- workload and engines


def make_prompts(seed: int = 11) -> list[list[int]]:
    """Prompts sharing system prefixes (4 blocks), with 1-5 blocks of their own and a partial tail."""
    rng = random.Random(seed)
    systems = [[rng.randrange(50_000) for _ in range(4 * BLOCK)] for _ in range(6)]
    return [rng.choice(systems) + [rng.randrange(50_000) for _ in range(rng.randint(1, 5) * BLOCK + 7)]
            for _ in range(60)]


class Engine:
    """An engine without a model: a real PrefixCache publishing through a real ZmqEventPublisher."""

    def __init__(self, name: str, *, hwm: int = 100_000, ports: tuple[int, int] | None = None,
                 buffer_steps: int = 10_000) -> None:
        self.name = name
        self.hwm = hwm
        self.buffer_steps = buffer_steps
        self.restarts = 0
        self._fresh = iter(range(10**9, 2 * 10**9, BLOCK * 64))
        self._open(ports)

    def _open(self, ports: tuple[int, int] | None) -> None:
        ep, rp = (f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}") if ports else (
            "tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        self.cache = PrefixCache.with_capacity(NUM_PAGES, page_size=BLOCK, debug_checks=False)
        self.pub = ZmqEventPublisher(ep, replay_endpoint=rp, hwm=self.hwm, buffer_steps=self.buffer_steps)
        self.cache.attach_publisher(self.pub)

    @property
    def ports(self) -> tuple[int, int]:
        rp = self.pub.replay_endpoint
        assert rp is not None
        return int(self.pub.endpoint.rsplit(":", 1)[1]), int(rp.rsplit(":", 1)[1])

    def admit(self, prompt: list[int]) -> None:
        self.cache.admit(prompt)

    def fresh(self, blocks: int = 2) -> None:
        """A never-seen prompt: always stores blocks, so always publishes a batch."""
        base = next(self._fresh)
        self.cache.admit(list(range(base, base + blocks * BLOCK)))

    @property
    def last_seq(self) -> int:
        return self.pub.statistics().next_seq - 1

    def restart(self) -> None:
        """Process restart: a new cache (empty) and a new publisher on the same ports, seq from 0."""
        ports = self.ports
        self.pub.close()
        self.restarts += 1
        self._open(ports)

    def close(self) -> None:
        self.pub.close()


class FrameProxy:
    """Sits between an engine's PUB and the router: drops, duplicates or reorders live frames."""

    def __init__(self, upstream: str, seed: int) -> None:
        self.upstream = upstream
        self.rng = random.Random(seed)
        self.drop_p = self.dup_p = self.reorder_p = 0.0
        self.dropped = self.duplicated = self.reordered = self.forwarded = 0
        #: bad frames sent after each forwarded one (``junk(frames, rng)`` makes them)
        self.junk: Callable[[list[bytes], random.Random], list[list[bytes]]] | None = None
        self.injected = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.endpoint = ""
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def set(self, *, drop_p: float = 0.0, dup_p: float = 0.0, reorder_p: float = 0.0) -> None:
        self.drop_p, self.dup_p, self.reorder_p = drop_p, dup_p, reorder_p

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        pub = ctx.socket(zmq.PUB)
        for s in (sub, pub):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.upstream)
        pub.bind("tcp://127.0.0.1:*")
        self.endpoint = pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._ready.set()
        held: list[bytes] | None = None
        try:
            while not self._stop.is_set():
                if not sub.poll(50):
                    if held is not None:  # nothing followed: let it go late anyway
                        pub.send_multipart(held)
                        held = None
                    continue
                frames = sub.recv_multipart()
                r = self.rng.random()
                if r < self.drop_p:
                    self.dropped += 1
                    continue
                if held is None and r < self.drop_p + self.reorder_p:
                    held = frames  # goes out after the next frame
                    self.reordered += 1
                    continue
                pub.send_multipart(frames)
                self.forwarded += 1
                junk = self.junk
                if junk is not None:
                    for bad in junk(frames, self.rng):
                        pub.send_multipart(bad)
                        self.injected += 1
                if held is not None:
                    pub.send_multipart(held)
                    held = None
                if self.rng.random() < self.dup_p:
                    pub.send_multipart(frames)
                    self.duplicated += 1
        finally:
            sub.close(0)
            pub.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@dataclass
class Row:
    fault: str
    injected: str = ""
    detected: str = ""
    recovered: bool = False
    truth: bool = False
    crashes: int = 0
    lost: int = 0
    seconds: float = 0.0
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Ctx:
    quick: bool
    workdir: Path
    seed: int
    num_engines: int
    prompts: list[list[int]] = field(default_factory=make_prompts)
    redis: RedisServer | None = None

    def steps(self, quick: int, full: int) -> int:
        return quick if self.quick else full

    def get_redis(self) -> RedisServer:
        if self.redis is None:
            self.redis = RedisServer().start()
        elif self.redis.proc is None:
            self.redis.start()
        return self.redis


class Cluster:
    """Engines (optionally behind frame proxies) and the serve processes following them."""

    def __init__(self, ctx: Ctx, *, proxies: bool = False, hwm: int = 100_000,
                 buffer_steps: int = 10_000, replay: bool = True, serve_env: dict[str, str] | None = None) -> None:
        self.ctx = ctx
        self.replay = replay
        self.serve_env = serve_env
        self.rng = random.Random(ctx.seed)
        self.engines = [Engine(f"e{i}", hwm=hwm, buffer_steps=buffer_steps)
                        for i in range(ctx.num_engines)]
        #: engine name -> (events, replay) endpoints the router uses instead of the engine's own
        self.via: dict[str, tuple[str, str]] = {}
        self.proxies = [FrameProxy(e.pub.endpoint, ctx.seed + i) for i, e in enumerate(self.engines)] \
            if proxies else []
        self.serves: list[Serve] = []
        self.killed: set[int] = set()
        self.extra_workers: list[str] = []

    def worker_args(self) -> list[str]:
        args: list[str] = []
        for i, e in enumerate(self.engines):
            events = self.proxies[i].endpoint if self.proxies else e.pub.endpoint
            replay = e.pub.replay_endpoint
            if e.name in self.via:
                events, replay = self.via[e.name]
            spec = f"name={e.name},events={events}" + (f",replay={replay}" if self.replay else "")
            args += ["--worker", spec]
        for spec in self.extra_workers:
            args += ["--worker", spec]
        return args

    def serve(self, *extra: str, port: int | None = None) -> Serve:
        s = Serve([*self.worker_args(), *extra], log_dir=self.ctx.workdir, port=port, env=self.serve_env).start()
        self.serves.append(s)
        return s

    def drive(self, steps: int) -> None:
        """Random prompts on random engines (each admit publishes one batch when it changes the cache)."""
        for _ in range(steps):
            self.rng.choice(self.engines).admit(self.rng.choice(self.ctx.prompts))

    def tail(self, n: int = 3) -> None:
        """Clean traffic after a fault: every engine publishes ``n`` more batches."""
        for _ in range(n):
            for e in self.engines:
                e.fresh()

    def caught_up(self, serve: Serve) -> bool:
        try:
            ws = serve.get("/workers")
        except httpx.HTTPError:
            return False
        return all(ws.get(e.name, {}).get("last_seq") == e.last_seq and ws[e.name]["state"] == "live"
                   for e in self.engines)

    def wait_recovered(self, serve: Serve, timeout_s: float = 60.0, *, traffic: bool = False) -> bool:
        """Wait until the router applied every engine's last batch.

        ``traffic``: keep live traffic flowing meanwhile (a batch per engine
        every half second until caught up), so that frames lost at the very
        end of a fault are revealed by the next batch, as in production.
        """
        last = [time.monotonic()]

        def done() -> bool:
            if self.caught_up(serve):
                return True
            if traffic and time.monotonic() - last[0] > 0.5:
                last[0] = time.monotonic()
                self.tail(1)
            return False

        try:
            wait_for(done, timeout_s, "the router to catch up", interval_s=0.05)
            return True
        except TimeoutError:
            return False

    def truth(self, serve: Serve) -> tuple[bool, int]:
        """(index equals every engine's cache, number of mismatches)."""
        mismatches = 0
        ws = serve.get("/workers")
        for e in self.engines:
            if ws[e.name]["blocks"] != e.cache.total_size() // BLOCK:
                mismatches += 1
        for prompt in self.ctx.prompts:
            scores = serve.post("/match", {"token_ids": prompt})["scores"]
            for e in self.engines:
                if scores.get(e.name, 0) != e.cache.cached_prefix_length(prompt) // BLOCK:
                    mismatches += 1
        return mismatches == 0, mismatches

    def wait_truth(self, serve: Serve, timeout_s: float = 60.0) -> bool:
        """Poll until the index equals the engines' caches (for streams renumbered by a relay)."""
        def live_and_true() -> bool:
            try:
                ws = serve.get("/workers")
                return all(ws[e.name]["state"] == "live" for e in self.engines) and self.truth(serve)[0]
            except (httpx.HTTPError, KeyError):
                return False

        try:
            wait_for(live_and_true, timeout_s, "the index to equal the engines' caches", interval_s=0.1)
            return True
        except TimeoutError:
            return False

    def lost(self, serve: Serve) -> int:
        """Accepted batches the router has not applied (per engine, behind its last seq)."""
        ws = serve.get("/workers")
        behind = 0
        for e in self.engines:
            seen = ws.get(e.name, {}).get("last_seq")
            behind += e.last_seq + 1 if seen is None else max(0, e.last_seq - seen)
        return behind

    def crashes(self) -> int:
        n = 0
        for s in self.serves:
            if s.proc is None or s.pid in self.killed:
                continue
            if not s.alive():
                n += 1
                continue
            try:
                if not s.get("/health").get("ingesting", False):
                    n += 1
            except httpx.HTTPError:
                n += 1
        return n

    def counters(self, serve: Serve) -> dict[str, int]:
        ws = serve.get("/workers")
        keys = ("gaps", "replayed_batches", "duplicates", "restarts", "resyncs", "malformed_frames",
                "events_rejected")
        out = {k: sum(int(ws[e.name].get(k) or 0) for e in self.engines) for k in keys}
        names = {e.name for e in self.engines}
        out["replay_timeouts"] = 0
        for line in serve.http.get("/metrics").text.splitlines():
            if line.startswith("tokenspeed_ingest_replay_timeouts_total{"):
                worker = line.split('worker="', 1)[1].split('"', 1)[0]
                if worker in names:
                    out["replay_timeouts"] += int(float(line.rsplit(" ", 1)[1]))
        return out

    def kill(self, serve: Serve) -> None:
        self.killed.add(serve.pid)
        serve.kill()

    def finish(self, row: Row, serve: Serve, recovered: bool | None = None, timeout_s: float = 120.0,
               traffic: bool = False) -> Row:
        """Clean tail, wait, then fill recovered / truth / crashes / lost."""
        self.tail()
        ok = self.wait_recovered(serve, timeout_s, traffic=traffic) and (recovered is None or recovered)
        row.recovered = ok and serve.alive()
        row.truth, mismatches = self.truth(serve) if serve.alive() else (False, -1)
        if mismatches:
            row.notes += f" {mismatches} mismatches"
        row.crashes = self.crashes()
        row.lost = self.lost(serve) if serve.alive() else -1
        return row

    def close(self) -> None:
        for s in self.serves:
            s.close()
        for p in self.proxies:
            p.close()
        for e in self.engines:
            e.close()


@contextmanager
def cluster(ctx: Ctx, **kw: Any) -> Iterator[Cluster]:
    c = Cluster(ctx, **kw)
    try:
        yield c
    finally:
        c.close()


def _fmt(counters: dict[str, int], *keys: str) -> str:
    return ", ".join(f"{k} {counters[k]}" for k in keys)


# --------------------------------------------------------------------------- frame faults


def _proxy_fault(ctx: Ctx, name: str, **probs: float) -> Row:
    row = Row(name)
    with cluster(ctx, proxies=True) as c:
        serve = c.serve()
        c.drive(20)
        c.wait_recovered(serve)
        for p in c.proxies:
            p.set(**probs)
        c.drive(c.ctx.steps(3000, 30_000))
        for p in c.proxies:
            p.set()
        dropped = sum(p.dropped for p in c.proxies)
        dup = sum(p.duplicated for p in c.proxies)
        reo = sum(p.reordered for p in c.proxies)
        fwd = sum(p.forwarded for p in c.proxies)
        c.finish(row, serve)
        k = c.counters(serve)
        parts = []
        if probs.get("drop_p"):
            parts.append(f"{dropped} of {dropped + fwd + reo} frames dropped")
        if probs.get("dup_p"):
            parts.append(f"{dup} frames sent twice")
        if probs.get("reorder_p"):
            parts.append(f"{reo} frames sent after their successor")
        row.injected = "; ".join(parts)
        row.detected = _fmt(k, "gaps", "replayed_batches", "duplicates", "resyncs", "replay_timeouts")
        stats = [e.pub.statistics() for e in c.engines]
        row.extra = {"dropped": dropped, "duplicated": dup, "reordered": reo, **k,
                     "engine_replay_requests": sum(st.replay_requests for st in stats),
                     "engine_replay_errors": sum(st.replay_errors for st in stats)}
    return row


def fault_loss(ctx: Ctx, pct: float) -> Row:
    return _proxy_fault(ctx, f"frame loss {pct:g}%", drop_p=pct / 100)


def fault_dup(ctx: Ctx) -> Row:
    return _proxy_fault(ctx, "duplicated frames (10%)", dup_p=0.10)


def fault_reorder(ctx: Ctx) -> Row:
    return _proxy_fault(ctx, "reordered frames (10%)", reorder_p=0.10)


# --------------------------------------------------------------------------- process faults


def fault_engine_restart(ctx: Ctx) -> Row:
    row = Row("engine (publisher) restart")
    with cluster(ctx) as c:
        serve = c.serve()
        c.drive(c.ctx.steps(100, 1000))
        c.wait_recovered(serve)
        n = c.ctx.steps(2, 10)
        for _ in range(n):
            for e in c.engines:
                e.restart()  # new process: empty cache, seq from 0, same ports
            c.drive(c.ctx.steps(30, 200))
            c.tail()  # every incarnation publishes something the router must see
            c.wait_recovered(serve)
        c.finish(row, serve)
        k = c.counters(serve)
        row.injected = f"{n * len(c.engines)} restarts (new cache, seq back to 0)"
        row.detected = _fmt(k, "restarts", "resyncs", "gaps", "replayed_batches")
        row.extra = k
    return row


def fault_router_kill(ctx: Ctx, *, state: bool) -> Row:
    row = Row("router SIGKILL + restart" + (" (with Redis)" if state else " (alone)"))
    with cluster(ctx) as c:
        extra = ["--state", f"{ctx.get_redis().url}?{STATE_OPTS}&cluster=kill{ctx.seed}"] if state else []
        serve = c.serve(*extra)
        c.drive(c.ctx.steps(150, 1500))
        c.wait_recovered(serve)
        kills = c.ctx.steps(2, 5)
        port = serve.port
        for _ in range(kills):
            c.kill(serve)
            c.drive(c.ctx.steps(60, 600))  # the engines go on while the router is down
            serve = c.serve(*extra, port=port)
        c.finish(row, serve)
        k = c.counters(serve)
        row.injected = f"{kills} SIGKILLs, traffic while down"
        detail = _fmt(k, "replayed_batches", "gaps")
        if state:
            st = serve.get("/health")["state"]
            warm = st.get("warm_start") or {}
            detail = f"warm start from {warm.get('source')} ({warm.get('num_blocks')} blocks); " + detail
        row.detected = detail
        row.extra = k
    return row


def fault_slow_consumer(ctx: Ctx) -> Row:
    row = Row("slow consumer (SIGSTOP) over ZMQ HWM")
    with cluster(ctx, hwm=50) as c:
        serve = c.serve()
        c.drive(20)
        c.wait_recovered(serve)
        before = [e.last_seq for e in c.engines]
        os.kill(serve.pid, signal.SIGSTOP)
        try:
            flood = c.ctx.steps(3000, 6000)  # within the replay ring (10,000 batches)
            for _ in range(flood):
                for e in c.engines:
                    e.fresh(blocks=40)  # ~3.5 KB batches: far more than socket buffers hold
            for e in c.engines:
                e.pub.wait_sent(30)
        finally:
            os.kill(serve.pid, signal.SIGCONT)
        published = sum(e.last_seq - b for e, b in zip(c.engines, before, strict=True))
        # the tail right after SIGCONT is itself dropped while the router drains its
        # buffers: live traffic goes on until the router sees the gap
        c.finish(row, serve, timeout_s=300, traffic=True)
        k = c.counters(serve)
        row.injected = f"router stopped while {published} batches were published (PUB hwm 50)"
        row.detected = _fmt(k, "gaps", "replayed_batches", "resyncs")
        row.extra = {"published_while_stopped": published, **k}
    return row


def _metric(serve: Serve, name: str, worker: str) -> float:
    """One worker's sample of a counter in ``/metrics`` (0 when absent)."""
    for line in serve.http.get("/metrics").text.splitlines():
        if line.startswith(name + "{") and f'worker="{worker}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _steady(c: Cluster, serve: Serve, rng: random.Random, n: int) -> tuple[int, int]:
    """``n`` routed requests (a workload system prefix and a fresh suffix, as chat turns are):
    ``/route``, the chosen engine serves it, ``/release``. Returns (cached tokens, prompt tokens)."""
    systems = sorted({tuple(p[: 4 * BLOCK]) for p in c.ctx.prompts})
    engines = {e.name: e for e in c.engines}
    hit = total = 0
    for _ in range(n):
        prompt = list(rng.choice(systems)) + [rng.randrange(50_000) for _ in range(rng.randint(1, 3) * BLOCK + 7)]
        answer = serve.post("/route", {"token_ids": prompt})
        engine = engines[answer["worker"]]
        hit += engine.cache.cached_prefix_length(prompt)
        total += len(prompt)
        engine.admit(prompt)
        serve.post("/release", {"request_id": answer["request_id"]})
        if rng.random() < 0.2:  # traffic from elsewhere (not routed here) reaches the engines too
            for e in c.engines:
                e.fresh(1)
    return hit, total


def _burst(engine: Engine, blocks_per_s: float, seconds: float) -> int:
    """Churn batches (32 blocks stored, the previous 32 removed) at ``blocks_per_s`` on the engine's
    own publisher: they net to nothing, so the engine's cache stays its truth. Returns batches sent."""
    ids = iter(range(10**15, 10**16))
    prev: list[int] = []
    per_batch = 64
    interval = per_batch / blocks_per_s
    start = time.perf_counter()
    sent = 0
    while time.perf_counter() - start < seconds:
        chain = [next(ids) for _ in range(32)]
        events: list[Any] = [BlockStored(block_hashes=chain, parent_block_hash=None,
                                         token_ids=[7] * (32 * BLOCK), block_size=BLOCK)]
        if prev:
            events.append(BlockRemoved(block_hashes=prev))
        engine.pub.publish(KVEventBatch(time.time(), events))
        prev = chain
        sent += 1
        delay = start + sent * interval - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
    if prev:
        engine.pub.publish(KVEventBatch(time.time(), [BlockRemoved(block_hashes=prev)]))
        sent += 1
    return sent


def fault_shed_recovery(ctx: Ctx) -> Row:
    """Overload: one engine's stream sheds at 200k blocks/s, then steady routed load (issue 33)."""
    row = Row("overload: shed at 200k blocks/s, then steady load")
    warm, steady = ctx.steps(300, 600), ctx.steps(600, 1200)

    def run(burst: bool) -> dict[str, Any]:
        rng = random.Random(ctx.seed)
        with cluster(ctx) as c:
            serve = c.serve()
            c.tail()
            c.wait_recovered(serve, traffic=True)
            _steady(c, serve, rng, warm)
            c.wait_recovered(serve)
            out: dict[str, Any] = {}
            if burst:
                e0 = c.engines[0]
                # The router is paused for 1.5 s of the 3 s burst: behind by more than its
                # ingest_max_lag_s (1 s) whatever its speed, it must shed that stream.
                stop = threading.Timer(0.0, lambda: os.kill(serve.pid, signal.SIGSTOP))
                cont = threading.Timer(1.5, lambda: os.kill(serve.pid, signal.SIGCONT))
                stop.start()
                cont.start()
                try:
                    out["burst_batches"] = _burst(e0, 200_000, 3.0)
                finally:
                    cont.join()
                    os.kill(serve.pid, signal.SIGCONT)
                c.tail()
                wait_for(lambda: all(serve.get("/workers")[e.name]["last_seq"] == e.last_seq for e in c.engines),
                         120, "the router to apply the burst's last batch", interval_s=0.1)
                ws = serve.get("/workers")
                out["after_burst"] = ws[e0.name]["state"]
                out["shed_batches"] = int(_metric(serve, "tokenspeed_ingest_shed_batches_total", e0.name))
            hit1, tot1 = _steady(c, serve, rng, steady // 2)
            hit2, tot2 = _steady(c, serve, rng, steady - steady // 2)
            c.finish(row if burst else Row("control"), serve, timeout_s=120, traffic=True)
            ws = serve.get("/workers")
            out.update(
                hit_first_half=hit1 / tot1, hit_second_half=hit2 / tot2,
                states={e.name: ws[e.name]["state"] for e in c.engines},
                resyncs=sum(int(ws[e.name]["resyncs"]) for e in c.engines),
                named_parents=sum(int(ws[e.name].get("named_parents") or 0) for e in c.engines),
                adopted_blocks=sum(int(ws[e.name].get("adopted_blocks") or 0) for e in c.engines),
                truth=c.truth(serve)[0], crashes=c.crashes(), lost=c.lost(serve),
            )
            return out

    control = run(False)
    got = run(True)
    reached = got["hit_second_half"] >= control["hit_second_half"] - 0.01
    all_live = all(s == "live" for s in got["states"].values())
    row.injected = (f"{got['burst_batches']:,} churn batches on e0 at 200k blocks/s for 3 s, router paused 1.5 s; "
                    f"then {steady} routed requests (system prefix + fresh suffix)")
    row.detected = (f"shed_batches {got['shed_batches']:,}, resyncs {got['resyncs']}, e0 {got['after_burst']} after "
                    f"the burst; named parents {got['named_parents']}, adopted blocks {got['adopted_blocks']}; "
                    f"hit ratio (last {steady - steady // 2}) {got['hit_second_half']:.3f} vs "
                    f"{control['hit_second_half']:.3f} without the burst")
    row.recovered = row.recovered and all_live and reached and got["shed_batches"] > 0
    if not reached:
        row.notes += " hit ratio below the run without the burst"
    if got["shed_batches"] == 0:
        row.notes += " nothing was shed"
    row.extra = {"with_burst": got, "without_burst": control}
    return row


def fault_redis_restart(ctx: Ctx) -> Row:
    row = Row("Redis restart (no persistence)")
    with cluster(ctx) as c:
        redis = ctx.get_redis()
        serve = c.serve("--state", f"{redis.url}?{STATE_OPTS}&cluster=rr{ctx.seed}")
        c.drive(c.ctx.steps(150, 1500))
        c.wait_recovered(serve)
        n = c.ctx.steps(1, 3)
        for _ in range(n):
            redis.stop()
            c.drive(c.ctx.steps(40, 300))  # ingested while Redis is down: buffered by the leader
            redis.start()
            c.drive(c.ctx.steps(40, 300))
        c.finish(row, serve)
        st = serve.get("/health")["state"]
        row.injected = f"{n} restarts of redis-server (stream, lease, snapshots lost)"
        row.detected = (f"stream resets {st['resets_detected']}, takeovers {st['takeovers']}, "
                        f"dropped {st['dropped']}, degraded now {st['degraded']}")
        row.extra = {k: st[k] for k in ("resets_detected", "takeovers", "dropped", "degraded")}
    return row


def fault_leader_failover(ctx: Ctx) -> Row:
    row = Row("leader failover (SIGKILL the leader)")
    with cluster(ctx) as c:
        url = f"{ctx.get_redis().url}?{STATE_OPTS}&cluster=fo{ctx.seed}"
        a = c.serve("--state", url + "&replica_id=ra")
        b = c.serve("--state", url + "&replica_id=rb")

        def leader() -> Serve | None:
            roles = [(s, s.get("/health")["state"]["role"]) for s in (a, b)]
            leaders = [s for s, r in roles if r == "leader"]
            return leaders[0] if len(leaders) == 1 else None

        n = c.ctx.steps(1, 3)
        survivor = a
        for i in range(n):
            c.drive(c.ctx.steps(100, 800))
            lead = wait_for(leader, 30, "one leader", interval_s=0.05)
            survivor = b if lead is a else a
            c.kill(lead)
            c.drive(c.ctx.steps(50, 400))
            wait_for(lambda s=survivor: s.get("/health")["state"]["role"] == "leader", 30,
                     "the survivor to take the lease", interval_s=0.05)
            if i + 1 < n:  # bring a replica back for the next round
                replacement = c.serve("--state", url + f"&replica_id=r{i}", port=lead.port)
                a, b = survivor, replacement
        c.finish(row, survivor)
        st = survivor.get("/health")["state"]
        row.injected = f"{n} leader SIGKILLs with traffic flowing"
        row.detected = f"takeovers {st['takeovers']} on the survivor, lease ttl 1.5 s"
    return row


def _relay_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("tokenspeed_router.relay") is not None


def fault_router_kill_relay(ctx: Ctx, *, relay: bool = True) -> Row:
    """Router killed while each engine's small ring wraps: the relay's snapshot must fill it in.

    ``relay=False`` is the control: the same fault straight on the engines,
    whose rings cannot cover the outage (expected to end ``resyncing``).
    """
    row = Row("router SIGKILL + restart (behind a relay)" if relay else
              "control: router SIGKILL + restart, rings wrapped, no relay")
    if relay and not _relay_available():
        row.notes = "skipped: the relay (issue 13 item 1) is not on this branch"
        return row
    import subprocess
    import sys

    ring = 64
    with cluster(ctx, buffer_steps=ring) as c:
        relays: list[subprocess.Popen[bytes]] = []
        try:
            for e in c.engines if relay else []:
                pub, rep = f"tcp://127.0.0.1:{free_tcp_port()}", f"tcp://127.0.0.1:{free_tcp_port()}"
                log = open(ctx.workdir / f"relay-{e.name}.log", "wb")  # noqa: SIM115
                relays.append(subprocess.Popen(
                    [sys.executable, "-m", "tokenspeed_router.cli", "--log-level", "WARNING", "relay",
                     "--engine", e.pub.endpoint, "--engine-replay", str(e.pub.replay_endpoint),
                     "--publish", pub, "--replay", rep], stdout=subprocess.DEVNULL, stderr=log))
                log.close()
                c.via[e.name] = (pub, rep)
            serve = c.serve()
            c.drive(50)
            c.tail()
            c.wait_truth(serve)
            kills = c.ctx.steps(2, 5)
            port = serve.port
            for _ in range(kills):
                c.kill(serve)
                c.drive(c.ctx.steps(600, 3000))  # far more batches than each engine's ring holds
                serve = c.serve(port=port)
            c.tail()
            row.recovered = c.wait_truth(serve, 60 if relay else 10)
            row.truth, mismatches = c.truth(serve)
            if mismatches:
                row.notes += f" {mismatches} mismatches"
            row.crashes = c.crashes() + sum(1 for r in relays if r.poll() is not None)
            row.lost = 0 if row.truth else mismatches
            k = c.counters(serve)
            row.injected = (f"{kills} SIGKILLs; engines' rings ({ring} batches) wrapped while the "
                            "router was down")
            row.detected = _fmt(k, "replayed_batches", "gaps", "resyncs")
            row.extra = k
            if not relay:
                states = sorted({w["state"] for w in serve.get("/workers").values()})
                row.notes = (f"control (not a failure): engines' own rings cannot cover the outage; "
                             f"workers end {'/'.join(states)}, routed on load until they resync")
        finally:
            for r in relays:
                r.terminate()
                r.wait(10)
    return row


# --------------------------------------------------------------------------- bad input


def _captured_frames() -> list[list[bytes]]:
    """Live frames recorded from real engines (shared/captures), plus our own encoder's."""
    frames: list[list[bytes]] = []
    for path in sorted(data_dir("captures").glob("*/*.sub.kvcap")):
        frames.extend(list(r.frames) for r in read_kvcap(path))
    if not frames:
        raise SystemExit("no captured frames under shared/captures")
    toks = list(range(4 * BLOCK))
    ev = BlockStored(block_hashes=list(block_hashes(toks, BLOCK)), parent_block_hash=None,
                     token_ids=toks, block_size=BLOCK)
    for fmt in ("map", "array"):
        payload = encode_batch(KVEventBatch(1.0, [ev, AllBlocksCleared()]), wire_format=fmt)  # type: ignore[arg-type]
        frames.append([b"", (0).to_bytes(8, "big"), payload])
    return frames


def _mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    """One random mutation of a real multipart message."""
    out = list(frames)
    kind = rng.randrange(9)
    i = rng.randrange(len(out))
    b = bytearray(out[i])
    if kind == 0 and b:  # bit flips
        for _ in range(rng.randint(1, 8)):
            j = rng.randrange(len(b))
            b[j] ^= 1 << rng.randrange(8)
        out[i] = bytes(b)
    elif kind == 1:  # truncate
        out[i] = bytes(b[: rng.randrange(len(b) + 1)])
    elif kind == 2:  # random bytes
        out[i] = rng.randbytes(rng.randrange(64))
    elif kind == 3:  # drop a frame
        del out[i]
    elif kind == 4:  # extra frame
        out.insert(i, rng.randbytes(rng.randrange(16)))
    elif kind == 5:  # random seq
        if len(out) >= 2:
            out[1] = rng.randrange(2**64).to_bytes(8, "big")
    elif kind == 6 and b:  # overwrite a byte range with an msgpack marker
        j = rng.randrange(len(b))
        b[j] = rng.choice([0xC0, 0xC1, 0xDC, 0xDD, 0xDE, 0xDF, 0xCF, 0xD3, 0x90, 0x80])
        out[i] = bytes(b)
    elif kind == 7 and b:  # splice in a slice of itself
        j, k = sorted(rng.randrange(len(b) + 1) for _ in range(2))
        out[i] = bytes(b[:j] + b[k:] + b[j:k])
    else:  # seq of a wrong length
        if len(out) >= 2:
            out[1] = rng.randbytes(rng.choice([0, 1, 4, 7, 9, 16]))
    return out


def _sentinel(c: Cluster, serve: Serve, pub: zmq.Socket[bytes], name: str, key: int) -> bool:
    """A valid batch after the junk: once visible, everything before it was processed."""
    toks = [key + i for i in range(2 * BLOCK)]
    ev = BlockStored(block_hashes=list(block_hashes(toks, BLOCK)), parent_block_hash=None,
                     token_ids=toks, block_size=BLOCK)
    payload = encode_batch(KVEventBatch(time.time(), [AllBlocksCleared(), ev]))
    seq = [0]

    def visible() -> bool:
        pub.send_multipart([b"", seq[0].to_bytes(8, "big"), payload])
        seq[0] += 1
        return bool(serve.post("/match", {"token_ids": toks})["scores"].get(name, 0) == 2)

    try:
        wait_for(visible, 120, "the sentinel batch", interval_s=0.05)
        return True
    except TimeoutError:
        return False


def _junk_worker(c: Cluster, name: str) -> tuple[zmq.Socket[bytes], str]:
    sock = zmq.Context.instance().socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # queue rather than drop: the router is to see every frame
    sock.bind("tcp://127.0.0.1:*")
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    c.extra_workers.append(f"name={name},events={endpoint}")
    return sock, endpoint


def fault_fuzz(ctx: Ctx) -> Row:
    total = ctx.steps(20_000, 1_000_000)
    row = Row(f"fuzzed frames ({total:,})")
    rng = random.Random(ctx.seed)
    seeds = _captured_frames()
    with cluster(ctx) as c:
        sock, _ = _junk_worker(c, "fz")
        try:
            serve = c.serve()
            c.drive(50)
            c.wait_recovered(serve)
            wait_for(lambda: _sentinel(c, serve, sock, "fz", 7 * 10**8), 60, "the junk stream to connect")
            sent = 0
            chunk = 20_000
            while sent < total:
                for _ in range(min(chunk, total - sent)):
                    sock.send_multipart(_mutate(rng, rng.choice(seeds)))
                    sent += 1
                c.drive(5)  # real traffic interleaved with the junk
                # pace: let the router drain before the next chunk (a sentinel proves it)
                if not _sentinel(c, serve, sock, "fz", 8 * 10**8 + sent):
                    row.notes += " sentinel not seen"
                    break
            ws = serve.get("/workers")["fz"]
            c.finish(row, serve)
            row.injected = f"{sent:,} mutated real frames (captures of vLLM, SGLang, TokenSpeed)"
            row.detected = (f"malformed {ws['malformed_frames']:,}, events rejected {ws['events_rejected']:,},"
                            f" gaps {ws['gaps']:,}, restarts {ws['restarts']:,}")
            row.extra = {k: ws[k] for k in ("malformed_frames", "events_rejected", "gaps", "restarts",
                                            "resyncs", "batches_applied")}
        finally:
            sock.close(0)
    return row


def _interleaved_junk(seeds: list[list[bytes]]) -> Callable[[list[bytes], random.Random], list[list[bytes]]]:
    """Bad frames to send after each good one, under the seqs that could do harm.

    Each carries the good frame's own seq (a "restart" by the old rule: a seq
    already delivered, other bytes), the seq due next (a frame that would take
    the good batch's place), 0 (a "new process") or one ahead (a false gap);
    its payload is a mutated capture frame or one of the malformed classes of
    issue 28 (undecodable, not a batch, unknown tags, wrong types, a negative
    block size, 100,000 hashes for one token, a 4 G array header, random
    bytes). A mutant that still decodes to a batch with events
    is not a bad frame (a bit flip in a token id makes another valid batch)
    and is not sent: a valid batch is data, and under a reused seq it is a
    restart by definition (DESIGN §3); only what fails to decode or validate,
    or carries nothing to apply, must change nothing.
    """
    from tokenspeed_router.errors import WireError
    from tokenspeed_router.events import BatchDecoder
    from tokenspeed_router.events.codec import only_unknown_events
    from tokenspeed_router.events.frames import decode_seq

    classes = _bad_payload_classes()
    decoder = BatchDecoder()

    def is_bad(payload: bytes) -> bool:
        try:
            return only_unknown_events(decoder.decode(payload), payload)
        except WireError:
            return True

    def junk(frames: list[bytes], rng: random.Random) -> list[list[bytes]]:
        if len(frames) != 3 or len(frames[1]) != 8:
            return []
        seq = decode_seq(frames[1])
        out: list[list[bytes]] = []
        for _ in range(rng.choice((1, 2, 3))):
            at = rng.choice((seq, seq, seq + 1, 0, seq + 2))
            payload = rng.choice(classes)
            if rng.random() < 0.5:
                mutant = _mutate(rng, [b"", b"\0" * 8, rng.choice(seeds)[-1]])[-1]
                if is_bad(mutant):
                    payload = mutant
            out.append([frames[0], at.to_bytes(8, "big"), payload])
        return out

    return junk


def _bad_payload_classes() -> list[bytes]:
    import msgspec

    enc = msgspec.msgpack.Encoder()
    stored = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
              "token_ids": list(range(BLOCK)), "block_size": BLOCK}
    head = b"\x93\xcb" + struct.pack(">d", 1.0)  # [1.0, ...
    return [
        b"\xc1\xc1", enc.encode({"ts": 1.0}), enc.encode("BlockStored"),
        enc.encode([1.0, [{"type": "BlockMoved", "block_hashes": [1]}]]),
        enc.encode([1.0, [["KVCacheOffloaded", [1], "CPU"]]]),
        enc.encode([1.0, [{**stored, "block_hashes": ["a"]}]]),
        enc.encode([1.0, [{**stored, "block_size": -BLOCK}]]),
        enc.encode([1.0, [{**stored, "block_hashes": list(range(100_000)), "token_ids": [1]}]]),
        head + b"\xdd\xff\xff\xff\xff",
        bytes(random.Random(28).randrange(256) for _ in range(100)),
    ]


def fault_interleaved(ctx: Ctx, *, replay: bool, typed: bool) -> Row:
    """Bad payloads interleaved with an engine's own batches on its stream, under harmful seqs."""
    per_frame = 2  # bad frames per good one, on average
    goods = ctx.steps(2_000, 1_000_000 // per_frame)  # >= 1 M bad frames per row at full volume
    path = "typed path (reference core)" if typed else "native raw path"
    row = Row(f"interleaved bad payloads, {'with' if replay else 'no'} replay endpoint, {path}")
    env = {"TOKENSPEED_ROUTER_INDEX": "reference"} if typed else None
    with cluster(ctx, proxies=True, replay=replay, serve_env=env) as c:
        serve = c.serve()
        c.drive(20)
        c.wait_recovered(serve)
        junk = _interleaved_junk(_captured_frames())
        for p in c.proxies:
            p.junk = junk
        batches_before = sum(e.last_seq + 1 for e in c.engines)
        # 500 good batches (~1,500 frames) a chunk: a burst of 2,000 (~6,000 frames) put the router
        # more than ingest_max_lag_s behind on 2 cores, so it shed (an overload resync, by design):
        # this row is about bad frames, the slow-consumer row about overload
        chunk = 500
        done = 0
        while done < goods:
            for _ in range(min(chunk, goods - done)):
                c.rng.choice(c.engines).fresh(1)
            done += chunk
            # pace: let the router drain (all forwarded, all counted) before the next chunk
            wait_for(lambda want=sum(e.last_seq for e in c.engines): sum(  # type: ignore[misc]
                int(serve.get("/workers")[e.name].get("last_seq") or 0) for e in c.engines) >= want,
                300, "the router to drain a chunk", interval_s=0.1)
        for p in c.proxies:
            p.junk = None
        injected = sum(p.injected for p in c.proxies)
        batches = sum(e.last_seq + 1 for e in c.engines) - batches_before
        c.finish(row, serve)
        k = c.counters(serve)
        row.injected = f"{injected:,} bad frames between {batches:,} good batches ({len(c.engines)} engines)"
        row.detected = _fmt(k, "malformed_frames", "restarts", "resyncs", "gaps", "duplicates")
        row.extra = {**k, "injected": injected, "good_batches": batches}
        if k["restarts"] or k["resyncs"]:
            row.notes += f" restarts {k['restarts']}, resyncs {k['resyncs']} (must be 0)"
            row.truth = False
    return row


def fault_oversized(ctx: Ctx) -> Row:
    n = ctx.steps(3, 20)
    row = Row("oversized frames (65 MiB payloads)")
    with cluster(ctx) as c:
        sock, _ = _junk_worker(c, "big")
        try:
            serve = c.serve()
            c.drive(20)
            c.wait_recovered(serve)
            wait_for(lambda: _sentinel(c, serve, sock, "big", 7 * 10**8), 60, "the junk stream to connect")
            rss_before = rss_bytes(serve.pid)
            big = b"\x93" + b"\xcb" + b"\x00" * (65 << 20)
            for i in range(n):
                sock.send_multipart([b"", (10**6 + i).to_bytes(8, "big"), big])
                c.drive(5)
            seen = _sentinel(c, serve, sock, "big", 9 * 10**8)
            rss_after = rss_bytes(serve.pid)
            ws = serve.get("/workers")["big"]
            c.finish(row, serve, recovered=seen)
            row.injected = f"{n} frames of 65 MiB (limit 64 MiB) between valid traffic"
            mb = 1 << 20
            row.detected = (f"malformed {ws['malformed_frames']} (payload_size); serve RSS "
                            f"{rss_before / mb:.0f} -> {rss_after / mb:.0f} MB")
            row.extra = {"malformed_frames": ws["malformed_frames"], "rss_before": rss_before,
                         "rss_after": rss_after}
        finally:
            sock.close(0)
    return row


def _bad_bodies(rng: random.Random) -> Iterator[tuple[str, bytes, dict[str, str]]]:
    """(path, body, headers) of malformed API requests, cycling through kinds."""
    json_h = {"content-type": "application/json"}
    paths = ["/match", "/route", "/release", "/v1/completions", "/v1/chat/completions"]
    kinds: list[Callable[[], tuple[bytes, dict[str, str]]]] = [
        lambda: (rng.randbytes(rng.randrange(1, 200)), json_h),
        lambda: (b"{" * rng.randrange(1, 50_000), json_h),
        lambda: (json.dumps({"token_ids": "abc"}).encode(), json_h),
        lambda: (json.dumps({"token_ids": [1.5, 2]}).encode(), json_h),
        lambda: (json.dumps({"token_ids": [-1, 2**70]}).encode(), json_h),
        lambda: (json.dumps({"token_ids": [[1, 2], {"a": 1}]}).encode(), json_h),
        lambda: (json.dumps({"token_ids": None, "request_id": [5]}).encode(), json_h),
        lambda: (json.dumps({"token_ids": [1] * 8, "lora_id": {"x": 1}, "salt": [1]}).encode(), json_h),
        lambda: (json.dumps({"request_id": ["x"]}).encode(), json_h),
        lambda: (json.dumps([1, 2, 3]).encode(), json_h),
        lambda: (json.dumps({"model": 1, "prompt": [1.5], "messages": "x"}).encode(), json_h),
        lambda: (json.dumps({"prompt": None, "messages": {"role": "user"}}).encode(), json_h),
        lambda: (b"", json_h),
        lambda: (b"token_ids=1,2,3", {"content-type": "application/x-www-form-urlencoded"}),
        lambda: ('{"token_ids": [1, 2, 3], "salt": "\udcff"}'.encode("utf-8", "surrogatepass"), json_h),
    ]
    # big ones (over the body and token limits, deep nesting) are 1 in 100: each costs megabytes
    huge: list[Callable[[], tuple[bytes, dict[str, str]]]] = [
        lambda: (b"[" * 100_000 + b"]" * 100_000, json_h),
        lambda: (json.dumps({"token_ids": list(range(1_100_000))}).encode(), json_h),
        lambda: (b"[" + b"1," * (5 << 20) + b"1]", json_h),
    ]
    while True:
        body, headers = rng.choice(huge if rng.random() < 0.01 else kinds)()
        yield rng.choice(paths), body, headers


def fault_http(ctx: Ctx) -> Row:
    total = ctx.steps(3_000, 100_000)
    row = Row(f"malformed HTTP bodies ({total:,})")
    rng = random.Random(ctx.seed)
    with cluster(ctx) as c:
        serve = c.serve()
        c.drive(50)
        c.wait_recovered(serve)
        statuses: dict[int, int] = {}
        errors = 0
        bodies = _bad_bodies(rng)
        routed_before = serve.get("/workers")
        with httpx.Client(base_url=serve.url, timeout=30) as client:
            for i in range(total):
                path, body, headers = next(bodies)
                try:
                    st = client.post(path, content=body, headers=headers).status_code
                    statuses[st] = statuses.get(st, 0) + 1
                except httpx.HTTPError:
                    errors += 1
                if i % 500 == 0:
                    c.drive(2)
        in_flight = sum(w["in_flight"] for w in serve.get("/workers").values())
        c.finish(row, serve)
        ok_4xx = sum(n for s, n in statuses.items() if 400 <= s < 500)
        row.injected = (f"{total:,} bad bodies to /match, /route, /release and the OpenAI "
                        "/v1/completions, /v1/chat/completions")
        row.detected = (f"{ok_4xx:,} answered 4xx; 5xx {sum(n for s, n in statuses.items() if s >= 500)}; "
                        f"2xx {sum(n for s, n in statuses.items() if s < 300)}; connection errors {errors}")
        row.extra = {"statuses": {str(k): v for k, v in sorted(statuses.items())}, "errors": errors,
                     "in_flight_after": in_flight,
                     "in_flight_before": sum(w["in_flight"] for w in routed_before.values())}
        if in_flight:
            row.notes += f" {in_flight} requests left in flight"
    return row


# --------------------------------------------------------------------------- runner


FAULTS: dict[str, Callable[[Ctx], Row]] = {
    "loss_1pct": lambda ctx: fault_loss(ctx, 1.0),
    "loss_10pct": lambda ctx: fault_loss(ctx, 10.0),
    "dup": fault_dup,
    "reorder": fault_reorder,
    "engine_restart": fault_engine_restart,
    "router_kill": lambda ctx: fault_router_kill(ctx, state=False),
    "router_kill_redis": lambda ctx: fault_router_kill(ctx, state=True),
    "router_kill_relay": fault_router_kill_relay,
    "ring_wrap_control": lambda ctx: fault_router_kill_relay(ctx, relay=False),
    "redis_restart": fault_redis_restart,
    "leader_failover": fault_leader_failover,
    "slow_consumer": fault_slow_consumer,
    "shed_recovery": fault_shed_recovery,
    "fuzz": fault_fuzz,
    "interleaved_no_replay": lambda ctx: fault_interleaved(ctx, replay=False, typed=False),
    "interleaved_replay": lambda ctx: fault_interleaved(ctx, replay=True, typed=False),
    "interleaved_no_replay_typed": lambda ctx: fault_interleaved(ctx, replay=False, typed=True),
    "interleaved_replay_typed": lambda ctx: fault_interleaved(ctx, replay=True, typed=True),
    "oversized": fault_oversized,
    "http": fault_http,
}


def run(names: list[str], ctx: Ctx) -> list[Row]:
    rows: list[Row] = []
    for name in names:
        t0 = time.perf_counter()
        try:
            row = FAULTS[name](ctx)
        except Exception as err:  # a harness failure is a row, not the end of the matrix
            row = Row(name, notes=f"harness error: {type(err).__name__}: {err}")
        row.seconds = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(f"  {row.fault}: recovered={row.recovered} truth={row.truth} crashes={row.crashes} "
              f"lost={row.lost} ({row.seconds}s)", flush=True)
    return rows


def table(rows: list[Row]) -> str:
    head = ["fault", "injected", "detected", "recovered", "index = engines' truth", "crashes", "lost", "s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.notes.startswith("skipped"):
            lines.append(f"| {r.fault} | {r.notes} |" + " |" * (len(head) - 2))
            continue
        cells = [r.fault, r.injected, r.detected, "yes" if r.recovered else "NO",
                 "yes" if r.truth else "NO" + (f" ({r.notes.strip()})" if r.notes else ""),
                 str(r.crashes), str(r.lost), f"{r.seconds:g}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small volumes (a few minutes in all)")
    parser.add_argument("--only", help="comma-separated fault names: " + ", ".join(FAULTS))
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--logs", type=Path, help="keep the serve/relay logs in this folder")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(FAULTS)
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        parser.error(f"unknown fault(s) {unknown}; known: {', '.join(FAULTS)}")
    with tempfile.TemporaryDirectory(prefix="faults-") as tmp:
        workdir = Path(tmp)
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
            workdir = args.logs
        ctx = Ctx(quick=args.quick, workdir=workdir, seed=args.seed, num_engines=args.engines)
        try:
            rows = run(names, ctx)
        finally:
            if ctx.redis is not None:
                ctx.redis.close()
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"quick": args.quick, "engines": args.engines, "seed": args.seed,
                                         "rows": [asdict(r) for r in rows]}, indent=1))
    bad = [r.fault for r in rows if not r.notes.startswith(("skipped", "control"))
           and not (r.recovered and r.truth and r.crashes == 0 and r.lost == 0)]
    if bad:
        print("FAILED: " + ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
