"""The event relay (DESIGN §12) with real sockets: snapshot + tail, restarts, hashes-only.

The engine is a real PrefixCache publishing through a ZmqEventPublisher with
a tiny replay ring; routers are real EventSubscribers feeding the router's
own IndexIngestor + KvIndex. "Complete" always means: equal to the engine's
cache (block count and the match answer for every prompt).
"""

from __future__ import annotations

from typing import Any

import msgspec
import zmq
from support import wait_until
from support.relay import (
    LOOPBACK,
    PAGE,
    Ctx,
    Engine,
    RelayThread,
    RouterView,
    assert_same_as_engine,
    handshake,
    workload,
)
from support.server import BLOCK, DropProxy, removed, stored, tokens

from tokenspeed_router.events import (
    AllBlocksCleared,
    BatchReceived,
    BlockStored,
    KVEventBatch,
    PublisherRestarted,
    ResyncNeeded,
    decode_batch,
)
from tokenspeed_router.events.frames import END_SEQ, encode_seq
from tokenspeed_router.events.publisher import ZmqEventPublisher


def test_late_router_gets_complete_view_after_engine_ring_wrapped(ctx: Ctx) -> None:
    engine = Engine(ctx, buffer_steps=4)
    relay = RelayThread(ctx, engine, buffer_steps=8)
    try:
        handshake(engine, relay)
        prompts = workload(seed=3)
        engine.run(prompts)
        relay.wait_engine_seq(engine.last_seq)
        assert engine.last_seq > 50, "the workload must wrap both rings many times"
        assert engine.cache.statistics().evicted_tokens > 0

        # A router that joins the engine directly now only gets the last 4 batches.
        direct = RouterView(ctx, engine.publisher.endpoint, engine.publisher.replay_endpoint, worker="d")
        direct.wait_seq(engine.last_seq)
        assert direct.blocks() < engine.blocks()

        # Through the relay: snapshot (before the relay's ring) + the ring.
        late = RouterView(ctx, relay.relay.endpoint, relay.relay.replay_endpoint)
        late.wait_seq(relay.last_seq)
        assert_same_as_engine(late, engine, prompts)
        assert not any(isinstance(x, ResyncNeeded) for x in late.items)
        assert late.ingestor.statuses()["w"].state == "live"
        stats = relay.relay.statistics()
        assert stats.ring.snapshots_served >= 1 and stats.ring.last_snapshot_blocks > 0
        assert stats.ring.ring_batches == 8

        # And it keeps following live traffic.
        more = workload(seed=4, n=20)
        engine.run(more)
        relay.wait_engine_seq(engine.last_seq)
        late.wait_seq(relay.last_seq)
        assert_same_as_engine(late, engine, prompts + more)
        direct.close()
        late.close()
    finally:
        relay.close()
        engine.close()


def test_snapshot_reply_is_wire_compatible(ctx: Ctx) -> None:
    """A raw DEALER asking from seq 0: [b'', topic, seq, payload] frames, consecutive
    seqs ending at the relay's last one, AllBlocksCleared first, then the end marker."""
    engine = Engine(ctx, buffer_steps=4)
    relay = RelayThread(ctx, engine, buffer_steps=4, snapshot_blocks_per_batch=16)
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    try:
        handshake(engine, relay)
        engine.run(workload(seed=5, n=30))
        relay.wait_engine_seq(engine.last_seq)
        dealer.connect(relay.relay.replay_endpoint)
        dealer.send_multipart([b"", encode_seq(0)])
        frames_list = []
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        while True:
            assert poller.poll(10_000), "relay did not answer the replay request"
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                assert frames == [b"", b"", END_SEQ, b""]
                break
            assert len(frames) == 4 and frames[0] == b""
            frames_list.append(frames)
        seqs = [int.from_bytes(f[2], "big") for f in frames_list]
        assert seqs == list(range(seqs[0], relay.last_seq + 1))
        batches = [decode_batch(f[3]) for f in frames_list]
        assert isinstance(batches[0].events[0], AllBlocksCleared)
        snapshot_len = len(seqs) - 4
        assert snapshot_len > 1, "16 blocks per batch: the snapshot spans several batches"
        stored = [e for b in batches[:snapshot_len] for e in b.events if isinstance(e, BlockStored)]
        known: set[object] = set()
        for ev in stored:  # parents before children
            assert ev.parent_block_hash is None or ev.parent_block_hash in known
            known.update(ev.block_hashes)
    finally:
        dealer.close(linger=0)
        relay.close()
        engine.close()


def test_engine_restart_is_republished_as_clear_then_rebuilt(ctx: Ctx) -> None:
    engine = Engine(ctx, buffer_steps=1000)
    relay = RelayThread(ctx, engine, buffer_steps=1000)
    view = RouterView(ctx, relay.relay.endpoint, relay.relay.replay_endpoint)
    endpoints = (engine.publisher.endpoint, engine.publisher.replay_endpoint)
    try:
        handshake(engine, relay)
        engine.run(workload(seed=6, n=30))
        relay.wait_engine_seq(engine.last_seq)
        view.wait_seq(relay.last_seq)
        assert view.blocks() == engine.blocks() > 0

        engine.close()  # the engine restarts: same endpoints, empty cache, seq from 0
        assert endpoints[1] is not None
        engine = Engine(ctx, buffer_steps=1000, endpoint=endpoints[0], replay_endpoint=endpoints[1])
        prompts = workload(seed=7, n=10)
        engine.run(prompts)
        wait_until(lambda: relay.relay.statistics().restarts == 1, 15, what="the relay to see the restart")
        relay.wait_engine_seq(engine.last_seq)
        view.wait_seq(relay.last_seq)
        assert_same_as_engine(view, engine, prompts)
        # The router saw an ordinary relayed batch clearing everything, not a restart of the relay.
        assert not any(isinstance(x, PublisherRestarted) for x in view.items)
        cleared = [x for x in view.items if isinstance(x, BatchReceived)
                   and x.batch.events == [AllBlocksCleared()]]
        assert cleared
    finally:
        view.close()
        relay.close()
        engine.close()


def test_unrecoverable_engine_gap_is_republished_as_clear(ctx: Ctx) -> None:
    """No engine replay and a lost engine batch: the relay clears its routers, which then
    never claim more than the engine holds, and are exact again after the engine's next reset."""
    engine = Engine(ctx, buffer_steps=4)
    proxy = DropProxy(engine.publisher.endpoint, set())
    relay = RelayThread(ctx, engine, engine=proxy.endpoint, engine_replay=None, buffer_steps=1000)
    view = RouterView(ctx, relay.relay.endpoint, relay.relay.replay_endpoint)
    try:
        handshake(engine, relay)
        proxy.drop_seqs.add(engine.last_seq + 5)
        prompts = workload(seed=12, n=30)
        engine.run(prompts)
        relay.wait_engine_seq(engine.last_seq)
        view.wait_seq(relay.last_seq)
        stats = relay.relay.statistics()
        assert proxy.dropped and stats.resyncs == 1 and stats.gaps == 1
        cleared = [x for x in view.items if isinstance(x, BatchReceived) and x.batch.events == [AllBlocksCleared()]]
        assert len(cleared) == 1
        for tokens in prompts:
            assert view.score(tokens) <= engine.truth(tokens)
        engine.cache.reset()
        engine.run(again := workload(seed=13, n=20))
        relay.wait_engine_seq(engine.last_seq)
        view.wait_seq(relay.last_seq)
        assert_same_as_engine(view, engine, again)
    finally:
        view.close()
        relay.close()
        proxy.close()
        engine.close()


def test_hashes_only_matches_direct_router_and_sends_no_token_ids(ctx: Ctx) -> None:
    engine = Engine(ctx, buffer_steps=10_000)
    relay = RelayThread(ctx, engine, buffer_steps=8, hashes_only=True)
    direct = RouterView(ctx, engine.publisher.endpoint, engine.publisher.replay_endpoint, worker="d")
    raw = ctx.socket(zmq.SUB)
    raw.linger = 0
    raw.setsockopt(zmq.SUBSCRIBE, b"")
    raw.connect(relay.relay.endpoint)
    frames_seen: list[list[bytes]] = []

    def drain_raw() -> None:
        while True:
            try:
                frames_seen.append(raw.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return

    try:
        handshake(engine, relay)
        direct.wait_seq(engine.last_seq)
        prompts = workload(seed=8)
        engine.run(prompts)
        relay.wait_engine_seq(engine.last_seq)
        direct.wait_seq(engine.last_seq)
        late = RouterView(ctx, relay.relay.endpoint, relay.relay.replay_endpoint)
        late.wait_seq(relay.last_seq, each=drain_raw)
        assert relay.relay.statistics().ring.snapshots_served >= 1

        assert_same_as_engine(late, engine, prompts)
        queries = prompts + [p[: PAGE * k] for p in prompts for k in (1, 2)] + [[1, 2, 3, 4] * 3]
        assert [late.score(q) for q in queries] == [direct.score(q) for q in queries]
        hasher = relay.relay.statistics().hasher
        assert hasher is not None and hasher.blocks_hashed > 0

        # No token id in anything the relay sent: live frames and the late router's replay (snapshot).
        drain_raw()
        relayed = [msgspec.msgpack.decode(f[2]) for f in frames_seen if len(f) == 3]
        relayed += [decode_batch(item.payload) for item in late.items if isinstance(item, BatchReceived)]
        stores = 0
        for payload in relayed:
            batch = payload if isinstance(payload, KVEventBatch) else decode_batch(msgspec.msgpack.encode(payload))
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    stores += 1
                    assert ev.token_ids == [], ev
        assert stores > 0
        late.close()
    finally:
        raw.close(linger=0)
        direct.close()
        relay.close()
        engine.close()


def test_relay_loopback_only_defaults_are_validated() -> None:
    from tokenspeed_router.errors import ConfigError
    from tokenspeed_router.relay import RelayConfig

    for bad in (dict(buffer_steps=0), dict(curve_allow=("x.key",)), dict(curve_secret_key="x.key_secret"),
                dict(replay=LOOPBACK.replace("*", "5999"), publish=LOOPBACK.replace("*", "5999"))):
        kwargs = dict(engine="tcp://127.0.0.1:5557", publish=LOOPBACK, replay="tcp://127.0.0.1:0")
        kwargs.update(bad)  # type: ignore[arg-type]
        try:
            RelayConfig(**kwargs)  # type: ignore[arg-type]
        except ConfigError:
            continue
        raise AssertionError(f"accepted {bad}")


def test_relay_without_topic_republishes_under_the_engines_topic(ctx: Ctx) -> None:
    """An engine publishing under ``kv`` behind a relay started without ``--topic``:
    a router whose worker spec says ``topic=kv`` gets the whole view (it scored 0)."""
    engine = Engine(ctx, buffer_steps=64, topic="kv")
    relay = RelayThread(ctx, engine, buffer_steps=64)
    try:
        handshake(engine, relay)
        prompts = workload(seed=5, n=20)
        engine.run(prompts)
        relay.wait_engine_seq(engine.last_seq)
        view = RouterView(ctx, relay.relay.endpoint, relay.relay.replay_endpoint, topic="kv")
        view.wait_seq(relay.last_seq, each=lambda: None)
        assert relay.relay._publisher is not None and relay.relay._publisher.topic == "kv"
        assert_same_as_engine(view, engine, prompts)
        more = workload(seed=6, n=10)
        engine.run(more)
        relay.wait_engine_seq(engine.last_seq)
        view.wait_seq(relay.last_seq)
        assert_same_as_engine(view, engine, prompts + more)
        view.close()
    finally:
        relay.close()
        engine.close()


class _RawEngine:
    """A bare publisher (hand-made events) in the shape RelayThread takes."""

    def __init__(self, ctx: Ctx) -> None:
        self.publisher = ZmqEventPublisher(LOOPBACK, replay_endpoint=LOOPBACK, context=ctx, buffer_steps=1000)
        self.last_seq = -1

    def send(self, *events: Any) -> None:
        self.last_seq = self.publisher.publish(KVEventBatch(1.0, list(events)))

    def close(self) -> None:
        self.publisher.close()


def _raw_handshake(engine: _RawEngine, relay: RelayThread) -> None:
    def seen() -> bool:
        engine.send()
        return relay.relay.statistics().batches_in > 0

    wait_until(seen, 15, interval_s=0.02, what="the relay to receive the engine's first batch")
    relay.wait_engine_seq(engine.last_seq)


def test_network_blip_on_a_wrapped_relay_is_not_a_restart(ctx: Ctx) -> None:
    """A router following a relay whose ring wrapped loses its link while nothing is
    published: no restart, no resync, nothing rebuilt (it used to verify from seq 0,
    get the snapshot numbered with seqs it had applied with other bytes, and count a restart)."""
    engine = Engine(ctx, buffer_steps=4)
    relay = RelayThread(ctx, engine, buffer_steps=8)
    try:
        handshake(engine, relay)
        view = RouterView(ctx, relay.relay.endpoint, relay.relay.replay_endpoint)

        def follows_live() -> bool:  # a live batch reached it: its SUB is connected
            engine.probe()
            relay.wait_engine_seq(engine.last_seq)
            view.pump(0.05)
            stats = view.sub.statistics()
            return view.sub.last_seq == relay.last_seq and stats.delivered > stats.replayed

        wait_until(follows_live, 15, interval_s=0.0, what="the router to follow the relay live")
        # It applies the workload's batches as they are relayed; then the relay's ring wraps.
        prompts = workload(seed=8, n=40)
        engine.run(prompts)
        relay.wait_engine_seq(engine.last_seq)
        view.wait_seq(relay.last_seq)
        assert relay.last_seq > 20  # the relay's ring (8) has wrapped
        seen = len(view.items)
        view.sub.connection_reset()  # what the ingestion loop calls when the link comes back
        wait_until(lambda: (view.pump(), not view.sub.statistics().replaying and
                            not view.sub.needs_processing())[1], 15, what="the verify replay")
        assert view.sub.statistics().replay_requests >= 2  # the verify did run
        after = view.items[seen:]
        assert not any(isinstance(x, (PublisherRestarted, ResyncNeeded)) for x in after), after
        assert view.sub.statistics().restarts == 0
        assert_same_as_engine(view, engine, prompts)
        view.close()
    finally:
        relay.close()
        engine.close()


def test_snapshot_keeps_blocks_held_below_a_removed_block(ctx: Ctx) -> None:
    """The engine evicts block 2 of a 6-block chain, keeps 3..5, later stores 2 again:
    a router that joins through the snapshot scores 6 like a direct one (it scored 3)."""
    engine = _RawEngine(ctx)
    relay = RelayThread(ctx, engine, buffer_steps=4)  # type: ignore[arg-type]
    try:
        _raw_handshake(engine, relay)
        direct = RouterView(ctx, engine.publisher.endpoint, engine.publisher.replay_endpoint, worker="w")

        def direct_sees() -> bool:  # caught up *and* a live batch reached it: its SUB is connected
            engine.send()
            return direct.got_live(engine.last_seq)

        wait_until(direct_sees, 15, interval_s=0.0, what="the direct router to follow")
        chain = tokens(7, 6)
        engine.send(stored(chain))
        engine.send(removed(chain, 2, 1))
        for _ in range(6):  # push both out of the relay's ring: the hole is in its snapshot state
            engine.send()
        engine.send(stored(chain[2 * BLOCK : 3 * BLOCK], parent_tokens=chain[: 2 * BLOCK]))
        relay.wait_engine_seq(engine.last_seq)
        direct.wait_seq(engine.last_seq)
        assert direct.score(chain) == 6
        late = RouterView(ctx, relay.relay.endpoint, relay.relay.replay_endpoint)
        late.wait_seq(relay.last_seq)
        assert relay.relay.statistics().ring.snapshots_served >= 1
        assert late.score(chain) == 6 and late.blocks() == direct.blocks() == 6
        direct.close()
        late.close()
    finally:
        relay.close()
        engine.close()
