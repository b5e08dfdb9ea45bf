"""A worker recovers from a shed backlog without an engine restart (issue 33 item 3), over real ZMQ.

The engine is the reference ``LruEngine`` publishing through a real
``ZmqEventPublisher`` (a small replay ring, as stock engines have); the
router is a real ``EventSubscriber`` feeding a real ``RoutingCore``. While
the router does not read, the engine serves requests that announce its
shared prefixes; then the subscriber sheds the backlog
(``EventSubscriber.shed_backlog``, the overloaded router's own move), so
those announcements are gone for good. Under steady load the worker must
come back ``live`` with an index equal to the engine's cache, and be routed
the prefixes it holds.
"""

from __future__ import annotations

import random
import time

import zmq
from support import wait_until
from support.lru_engine import LruEngine

from tokenspeed_router.events import EventSubscriber, KVEventBatch, ZmqEventPublisher
from tokenspeed_router.events.subscriber import RESYNC_SHED, ResyncNeeded
from tokenspeed_router.router import RouterConfig
from tokenspeed_router.router.core import RoutingCore
from tokenspeed_router.router.ingest import WorkerState

BS = 4
LOOPBACK = "tcp://127.0.0.1:*"


class _Engine:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], name: str) -> None:
        self.name = name
        self.cache = LruEngine(block_size=BS, capacity_blocks=40, salt=name.encode())
        self.pub = ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, context=ctx, buffer_steps=4)
        self.last_seq = -1

    def serve(self, prompt: list[int]) -> None:
        events = self.cache.admit(prompt)
        if events:
            self.last_seq = self.pub.publish(KVEventBatch(1.0, events))

    def close(self) -> None:
        self.pub.close()


def test_shed_backlog_then_steady_load_returns_the_worker_live_and_exact() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    engines = {n: _Engine(ctx, n) for n in ("w0", "w1")}
    subs = {n: EventSubscriber(n, e.pub.endpoint, replay_endpoint=e.pub.replay_endpoint, context=ctx,
                               replay_timeout_s=5.0) for n, e in engines.items()}
    core = RoutingCore(RouterConfig(approx_block_size=BS), recovery_batches=3)
    rng = random.Random(5)
    heads = [[rng.randrange(1000) for _ in range(3 * BS)] for _ in range(3)]

    def prompt() -> list[int]:
        return rng.choice(heads) + [rng.randrange(1000, 10**6) for _ in range(rng.randint(1, 3) * BS)]

    def pump(name: str) -> None:
        for item in subs[name].poll(0.01):
            core.apply_item(item)

    def caught_up(name: str) -> None:
        e = engines[name]
        wait_until(lambda: (pump(name), subs[name].last_seq == e.last_seq)[1], 15,
                   interval_s=0.0, what=f"{name} at seq {e.last_seq}")

    def request(p: list[int]) -> str:
        decision = core.route(p)
        engines[decision.worker].serve(p)
        caught_up(decision.worker)
        core.release(decision.request_id)
        return decision.worker

    try:
        def joined(name: str) -> bool:
            """Publish one batch; true once it arrived live (caught up, and the SUB is connected)."""
            e = engines[name]
            e.serve([rng.randrange(10**7) for _ in range(BS)])
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                pump(name)
                if subs[name].last_seq == e.last_seq and subs[name].statistics().received > 0:
                    return True
            return False

        for name in engines:
            wait_until(lambda name=name: joined(name), 15, interval_s=0.0, what=f"{name} joined")
        for _ in range(60):
            request(prompt())
        # Overload: the router stops reading w0 while it serves every head (announcing
        # them), then sheds the backlog: more than its ring of 4 can give back.
        for head in heads:
            for _ in range(3):
                engines["w0"].serve(head + [rng.randrange(1000, 10**6) for _ in range(2 * BS)])
        wait_until(lambda: subs["w0"].socket.poll(0) != 0, 15, what="the backlog in w0's socket")
        shed = subs["w0"].shed_backlog()
        assert any(isinstance(x, ResyncNeeded) and x.reason == RESYNC_SHED for x in shed)
        for item in shed:
            core.apply_item(item)
        assert core.ingestor.state("w0") is WorkerState.RESYNCING
        served = {"w0": 0, "w1": 0}
        for i in range(400):
            served[request(prompt())] += 1
            if i % 5 == 0:  # traffic from elsewhere reaches both engines too
                for name, e in engines.items():
                    e.serve([rng.randrange(10**6, 10**7) for _ in range(BS)])
                    caught_up(name)
            if i > 200 and core.ingestor.state("w0") is WorkerState.LIVE:
                break
        st = core.ingestor.status("w0")
        assert st.state is WorkerState.LIVE, st
        assert st.named_parents >= 1 and served["w0"] > 0
        idx = core.index
        for head in heads:
            for name, e in engines.items():
                assert idx.match(head).get(name, 0) == e.cache.truth(head), (name, head[:4])
        for name, e in engines.items():
            assert idx.num_blocks(name) == e.cache.num_blocks(), name
    finally:
        for sub in subs.values():
            sub.close()
        for e in engines.values():
            e.close()
        ctx.term()
