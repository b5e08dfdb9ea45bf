"""A reference engine for the recovery tests: a prefix cache of token blocks, LRU by leaves.

Simple on purpose (the model a test is judged against): blocks are the full
token prefixes they end; a request touches its cached prefix, stores the
blocks it lacks under the last one it found, and evicts least recently used
*leaves* to make room (a radix cache evicts children before parents, as
SGLang's and ours do). External ids are opaque and stable per content
(``sha256`` of the prefix, as vLLM's chained hashes are), never the router's
content ids. ``truth(tokens)`` is how many leading blocks it holds.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from tokenspeed_router.events.schema import BlockRemoved, BlockStored, Event


class LruEngine:
    """One engine's cache (module docstring); ``admit`` returns the events of one batch."""

    def __init__(self, *, block_size: int, capacity_blocks: int, salt: bytes = b"") -> None:
        self.block_size = block_size
        self.capacity = capacity_blocks
        self._salt = salt
        #: prefix (tuple of tokens, whole blocks) -> None; order = least recently used first
        self._lru: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self._children: dict[tuple[int, ...], int] = {}

    def ext(self, prefix: tuple[int, ...]) -> int:
        return int.from_bytes(hashlib.sha256(self._salt + repr(prefix).encode()).digest()[:8], "little")

    def _blocks(self, tokens: list[int]) -> list[tuple[int, ...]]:
        bs = self.block_size
        return [tuple(tokens[: (i + 1) * bs]) for i in range(len(tokens) // bs)]

    def truth(self, tokens: list[int]) -> int:
        n = 0
        for p in self._blocks(tokens):
            if p not in self._lru:
                break
            n += 1
        return n

    def num_blocks(self) -> int:
        return len(self._lru)

    def admit(self, tokens: list[int]) -> list[Event]:
        """Serve a prompt: touch its cached prefix, evict leaves for room, store the rest."""
        blocks = self._blocks(tokens)[: self.capacity]
        have = self.truth(tokens)
        for p in reversed(blocks[:have]):  # leaf first, root last: parents end newest
            self._lru.move_to_end(p)
        new = blocks[have:]
        if not new:
            return []
        events: list[Event] = []
        removed = self._evict(len(self._lru) + len(new) - self.capacity, keep=set(blocks[:have]))
        if removed:
            events.append(BlockRemoved(block_hashes=[self.ext(p) for p in removed]))
        for p in new:
            self._lru[p] = None
            parent = p[: -self.block_size]
            if parent:
                self._children[parent] = self._children.get(parent, 0) + 1
        parent_ext = self.ext(blocks[have - 1]) if have else None
        bs = self.block_size
        events.append(BlockStored(
            block_hashes=[self.ext(p) for p in new],
            parent_block_hash=parent_ext,
            token_ids=list(tokens[have * bs : len(blocks) * bs]),
            block_size=bs,
        ))
        return events

    def _evict(self, n: int, keep: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = []
        while n > 0:
            victim = next((p for p in self._lru if not self._children.get(p) and p not in keep), None)
            if victim is None:
                break
            del self._lru[victim]
            parent = victim[: -self.block_size]
            if parent:
                self._children[parent] -= 1
            out.append(victim)
            n -= 1
        return out


class Fleet:
    """Engines behind a real :class:`RoutingCore` (index, ingestor, router), on a virtual clock.

    ``request(prompt)`` routes it, lets the chosen engine serve it and
    delivers that engine's batch (or loses it: ``lose``), then releases the
    request. ``check_sound()`` asserts the index never claims a block an
    engine does not hold: the contract the recovery must keep.
    """

    def __init__(self, core: object, engines: dict[str, LruEngine]) -> None:
        from tokenspeed_router.router.core import RoutingCore

        assert isinstance(core, RoutingCore)
        self.core = core
        self.engines = engines
        self.seq = dict.fromkeys(engines, -1)
        self.now = 0.0
        self.hits = self.tokens = 0
        #: engines whose latest batch was lost: the router cannot know yet what it removed
        self.behind: set[str] = set()
        for name in engines:
            core.add_worker(name)

    def publish(self, name: str, events: list[Event], *, lose: bool = False) -> None:
        from tokenspeed_router.events.schema import KVEventBatch

        if not events:
            return
        self.seq[name] += 1
        self.now += 0.001
        if lose:
            self.behind.add(name)
        else:
            self.behind.discard(name)
            self.core.apply_record(name, self.seq[name], KVEventBatch(self.now, events), self.now)

    def request(self, prompt: list[int], *, lose: bool = False, to: str | None = None) -> str:
        """Route (or send ``to`` a worker), serve, publish, release; returns the worker."""
        decision = self.core.route(prompt)
        name = to if to is not None else decision.worker
        engine = self.engines[name]
        self.hits += engine.truth(prompt) * engine.block_size
        self.tokens += len(prompt)
        self.publish(name, engine.admit(prompt), lose=lose)
        self.core.release(decision.request_id)
        return name

    def check_sound(self, prompts: list[list[int]]) -> None:
        """Every engine whose latest batch arrived: the index claims nothing it does not hold."""
        for prompt in prompts:
            scores = self.core.index.match(prompt)
            for name, engine in self.engines.items():
                if name in self.behind:
                    continue
                got, truth = scores.get(name, 0), engine.truth(prompt)
                assert got <= truth, f"{name} claimed {got} blocks of a prompt it holds {truth} of"

    def exact(self, prompts: list[list[int]]) -> bool:
        for prompt in prompts:
            scores = self.core.index.match(prompt)
            if any(scores.get(n, 0) != e.truth(prompt) for n, e in self.engines.items()):
                return False
        return all(self.core.index.num_blocks(n) == e.num_blocks() for n, e in self.engines.items())
