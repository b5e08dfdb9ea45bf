"""Routing cost model, selection rules and the approximate (event-less) prefix store.

Everything here is pure: no I/O, no clock reads (callers pass ``now_s``), no
global random state (callers pass a :class:`random.Random`). :class:`Router`
(``router.py``) wires these pieces to the index and to its in-flight table.

The cost itself -- an estimated time to first token per candidate -- is the
cost model's (``router/cost.py``); this module holds the pieces it and the
router share: the policies, the load a worker carries (:class:`WorkerLoad`),
the cost weights, the tier credit of a cached prefix
(:func:`credited_tokens`), the tie rules and softmax sampling, and the
approximate prefix store of workers that publish no events.

Complexity: the approximate store
costs O(blocks of the prompt) to record and O(workers * log(blocks)) to match.
"""

from __future__ import annotations

import enum
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tokenspeed_router.hashing import ContentHash, block_hashes

__all__ = [
    "ApproxPrefixStore",
    "CostWeights",
    "LoadLike",
    "MatchDetailLike",
    "Policy",
    "PrefixIndex",
    "WorkerLoad",
    "credited_tokens",
    "lowest_tied",
    "pick_lowest",
    "sample_softmax",
]

class Policy(str, enum.Enum):
    """Routing policies; all share one interface and the same in-flight tracking."""

    #: Cost = uncached prefill (exact, from KV events) + load. The default.
    KV_AWARE = "kv_aware"
    #: Uniformly random among candidates (seeded RNG).
    RANDOM = "random"
    #: Rotate through candidates in name order.
    ROUND_ROBIN = "round_robin"
    #: Cost = load terms only (no prefix knowledge).
    LEAST_LOADED = "least_loaded"
    #: kv_aware cost, but prefix knowledge comes from what the router itself
    #: routed (no events), like SGLang's cache_aware / Dynamo's approx mode.
    APPROX = "approx"


class MatchDetailLike(Protocol):
    """What the router reads from ``KvIndex.match_detail`` (duck-typed for tests)."""

    @property
    def scores(self) -> Mapping[str, int]: ...

    @property
    def tiers(self) -> Mapping[str, Mapping[str, int]]: ...

    @property
    def block_size(self) -> Mapping[str, int]: ...


class LoadLike(Protocol):
    """Anything with the three load counters of :class:`WorkerLoad`."""

    @property
    def active_requests(self) -> int: ...

    @property
    def pending_prefill_tokens(self) -> int: ...

    @property
    def active_tokens(self) -> int: ...


class PrefixIndex(Protocol):
    """The part of :class:`~tokenspeed_router.router.index.KvIndex` the router uses."""

    def match_detail(
        self, token_ids: Any, lora_id: int | str | None = None, salt: str | bytes | None = None
    ) -> MatchDetailLike: ...


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's load as the cost model sees it.

    ``pending_prefill_tokens``: prompt tokens routed to the worker whose prefill
    has not finished (uncached part only). ``active_tokens``: context tokens of
    requests in flight there (their KV occupancy while decoding).
    ``active_requests``: requests in flight there. The engine terms, when a
    load provider knows them (decision replay: what a decision log
    recorded), replace the cost model's own: ``queue_s`` its queue clock,
    ``prefill_tokens_per_s``/``prefill_overhead_s`` its fitted speed.
    """

    active_requests: int = 0
    pending_prefill_tokens: int = 0
    active_tokens: int = 0
    queue_s: float | None = None
    prefill_tokens_per_s: float | None = None
    prefill_overhead_s: float | None = None

    def to_dict(self) -> dict[str, int]:
        """JSON-ready form (for ``GET /workers`` and logs)."""
        return {
            "active_requests": self.active_requests,
            "pending_prefill_tokens": self.pending_prefill_tokens,
            "active_tokens": self.active_tokens,
        }


@dataclass(frozen=True, slots=True)
class CostWeights:
    """The weights of the cost (``router/cost.py``).

    No defaults here: the shipped values live on ``RouterConfig`` only, and
    ``RouterConfig.weights()`` builds this struct from them.
    """

    prefill_weight: float
    queue_weight: float
    decode_weight: float
    request_weight: float
    inflight_factor: float
    #: the learnt share of requests carrying a session's own history when the decision was
    #: made (the config's struct has 0: the router fills it in for an explanation)
    followup_share: float
    cpu_hit_credit: float
    storage_hit_credit: float


def credited_tokens(
    matched_blocks: int, block_size: int, tiers: Mapping[str, int] | None, weights: CostWeights
) -> float:
    """Prompt tokens a worker's cached prefix saves, with tier credits.

    A GPU hit saves the whole block; a CPU or storage hit saves only part of it,
    because the block must first be copied back to the GPU (Dynamo uses 0.75 and
    0.25, llm-d 0.8 for CPU). Without tier detail every block counts as GPU.
    """
    if matched_blocks <= 0:
        return 0.0
    if not tiers:
        return float(matched_blocks * block_size)
    gpu = tiers.get("gpu", 0)
    cpu = tiers.get("cpu", 0)
    storage = tiers.get("storage", 0)
    other = matched_blocks - gpu - cpu - storage  # unknown tier names count as GPU
    blocks = gpu + max(other, 0) + weights.cpu_hit_credit * cpu
    blocks += weights.storage_hit_credit * storage
    return blocks * block_size


def pick_lowest(
    costs: Mapping[str, float],
    tie_key: Callable[[str], tuple[int, ...]],
    *,
    best: float | None = None,
) -> str:
    """The worker with the lowest cost; ties go to the smallest ``tie_key(worker)``.

    Costs within a relative 1e-9 of the minimum tie. The router's key is
    ``(active_requests, last_pick_serial)``: ties go to the emptier worker, then
    to the one chosen least recently, so on an idle cluster misses rotate
    instead of all landing on the first worker (sgl-project/sglang#32983). The
    worker name is the final key, so the choice is a pure function of its inputs.
    """
    tied = lowest_tied(costs, best=best)
    if len(tied) == 1:
        return tied[0]
    return min(tied, key=lambda w: (*tie_key(w), w))


def lowest_tied(costs: Mapping[str, float], *, best: float | None = None) -> list[str]:
    """The workers whose cost ties with the lowest (within a relative 1e-9), in ``costs`` order.

    The tie rule of :func:`pick_lowest`, shared with the route explanation so
    both say the same thing about which candidates tied.
    """
    if not costs:
        raise ValueError("no candidates")
    if best is None:  # the caller may pass the minimum it found while computing costs
        best = min(costs.values())
    slack = 1e-9 * max(1.0, abs(best))
    return [w for w, c in costs.items() if c <= best + slack]


def sample_softmax(costs: Mapping[str, float], temperature: float, rng: random.Random) -> str:
    """Sample a worker with ``p ∝ exp(-(c - min) / ((max - min) * T))``.

    Normalising by the cost range (as Dynamo does) makes ``temperature``
    unitless: T = 1 gives the worst candidate e^-1 the weight of the best one,
    whatever the prompt length. Candidates are visited in name order so a
    seeded RNG reproduces the same choices.
    """
    if not costs:
        raise ValueError("no candidates")
    names = sorted(costs)
    lo = min(costs.values())
    span = max(costs.values()) - lo
    if span <= 0.0:
        return names[int(rng.random() * len(names)) % len(names)]
    scale = span * temperature
    weights = [math.exp(-(costs[w] - lo) / scale) for w in names]
    x = rng.random() * sum(weights)
    for name, weight in zip(names, weights, strict=True):
        x -= weight
        if x < 0.0:
            return name
    return names[-1]


class ApproxPrefixStore:
    """What the router routed where: per-worker chained block hashes with a TTL.

    Used for workers that publish no KV events (and for the whole cluster under
    the ``approx`` policy). Recording a routed prompt stores the content hash
    of each of its full blocks (``hashing.block_hashes``, so the same function
    as the event-fed index) under the worker, expiring ``ttl_s`` after the
    latest use, bounded to ``max_blocks`` per worker (least recently used
    first).

    Invariant: a worker's stored blocks are prefix-closed. A prompt's blocks
    are touched leaf first and root last, so a parent is always at least as
    recent as any of its children and both TTL expiry and LRU eviction (which
    pop the oldest entries) remove children before their parents. That is what
    lets :meth:`match` binary-search the matched depth.

    Each worker's map is ordered by last touch; because the TTL is the same
    for all entries, that is also expiry order, so expiring is popping from the
    front: O(1) amortised.
    """

    __slots__ = ("_block_size", "_blocks", "_max_blocks", "_next_expiry", "_ttl_s")

    def __init__(self, *, block_size: int, ttl_s: float, max_blocks: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self._block_size = block_size
        self._ttl_s = ttl_s
        self._max_blocks = max_blocks
        self._blocks: dict[str, OrderedDict[int, float]] = {}
        #: no entry expires before this (a lower bound): ``expire`` is free until then
        self._next_expiry = math.inf

    @property
    def block_size(self) -> int:
        """Tokens per approximate block."""
        return self._block_size

    def hash_prompt(
        self, token_ids: Any, lora_id: int | None = None, salt: str | bytes | None = None
    ) -> list[ContentHash]:
        """Chained content hashes of the prompt's full blocks (hash once, reuse)."""
        return block_hashes(token_ids, self._block_size, lora_id=lora_id, salt=salt)

    def record(self, worker: str, hashes: Sequence[int], now_s: float) -> None:
        """Remember that ``worker`` now holds the prefix named by ``hashes``."""
        if not hashes:
            return
        blocks = self._blocks.get(worker)
        if blocks is None:
            blocks = self._blocks[worker] = OrderedDict()
        expiry = now_s + self._ttl_s
        if expiry < self._next_expiry:
            self._next_expiry = expiry
        move = blocks.move_to_end
        for h in reversed(hashes):  # leaf first, root last: parents stay newer
            blocks[h] = expiry
            move(h)
        excess = len(blocks) - self._max_blocks
        for _ in range(max(excess, 0)):
            blocks.popitem(last=False)

    def expire(self, now_s: float) -> int:
        """Drop entries whose TTL has passed; returns how many were dropped.

        Runs on every match: while ``now_s`` is before the earliest expiry it
        costs one comparison instead of a look at every worker's oldest entry.
        """
        if now_s < self._next_expiry:
            return 0
        dropped = 0
        earliest = math.inf
        for blocks in self._blocks.values():
            while blocks:
                h, expiry = next(iter(blocks.items()))
                if expiry > now_s:
                    if expiry < earliest:
                        earliest = expiry
                    break
                del blocks[h]
                dropped += 1
        self._next_expiry = earliest
        return dropped

    def match(self, hashes: Sequence[int], workers: Iterable[str], now_s: float) -> dict[str, int]:
        """Leading blocks of ``hashes`` each worker holds (only workers with >= 1)."""
        self.expire(now_s)
        out: dict[str, int] = {}
        if not hashes:
            return out
        for worker in workers:
            blocks = self._blocks.get(worker)
            if not blocks or hashes[0] not in blocks:
                continue
            lo, hi = 1, len(hashes)  # blocks[hashes[:lo]] held; find the largest such lo
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if hashes[mid - 1] in blocks:
                    lo = mid
                else:
                    hi = mid - 1
            out[worker] = lo
        return out

    def num_blocks(self, worker: str | None = None) -> int:
        """Stored (possibly expired, not yet pruned) blocks, for one worker or all."""
        if worker is not None:
            return len(self._blocks.get(worker, ()))
        return sum(len(b) for b in self._blocks.values())

    def clear_worker(self, worker: str) -> None:
        """Forget everything recorded for ``worker``."""
        self._blocks.pop(worker, None)
