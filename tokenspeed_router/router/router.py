"""The router: pick a worker (or a prefill/decode pair) for each request.

``Router.route(token_ids)`` combines three things:

* **prefix knowledge** — per worker, how many leading blocks of the prompt it
  holds and on which tier: exact from the event-fed :class:`KvIndex` for
  workers that publish KV events, approximate (what this router routed there,
  with a TTL) for workers that do not, nothing for *cold* workers (their index
  state is being resynchronised, so it cannot be trusted);
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

import enum
import itertools
import logging
import math
import random
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenspeed_router.errors import ConfigError, NoWorkerAvailableError
from tokenspeed_router.hashing import ContentHash
from tokenspeed_router.router.decision import (
    CandidateCost,
    CostTerms,
    CreditSource,
    PrefixCredit,
    RouteDecision,
    RouteExplanation,
    explain_pool,
)
from tokenspeed_router.router.engine_belief import EngineBelief, PrefillFit, rendezvous_pick
from tokenspeed_router.router.index import lora_key
from tokenspeed_router.router.peer_work import PeerPredictions
from tokenspeed_router.router.scoring import (
    ApproxPrefixStore,
    CostWeights,
    MatchDetailLike,
    Policy,
    PrefixIndex,
    WorkerLoad,
    credited_tokens,
    lowest_tied,
    pick_lowest,
    sample_softmax,
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


class WorkerRole(str, enum.Enum):
    """What a worker may do in disaggregated serving."""

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


#: ``load_provider(worker) -> WorkerLoad | None``: the caller's view of a
#: worker's load (e.g. the simulator's real queues). ``None`` means "use the
#: router's own in-flight tracking for this worker".
LoadProvider = Callable[[str], "WorkerLoad | None"]


class PeerLoad(Protocol):
    """Load that other router replicas have in flight, per worker.

    ``peers()`` is read once per routing decision and must be cheap (a cached
    mapping, never a network round trip); ``changed()`` is called whenever this
    router's own in-flight load changes (admit, release, prefill done, expiry)
    so the implementation can publish it soon. Both run under the caller's
    lock, on the routing thread.
    """

    def peers(self) -> Mapping[str, WorkerLoad]: ...

    def changed(self) -> None: ...


def _finite_nonneg(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """Routing policy and cost weights (validated on construction).

    Weights are in token units (see ``scoring.py``): ``prefill_weight`` per
    uncached prompt token of this request, ``queue_weight`` per prefill token
    already queued on the worker, ``decode_weight`` per context token of
    requests in flight there, ``request_weight`` per in-flight request. The
    defaults estimate TTFT as "queued prefill + own uncached prefill" with the
    request's own prefill counted 2.5 times (recomputing a prefix elsewhere also
    costs later requests and a second copy in another cache), plus a small
    pull towards workers holding less live KV; routed prompts are remembered
    for 15 s so siblings co-locate before the engine's events arrive. Both
    settings were measured on the Mooncake traces (docs/simulation.md).
    """

    #: One of :class:`Policy` (a plain string such as ``"round_robin"`` works).
    policy: Policy | str = Policy.KV_AWARE
    prefill_weight: float = 2.5
    queue_weight: float = 1.0
    decode_weight: float = 0.05
    request_weight: float = 0.0
    #: Fraction of a block's prefill a CPU-tier (resp. storage-tier) hit saves.
    cpu_hit_credit: float = 0.75
    storage_hit_credit: float = 0.25
    #: 0 = argmin of the cost; > 0 = softmax sampling over range-normalised costs.
    temperature: float = 0.0
    #: Seed of the router's own ``random.Random`` when none is passed in.
    seed: int = 0
    #: In-flight entries not released within this time stop counting as load.
    inflight_timeout_s: float = 300.0
    #: P/D: skip remote prefill when the decode worker misses at most this many tokens.
    local_prefill_threshold_tokens: int = 512
    #: Approximate prefix store (workers without events, ``approx`` policy).
    approx_block_size: int = 64
    approx_ttl_s: float = 120.0
    approx_max_blocks_per_worker: int = 100_000
    #: > 0: also remember routed prompts for event-publishing workers for this
    #: long, and score each worker by the larger of index and memory, so that
    #: sibling requests arriving before the engine's BlockStored still
    #: co-locate (Dynamo's predict-on-route). 0 disables it.
    predict_on_route_ttl_s: float = 15.0
    #: Prefix of generated request ids; None = a random one per Router.
    request_id_prefix: str | None = None
    #: ``"v2"``: the cost is an estimated TTFT in seconds (``router/engine_belief.py``,
    #: docs/routing.md "Cost model v2"): a queue clock with a per-prefill overhead,
    #: a prefill rate fitted per engine, credit trimmed to the blocks that survive
    #: until the prefill starts, predictions that bridge only the wait for the
    #: engine's BlockStored, rendezvous tie-breaks. ``"v1"``: the token-unit cost of
    #: earlier releases (predictions with a TTL refreshed by every sibling).
    cost_model: str = "v2"
    #: v2: prior prefill rate and per-prefill overhead, until fitted from first tokens
    prefill_tokens_per_s: float = 10_000.0
    prefill_overhead_s: float = 0.020
    #: v2: fit rate and overhead per engine from observed prefills (False: keep the priors)
    fit_prefill: bool = True
    #: v2: a prediction ends this long after its request's first token at the latest
    #: (the wait for the engine's BlockStored; the first BlockStored batch ends it sooner)
    prediction_grace_s: float = 1.0
    #: v2: an engine's KV capacity in tokens for the survival estimate; 0 = learn it
    #: from its events (the blocks it held when it first evicted)
    engine_capacity_tokens: int = 0
    #: v2: blocks whose age is within this fraction below the horizon count half
    survival_band: float = 0.2

    def __post_init__(self) -> None:
        try:
            policy = Policy(self.policy)
        except ValueError:
            names = ", ".join(p.value for p in Policy)
            raise ConfigError(f"unknown policy {self.policy!r}; expected one of {names}") from None
        object.__setattr__(self, "policy", policy)
        for name in ("prefill_weight", "queue_weight", "decode_weight", "request_weight"):
            _finite_nonneg(name, getattr(self, name))
        for name in ("cpu_hit_credit", "storage_hit_credit"):
            value = getattr(self, name)
            _finite_nonneg(name, value)
            if value > 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {value!r}")
        _finite_nonneg("temperature", self.temperature)
        _positive("inflight_timeout_s", self.inflight_timeout_s)
        _positive("approx_ttl_s", self.approx_ttl_s)
        _finite_nonneg("predict_on_route_ttl_s", self.predict_on_route_ttl_s)
        if self.cost_model not in ("v1", "v2"):
            raise ConfigError(f"cost_model must be 'v1' or 'v2', got {self.cost_model!r}")
        _positive("prefill_tokens_per_s", self.prefill_tokens_per_s)
        _finite_nonneg("prefill_overhead_s", self.prefill_overhead_s)
        _finite_nonneg("prediction_grace_s", self.prediction_grace_s)
        _finite_nonneg("survival_band", self.survival_band)
        if self.survival_band >= 1.0:
            raise ConfigError(f"survival_band must be in [0, 1), got {self.survival_band!r}")
        if not isinstance(self.fit_prefill, bool):
            raise ConfigError(f"fit_prefill must be a bool, got {self.fit_prefill!r}")
        for name in (
            "local_prefill_threshold_tokens",
            "engine_capacity_tokens",
            "approx_block_size",
            "approx_max_blocks_per_worker",
            "seed",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{name} must be an int, got {value!r}")
        if self.local_prefill_threshold_tokens < 0 or self.engine_capacity_tokens < 0:
            raise ConfigError("local_prefill_threshold_tokens and engine_capacity_tokens must be >= 0")
        if self.approx_block_size <= 0 or self.approx_max_blocks_per_worker <= 0:
            raise ConfigError("approx_block_size and approx_max_blocks_per_worker must be > 0")

    @property
    def policy_name(self) -> str:
        """The policy as its string value."""
        return Policy(self.policy).value

    def weights(self) -> CostWeights:
        """The cost weights as one struct (for ``scoring.worker_cost``)."""
        return CostWeights(
            prefill_weight=self.prefill_weight,
            queue_weight=self.queue_weight,
            decode_weight=self.decode_weight,
            request_weight=self.request_weight,
            cpu_hit_credit=self.cpu_hit_credit,
            storage_hit_credit=self.storage_hit_credit,
        )


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """How the router knows a worker."""

    role: WorkerRole
    events: bool
    cold: bool


_UNSYNCED: Any = object()


@dataclass(frozen=True, slots=True)
class RouterStatistics:
    """Counters since construction (a frozen snapshot)."""

    routed: int
    released: int
    expired: int
    in_flight: int
    remote_prefills: int
    local_prefills: int


@dataclass(frozen=True, slots=True)
class EngineEstimate:
    """What cost model v2 believes about one engine (``Router.engine_estimates``).

    ``queue_s``: seconds of prefill queued ahead of a request routed now;
    ``queued_prefills``: prefills queued or running; the fitted
    ``prefill_tokens_per_s`` and ``prefill_overhead_s`` (``fit_samples``
    prefills seen); ``capacity_tokens``: the eviction horizon (None: unknown,
    no eviction seen yet); ``predictions``: requests whose store is bridged.
    """

    queue_s: float
    queued_prefills: int
    prefill_tokens_per_s: float
    prefill_overhead_s: float
    fit_samples: int
    capacity_tokens: int | None
    predictions: int

    def to_dict(self) -> dict[str, float | int | None]:
        return {
            "queue_s": self.queue_s,
            "queued_prefills": self.queued_prefills,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "prefill_overhead_s": self.prefill_overhead_s,
            "fit_samples": self.fit_samples,
            "capacity_tokens": self.capacity_tokens,
            "predictions": self.predictions,
        }


@dataclass(slots=True)
class _Worker:
    name: str
    role: WorkerRole
    events: bool
    cold: bool = False
    active_requests: int = 0
    pending_prefill_tokens: int = 0
    active_tokens: int = 0
    last_pick: int = -1  # serial of the last route that chose it (-1: never)


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


_INDEX, _PREDICTED, _APPROX = CreditSource.INDEX, CreditSource.PREDICTED, CreditSource.APPROX
#: policies that compute a cost (and so keep engine models under v2)
_COST_POLICIES = (Policy.KV_AWARE, Policy.APPROX, Policy.LEAST_LOADED)

#: one pool of an explained decision: cost terms per candidate, choice, tied set, drawn at random
_PoolTrace = tuple[list[CostTerms], str, frozenset[str], bool]


def _cost_terms(
    pool: str, name: str, k: PrefixCredit | None, uncached: float, load: Any, peer: WorkerLoad | None, cost: float
) -> CostTerms:
    """The terms ``Router._choose`` just priced, with other replicas' load folded in."""
    queue, active, requests = load.pending_prefill_tokens, load.active_tokens, load.active_requests
    if peer is not None:
        queue += peer.pending_prefill_tokens
        active += peer.active_tokens
        requests += peer.active_requests
    return CostTerms(pool, name, k, float(uncached), queue, active, requests, cost)


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
        self._v2 = config.cost_model == "v2"
        #: v2: per worker, the engine model (queue clock, fit, horizon, bridged predictions)
        self._engines: dict[str, EngineBelief] = {}
        #: v2: one fit over every engine's prefills (engines use it until they have their own)
        self._fleet_fit = PrefillFit(config.prefill_tokens_per_s, config.prefill_overhead_s, forget=0.999)
        self._name_keys: dict[str, int] = {}
        self._route_now = 0.0
        self._route_hashes: list[ContentHash] | None = None
        self._peer_ids = itertools.count()
        self._predicted: ApproxPrefixStore | None = None
        if config.predict_on_route_ttl_s > 0 and not self._v2:
            self._predicted = ApproxPrefixStore(
                block_size=config.approx_block_size,
                ttl_s=config.predict_on_route_ttl_s,
                max_blocks=config.approx_max_blocks_per_worker,
            )
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
            self._workers[name] = _Worker(name, parsed, bool(events))
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
        self._pools = None
        for entry in self._inflight.values():
            entry.parts = [p for p in entry.parts if p.worker != name]
        self._approx.clear_worker(name)
        if self._predicted is not None:
            self._predicted.clear_worker(name)
        self._engines.pop(name, None)

    def set_cold(self, name: str, cold: bool) -> None:
        """Cold workers score 0 matched blocks (their index state is not trusted)
        but stay routable by load. The ingestor's resyncing/stale states map here.
        """
        self._discover()
        self._worker(name).cold = bool(cold)
        if cold:
            self._cold.add(name)
        else:
            self._cold.discard(name)

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

        self._route_now = now
        self._route_hashes = hashes
        trace: list[_PoolTrace] | None = [] if explain else None
        pools = self._membership()
        if self._num_split_roles == 0:
            decode = self._choose("all", pools.all, num_tokens, known, trace)
            prefill = None
        else:
            if not pools.decode:
                raise NoWorkerAvailableError("no decode-capable worker (role decode or both)")
            decode = self._choose("decode", pools.decode, num_tokens, known, trace)
            prefill = None
            uncached = num_tokens - self._tokens(known, decode)
            if uncached > self._config.local_prefill_threshold_tokens and pools.prefill:
                prefill = self._choose("prefill", pools.prefill, num_tokens, known, trace)
                if prefill == decode:
                    prefill = None

        site = prefill if prefill is not None else decode
        site_known = known.get(site)
        if site_known is not None:
            matched_blocks, matched_tokens, block_size = site_known.blocks, site_known.tokens, site_known.block_size
        else:
            matched_blocks = matched_tokens = 0
            block_size = detail.block_size.get(site, 0) if detail is not None else 0
        self._admit(request_id, now, num_tokens, known, decode, prefill)
        if hashes is not None:
            self._remember(hashes, (site, decode), now)
            if shared is not None:
                shared.routed((site, decode) if site != decode else (site,), hashes)
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
            explanation = self._explanation(trace, site, decode, prefill, num_tokens, detail)
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
        Cost model v2 also re-anchors the engine's queue clock here, fits its
        prefill rate from the service time, and ends the request's prediction
        at the engine's next BlockStored; ``uncached_tokens`` (prompt tokens
        the engine reported it did not reuse) makes the fit exact, else the
        router's own estimate is used.
        """
        entry = self._inflight.get(request_id)
        if entry is None:
            return False
        if self._engines:
            now = self._clock()
            grace = now + self._config.prediction_grace_s
            for part in entry.parts:
                eng = self._engines.get(part.worker)
                if eng is not None and request_id in eng.pending:
                    eng.done(request_id, now, uncached_tokens, fit=self._config.fit_prefill)
                    eng.prediction_done(request_id, grace)
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

    def engine_estimates(self) -> dict[str, EngineEstimate]:
        """Cost model v2's view of each engine it has routed to (empty under v1)."""
        now = self._clock()
        return {
            name: EngineEstimate(
                queue_s=eng.queue_s(now),
                queued_prefills=len(eng.pending),
                prefill_tokens_per_s=eng.fit.rate,
                prefill_overhead_s=eng.fit.overhead,
                fit_samples=eng.own_fit.samples,
                capacity_tokens=None if eng.capacity_tokens == math.inf else int(eng.capacity_tokens),
                predictions=len(eng.predictions),
            )
            for name, eng in self._engines.items()
        }

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
                workers[name] = _Worker(name, WorkerRole.BOTH, True)
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
        hashes: list[ContentHash] | None = None
        predicted = self._predicted
        if self._v2:
            hashes = self._approx.hash_prompt(token_ids, lora_key(lora_id), salt)
            if approx_names:
                bs = self._approx.block_size
                for name, blocks in self._approx.match(hashes, approx_names, now).items():
                    known[name] = PrefixCredit(blocks, bs, float(blocks * bs), _APPROX)
            self._v2_credit(known, hashes, index_workers, now)
        elif approx_names or predicted is not None:
            hashes = self._approx.hash_prompt(token_ids, lora_key(lora_id), salt)
            bs = self._approx.block_size
            if approx_names:
                for name, blocks in self._approx.match(hashes, approx_names, now).items():
                    known[name] = PrefixCredit(blocks, bs, float(blocks * bs), _APPROX)
            if predicted is not None and index_workers:
                for name, blocks in predicted.match(hashes, index_workers, now).items():
                    have = known.get(name)
                    if have is None or have.tokens < blocks * bs:
                        known[name] = PrefixCredit(blocks, bs, float(blocks * bs), _PREDICTED)
        for name in self._cold:
            known.pop(name, None)
        for name, trust in self._trust.items():
            k = known.get(name)
            if k is not None:
                if trust <= 0.0:
                    del known[name]
                else:
                    known[name] = PrefixCredit(k.blocks, k.block_size, k.credit_tokens * trust, k.source)
        return known, hashes, detail

    def _engine(self, name: str) -> EngineBelief:
        eng = self._engines.get(name)
        if eng is None:
            c = self._config
            cap = float(c.engine_capacity_tokens) if c.engine_capacity_tokens > 0 else math.inf
            eng = self._engines[name] = EngineBelief(
                PrefillFit(c.prefill_tokens_per_s, c.prefill_overhead_s),
                shared_fit=self._fleet_fit,
                capacity_tokens=cap,
                capacity_fixed=c.engine_capacity_tokens > 0,
            )
        return eng

    def _v2_credit(
        self, known: dict[str, PrefixCredit], hashes: list[ContentHash], index_workers: list[str], now: float
    ) -> None:
        """Cost model v2's credit: bridged predictions, then the survival trim.

        A prediction reaching deeper than the index credits the prompt as the
        request in flight will store it; then every credit is cut to the blocks
        expected to survive until this request's prefill starts (the engine's
        eviction horizon against the blocks' ages on its insertion clock).
        """
        abs_ = self._approx.block_size
        predict = self._config.predict_on_route_ttl_s > 0
        band = self._config.survival_band
        engines = self._engines
        if predict:
            for name in index_workers:
                eng = engines.get(name)
                if eng is None or not eng.predictions:
                    continue
                eng.expire_predictions(now)
                blocks = eng.predicted_blocks(hashes)
                if blocks:
                    have = known.get(name)
                    if have is None or have.tokens < blocks * abs_:
                        known[name] = PrefixCredit(blocks, abs_, float(blocks * abs_), _PREDICTED)
        for name, k in list(known.items()):
            eng = engines.get(name)
            if eng is None:
                continue
            alive = eng.surviving_blocks(hashes, band)
            if alive is None:
                continue
            sure, likely = alive
            limit = (sure + 0.5 * (likely - sure)) * abs_
            if k.credit_tokens > limit:
                known[name] = PrefixCredit(k.blocks, k.block_size, float(limit), k.source)

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
        trace: list[_PoolTrace] | None = None,
    ) -> str:
        """Apply the policy to one pool of candidates.

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
        if self._v2:
            return self._choose_v2(pool, candidates, num_tokens, known, trace)
        # scoring.worker_cost, inlined: this loop runs for every worker on every request.
        weights = self._weights
        pw, qw = weights.prefill_weight, weights.queue_weight
        dw, rw = weights.decode_weight, weights.request_weight
        provider = self._load_provider
        workers = self._workers
        get_known = known.get
        peers = self._peer_load.peers() if self._peer_load is not None else None
        peer_requests: dict[str, int] = {}
        costs: dict[str, float] = {}
        terms: list[CostTerms] | None = [] if trace is not None else None
        best = math.inf
        for name in candidates:
            load: Any = workers[name]
            external = provider(name) if provider is not None else None
            if external is not None:
                load = external
            k = get_known(name)
            uncached = num_tokens - k.credit_tokens if k is not None else num_tokens
            if uncached < 0:
                uncached = 0
            cost = (
                pw * uncached
                + qw * load.pending_prefill_tokens
                + dw * load.active_tokens
                + rw * load.active_requests
            )
            peer = peers.get(name) if peers and external is None else None
            if peer is not None:  # other replicas' load on it (not part of a provider's answer)
                cost += (
                    qw * peer.pending_prefill_tokens
                    + dw * peer.active_tokens
                    + rw * peer.active_requests
                )
                peer_requests[name] = peer.active_requests
            costs[name] = cost
            if cost < best:
                best = cost
            if terms is not None:
                terms.append(_cost_terms(pool, name, k, uncached, load, peer, cost))
        sampled = self._config.temperature > 0.0
        if sampled:
            choice = sample_softmax(costs, self._config.temperature, self._rng)
        else:
            choice = pick_lowest(
                costs,
                lambda n: (workers[n].active_requests + peer_requests.get(n, 0), workers[n].last_pick),
                best=best,
            )
        if trace is not None and terms is not None:  # (both or neither)
            trace.append((terms, choice, frozenset(lowest_tied(costs, best=best)), sampled))
        return choice

    def _choose_v2(
        self,
        pool: str,
        candidates: list[str],
        num_tokens: int,
        known: Mapping[str, PrefixCredit],
        trace: list[_PoolTrace] | None,
    ) -> str:
        """Cost model v2: the estimated TTFT in seconds, ties broken by rendezvous hash.

        cost(w) = queue_weight * queue_s(w) + overhead(w)
                + (prefill_weight * uncached(w) + decode_weight * active_tokens(w)
                   + request_weight * active_requests(w)) / rate(w)
        with ``queue_s`` the engine's queue clock (other replicas' pending
        prefill added at ``rate``). Ties (within a relative 1e-9, as in v1: idle
        workers, equal credit) go to the tied worker whose rendezvous weight for
        the prompt's first uncached block is highest among those with the fewest
        requests in flight, so replicas and siblings agree.
        """
        now = self._route_now
        weights = self._weights
        pw, qw = weights.prefill_weight, weights.queue_weight
        dw, rw = weights.decode_weight, weights.request_weight
        provider = self._load_provider
        workers = self._workers
        get_known = known.get
        peers = self._peer_load.peers() if self._peer_load is not None else None
        costs: dict[str, float] = {}
        terms: list[CostTerms] | None = [] if trace is not None else None
        best = math.inf
        for name in candidates:
            eng = self._engine(name)
            fit = eng.fit
            rate = fit.rate
            load: Any = workers[name]
            external = provider(name) if provider is not None else None
            k = get_known(name)
            uncached = num_tokens - k.credit_tokens if k is not None else num_tokens
            if uncached < 0:
                uncached = 0
            if external is not None:
                load = external
                queue_s = external.pending_prefill_tokens / rate
            else:
                queue_s = eng.queue_s(now)
            # scoring.ttft_cost, inlined (this loop runs for every worker on every request)
            cost = qw * queue_s + fit.overhead + (pw * uncached + dw * load.active_tokens + rw * load.active_requests) / rate
            peer = peers.get(name) if peers and external is None else None
            if peer is not None:
                cost += (qw * peer.pending_prefill_tokens + dw * peer.active_tokens + rw * peer.active_requests) / rate
            costs[name] = cost
            if cost < best:
                best = cost
            if terms is not None:
                terms.append(_cost_terms(pool, name, k, uncached, load, peer, cost))
        sampled = self._config.temperature > 0.0
        tied = lowest_tied(costs, best=best)
        if sampled:
            choice = sample_softmax(costs, self._config.temperature, self._rng)
        elif len(tied) == 1:
            choice = tied[0]
        else:
            # Fewest in flight first (this router's and the other replicas'), then rendezvous.
            def in_flight(n: str) -> int:
                peer = peers.get(n) if peers and provider is None else None
                return workers[n].active_requests + (peer.active_requests if peer is not None else 0)

            fewest = min(in_flight(n) for n in tied)
            least = [n for n in tied if in_flight(n) == fewest]
            hashes = self._route_hashes
            if len(least) == 1:
                choice = least[0]
            elif hashes:
                abs_ = self._approx.block_size
                depth = max((known[n].tokens for n in least if n in known), default=0) // abs_
                choice = rendezvous_pick(int(hashes[min(depth, len(hashes) - 1)]), sorted(least), self._name_keys)
            else:
                choice = min(least, key=lambda n: (workers[n].last_pick, n))
        if trace is not None and terms is not None:
            trace.append((terms, choice, frozenset(tied), sampled))
        return choice

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
        trace: list[_PoolTrace],
        site: str,
        decode: str,
        prefill: str | None,
        num_tokens: int,
        detail: MatchDetailLike | None,
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
            weights=self._weights,
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
    ) -> None:
        """Count the request on the chosen workers."""
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
        if self._v2 and self._policy in _COST_POLICIES:
            self._admit_v2(request_id, now, uncached, site, decode)
        self._inflight[request_id] = entry
        self._expiry.append(entry)
        if self._peer_load is not None:
            self._peer_load.changed()

    def _admit_v2(self, request_id: str, now: float, uncached: int, site: str, decode: str) -> None:
        """Queue the prefill on ``site``'s clock, touch its blocks, predict its store."""
        eng = self._engine(site)
        eng.admit(request_id, uncached, now)
        hashes = self._route_hashes
        if not hashes:
            return
        eng.touch(hashes)
        w = self._workers[site]
        c = self._config
        if w.events and self._policy is not Policy.APPROX and c.predict_on_route_ttl_s > 0:
            # Until its BlockStored can have arrived: at most twice the expected wait plus
            # the grace, and never beyond the TTL (a request that never reports back).
            wait = max(eng.free_at - now, 0.0)
            deadline = now + min(2 * wait + c.prediction_grace_s, c.predict_on_route_ttl_s)
            eng.predict(request_id, [int(h) for h in hashes], deadline)
        if decode != site:
            self._engine(decode).touch(hashes)

    def on_index_applied(self, worker: str, stats: Any) -> None:
        """An event batch of ``worker`` was applied (``IndexIngestor(on_applied=...)``).

        ``stats`` is ``KvIndex.apply``'s :class:`~tokenspeed_router.router.index.ApplyStats`.
        A batch that stored blocks ends the predictions whose prefill is over (the
        index holds them now); one that removed blocks tells the engine's capacity.
        """
        eng = self._engines.get(worker)
        if eng is None:
            return
        if getattr(stats, "stored_blocks", 0):
            eng.stored()
        removed = getattr(stats, "removed_blocks", 0)
        if removed and self._index is not None:
            count = getattr(self._index, "num_blocks", None)
            bs_of = getattr(self._index, "block_size_of", None)
            bs = (bs_of(worker) if bs_of is not None else None) or 0
            if count is not None and bs:
                eng.saw_removal(int(count(worker)) * bs, removed * bs)

    def on_index_cleared(self, worker: str) -> None:
        """``worker``'s index entries were dropped (restart, resync): its predictions end too."""
        eng = self._engines.get(worker)
        if eng is not None:
            eng.cleared()

    def _remember(self, hashes: list[ContentHash], chosen: tuple[str, ...], now: float) -> None:
        """Record the routed prompt for workers whose knowledge comes from memory."""
        approx_all = self._policy is Policy.APPROX
        for name in dict.fromkeys(chosen):
            w = self._workers[name]
            if approx_all or not w.events:
                self._approx.record(name, hashes, now)
            elif self._predicted is not None:
                self._predicted.record(name, hashes, now)

    def _remember_peers(self, shared: PeerPredictions, now: float) -> None:
        """Remember the other replicas' routes as if this router had made them."""
        workers = self._workers
        for p in shared.take_predictions():
            known = tuple(w for w in p.workers if w in workers)
            if not known:
                continue
            if not self._v2:
                self._remember([ContentHash(h) for h in p.hashes], known, now)
                continue
            # v2: a bridged prediction of the peer's request, for as long as its prefill
            # can take on that engine's clock (this router never hears its first token)
            c = self._config
            hashes = [int(h) for h in p.hashes]
            for name in known:
                eng = self._engine(name)
                eng.touch(hashes)
                if workers[name].events and c.predict_on_route_ttl_s > 0:
                    wait = eng.queue_s(now) + eng.fit.predict(len(hashes) * self._approx.block_size)
                    deadline = now + min(2 * wait + c.prediction_grace_s, c.predict_on_route_ttl_s)
                    eng.predict(f"peer-{next(self._peer_ids)}", hashes, deadline)

    def _drop(self, entry: _InFlight) -> None:
        if self._engines:
            for part in entry.parts:
                eng = self._engines.get(part.worker)
                if eng is not None:
                    eng.release(entry.request_id)
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
