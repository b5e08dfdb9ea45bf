"""The router: pick a worker (or a prefill/decode pair) for each request.

``Router.route(token_ids)`` combines three things:

* **prefix knowledge** — per worker, how many leading blocks of the prompt it
  holds and on which tier: exact from the event-fed :class:`KvIndex` for
  workers that publish KV events, approximate (what this router routed there,
  with a TTL) for workers that do not, nothing for *cold* workers (their index
  state is not trusted) -- except that a cold worker *recovering* from lost
  events is credited, approximately, with what this router routed there since
  the loss, and those prompts are kept as chains that name the parents of its
  orphaned stores (``router/chain_record.py``, ``router/recovery.py``);
* **load** — per worker, requests in flight, their outstanding prefill tokens
  and their context tokens, tracked from the router's own decisions and
  released by :meth:`Router.release` (request finished),
  :meth:`Router.mark_prefill_done` (first token) or after
  ``inflight_timeout_s``; or supplied by the caller through ``load_provider``;
  plus, with several router replicas, what the *other* replicas have in
  flight on each worker (``peer_load``, shared through Redis by
  ``tokenspeed_router.state.load``), so replicas splitting traffic weigh the
  same load one router would;
* **a policy** — the cost in ``scoring.py`` (``kv_aware``, ``least_loaded``,
  ``approx``) minimised with deterministic tie-breaking or sampled with a
  softmax, or a cache-blind baseline (``random``, ``round_robin``).

Disaggregated serving. When some workers are ``prefill``-only or
``decode``-only, a request gets a decode worker (chosen among decode-capable
workers by the same cost: decode workers hold past turns, so their prefix
saves KV transfer or local prefill) and, unless that decode worker's uncached
part is at most ``local_prefill_threshold_tokens``, a prefill worker (chosen
among prefill-capable workers by the cost). In the answer, ``worker`` is where
the prompt is prefilled and ``decode_worker`` where tokens are generated;
``prefill_worker`` is set only when those differ (a remote prefill and a KV
transfer are needed) and is ``None`` when the decode worker prefills locally.
With only ``both`` workers the router never splits a request:
``worker == decode_worker`` and ``prefill_worker is None``.

The answer is a :class:`~tokenspeed_router.router.decision.RouteDecision`:
the ``POST /route`` fields plus each worker's credited prefix and the index's
own view from the one walk (callers need no ``match`` of their own), and,
with ``route(..., explain=True)``, every candidate's cost terms.

One owner: a Router is not thread safe; the server calls it from one task.
The clock and the RNG are injected; nothing here reads global state.
Complexity per ``route``: one index match (hashing included) plus O(workers).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenspeed_router.errors import ConfigError, NoWorkerAvailableError
from tokenspeed_router.hashing import ContentHash, root_seed, tokens_to_bytes
from tokenspeed_router.router.chain_record import ChainRecord
from tokenspeed_router.router.config import (
    EngineEstimate,
    LoadProvider,
    PeerLoad,
    RouterConfig,
    RouterStatistics,
    WorkerInfo,
    WorkerRole,
)
from tokenspeed_router.router.cost import CostModel, LoadCounters, PoolTrace
from tokenspeed_router.router.decision import (
    CandidateCost,
    CostTerms,
    CreditSource,
    PrefixCredit,
    RouteDecision,
    RouteExplanation,
    explain_pool,
)
from tokenspeed_router.router.index import lora_key
from tokenspeed_router.router.peer_work import PeerEnded, PeerPrediction, PeerPredictions
from tokenspeed_router.router.scoring import (
    ApproxPrefixStore,
    MatchDetailLike,
    Policy,
    PrefixIndex,
    WorkerLoad,
    credited_tokens,
)

__all__ = [
    "CandidateCost",
    "CreditSource",
    "EngineEstimate",
    "LoadProvider",
    "PeerLoad",
    "PrefixCredit",
    "RouteDecision",
    "RouteExplanation",
    "Router",
    "RouterConfig",
    "RouterStatistics",
    "WorkerInfo",
    "WorkerRole",
]

logger = logging.getLogger(__name__)


_UNSYNCED: Any = object()


@dataclass(slots=True)
class _Worker(LoadCounters):
    name: str = ""
    role: WorkerRole = WorkerRole.BOTH
    events: bool = True
    cold: bool = False


@dataclass(slots=True)
class _Part:
    worker: str
    requests: int
    pending_prefill_tokens: int
    active_tokens: int
    prefill_only: bool  # the remote prefill worker's share: gone at prefill done


@dataclass(slots=True)
class _InFlight:
    request_id: str
    deadline_s: float
    parts: list[_Part] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Pools:
    """Worker lists derived from membership, rebuilt only when it changes."""

    all: list[str]
    decode: list[str]
    prefill: list[str]
    indexed: list[str]  # publish events: scored from the index
    remembered: list[str]  # no events: scored from the approximate store


_INDEX, _APPROX = CreditSource.INDEX, CreditSource.APPROX
#: policies that compute a cost (and so keep engine models)
_COST_POLICIES = (Policy.KV_AWARE, Policy.APPROX, Policy.LEAST_LOADED)


def _subset(pools: _Pools, only: Collection[str]) -> _Pools:
    """``pools`` restricted to the workers in ``only`` (same order)."""
    keep = only if isinstance(only, (set, frozenset, dict)) else set(only)
    out = _Pools(*([w for w in names if w in keep] for names in (
        pools.all, pools.decode, pools.prefill, pools.indexed, pools.remembered)))
    if not out.all:
        raise NoWorkerAvailableError("none of the allowed workers is routable")
    return out


class Router:
    """Chooses workers for requests; see the module docstring.

    ``index`` may be None when no worker publishes events (baselines, approx).
    ``clock`` (seconds, monotonic) drives in-flight expiry and approximate-store
    TTLs; ``rng`` drives softmax sampling and the ``random`` policy (default:
    ``random.Random(config.seed)``); ``load_provider`` replaces the router's
    own load tracking per worker when it returns a :class:`WorkerLoad`;
    ``peer_load`` adds other replicas' in-flight load to the router's own
    tracking (not to a ``load_provider``'s answer, which is taken as the
    worker's whole load).
    """

    def __init__(
        self,
        index: PrefixIndex | None,
        config: RouterConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        load_provider: LoadProvider | None = None,
        peer_load: PeerLoad | None = None,
    ) -> None:
        self._index = index
        self._config = config = config if config is not None else RouterConfig()
        self._policy = Policy(config.policy)
        self._weights = config.weights()
        self._clock = clock
        self._rng = rng if rng is not None else random.Random(config.seed)
        self._load_provider = load_provider
        self._peer_load = peer_load
        #: the peer-load provider again when it also exchanges route predictions
        self._peer_predictions = peer_load if isinstance(peer_load, PeerPredictions) else None
        self._workers: dict[str, _Worker] = {}
        #: workers taken from the index, not added explicitly (see ``_discover``)
        self._discovered: set[str] = set()
        #: explicitly removed names the index may still know: never rediscovered
        self._removed: set[str] = set()
        self._index_version: object = _UNSYNCED
        self._cold: set[str] = set()
        #: cold workers recovering from lost events: credited with what this router routed there
        #: since (the approximate store) and those prompts' chains, made on the first route there
        self._recovering: dict[str, ChainRecord | None] = {}
        #: truth-loop trust below 1 per worker (credit scaled by it)
        self._trust: dict[str, float] = {}
        self._pools: _Pools | None = None  # derived from _workers; None = rebuild
        self._inflight: dict[str, _InFlight] = {}
        self._expiry: deque[_InFlight] = deque()
        self._approx = ApproxPrefixStore(
            block_size=config.approx_block_size,
            ttl_s=config.approx_ttl_s,
            max_blocks=config.approx_max_blocks_per_worker,
        )
        #: the engines as this router believes them, and the cost (router/cost.py)
        self._cost = CostModel(config, block_size=config.approx_block_size, rng=self._rng,
                               load_provider=load_provider)
        self._cursors: dict[str, int] = {}
        self._serial = itertools.count()
        prefix = config.request_id_prefix
        self._id_prefix = prefix if prefix is not None else uuid.uuid4().hex[:12]
        self._ids = itertools.count()
        self._num_split_roles = 0  # workers whose role is prefill or decode
        self._routed = 0
        self._released = 0
        self._expired = 0
        self._remote_prefills = 0
        self._local_prefills = 0

    @property
    def peer_load(self) -> PeerLoad | None:
        """Other replicas' in-flight load, when shared (see :class:`PeerLoad`)."""
        return self._peer_load

    def set_peer_load(self, peer_load: PeerLoad | None) -> None:
        """Start (or stop, with None) adding other replicas' load to this router's."""
        self._peer_load = peer_load
        self._peer_predictions = peer_load if isinstance(peer_load, PeerPredictions) else None

    # --- membership -----------------------------------------------------------

    @property
    def config(self) -> RouterConfig:
        """The (frozen) configuration."""
        return self._config

    def add_worker(
        self, name: str, role: WorkerRole | str = "both", *, events: bool = True
    ) -> None:
        """Make ``name`` routable. Re-adding updates role/events and keeps its load.

        ``events=False`` marks a worker that publishes no KV events: its prefix
        knowledge comes from what this router routed there (approx mode).
        ``name`` must equal the index's worker name (``NAME/dpR`` per DP rank).
        Workers the index knows need no ``add_worker`` (see :meth:`workers`);
        calling it pins the role and keeps the worker routable after the
        index forgets it.
        """
        if not isinstance(name, str) or not name:
            raise ConfigError(f"worker name must be a non-empty string, got {name!r}")
        try:
            parsed = WorkerRole(role)
        except ValueError:
            raise ConfigError(
                f"worker {name!r}: role must be 'both', 'prefill' or 'decode', got {role!r}"
            ) from None
        self._discovered.discard(name)
        self._removed.discard(name)
        old = self._workers.get(name)
        if old is None:
            self._workers[name] = _Worker(name=name, role=parsed, events=bool(events))
        else:
            if old.role is not WorkerRole.BOTH:
                self._num_split_roles -= 1
            old.role = parsed
            old.events = bool(events)
        if parsed is not WorkerRole.BOTH:
            self._num_split_roles += 1
        self._pools = None

    def remove_worker(self, name: str) -> None:
        """Stop routing to ``name`` and forget its load and approximate prefixes.

        Also for a worker taken from the index: it is not rediscovered until
        :meth:`add_worker` names it again.
        """
        self._removed.add(name)
        self._discovered.discard(name)
        self._forget(name)

    def _forget(self, name: str) -> None:
        worker = self._workers.pop(name, None)
        if worker is None:
            return
        if worker.role is not WorkerRole.BOTH:
            self._num_split_roles -= 1
        self._cold.discard(name)
        self._recovering.pop(name, None)
        self._pools = None
        for entry in self._inflight.values():
            entry.parts = [p for p in entry.parts if p.worker != name]
        self._approx.clear_worker(name)
        self._cost.forget(name)

    def set_cold(self, name: str, cold: bool, *, recovering: bool = False) -> None:
        """Cold workers score 0 matched blocks (their index state is not trusted)
        but stay routable by load. The ingestor's resyncing/stale states map here.

        ``recovering`` (a cold worker whose events were lost, the ingestor's
        ``resyncing``): instead of 0 it is credited with what this router
        routes there from now on (the approximate store, as for a worker
        without events), and those prompts are kept as chains for
        :meth:`name_parent`, until it is no longer cold.
        """
        self._discover()
        w = self._worker(name)
        w.cold = bool(cold)
        if cold:
            self._cold.add(name)
        else:
            self._cold.discard(name)
        if cold and recovering:
            self._recovering.setdefault(name, None)
        elif self._recovering.pop(name, _UNSYNCED) is not _UNSYNCED and not self._remembers(w):
            self._approx.clear_worker(name)  # the index is trusted again: the memory goes

    def name_parent(self, name: str, root: int, block_bytes: bytes) -> list[int] | None:
        """Content ids of the prefix a block with these tokens extends on recovering worker ``name``,
        from the prompts this router routed there (``ChainRecord.parent_chain``); None if unknown."""
        record = self._recovering.get(name)
        return record.parent_chain(block_bytes, root) if record is not None else None

    def capacity_blocks(self, name: str) -> int | None:
        """The engine's capacity in its index block size, as the cost model learnt it (None: unknown)."""
        tokens = self._cost.capacity_tokens(name)
        bs = self._index_block_size(name)
        if tokens is None or not bs:
            return None
        return -(-int(tokens) // bs)

    def _index_block_size(self, name: str) -> int | None:
        bs_of = getattr(self._index, "block_size_of", None)
        return bs_of(name) if bs_of is not None else None

    def _remembers(self, w: _Worker) -> bool:
        """Whether the approximate store is ``w``'s own memory (no events, or the approx policy)."""
        return self._policy is Policy.APPROX or not w.events

    def set_trust(self, name: str, trust: float) -> None:
        """Scale ``name``'s credited prefix by ``trust`` (1: as known, 0: none, as if cold).

        The gateway's truth loop lowers it gradually while the engine's reported
        reuse disagrees with the index, instead of routing it on load alone.
        """
        if not (isinstance(trust, (int, float)) and 0.0 <= trust <= 1.0):
            raise ConfigError(f"trust must be in [0, 1], got {trust!r}")
        if trust >= 1.0:
            self._trust.pop(name, None)
        else:
            self._trust[name] = float(trust)

    def workers(self) -> dict[str, WorkerInfo]:
        """Every routable worker with its role, event mode and cold flag.

        Routable: every worker added with :meth:`add_worker`, plus every worker
        the index knows (``KvIndex.workers()``) that was neither added nor
        removed explicitly; those route as ``role="both", events=True`` and
        stop being routable when the index forgets them.
        """
        self._discover()
        return {w.name: WorkerInfo(w.role, w.events, w.cold) for w in self._workers.values()}

    # --- routing --------------------------------------------------------------

    def route(
        self,
        token_ids: Any,
        *,
        request_id: str | None = None,
        lora_id: int | str | None = None,
        salt: str | bytes | None = None,
        explain: bool = False,
        only: Collection[str] | None = None,
    ) -> RouteDecision:
        """Choose where to prefill and decode ``token_ids`` and count it in flight.

        The answer carries what callers need afterwards (per-worker credits,
        the index's own view from this call's single walk; see
        ``router/decision.py``), so none of them walks the index again.
        ``explain=True`` also keeps every candidate's cost terms
        (``RouteDecision.explanation``); off, nothing extra is recorded.

        Raises :class:`NoWorkerAvailableError` when no worker can take it, and
        :class:`~tokenspeed_router.errors.WireError` for token ids that cannot be
        hashed. A ``request_id`` still in flight is released and routed anew.
        ``only``: choose among these workers alone (the endpoint picker's subset
        hint); :class:`NoWorkerAvailableError` when none of them is routable.
        """
        now = self._clock()
        self._expire(now)
        self._discover()
        workers = self._workers
        if not workers:
            raise NoWorkerAvailableError("no workers: add_worker() first, or feed the index events")
        if request_id is None:
            request_id = f"{self._id_prefix}-{next(self._ids)}"
        elif request_id in self._inflight:
            self.release(request_id)
        num_tokens = len(token_ids)
        policy = self._policy

        known: dict[str, PrefixCredit] = {}
        hashes: list[ContentHash] | None = None
        detail: MatchDetailLike | None = None
        shared = self._peer_predictions
        if shared is not None:
            self._remember_peers(shared, now)
        if policy in (Policy.KV_AWARE, Policy.APPROX):
            known, hashes, detail = self._knowledge(token_ids, lora_id, salt, now)

        trace: list[PoolTrace] | None = [] if explain else None
        share = self._cost.followup_share  # what this decision prices with (the route folds into it)
        pools = self._membership()
        if only is not None:
            pools = _subset(pools, only)
        if self._num_split_roles == 0:
            decode = self._choose("all", pools.all, num_tokens, known, hashes, now, trace)
            prefill = None
        else:
            if not pools.decode:
                raise NoWorkerAvailableError("no decode-capable worker (role decode or both)")
            decode = self._choose("decode", pools.decode, num_tokens, known, hashes, now, trace)
            prefill = None
            uncached = num_tokens - self._tokens(known, decode)
            if uncached > self._config.local_prefill_threshold_tokens and pools.prefill:
                prefill = self._choose("prefill", pools.prefill, num_tokens, known, hashes, now, trace)
                if prefill == decode:
                    prefill = None

        site = prefill if prefill is not None else decode
        site_known = known.get(site)
        if site_known is not None:
            matched_blocks, matched_tokens, block_size = site_known.blocks, site_known.tokens, site_known.block_size
        else:
            matched_blocks = matched_tokens = 0
            block_size = detail.block_size.get(site, 0) if detail is not None else 0
        uncached = self._admit(request_id, now, num_tokens, known, decode, prefill, hashes)
        if hashes is not None:
            self._remember(hashes, (site, decode), now)
        if self._recovering:
            self._record_chains(token_ids, lora_id, salt, (site, decode))
        if shared is not None and policy in _COST_POLICIES:
            shared.routed((site, decode) if site != decode else (site,), hashes or (), request_id, uncached,
                          history=self._cost.last_history)
        self._routed += 1
        if prefill is not None:
            self._remote_prefills += 1
        elif self._num_split_roles:
            self._local_prefills += 1
        scores = {w: (known[w].blocks if w in known else 0) for w in pools.all}
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "route request_id=%s tokens=%d worker=%s prefill=%s decode=%s matched=%d",
                request_id,
                num_tokens,
                site,
                prefill,
                decode,
                matched_blocks,
            )
        explanation = None
        if trace is not None:
            explanation = self._explanation(trace, site, decode, prefill, num_tokens, detail, share)
        return RouteDecision(
            worker=site,
            matched_blocks=matched_blocks,
            matched_tokens=matched_tokens,
            scores=scores,
            prefill_worker=prefill,
            decode_worker=decode,
            request_id=request_id,
            block_size=block_size,
            num_tokens=num_tokens,
            credits=known,
            index_match=detail,
            explanation=explanation,
        )

    def release(self, request_id: str) -> bool:
        """The request finished: stop counting it. False if unknown or expired."""
        entry = self._inflight.pop(request_id, None)
        if entry is None:
            return False
        self._drop(entry)
        self._released += 1
        if len(self._expiry) > 2 * len(self._inflight) + 1024:
            # Released entries wait in the expiry queue until their deadline;
            # compact it so a busy router holds O(in flight), not O(rate * timeout).
            live = self._inflight
            self._expiry = deque(e for e in self._expiry if live.get(e.request_id) is e)
        return True

    def mark_prefill_done(self, request_id: str, *, uncached_tokens: int | None = None) -> bool:
        """The request produced its first token: its prefill is no longer queued.

        Drops its pending prefill tokens everywhere and its share on a remote
        prefill worker; the decode worker keeps counting it until
        :meth:`release`. Optional: without it, prefill tokens count until release.
        The cost model also re-anchors the engine's queue clock here, fits its
        prefill rate from the service time, and ends the request's prediction
        at the engine's next BlockStored; ``uncached_tokens`` (prompt tokens
        the engine reported it did not reuse) makes the fit exact, else the
        router's own estimate is used.
        """
        entry = self._inflight.get(request_id)
        if entry is None:
            return False
        self._cost.prefill_done(request_id, [p.worker for p in entry.parts], self._clock(), uncached_tokens)
        if self._peer_predictions is not None:
            self._peer_predictions.prefill_done(request_id)
        kept: list[_Part] = []
        if self._peer_load is not None:
            self._peer_load.changed()
        for part in entry.parts:
            worker = self._workers.get(part.worker)
            if worker is not None:
                worker.pending_prefill_tokens -= part.pending_prefill_tokens
                if part.prefill_only:
                    worker.active_requests -= part.requests
                    worker.active_tokens -= part.active_tokens
            part.pending_prefill_tokens = 0
            if not part.prefill_only:
                kept.append(part)
        entry.parts = kept
        return True

    def load(self) -> dict[str, WorkerLoad]:
        """Per worker: in-flight requests, pending prefill tokens, context tokens.

        The router's own tracking (after expiring overdue entries), not the
        ``load_provider``'s view.
        """
        self._expire(self._clock())
        self._discover()
        return {
            w.name: WorkerLoad(w.active_requests, w.pending_prefill_tokens, w.active_tokens)
            for w in self._workers.values()
        }

    @property
    def followup_share(self) -> float:
        """The learnt share of requests carrying a session's own history (``router/cost.py``)."""
        return self._cost.followup_share

    def pin_followup_share(self, share: float | None) -> None:
        """Hold the cost model's share of requests carrying a session's own history (decision
        replay prices a logged decision with the share it saw); None: learn it again."""
        self._cost.pin_followup_share(share)

    def engine_estimates(self) -> dict[str, EngineEstimate]:
        """The cost model's view of each engine it has routed to."""
        return self._cost.estimates(self._clock())

    def in_flight(self) -> int:
        """Requests currently counted in flight."""
        return len(self._inflight)

    def statistics(self) -> RouterStatistics:
        """Counters since construction."""
        return RouterStatistics(
            routed=self._routed,
            released=self._released,
            expired=self._expired,
            in_flight=len(self._inflight),
            remote_prefills=self._remote_prefills,
            local_prefills=self._local_prefills,
        )

    # --- internals --------------------------------------------------------------

    def _discover(self) -> None:
        """Follow the index's membership for workers not added explicitly.

        Costs one attribute read per call while the index's ``workers_version``
        is unchanged (an index without it is listed every time; one without
        ``workers()`` contributes nothing).
        """
        index = self._index
        list_workers = getattr(index, "workers", None)
        if list_workers is None:
            return
        version = getattr(index, "workers_version", None)
        if version is not None and version == self._index_version:
            return
        self._index_version = version
        names = list_workers()
        if self._discovered:
            present = set(names)
            for name in [n for n in self._discovered if n not in present]:
                self._discovered.discard(name)
                self._forget(name)
        workers = self._workers
        for name in names:
            if name not in workers and name not in self._removed:
                workers[name] = _Worker(name=name)
                self._discovered.add(name)
                self._pools = None

    def _worker(self, name: str) -> _Worker:
        try:
            return self._workers[name]
        except KeyError:
            raise KeyError(f"unknown worker {name!r}") from None

    def _membership(self) -> _Pools:
        pools = self._pools
        if pools is None:
            ws = sorted(self._workers.values(), key=lambda w: w.name)
            approx_all = self._policy is Policy.APPROX
            pools = self._pools = _Pools(
                all=[w.name for w in ws],
                decode=[w.name for w in ws if w.role is not WorkerRole.PREFILL],
                prefill=[w.name for w in ws if w.role is not WorkerRole.DECODE],
                indexed=[] if approx_all else [w.name for w in ws if w.events],
                remembered=[w.name for w in ws if approx_all or not w.events],
            )
        return pools

    def _knowledge(
        self, token_ids: Any, lora_id: int | str | None, salt: str | bytes | None, now: float
    ) -> tuple[dict[str, PrefixCredit], list[ContentHash] | None, MatchDetailLike | None]:
        """Credited prefix per routable worker (index, memory, or both), the prompt's
        approximate-store hashes, and the index's answer (None when not asked)."""
        workers = self._workers
        weights = self._weights
        pools = self._membership()
        known: dict[str, PrefixCredit] = {}
        index_workers = pools.indexed
        approx_names = pools.remembered
        detail: MatchDetailLike | None = None
        if index_workers and self._index is not None:
            detail = self._index.match_detail(token_ids, lora_id, salt)
            block_size = detail.block_size
            tiers = detail.tiers
            for name, blocks in detail.scores.items():
                w = workers.get(name)
                if w is None or not w.events or blocks <= 0:
                    continue
                bs = block_size.get(name, 0)
                t = tiers.get(name)
                if t is None or t.get("gpu", 0) >= blocks:
                    credit = float(blocks * bs)  # all on GPU: the common case
                else:
                    credit = credited_tokens(blocks, bs, t, weights)
                known[name] = PrefixCredit(blocks, bs, credit, _INDEX)
        hashes = self._approx.hash_prompt(token_ids, lora_key(lora_id), salt)
        if approx_names:
            bs = self._approx.block_size
            for name, blocks in self._approx.match(hashes, approx_names, now).items():
                known[name] = PrefixCredit(blocks, bs, float(blocks * bs), _APPROX)
        recovering = self._recovering
        if recovering:  # their index entries are not trusted: what was routed there since is
            for name in recovering:
                known.pop(name, None)
            bs = self._approx.block_size
            for name, blocks in self._approx.match(hashes, recovering, now).items():
                known[name] = PrefixCredit(blocks, bs, float(blocks * bs), _APPROX)
        self._cost.credit(known, hashes, index_workers, now)
        for name in self._cold:
            if name not in recovering:
                known.pop(name, None)
        for name, trust in self._trust.items():
            k = known.get(name)
            if k is not None:
                if trust <= 0.0:
                    del known[name]
                else:
                    known[name] = PrefixCredit(k.blocks, k.block_size, k.credit_tokens * trust, k.source)
        return known, hashes, detail

    @staticmethod
    def _tokens(known: Mapping[str, PrefixCredit], name: str) -> int:
        k = known.get(name)
        return k.tokens if k is not None else 0

    def _choose(
        self,
        pool: str,
        candidates: list[str],
        num_tokens: int,
        known: Mapping[str, PrefixCredit],
        hashes: list[ContentHash] | None,
        now: float,
        trace: list[PoolTrace] | None = None,
    ) -> str:
        """Apply the policy to one pool of candidates (the cost-based ones: ``router/cost.py``).

        ``trace`` (``explain=True``): append this pool's cost terms per
        candidate, the choice, the tied set and whether it was drawn at random.
        """
        policy = self._policy
        if policy is Policy.RANDOM or policy is Policy.ROUND_ROBIN:
            names = sorted(candidates)
            if policy is Policy.RANDOM:
                choice = names[int(self._rng.random() * len(names)) % len(names)]
            else:
                cursor = self._cursors.get(pool, 0)
                self._cursors[pool] = cursor + 1
                choice = names[cursor % len(names)]
            if trace is not None:
                blind = [CostTerms(pool, n, None, float(num_tokens), *self._load_terms(n), None) for n in names]
                trace.append((blind, choice, frozenset(), policy is Policy.RANDOM))
            return choice
        peers = self._peer_load.peers() if self._peer_load is not None else None
        return self._cost.choose(pool, candidates, num_tokens, known, self._workers, peers, hashes, now, trace)

    def _load_terms(self, name: str) -> tuple[int, int, int]:
        """(queued prefill, context tokens, requests) on ``name`` as the cost would see them."""
        external = self._load_provider(name) if self._load_provider is not None else None
        if external is not None:
            return external.pending_prefill_tokens, external.active_tokens, external.active_requests
        w = self._workers[name]
        peers = self._peer_load.peers() if self._peer_load is not None else None
        peer = peers.get(name) if peers else None
        if peer is None:
            return w.pending_prefill_tokens, w.active_tokens, w.active_requests
        return (
            w.pending_prefill_tokens + peer.pending_prefill_tokens,
            w.active_tokens + peer.active_tokens,
            w.active_requests + peer.active_requests,
        )

    def _explanation(
        self,
        trace: list[PoolTrace],
        site: str,
        decode: str,
        prefill: str | None,
        num_tokens: int,
        detail: MatchDetailLike | None,
        share: float,
    ) -> RouteExplanation:
        candidates: list[CandidateCost] = []
        policy = self._policy.value
        for rows, choice, tied, sampled in trace:
            candidates += explain_pool(
                rows, choice, tied=tied, sampled=sampled, policy=policy, cold=self._cold, index_match=detail
            )
        return RouteExplanation(
            worker=site,
            decode_worker=decode,
            prefill_worker=prefill,
            policy=policy,
            num_tokens=num_tokens,
            temperature=self._config.temperature,
            weights=dataclasses.replace(self._weights, followup_share=share),
            candidates=tuple(candidates),
        )

    def _admit(
        self,
        request_id: str,
        now: float,
        num_tokens: int,
        known: Mapping[str, PrefixCredit],
        decode: str,
        prefill: str | None,
        hashes: list[ContentHash] | None,
    ) -> int:
        """Count the request on the chosen workers (and on the cost model's engine clocks);
        returns the prompt tokens it predicts the prefill site computes."""
        entry = _InFlight(request_id, now + self._config.inflight_timeout_s)
        serial = next(self._serial)
        site = prefill if prefill is not None else decode
        site_known = known.get(site)
        credit = site_known.credit_tokens if site_known is not None else 0.0
        uncached = max(round(num_tokens - credit), 0)
        if prefill is None:
            entry.parts.append(_Part(decode, 1, uncached, num_tokens, prefill_only=False))
        else:
            entry.parts.append(_Part(prefill, 1, uncached, 0, prefill_only=True))
            entry.parts.append(_Part(decode, 1, 0, num_tokens, prefill_only=False))
        for part in entry.parts:
            w = self._workers[part.worker]
            w.active_requests += part.requests
            w.pending_prefill_tokens += part.pending_prefill_tokens
            w.active_tokens += part.active_tokens
            w.last_pick = serial
        if self._policy in _COST_POLICIES:
            predict = self._workers[site].events and self._policy is not Policy.APPROX
            self._cost.admit(request_id, now, uncached, site, decode, hashes, predict)
        self._inflight[request_id] = entry
        self._expiry.append(entry)
        if self._peer_load is not None:
            self._peer_load.changed()
        return uncached

    def on_index_applied(self, worker: str, stats: Any) -> None:
        """An event batch of ``worker`` was applied (the routing core wires the ingestor here).

        ``stats`` is ``KvIndex.apply``'s :class:`~tokenspeed_router.router.index.ApplyStats`:
        its stores end the predictions they confirm, its removals tell the
        engine's capacity (router/cost.py). The worker's blocks after the batch
        come with it (``ApplyStats.blocks``, counted by the apply itself); the
        index is asked again only when a caller's stats lack them.
        """
        removed = getattr(stats, "removed_blocks", 0)
        held = None
        bs = 0
        if removed and self._index is not None:
            bs_of = getattr(self._index, "block_size_of", None)
            bs = (bs_of(worker) if bs_of is not None else None) or 0
            blocks = getattr(stats, "blocks", -1)
            if blocks >= 0:
                held = int(blocks)
            else:
                count = getattr(self._index, "num_blocks", None)
                held = int(count(worker)) if count is not None else None
        self._cost.applied(worker, getattr(stats, "stored_blocks", 0), removed, held, bs)

    def on_index_cleared(self, worker: str) -> None:
        """``worker``'s index entries were dropped (restart, resync): its predictions end too."""
        self._cost.cleared(worker)

    def _remember(self, hashes: list[ContentHash], chosen: tuple[str, ...], now: float) -> None:
        """Record the routed prompt for workers whose knowledge comes from memory."""
        approx_all = self._policy is Policy.APPROX
        recovering = self._recovering
        for name in dict.fromkeys(chosen):
            if approx_all or not self._workers[name].events or name in recovering:
                self._approx.record(name, hashes, now)

    def _record_chains(
        self, token_ids: Any, lora_id: int | str | None, salt: str | bytes | None, chosen: tuple[str, ...]
    ) -> None:
        """Keep the routed prompt as a chain at each recovering chosen worker's block size."""
        data: bytes | None = None
        for name in dict.fromkeys(chosen):
            if name not in self._recovering:
                continue
            bs = self._index_block_size(name)
            if not bs:
                continue
            record = self._recovering[name]
            if record is None or record.block_size != bs:
                record = self._recovering[name] = ChainRecord(bs)
            if data is None:
                data = tokens_to_bytes(token_ids)
            record.record(data, root_seed(lora_key(lora_id), salt))

    def _remember_peers(self, shared: PeerPredictions, now: float) -> None:
        """Take in the other replicas' requests as if this router had routed them (``peer_work.py``)."""
        workers = self._workers
        cost = self._cost
        for event in shared.take_predictions():
            at = now if event.at is None else min(event.at, now)
            if isinstance(event, PeerPrediction):
                known = tuple(w for w in event.workers if w in workers)
                if known:
                    site = event.workers[0] if event.workers[0] in workers else None
                    cost.peer_routed(event.hashes, known, lambda n: workers[n].events, at,
                                     request=event.request, site=site, uncached=event.uncached,
                                     history=event.history)
            elif isinstance(event, PeerEnded):
                cost.peer_ended(event.request, at)
            else:
                cost.peer_prefill_done(event.request, at)

    def _drop(self, entry: _InFlight) -> None:
        self._cost.release(entry.request_id, [p.worker for p in entry.parts], self._clock())
        if self._peer_predictions is not None:
            self._peer_predictions.ended(entry.request_id)
        if self._peer_load is not None and entry.parts:
            self._peer_load.changed()
        for part in entry.parts:
            w = self._workers.get(part.worker)
            if w is None:
                continue
            w.active_requests -= part.requests
            w.pending_prefill_tokens -= part.pending_prefill_tokens
            w.active_tokens -= part.active_tokens
        entry.parts = []

    def _expire(self, now: float) -> None:
        expiry = self._expiry
        while expiry and expiry[0].deadline_s <= now:
            entry = expiry.popleft()
            if self._inflight.get(entry.request_id) is entry:
                del self._inflight[entry.request_id]
                self._drop(entry)
                self._expired += 1
                logger.debug("in-flight request_id=%s expired", entry.request_id)
