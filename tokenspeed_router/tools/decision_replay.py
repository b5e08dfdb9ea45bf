"""Read a decision log back and ask what another policy would have decided (``replay``/``simulate --decisions``).

Each logged decision (``server/decision_log.py``) is decided again by the
routing core (``router/core.py``) under the policy and weights asked for (by
default the logged ones), with the cost model the router runs, *in the state
the live router saw*: the same candidates, each with the terms the log
recorded for it (the engine's queue clock, its fitted prefill speed, context
tokens and requests in flight, other replicas' included), the same cold
flags. Logs written before the engine terms were recorded give only the
queued prefill tokens; they are priced at the re-deciding router's prior
speed. Only the prefix knowledge has two sources:

* ``replay EVENTLOG --decisions FILE``: the index rebuilt from the event log
  as of each decision's time (events received strictly before it; the
  ingestion lag of the live router is not modelled), matched against
  the logged prompt. This also checks the live router: ``index_agrees``
  counts decisions whose chosen worker the rebuilt index credits with the
  logged prefix (credits from the event index only; a predict-on-route
  credit has no events to check against yet);
* ``simulate --decisions FILE``: the logged credits themselves (matched
  blocks per tier and block size of every candidate), no event log needed.
  Predict-on-route memory is off unless a router option sets it: the logged
  credits already include what the live router predicted.

It is a one-step counterfactual: every decision starts from the logged state,
so a different choice does not change the load later decisions see (the
simulator, ``tokenspeed-router simulate --trace``, plays whole alternatives
out). The re-deciding router keeps its own history across decisions (the
round-robin cursor, the approximate store, tie-break recency), on a clock
that reads the decisions' times.

Worker roles are inferred from the pools each worker was a candidate in
(``all`` or both pools: ``both``; only ``decode`` or only ``prefill``: that
role). Every term a candidate row carries is kept in the log; this reader
uses the load terms and the prefix, so cost-model changes that add terms are
priced by the re-deciding router's own cost, not copied from the log.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

import msgspec

from tokenspeed_router.errors import ConfigError, TokenspeedError, WireError
from tokenspeed_router.events.codec import BatchDecoder
from tokenspeed_router.events.records import LogRecord
from tokenspeed_router.router.core import RoutingCore
from tokenspeed_router.router.router import RouterConfig, WorkerRole
from tokenspeed_router.router.scoring import PrefixIndex, WorkerLoad
from tokenspeed_router.server.decision_log import LoggedDecision

__all__ = [
    "DecisionComparison",
    "Redecided",
    "Redecider",
    "redecide_config",
    "replay_decisions",
    "simulate_decisions",
]

logger = logging.getLogger(__name__)

_ROUTER_FIELDS = frozenset(f.name for f in dataclasses.fields(RouterConfig))


def redecide_config(
    first: LoggedDecision | None, policy: str | None, options: Mapping[str, Any], *, logged_view: bool
) -> RouterConfig:
    """The re-deciding router's config: the logged policy and weights, then ``policy`` and ``options``.

    Weights the log names that this version's :class:`RouterConfig` does not
    know (another cost model's) are left out.
    """
    knobs: dict[str, Any] = {}
    if first is not None:
        knobs.update({k: v for k, v in first.weights.items() if k in _ROUTER_FIELDS})
        knobs["temperature"] = first.temperature
        knobs["policy"] = first.policy
    if logged_view:
        knobs["predict_on_route_ttl_s"] = 0.0
    knobs.update(options)
    if policy is not None:
        knobs["policy"] = policy
    try:
        return RouterConfig(**knobs)
    except TypeError as err:
        raise ConfigError(f"router options {dict(options)!r}: {err}") from None


@dataclass(frozen=True)
class Redecided:
    """One logged decision and the re-decision.

    ``logged_*``: the live router's choice and what it credited that worker
    with; the unprefixed fields: the re-decision's choice and its credit (in
    the re-decision's own knowledge). ``replayed_tokens``: what the rebuilt
    index says the *logged* worker held (replay only); ``index_agrees``:
    whether that equals the logged prefix (None when the logged credit was
    not from the event index, or in ``simulate``).
    """

    request_id: str
    time_s: float
    logged_worker: str
    worker: str
    logged_matched_tokens: int
    matched_tokens: int
    logged_uncached_tokens: float
    uncached_tokens: float
    replayed_tokens: int | None = None
    index_agrees: bool | None = None

    @property
    def agree(self) -> bool:
        return self.worker == self.logged_worker

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "agree": self.agree}


class _LoggedView:
    """A ``MatchDetailLike`` built from a decision's candidate rows (``simulate --decisions``)."""

    __slots__ = ("block_size", "scores", "tiers")

    def __init__(self, rows: Iterable[Mapping[str, Any]]) -> None:
        self.scores: dict[str, int] = {}
        self.tiers: dict[str, dict[str, int]] = {}
        self.block_size: dict[str, int] = {}
        for c in rows:
            name = c["worker"]
            if name in self.scores:
                continue
            bs = int(c.get("block_size") or 0)
            blocks = int(c.get("matched_blocks") or 0)
            self.scores[name] = blocks
            if bs > 0:
                self.block_size[name] = bs
                by_tier = c.get("matched_tokens_by_tier") or {}
                self.tiers[name] = {t: int(v) // bs for t, v in by_tier.items()} if by_tier else {"gpu": blocks}


class _LoggedIndex:
    """Answers every ``match_detail`` with the current decision's logged credits."""

    def __init__(self) -> None:
        self.view = _LoggedView(())

    def match_detail(self, token_ids: Any, lora_id: int | str | None = None, salt: Any = None) -> _LoggedView:
        return self.view


class _ReplayView:
    """The rebuilt index's answer, with the decision's logged predictions on top (``replay``).

    The live router also credited prompts routed before their engine's
    ``BlockStored`` (predictions, bridged until the store); the event log
    cannot show those yet, so a re-decision would see less than the live
    router did. Each candidate whose logged credit came from a prediction is
    credited what the log says (in the index's block size), when deeper than
    the index.
    """

    def __init__(self, index: PrefixIndex) -> None:
        self._index = index
        self.predicted: dict[str, int] = {}  # worker -> predicted prefix tokens (this decision)

    def match_detail(self, token_ids: Any, lora_id: int | str | None = None, salt: Any = None) -> Any:
        detail = self._index.match_detail(token_ids, lora_id, salt)
        if not self.predicted:
            return detail
        view = _LoggedView(())
        view.scores = dict(detail.scores)
        view.tiers = {w: dict(t) for w, t in detail.tiers.items()}
        view.block_size = dict(detail.block_size)
        for worker, tokens in self.predicted.items():
            bs = view.block_size.get(worker, 0)
            blocks = tokens // bs if bs else 0
            have = view.scores.get(worker, 0)
            if blocks > have:
                view.scores[worker] = blocks
                tiers = view.tiers.setdefault(worker, {"gpu": 0})
                tiers["gpu"] = tiers.get("gpu", 0) + blocks - have
        return view

    def show(self, rows: Iterable[Mapping[str, Any]]) -> None:
        self.predicted = {
            c["worker"]: int(c.get("matched_tokens") or 0)
            for c in rows if c.get("credit_source") == "predicted" and not c.get("cold")
        }


def _float_or_none(value: Any) -> float | None:
    """A logged engine term (None when the log predates it or holds something else)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return None


def _role(pools: set[str]) -> WorkerRole:
    if "all" in pools or {"decode", "prefill"} <= pools:
        return WorkerRole.BOTH
    return WorkerRole.DECODE if "decode" in pools else WorkerRole.PREFILL


class Redecider:
    """The routing core deciding logged decisions again (see the module docstring).

    ``index``: the rebuilt event index (``replay``), or None to use the
    logged credits (``simulate``).
    """

    def __init__(self, config: RouterConfig, index: PrefixIndex | None = None) -> None:
        self._logged = _LoggedIndex() if index is None else None
        self._index = index
        self._replay_view = _ReplayView(index) if index is not None else None
        self._loads: dict[str, WorkerLoad] = {}
        self._now = 0.0
        self._members: dict[str, tuple[WorkerRole, bool, bool]] = {}
        self.config = config
        self.core = RoutingCore(
            config, clock=lambda: self._now, load_provider=self._loads.get,
            match_view=self._replay_view if self._replay_view is not None else self._logged,
        )
        self.router = self.core.router
        self._serial = 0

    @property
    def replaying(self) -> bool:
        return self._logged is None

    def decide(self, d: LoggedDecision) -> Redecided | None:
        """Decide ``d`` again; None when it cannot be (no token ids to match in a replay)."""
        if self._logged is None and not d.token_ids:
            return None
        self._now = d.time_s
        self._membership(d)
        if self._logged is not None:
            self._logged.view = _LoggedView(d.candidates)
        if self._replay_view is not None:
            self._replay_view.show(d.candidates)
        tokens = d.token_ids if d.token_ids else [0] * d.num_tokens
        # the share of requests carrying a session's own history, as the logged decision saw it
        # (a log of a release without it: learnt from the re-decisions, as a live router would)
        share = d.weights.get("followup_share")
        self.router.pin_followup_share(float(share) if isinstance(share, (int, float)) else None)
        self._serial += 1
        rid = f"redecide-{self._serial}"
        try:
            again = self.core.route(tokens, request_id=rid, lora_id=d.lora_id, salt=d.salt, explain=True)
        finally:
            self.core.release(rid)
        explanation = again.explanation
        assert explanation is not None
        pool = "prefill" if again.prefill_worker is not None else None
        mine = explanation.candidate(again.worker, pool)
        logged = d.chosen() or {}
        replayed: int | None = None
        agrees: bool | None = None
        if self._index is not None:
            view = again.index_match
            if view is None or (self._replay_view is not None and self._replay_view.predicted):
                # no index read (a baseline policy), or logged predictions on top: the index alone, for the audit
                view = self._index.match_detail(tokens, d.lora_id, d.salt)
            replayed = view.scores.get(d.worker, 0) * view.block_size.get(d.worker, 0)
            if logged.get("credit_source") in ("index", None) and not logged.get("cold"):
                agrees = replayed == int(logged.get("matched_tokens") or 0)
        return Redecided(
            request_id=d.request_id, time_s=d.time_s, logged_worker=d.worker, worker=again.worker,
            logged_matched_tokens=int(logged.get("matched_tokens") or 0), matched_tokens=again.matched_tokens,
            logged_uncached_tokens=float(logged.get("uncached_tokens") or 0.0),
            uncached_tokens=float(mine.uncached_tokens), replayed_tokens=replayed, index_agrees=agrees,
        )

    def _membership(self, d: LoggedDecision) -> None:
        core = self.core
        pools: dict[str, set[str]] = {}
        loads: dict[str, WorkerLoad] = {}
        cold: dict[str, bool] = {}
        events: dict[str, bool] = {}
        for c in d.candidates:
            name = c["worker"]
            pools.setdefault(name, set()).add(str(c.get("pool", "all")))
            if name not in loads:
                loads[name] = WorkerLoad(
                    active_requests=int(c.get("active_requests") or 0),
                    pending_prefill_tokens=int(c.get("queue_tokens") or 0),
                    active_tokens=int(c.get("active_tokens") or 0),
                    queue_s=_float_or_none(c.get("queue_s")),
                    prefill_tokens_per_s=_float_or_none(c.get("prefill_tokens_per_s")),
                    prefill_overhead_s=_float_or_none(c.get("prefill_overhead_s")),
                )
                cold[name] = bool(c.get("cold"))
                # in a replay a worker without events (approx credits) is remembered, not indexed
                events[name] = self._logged is not None or c.get("credit_source") != "approx"
        for name in [n for n in core.router.workers() if n not in pools]:
            core.router.remove_worker(name)  # routing only: a replay's index keeps its entries
            self._members.pop(name, None)
        for name, in_pools in pools.items():
            member = (_role(in_pools), events[name], cold[name])
            if self._members.get(name) != member:
                core.add_worker(name, member[0], events=member[1])
                core.set_distrusted(name, member[2])  # routed on load alone, as the live router did
                self._members[name] = member
        self._loads.clear()
        self._loads.update(loads)


@dataclass
class DecisionComparison:
    """What a pass over a decision log found (the JSON summary ``replay``/``simulate`` print)."""

    policy: str
    logged_policy: str | None = None
    decisions: int = 0
    skipped_no_tokens: int = 0
    agree: int = 0
    logged_uncached_tokens: float = 0.0
    uncached_tokens: float = 0.0
    logged_matched_tokens: int = 0
    matched_tokens: int = 0
    index_checked: int = 0
    index_agrees: int = 0
    logged_workers: dict[str, int] = field(default_factory=dict)
    workers: dict[str, int] = field(default_factory=dict)

    def add(self, row: Redecided) -> None:
        self.decisions += 1
        self.agree += row.agree
        self.logged_uncached_tokens += row.logged_uncached_tokens
        self.uncached_tokens += row.uncached_tokens
        self.logged_matched_tokens += row.logged_matched_tokens
        self.matched_tokens += row.matched_tokens
        self.logged_workers[row.logged_worker] = self.logged_workers.get(row.logged_worker, 0) + 1
        self.workers[row.worker] = self.workers.get(row.worker, 0) + 1
        if row.index_agrees is not None:
            self.index_checked += 1
            self.index_agrees += row.index_agrees

    def to_dict(self) -> dict[str, Any]:
        n = self.decisions
        return {
            "policy": self.policy,
            "logged_policy": self.logged_policy,
            "decisions": n,
            "skipped_no_tokens": self.skipped_no_tokens,
            "agree": self.agree,
            "agree_fraction": round(self.agree / n, 6) if n else None,
            "uncached_tokens": {"logged": self.logged_uncached_tokens, "policy": self.uncached_tokens},
            "matched_tokens": {"logged": self.logged_matched_tokens, "policy": self.matched_tokens},
            "index_checked": self.index_checked,
            "index_agrees": self.index_agrees,
            "workers": {"logged": dict(sorted(self.logged_workers.items())),
                        "policy": dict(sorted(self.workers.items()))},
        }


def _run(decider: Redecider, decisions: Iterable[LoggedDecision], before: Any, out: IO[str] | None,
         until_s: float | None) -> DecisionComparison:
    comparison = DecisionComparison(policy=decider.config.policy_name)
    encoder = msgspec.json.Encoder()
    for d in decisions:
        if until_s is not None and d.time_s > until_s:
            break
        if comparison.logged_policy is None:
            comparison.logged_policy = d.policy
        before(d.time_s)
        try:
            row = decider.decide(d)
        except TokenspeedError as err:  # token ids the index cannot hash: a line written by something else
            logger.warning("decision %s (line %d) cannot be decided again: %s", d.request_id, d.line, err)
            comparison.skipped_no_tokens += 1
            continue
        if row is None:
            comparison.skipped_no_tokens += 1
            continue
        comparison.add(row)
        if out is not None:
            out.write(encoder.encode(row.to_dict()).decode() + "\n")
    return comparison


def simulate_decisions(
    decisions: Iterable[LoggedDecision], config: RouterConfig, *, out: IO[str] | None = None,
) -> DecisionComparison:
    """Re-decide every logged decision on its logged credits and loads (``simulate --decisions``)."""
    return _run(Redecider(config), decisions, lambda _t: None, out, None)


class _Stepper:
    """Applies event-log records to a service up to a time, keeping the first later record for next time."""

    def __init__(self, service: Any, records: Iterable[LogRecord]) -> None:
        self._service = service
        self._records: Iterator[LogRecord] = iter(records)
        self._next: LogRecord | None = None
        self._decoder = BatchDecoder()
        self.applied = 0
        self.malformed = 0

    def until(self, time_s: float) -> None:
        while True:
            rec = self._next if self._next is not None else next(self._records, None)
            if rec is None:
                return
            if rec.recv_time_s >= time_s:  # received strictly before the decision, or not yet
                self._next = rec
                return
            self._next = None
            try:
                batch = self._decoder.decode(rec.payload)
            except WireError:
                self.malformed += 1
                continue
            self._service.apply_record(rec.worker, rec.seq, batch, rec.recv_time_s, payload=rec.payload)
            self.applied += 1


def replay_decisions(
    service: Any,
    records: Iterable[LogRecord],
    decisions: Iterable[LoggedDecision],
    config: RouterConfig,
    *,
    out: IO[str] | None = None,
    until_s: float | None = None,
) -> DecisionComparison:
    """Rebuild ``service``'s index from ``records`` decision by decision and re-decide each (``replay``)."""
    stepper = _Stepper(service, records)
    decider = Redecider(config, service.index)
    comparison = _run(decider, decisions, stepper.until, out, until_s)
    if stepper.malformed:
        logger.warning("%d undecodable event-log records skipped", stepper.malformed)
    return comparison
