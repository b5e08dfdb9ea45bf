"""Relay benchmark: what a snapshot costs, and what a late router gains from it.

Run:  .venv/bin/python benchmarks/bench_relay.py [--blocks 100000] [--json OUT]

Fixed seed. An engine's history of ``--blocks`` stored blocks (16 tokens
each, in 32-block chains, one batch per chain) is folded into a relay's
state; then:

* ``apply``: folding the history into the relay's BlockSet (blocks/s);
* ``snapshot_cold``: dump + encode the whole block set into snapshot batches
  (what the first late router pays, under the relay's ring lock);
* ``snapshot_cached``: the same request again before the ring moves;
* ``join_snapshot``: end to end on loopback: a real relay publisher
  (``SnapshotRing`` as its replay source) and a real ``EventSubscriber`` +
  ``IndexIngestor`` + ``KvIndex`` joining from seq 0, until the index holds
  every block;
* ``join_full_replay`` (the baseline): the same router joining a plain
  publisher whose ring still holds the entire history (what a router would
  need without a relay: an engine ring as large as the history, which stock
  engines do not keep);
* ``hash_blocks_per_s``: ``--hashes-only`` rewriting (content hash per block);
* ``relayed_batches_per_s`` vs ``direct_batches_per_s``: the history streamed
  by an engine publisher to a subscriber through a running ``EventRelay``
  (plain, and ``--hashes-only``), against the same subscriber on the engine
  directly, as a ratio.

Timings on a shared machine are noisy: read ``join_snapshot`` as a ratio to
``join_full_replay`` measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from typing import Any

import zmq

from tokenspeed_router.events import EventSubscriber, KVEventBatch, ZmqEventPublisher, encode_batch
from tokenspeed_router.events.schema import BlockStored
from tokenspeed_router.relay import BlockSet, ContentHasher, EventRelay, RelayConfig, SnapshotRing
from tokenspeed_router.router import KvIndex
from tokenspeed_router.router.ingest import IndexIngestor

BLOCK = 16
CHAIN = 32


def history(num_blocks: int, seed: int = 0) -> list[KVEventBatch]:
    rng = random.Random(seed)
    batches = []
    next_id = 1
    for _ in range(num_blocks // CHAIN):
        hashes = list(range(next_id, next_id + CHAIN))
        next_id += CHAIN
        tokens = [rng.randrange(32_000) for _ in range(CHAIN * BLOCK)]
        batches.append(KVEventBatch(time.time(), [BlockStored(block_hashes=hashes, parent_block_hash=None,
                                                              token_ids=tokens, block_size=BLOCK)]))
    return batches


def join(ctx: zmq.Context[Any], pub: ZmqEventPublisher, expected_blocks: int, timeout_s: float = 300) -> float:
    """Seconds from subscribing to an index holding ``expected_blocks`` (a real router's path)."""
    index = KvIndex()
    ingestor = IndexIngestor(index)
    t0 = time.perf_counter()
    sub = EventSubscriber("w", pub.endpoint, replay_endpoint=pub.replay_endpoint, context=ctx,
                          replay_timeout_s=60.0)
    try:
        while index.num_blocks("w") < expected_blocks:
            for item in sub.poll(0.05):
                ingestor.on_item(item)
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"router holds {index.num_blocks('w')} of {expected_blocks} blocks")
        return time.perf_counter() - t0
    finally:
        sub.close()


def stream(ctx: zmq.Context[Any], batches: list[KVEventBatch], relay: bool | None) -> float:
    """Batches/s from the first publish to the subscriber's last delivery (relay None: direct)."""
    with ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", context=ctx,
                           buffer_steps=len(batches) + 10) as engine:
        relayed: EventRelay | None = None
        stop = threading.Event()
        thread = None
        source = engine
        if relay is not None:
            relayed = EventRelay(RelayConfig(engine=engine.endpoint, engine_replay=engine.replay_endpoint,
                                             publish="tcp://127.0.0.1:*", replay="tcp://127.0.0.1:*",
                                             buffer_steps=1000, hashes_only=relay), context=ctx)
            thread = threading.Thread(target=relayed.run, args=(stop, 0.01), daemon=True)
            thread.start()
        endpoint = relayed.endpoint if relayed is not None else engine.endpoint
        replay = relayed.replay_endpoint if relayed is not None else engine.replay_endpoint
        sub = EventSubscriber("w", endpoint, replay_endpoint=replay, context=ctx, replay_timeout_s=60.0)
        try:
            engine.publish(KVEventBatch(time.time(), []))  # seq 0: a handshake through every hop
            got = 0
            while got == 0:
                got += sum(1 for _ in sub.poll(0.05))
                if got == 0 and source.statistics().next_seq < 50:
                    engine.publish(KVEventBatch(time.time(), []))
            target = sub.last_seq
            assert target is not None
            t0 = time.perf_counter()
            for b in batches:
                engine.publish(b)
            last = target + len(batches)
            while sub.last_seq is None or sub.last_seq < last:
                sub.poll(0.05)
            return len(batches) / (time.perf_counter() - t0)
        finally:
            sub.close()
            stop.set()
            if thread is not None:
                thread.join(10)
            if relayed is not None:
                relayed.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args(argv)
    batches = history(args.blocks)
    blocks = len(batches) * CHAIN
    out: dict[str, Any] = {"blocks": blocks, "block_tokens": BLOCK}

    t0 = time.perf_counter()
    bs = BlockSet()
    for b in batches:
        bs.apply(b)
    out["apply_blocks_per_s"] = round(blocks / (time.perf_counter() - t0))

    ring = SnapshotRing(1)
    payloads = [encode_batch(b) for b in batches]
    for seq, (payload, batch) in enumerate(zip(payloads, batches, strict=True)):
        ring.append(seq, payload, batch)  # all but the last fold into the base
    t0 = time.perf_counter()
    answer = ring.replay_from(0)
    out["snapshot_cold_s"] = round(time.perf_counter() - t0, 4)
    out["snapshot_batches"] = len(answer) - 1
    out["snapshot_bytes"] = sum(len(p) for _, p in answer)
    t0 = time.perf_counter()
    ring.replay_from(0)
    out["snapshot_cached_s"] = round(time.perf_counter() - t0, 6)

    ctx: zmq.Context[Any] = zmq.Context()
    with ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", context=ctx,
                           buffer_steps=0, replay_source=ring) as relay_pub:
        out["join_snapshot_s"] = round(join(ctx, relay_pub, blocks), 3)
    with ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", context=ctx,
                           buffer_steps=len(batches)) as plain:
        for b in batches:
            plain.publish(b)
        plain.wait_sent(60)
        out["join_full_replay_s"] = round(join(ctx, plain, blocks), 3)
    hasher = ContentHasher()
    t0 = time.perf_counter()
    for b in batches:
        hasher.translate(b)
    out["hash_blocks_per_s"] = round(blocks / (time.perf_counter() - t0))
    out["direct_batches_per_s"] = round(stream(ctx, batches, relay=None))
    out["relayed_batches_per_s"] = round(stream(ctx, batches, relay=False))
    out["relayed_hashes_only_batches_per_s"] = round(stream(ctx, batches, relay=True))
    out["relayed_vs_direct"] = round(out["relayed_batches_per_s"] / out["direct_batches_per_s"], 2)
    ctx.term()
    out["join_snapshot_vs_full_replay"] = round(out["join_snapshot_s"] / out["join_full_replay_s"], 2)
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
