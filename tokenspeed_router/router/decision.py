"""What ``Router.route`` answers: one typed decision per request, explainable on demand.

The router walks the index once per request (``KvIndex.match_detail``) and
computes a cost for every candidate. Everything a caller needs afterwards
travels in the :class:`RouteDecision`, so no caller walks the index again:

* the ``POST /route`` fields of DESIGN §6 (``worker``, ``matched_blocks``,
  ``matched_tokens``, ``scores``, ``prefill_worker``, ``decode_worker``,
  ``request_id``; :meth:`RouteDecision.to_dict` is that JSON, unchanged);
* ``credits``: per routable worker, the prefix the router credited it with
  (:class:`PrefixCredit`: leading blocks, block size, tokens saved after tier
  credits, and where the knowledge came from: the event index, the
  predict-on-route memory, or the approximate store). Workers absent from it
  were credited nothing (no match, cold, or a baseline policy);
* ``index_match``: the event index's own answer from that one walk (every
  worker the index knows, cold ones included, tiers and block sizes), or
  ``None`` when the policy read no index. The gateway's truth loop compares
  engines' reported reuse against *this* (what the events say), not against
  the credit, which may include predictions the events have not confirmed;
* ``explanation``: with ``route(..., explain=True)`` only, the cost breakdown
  per candidate (:class:`RouteExplanation` of :class:`CandidateCost`), kept
  from the loop that chose the worker, so it is exactly what was compared
  (DESIGN §13 "why this worker"). Without the flag nothing is recorded and
  the field is ``None``.

Everything here is built by the router and immutable afterwards; the mappings
are the router's per-request objects handed over, never copies, so carrying
them costs nothing on the hot path. Convert to JSON only at the edge
(:meth:`RouteDecision.to_dict`, :meth:`RouteExplanation.to_dict`).

The types are frozen ``msgspec.Struct``s, not dataclasses: the router builds
a decision per request and a credit per matched worker, and a frozen Struct
of twelve fields is built several times faster than a frozen dataclass of
seven (``benchmarks/bench_decision.py``). They are not wire types: nothing
decodes them, and the transports send ``to_dict()``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from tokenspeed_router.router.scoring import CostWeights, MatchDetailLike
from tokenspeed_router.router.tiers import TIER_NAMES

__all__ = [
    "CandidateCost",
    "CostTerms",
    "CreditSource",
    "PrefixCredit",
    "RouteDecision",
    "RouteExplanation",
    "TIERS",
    "rank_candidates",
]

#: tier names of ``KvIndex.match_detail`` (best first): ``router/tiers.py`` defines them
TIERS: tuple[str, ...] = TIER_NAMES


class CreditSource(str, enum.Enum):
    """Where a worker's credited prefix comes from."""

    #: the event-fed ``KvIndex`` (exact; tier credits applied)
    INDEX = "index"
    #: predict-on-route memory of an event worker: it routed this prefix there
    #: recently and the memory reaches deeper than the index (events not yet in)
    PREDICTED = "predicted"
    #: the approximate store: a worker without events, or the ``approx`` policy
    APPROX = "approx"


class PrefixCredit(msgspec.Struct, frozen=True):
    """The prefix the router credited one worker with, for one request.

    ``blocks`` leading blocks of ``block_size`` tokens (``blocks`` is the
    worker's ``scores`` entry); ``credit_tokens`` is the prompt tokens they
    save after tier credits (``scoring.credited_tokens``: a CPU or storage
    block saves only part of its prefill), at most ``tokens``.
    """

    blocks: int
    block_size: int
    credit_tokens: float
    source: CreditSource

    @property
    def tokens(self) -> int:
        """Matched prefix in tokens (before tier credits)."""
        return self.blocks * self.block_size


class CostTerms(msgspec.Struct, frozen=True):
    """One candidate's cost as the cost model computed it (``explain=True`` only).

    Load terms include other replicas' load on the worker when it was added.
    ``cost`` is None for the cache-blind baselines (``random``,
    ``round_robin``), which compute none; so are the engine terms
    (``queue_s``: seconds of prefill queued ahead on the engine's clock,
    ``prefill_tokens_per_s``/``prefill_overhead_s``: its fitted speed), which
    decision replay reads back to price a logged decision as it was priced.
    """

    pool: str
    worker: str
    credit: PrefixCredit | None
    uncached_tokens: float
    queue_tokens: int
    active_tokens: int
    active_requests: int
    cost: float | None
    queue_s: float | None = None
    prefill_tokens_per_s: float | None = None
    prefill_overhead_s: float | None = None


class CandidateCost(msgspec.Struct, frozen=True, kw_only=True):
    """One candidate of one pool, with every term of its cost and why it won or lost.

    ``pool``: ``all`` (aggregated serving), or ``decode`` / ``prefill``
    (disaggregated: the decode worker is chosen first, then, when it misses
    too much, a prefill worker). ``matched_tokens_by_tier``: the credited
    prefix per tier (index credits only know tiers; predict-on-route and
    approximate credits count as ``gpu``, as the cost does).
    ``uncached_tokens`` = ``num_tokens - credited_tokens`` (>= 0);
    ``queue_tokens``: prefill tokens queued on the worker (its pending
    prefill); ``queue_s``, ``prefill_tokens_per_s``, ``prefill_overhead_s``:
    the engine terms the cost model used (``router/cost.py``); ``cost``: the
    estimated TTFT in seconds those terms give (None for a baseline policy);
    ``cold``: its prefix was not trusted (resyncing, stale, or flagged by the
    truth loop), so it was credited nothing.
    """

    worker: str
    pool: str
    matched_blocks: int
    block_size: int
    matched_tokens: int
    matched_tokens_by_tier: Mapping[str, int]
    credit_source: CreditSource | None
    credited_tokens: float
    uncached_tokens: float
    queue_tokens: int
    active_tokens: int
    active_requests: int
    cost: float | None
    cold: bool
    chosen: bool
    reason: str
    queue_s: float | None = None
    prefill_tokens_per_s: float | None = None
    prefill_overhead_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: the DESIGN §13 candidate keys, then the other terms."""
        return {
            "worker": self.worker,
            "matched_tokens": self.matched_tokens,
            "uncached_tokens": self.uncached_tokens,
            "queue_tokens": self.queue_tokens,
            "cost": self.cost,
            "reason": self.reason,
            "pool": self.pool,
            "chosen": self.chosen,
            "matched_blocks": self.matched_blocks,
            "block_size": self.block_size,
            "matched_tokens_by_tier": dict(self.matched_tokens_by_tier),
            "credit_source": self.credit_source.value if self.credit_source is not None else None,
            "credited_tokens": self.credited_tokens,
            "active_tokens": self.active_tokens,
            "active_requests": self.active_requests,
            "cold": self.cold,
            "queue_s": self.queue_s,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "prefill_overhead_s": self.prefill_overhead_s,
        }


class RouteExplanation(msgspec.Struct, frozen=True, kw_only=True):
    """Why ``worker`` was chosen: every candidate of every pool, in evaluation order.

    ``weights`` are the cost weights in force; ``temperature`` > 0 means the
    worker was sampled (softmax over the costs), not the argmin.
    """

    worker: str
    decode_worker: str
    prefill_worker: str | None
    policy: str
    num_tokens: int
    temperature: float
    weights: CostWeights
    candidates: tuple[CandidateCost, ...]

    def candidate(self, worker: str, pool: str | None = None) -> CandidateCost:
        """The entry of ``worker`` (in ``pool``, default: the first pool it appears in)."""
        for c in self.candidates:
            if c.worker == worker and (pool is None or c.pool == pool):
                return c
        raise KeyError(f"no candidate {worker!r}" + (f" in pool {pool!r}" if pool else ""))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, DESIGN §13: ``{"worker", "candidates": [...]}`` plus context."""
        return {
            "worker": self.worker,
            "candidates": [c.to_dict() for c in self.candidates],
            "decode_worker": self.decode_worker,
            "prefill_worker": self.prefill_worker,
            "policy": self.policy,
            "num_tokens": self.num_tokens,
            "temperature": self.temperature,
        }


def _by_tier(credit: PrefixCredit | None, tiers: Mapping[str, int] | None) -> dict[str, int]:
    if credit is None:
        return dict.fromkeys(TIERS, 0)
    if credit.source is CreditSource.INDEX and tiers:
        bs = credit.block_size
        out = {t: tiers.get(t, 0) * bs for t in TIERS}
        out["gpu"] += credit.tokens - sum(out.values())  # unknown tier names count as GPU
        return out
    return {"gpu": credit.tokens, "cpu": 0, "storage": 0}


def _lost_by(r: CostTerms, win: CostTerms | None) -> str:
    """Why ``r`` lost to the winner ``win``: the margin, and the two terms an operator checks first."""
    if win is None or win.cost is None or r.cost is None:
        return "higher cost"
    if r.queue_s is not None and win.queue_s is not None:
        queued = f"queued {r.queue_s:.3g} vs {win.queue_s:.3g} s"
    else:
        queued = f"queued prefill {r.queue_tokens} vs {win.queue_tokens}"
    return (f"higher cost: {r.cost:.6g} vs {win.cost:.6g} on {win.worker} "
            f"(uncached {r.uncached_tokens:.6g} vs {win.uncached_tokens:.6g} tokens, {queued})")


def explain_pool(
    rows: Sequence[CostTerms],
    chosen: str,
    *,
    tied: frozenset[str],
    sampled: bool,
    policy: str,
    cold: frozenset[str] | set[str],
    index_match: MatchDetailLike | None,
) -> list[CandidateCost]:
    """Turn one pool's cost rows into candidates with their reasons.

    ``tied``: the candidates whose cost tied with the lowest (the tie-break
    decided among them); ``sampled``: the choice was drawn (softmax or the
    ``random`` policy) rather than the argmin.
    """
    tiers = index_match.tiers if index_match is not None else None
    win = next((r for r in rows if r.worker == chosen), None)
    out: list[CandidateCost] = []
    for r in rows:
        k = r.credit
        is_chosen = r.worker == chosen
        if r.cost is None:
            reason = f"{policy}: chosen" if is_chosen else f"{policy}: not chosen"
        elif sampled:
            reason = "sampled (softmax over costs)" if is_chosen else "not sampled"
        elif is_chosen:
            reason = "lowest cost, won the tie-break" if len(tied) > 1 else "lowest cost"
        elif r.worker in tied:
            reason = "tied on cost, lost the tie-break (more in flight, or chosen more recently)"
        else:
            reason = _lost_by(r, win)
        is_cold = r.worker in cold
        if is_cold:
            reason += "; cold: its prefix is not trusted, routed on load"
        out.append(CandidateCost(
            worker=r.worker,
            pool=r.pool,
            matched_blocks=k.blocks if k is not None else 0,
            block_size=k.block_size if k is not None else 0,
            matched_tokens=k.tokens if k is not None else 0,
            matched_tokens_by_tier=_by_tier(k, tiers.get(r.worker) if tiers is not None else None),
            credit_source=k.source if k is not None else None,
            credited_tokens=k.credit_tokens if k is not None else 0.0,
            uncached_tokens=r.uncached_tokens,
            queue_tokens=r.queue_tokens,
            active_tokens=r.active_tokens,
            active_requests=r.active_requests,
            cost=r.cost,
            cold=is_cold,
            chosen=is_chosen,
            reason=reason,
            queue_s=r.queue_s,
            prefill_tokens_per_s=r.prefill_tokens_per_s,
            prefill_overhead_s=r.prefill_overhead_s,
        ))
    return out


class RouteDecision(msgspec.Struct, frozen=True):
    """The answer of ``Router.route``; its first seven fields are ``POST /route`` (DESIGN §6).

    ``worker``: where the prompt is prefilled (the decode worker itself unless
    a remote prefill is needed). ``matched_blocks``/``matched_tokens``: the
    prefix ``worker`` holds, in its block size. ``scores``: leading blocks each
    routable worker holds as the router saw them, every routable worker listed
    (0 for none; cold workers count 0; workers without events count what the
    router remembers; baseline policies, which read no prefix, list zeros).
    ``prefill_worker``: set only for a remote prefill; ``decode_worker``: where
    tokens are generated.

    Beyond the contract (see the module docstring): ``block_size`` of
    ``worker``'s prefix (its credit's, else the index's, else 0);
    ``num_tokens`` routed; ``credits`` per worker; ``index_match`` from the one
    index walk; ``explanation`` when asked for.
    """

    worker: str
    matched_blocks: int
    matched_tokens: int
    scores: dict[str, int]
    prefill_worker: str | None
    decode_worker: str
    request_id: str
    block_size: int = 0
    num_tokens: int = 0
    credits: Mapping[str, PrefixCredit] = msgspec.field(default_factory=dict)
    index_match: MatchDetailLike | None = None
    explanation: RouteExplanation | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, keys as in DESIGN §6."""
        return {
            "worker": self.worker,
            "matched_blocks": self.matched_blocks,
            "matched_tokens": self.matched_tokens,
            "scores": dict(self.scores),
            "prefill_worker": self.prefill_worker,
            "decode_worker": self.decode_worker,
            "request_id": self.request_id,
        }

    def predicted_tokens(self, worker: str) -> int:
        """Prefix tokens the router credited ``worker`` with (before tier credits; 0 if none)."""
        k = self.credits.get(worker)
        return k.tokens if k is not None else 0

    def credited_tokens(self, worker: str) -> float:
        """Prompt tokens ``worker``'s credited prefix saves, after tier credits (what the cost used)."""
        k = self.credits.get(worker)
        return k.credit_tokens if k is not None else 0.0

    def block_size_of(self, worker: str) -> int:
        """``worker``'s block size as the router knew it (credit, else index; 0 when unknown)."""
        k = self.credits.get(worker)
        if k is not None:
            return k.block_size
        m = self.index_match
        return m.block_size.get(worker, 0) if m is not None else 0

    def indexed_tokens(self, worker: str) -> int:
        """Leading prompt tokens the *event index* says ``worker`` holds (any tier).

        Cold workers included (the index still answers for them), predictions
        excluded: the view the truth loop checks engines against. 0 when the
        policy read no index.
        """
        m = self.index_match
        if m is None:
            return 0
        return m.scores.get(worker, 0) * m.block_size.get(worker, 0)


def rank_candidates(explanation: RouteExplanation, worker: str) -> tuple[str, ...]:
    """The workers of ``worker``'s pool in the explanation, cheapest first (``worker`` among them).

    Candidates without a cost (the blind policies: random, round robin) follow the
    costed ones by name. The endpoint picker names the rest as fallbacks.
    """
    pool = next((c.pool for c in explanation.candidates if c.worker == worker and c.chosen), None)
    rows = [c for c in explanation.candidates if pool is None or c.pool == pool]
    rows.sort(key=lambda c: (c.worker != worker, c.cost is None, c.cost or 0.0, c.worker))
    return tuple(dict.fromkeys(c.worker for c in rows))
