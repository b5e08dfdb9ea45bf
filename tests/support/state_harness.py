"""Helpers for the Redis state tests (tests/integration/test_state_*.py).

Real publishers, real subscribers, a real redis-server: the only thing made
up here is the workload (a deterministic random mix of stores, removes and
clears over shared prompts, so that matches are meaningful).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Mapping
from typing import Any

import zmq

from support import wait_until
from tokenspeed_router.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from tokenspeed_router.events.publisher import ZmqEventPublisher
from tokenspeed_router.events.subscriber import EventSubscriber, SubscriberItem
from tokenspeed_router.events.subscriber_group import SubscriberGroup
from tokenspeed_router.router.index import KvIndex
from tokenspeed_router.router.ingest import IndexIngestor
from tokenspeed_router.state import LocalIndexHost, RedisStateConfig, RedisStateReplica

BLOCK_SIZE = 4
NUM_PROMPTS = 12
PROMPT_BLOCKS = 6


def prompts(seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 50_000) for _ in range(2 * BLOCK_SIZE)]
    out = []
    for i in range(NUM_PROMPTS):
        tail = [rng.randrange(1, 50_000) for _ in range((PROMPT_BLOCKS - 2) * BLOCK_SIZE)]
        out.append(shared + tail if i % 2 == 0 else tail + shared)
    return out


def queries() -> list[list[int]]:
    """Every prompt at every block length, plus a partial tail (never matches)."""
    out = []
    for p in prompts():
        for k in range(1, PROMPT_BLOCKS + 1):
            out.append(p[: k * BLOCK_SIZE])
        out.append(p[: 2 * BLOCK_SIZE + 1])
    return out


class WorkerModel:
    """A worker's cache as chains of prompt prefixes; emits valid events."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.prompts = prompts()
        self.chains: dict[int, list[BlockHash]] = {}
        self.next_hash = seed * 1_000_000 + 1

    def next_events(self) -> list[Any]:
        r = self.rng.random()
        held = [p for p, c in self.chains.items() if c]
        if r < 0.02 and held:
            self.chains.clear()
            return [AllBlocksCleared()]
        if r < 0.3 and held:
            p = self.rng.choice(held)
            h = self.chains[p].pop()
            return [BlockRemoved(block_hashes=[h])]
        p = self.rng.randrange(NUM_PROMPTS)
        chain = self.chains.setdefault(p, [])
        target = self.rng.randint(len(chain) + 1, PROMPT_BLOCKS) if len(chain) < PROMPT_BLOCKS else 0
        if not target:
            h = chain.pop()
            return [BlockRemoved(block_hashes=[h])]
        new: list[BlockHash] = list(range(self.next_hash, self.next_hash + target - len(chain)))
        self.next_hash += len(new)
        tokens = self.prompts[p][len(chain) * BLOCK_SIZE : target * BLOCK_SIZE]
        parent = chain[-1] if chain else None
        chain.extend(new)
        return [BlockStored(block_hashes=new, parent_block_hash=parent, token_ids=tokens,
                            block_size=BLOCK_SIZE)]


class Workers:
    """Real ZmqEventPublishers (PUB + replay ROUTER on OS-chosen ports)."""

    def __init__(self, names: list[str], ctx: zmq.Context[Any]) -> None:
        self.names = names
        self.publishers = {
            n: ZmqEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                                 buffer_steps=10_000, context=ctx)
            for n in names
        }
        self.models = {n: WorkerModel(i + 1) for i, n in enumerate(names)}
        self.last_seq: dict[str, int] = {}

    def endpoints(self) -> list[tuple[str, str, str | None]]:
        return [(n, p.endpoint, p.replay_endpoint) for n, p in self.publishers.items()]

    def publish(self, rounds: int) -> None:
        for _ in range(rounds):
            for n in self.names:
                self.last_seq[n] = self.publishers[n].publish(
                    KVEventBatch(time.time(), self.models[n].next_events()))
        for p in self.publishers.values():
            p.wait_sent(5.0)

    def handshake(self, *parties: Any, timeout_s: float = 10.0) -> None:
        """Publish empty probe batches until every party has seen one from every worker.

        ZeroMQ drops what a PUB sends before a SUB is connected, and a
        subscriber that never sees live traffic never asks for replay: the probe
        makes sure the subscriptions are up before the test's events flow.
        """

        def seen() -> bool:
            for n in self.names:
                self.last_seq[n] = self.publishers[n].publish(KVEventBatch(time.time(), []))
            for party in parties:
                seqs = party.seqs() if isinstance(party, Replica) else party.last_seqs()
                if any(seqs.get(n) is None for n in self.names):
                    return False
            return True

        wait_until(seen, timeout_s=timeout_s, interval_s=0.02, what="subscriptions to see the probes")
        wait_converged(self, *parties)

    def close(self) -> None:
        for p in self.publishers.values():
            p.close()


class Pump:
    """Subscribes while told to and feeds every item to ``submit`` on its own thread.

    Plays the router service's ingestion loop: ``control`` is the replica's
    IngestionControl (start from the given seqs / stop).
    """

    def __init__(self, endpoints: list[tuple[str, str, str | None]], submit: Any,
                 ctx: zmq.Context[Any]) -> None:
        self.endpoints = endpoints
        self.submit = submit
        self.ctx = ctx
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.started_with: list[dict[str, int]] = []

    @property
    def control(self) -> tuple[Any, Any]:
        return (self.start, self.stop)

    def start(self, start_seqs: Mapping[str, int]) -> None:
        self.stop()
        self.started_with.append(dict(start_seqs))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(dict(start_seqs), self._stop),
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self._thread = None

    def _run(self, start_seqs: dict[str, int], stop: threading.Event) -> None:
        group = SubscriberGroup(
            EventSubscriber(n, ep, replay_endpoint=rp, context=self.ctx, replay_timeout_s=2.0,
                            start_seq=start_seqs.get(n))
            for n, ep, rp in self.endpoints
        )
        try:
            while not stop.is_set():
                for item in group.poll(0.02):
                    self.submit(item)
        finally:
            group.close()


class Reference:
    """A single in-memory router that saw everything (its own subscribers)."""

    def __init__(self, endpoints: list[tuple[str, str, str | None]], ctx: zmq.Context[Any]) -> None:
        self.index = KvIndex()
        self.ingestor = IndexIngestor(self.index)
        self.lock = threading.Lock()
        self.pump = Pump(endpoints, self._apply, ctx)
        self.pump.start({})

    def _apply(self, item: SubscriberItem) -> None:
        with self.lock:
            self.ingestor.on_item(item)

    def last_seqs(self) -> dict[str, int | None]:
        with self.lock:
            return {w: s.last_seq for w, s in self.ingestor.statuses().items()}

    def answers(self) -> list[dict[str, int]]:
        with self.lock:
            return [self.index.match(q) for q in queries()]

    def close(self) -> None:
        self.pump.stop()


def make_config(url: str, replica_id: str, **overrides: Any) -> RedisStateConfig:
    values: dict[str, Any] = {
        "lease_ttl_s": 3.0, "snapshot_every_batches": 10_000, "snapshot_every_s": 3600.0,
        "read_block_ms": 50, "backoff_min_s": 0.02, "backoff_max_s": 0.2, "socket_timeout_s": 1.0,
    }
    values.update(overrides)
    return RedisStateConfig(url=url, replica_id=replica_id, **values)


class Replica:
    """A RedisStateReplica with its index host and its (leader-only) subscriptions."""

    def __init__(self, url: str, name: str, endpoints: list[tuple[str, str, str | None]],
                 ctx: zmq.Context[Any], **overrides: Any) -> None:
        self.name = name
        self.host = LocalIndexHost()
        self.state = RedisStateReplica(make_config(url, name, **overrides), self.host)
        self.pump = Pump(endpoints, self.state.submit, ctx)
        self.state.set_ingestion(self.pump.control)

    def start(self) -> Replica:
        self.state.start()
        return self

    def answers(self) -> list[dict[str, int]]:
        with self.host.locked():
            return [self.host.index.match(q) for q in queries()]

    def seqs(self) -> dict[str, int]:
        return {w: p[1] for w, p in self.state.applier.positions_copy().items()}

    def crash(self) -> None:
        """As if the process was SIGKILLed: nothing flushed, nothing released."""
        self.pump.stop()
        crash_replica(self.state)

    def close(self) -> None:
        self.state.close()
        self.pump.stop()


def crash_replica(replica: RedisStateReplica) -> None:
    """Stop a replica's threads at once without flushing or releasing its lease.

    A test hook, so it lives here and reaches into the replica: the library has
    no reason to offer a way to lose data on purpose.
    """
    replica._closed = True
    replica._stop.set()
    replica._wake.set()
    replica.writer.deactivate()
    replica.writer.stop(1.0)
    replica.follower.stop(1.0)
    if replica._thread is not None:
        replica._thread.join(5.0)
    replica._client.close()
    replica._role = "stopped"


def wait_converged(workers: Workers, *parties: Any, timeout_s: float = 20.0) -> None:
    """Wait until every party (Replica or Reference) applied each worker's last seq."""
    target = dict(workers.last_seq)

    def done() -> bool:
        for party in parties:
            seqs = party.seqs() if isinstance(party, Replica) else party.last_seqs()
            if any(seqs.get(w) != s for w, s in target.items()):
                return False
        return True

    try:
        wait_until(done, timeout_s=timeout_s, what=f"replicas to apply seqs {target}")
    except AssertionError as err:
        seen = [p.seqs() if isinstance(p, Replica) else p.last_seqs() for p in parties]
        raise AssertionError(f"{err}; parties are at {seen}") from None


def wait_leader(*replicas: Replica, timeout_s: float = 15.0) -> Replica:
    def leader() -> Replica | None:
        leaders = [r for r in replicas if r.state.is_leader]
        return leaders[0] if len(leaders) == 1 else None

    result = wait_until(leader, timeout_s=timeout_s, what="exactly one leader")
    assert result is not None
    return result
