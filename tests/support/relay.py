"""Engine, relay and router pieces for the relay tests (real sockets, no sleeps)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from support import wait_until
from tokenspeed_router.cache import PrefixCache
from tokenspeed_router.events import EventSubscriber, SubscriberItem, ZmqEventPublisher
from tokenspeed_router.events.curve import CurveClientKeys
from tokenspeed_router.relay import EventRelay, RelayConfig
from tokenspeed_router.router import KvIndex
from tokenspeed_router.router.ingest import IndexIngestor

Ctx = zmq.Context[zmq.Socket[bytes]]
PAGE = 4
LOOPBACK = "tcp://127.0.0.1:*"


def workload(seed: int, n: int = 80) -> list[list[int]]:
    """Prompts with shared system prefixes, enough to evict from a small cache."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(4 * PAGE)] for _ in range(3)]
    out = []
    for _ in range(n):
        head = rng.choice(systems)[: PAGE * rng.randint(0, 4)]
        out.append(head + [rng.randrange(1000) for _ in range(rng.randint(1, 5 * PAGE))])
    return out


class Engine:
    """A PrefixCache publishing through a real ZmqEventPublisher (the engine's truth)."""

    def __init__(self, ctx: Ctx, *, buffer_steps: int, pages: int = 24, endpoint: str = LOOPBACK,
                 replay_endpoint: str = LOOPBACK, topic: str = "") -> None:
        self.cache = PrefixCache.with_capacity(pages, page_size=PAGE, medium="GPU")
        self.publisher = ZmqEventPublisher(endpoint, replay_endpoint=replay_endpoint, context=ctx,
                                           buffer_steps=buffer_steps, topic=topic)
        self.cache.attach_publisher(self.publisher)
        self._probe = iter(range(100_000, 200_000))

    @property
    def last_seq(self) -> int:
        return self.publisher.statistics().next_seq - 1

    def probe(self) -> None:
        """One new block, so one batch."""
        self.cache.admit([next(self._probe)] * PAGE)

    def run(self, prompts: list[list[int]]) -> None:
        for tokens in prompts:
            self.cache.admit(tokens)
        self.cache.evict(6 * PAGE)
        self.cache.flush_events()

    def blocks(self) -> int:
        return self.cache.total_size() // PAGE

    def truth(self, tokens: list[int]) -> int:
        return self.cache.match_prefix(tokens).device_prefix_length // PAGE

    def close(self) -> None:
        self.publisher.close()


class RelayThread:
    """An EventRelay driven by its own thread (as the CLI does)."""

    def __init__(self, ctx: Ctx, source: Engine, **config: Any) -> None:
        values: dict[str, Any] = {"engine": source.publisher.endpoint,
                                  "engine_replay": source.publisher.replay_endpoint,
                                  "publish": LOOPBACK, "replay": LOOPBACK}
        values.update(config)
        cfg = RelayConfig(**values)
        self.relay = EventRelay(cfg, context=ctx)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.relay.run, args=(self._stop, 0.01), daemon=True)
        self._thread.start()

    def wait_engine_seq(self, seq: int) -> None:
        wait_until(lambda: self.relay.statistics().last_engine_seq == seq, 15,
                   what=f"engine seq {seq} at the relay")

    @property
    def last_seq(self) -> int:
        return self.relay.statistics().next_seq - 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.relay.close()


class RouterView:
    """What a router builds from one stream: subscriber -> IndexIngestor -> KvIndex."""

    def __init__(self, ctx: Ctx, endpoint: str, replay: str | None, *, curve: CurveClientKeys | None = None,
                 worker: str = "w", topic: str = "") -> None:
        self.worker = worker
        self.index = KvIndex()
        self.ingestor = IndexIngestor(self.index)
        self.items: list[SubscriberItem] = []
        self.sub = EventSubscriber(worker, endpoint, replay_endpoint=replay, context=ctx, curve=curve,
                                   replay_timeout_s=5.0, topic=topic)

    def pump(self, timeout_s: float = 0.01) -> None:
        for item in self.sub.poll(timeout_s):
            self.items.append(item)
            self.ingestor.on_item(item)

    def got_live(self, seq: int, within_s: float = 0.5) -> bool:
        """Whether batch ``seq``, just published, arrives within ``within_s`` with the SUB
        connected (a live batch received): caught up through a join replay is not enough,
        the next batches could still be lost to the slow joiner."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            self.pump()
            if self.sub.last_seq == seq and self.sub.statistics().received > 0:
                return True
        return False

    def wait_seq(self, seq: int, each: Callable[[], None] | None = None, timeout_s: float = 15) -> None:
        def there() -> bool:
            if each is not None:
                each()
            self.pump()
            return self.sub.last_seq == seq

        try:
            wait_until(there, timeout_s, what=f"seq {seq} at router {self.worker}")
        except AssertionError as err:  # say which stream and how far it got
            raise AssertionError(f"{err} from {self.sub.endpoint}: {self.sub.statistics()}") from None

    def blocks(self) -> int:
        return self.index.num_blocks(self.worker)

    def score(self, tokens: list[int]) -> int:
        return self.index.match(tokens).get(self.worker, 0)

    def close(self) -> None:
        self.sub.close()


def handshake(engine: Engine, relay: RelayThread) -> None:
    """Publish probes until the relay has the engine's stream (slow joiner)."""
    def seen() -> bool:
        engine.probe()
        return relay.relay.statistics().batches_in > 0

    wait_until(seen, 15, interval_s=0.02, what="the relay to receive the engine's first batch")
    engine.cache.reset()  # AllBlocksCleared: probes the relay may have missed do not count
    engine.cache.flush_events()
    relay.wait_engine_seq(engine.last_seq)


def assert_same_as_engine(view: RouterView, engine: Engine, prompts: list[list[int]]) -> None:
    assert view.blocks() == engine.blocks(), (view.blocks(), engine.blocks())
    for tokens in prompts:
        assert view.score(tokens) == engine.truth(tokens), tokens
