"""The cost model: what a request would cost on each engine, and which engine wins.

One model, in seconds of estimated time to first token (docs/routing.md).
Per engine it keeps an :class:`~tokenspeed_router.router.engine_belief.EngineBelief`
(a queue clock of the prefills routed there, a prefill speed fitted from
observed first tokens, the eviction horizon learnt from its removals, and
predictions that bridge a routed prompt until the engine's ``BlockStored``
arrives). The router (``router/router.py``) hands it the credited prefix of
every candidate and asks it to choose; this module alone decides what a
candidate costs, so a change to the model is a change to this file and to
``engine_belief.py``.

    cost(w) = queue_weight * queue_s(w) + admission_s(w)
            + (overhead(w) + (prefill_weight * (uncached(w) - replica(w)) + replica(w)) / rate(w))
              * (1 + inflight_factor * share * requests(w))
            + (decode_weight * active_tokens(w) + request_weight * requests(w)) / rate(w)

``queue_s``: the engine's queue clock (every replica's prefills on it);
``admission_s``: the wait for cache room, when the prompt's new blocks do
not fit beside those the requests in flight pin (``engine_belief.py``);
``uncached``: the prompt minus the credited prefix, the credit first trimmed
to the blocks expected to survive until the prefill starts.

**Sessions in flight** (issue 31; docs/routing.md). A request in flight on
an engine is, in a session workload, the promise of a next turn that will
come back to the same engine with a longer prompt. The queue clock only
sees prefills routed already, so a holder of many live sessions looks free
until their follow-ups arrive together; vllm-router's ``kv_aware`` prices
every request's prefill times (requests in flight + 1) and keeps the tail
down that way. Ours multiplies this request's own prefill time there
(overhead and uncached tokens) by ``1 + inflight_factor * share *
requests(w)``, where ``share`` is the fraction of
recent requests (an EWMA over this router's and its peers' routes) that
carried a session's *own* history: one engine's credit deeper than every
other engine's by at least a block. With no sessions (single-turn traffic,
prefixes several engines hold) the share is near 0 and the model is the
plain queue clock; with every request a follow-up it is vllm-router's in-flight
pressure, in seconds rather than raw tokens. The queue is not multiplied:
it already holds the prefills in flight, and multiplying it counts them
twice -- on a document-QA trace that made every busy holder of a document
look unaffordable, so questions recomputed their documents elsewhere, the
caches churned and the queues grew further (hit 0.80 against 0.97, issue 31).

``replica``: the part of a *hot* prefix (one at least two engines hold)
this engine lacks, priced at its recompute time alone: with ``prefill_weight``
above 1, a hot prefix is worth one more copy as soon as its holders queue
longer than recomputing it costs (issue 26; docs/routing.md, "Hot
prefixes"). At the shipped weight 1 the rule changes nothing.
Ties (within a relative 1e-9) go to the fewest requests in flight, then to
the rendezvous hash of the prompt's first uncached block, so replicas and
siblings agree.

Decision replay (``tools/decision_replay.py``) prices logged decisions with
the same :meth:`CostModel.choose`: a ``load_provider`` answer that carries
``queue_s``/``prefill_tokens_per_s``/``prefill_overhead_s`` (what the log
recorded) replaces the engine's own clock and fit.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenspeed_router.router.config import EngineEstimate, LoadProvider, RouterConfig
from tokenspeed_router.router.decision import CostTerms, CreditSource, PrefixCredit
from tokenspeed_router.router.engine_belief import EngineBelief, PrefillFit, rendezvous_pick
from tokenspeed_router.router.scoring import WorkerLoad, lowest_tied, sample_softmax

__all__ = ["CostModel", "LoadCounters", "PoolTrace"]

#: one pool of an explained decision: cost terms per candidate, choice, tied set, drawn at random
PoolTrace = tuple[list[CostTerms], str, frozenset[str], bool]

_PREDICTED = CreditSource.PREDICTED


@dataclass(slots=True)
class LoadCounters:
    """This router's own in-flight counters for one worker (``router.py`` keeps them)."""

    active_requests: int = 0
    pending_prefill_tokens: int = 0
    active_tokens: int = 0
    last_pick: int = -1  # serial of the last route that chose it (-1: never)


class CostModel:
    """The engines as this router believes them, and the choice among candidates (module docstring).

    ``block_size``: the granularity of the prompt hashes the model keys its
    touches and predictions by (the router's approximate-store hashes).
    """

    def __init__(
        self,
        config: RouterConfig,
        *,
        block_size: int,
        rng: random.Random,
        load_provider: LoadProvider | None = None,
    ) -> None:
        self._config = config
        self._weights = config.weights()
        self._block_size = block_size
        self._rng = rng
        self._load_provider = load_provider
        self._engines: dict[str, EngineBelief] = {}
        #: one fit over every engine's prefills (engines use it until they have their own)
        self._fleet_fit = PrefillFit(config.prefill_tokens_per_s, config.prefill_overhead_s, forget=0.999)
        self._name_keys: dict[str, int] = {}
        self._peer_ids = itertools.count()
        #: other replicas' requests in flight here: key -> the engine it prefills on
        self._peer_sites: dict[str, str] = {}
        #: True once a peer shares its requests one by one (its prefills are on the clocks,
        #: so its queued-token total must not be added again)
        self._peer_clocks = False
        #: the fraction of routed requests that carried a session's own history (module docstring)
        self._share = 0.0
        #: decision replay: the share the logged decision saw, held fixed (None: learnt)
        self._pinned_share: float | None = None
        #: whether the prompt last credited carried a session's own history
        self.last_history = False

    #: the weight of one route in the share's EWMA (about the last 100 routes)
    SHARE_GAIN = 0.01

    @property
    def followup_share(self) -> float:
        """The share of requests carrying a session's own history the cost uses now."""
        return self._share if self._pinned_share is None else self._pinned_share

    def pin_followup_share(self, share: float | None) -> None:
        """Hold the share at ``share`` (decision replay: what the logged decision saw); None: learn again."""
        self._pinned_share = None if share is None else min(max(float(share), 0.0), 1.0)

    def _fold_history(self, history: bool) -> None:
        self._share += self.SHARE_GAIN * ((1.0 if history else 0.0) - self._share)

    # --- engines ---------------------------------------------------------------------

    def engine(self, name: str) -> EngineBelief:
        """The belief about ``name`` (made on first use, from the priors and the fleet's fit)."""
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

    def forget(self, name: str) -> None:
        self._engines.pop(name, None)

    def capacity_tokens(self, name: str) -> float | None:
        """``name``'s cache capacity in tokens (learnt from its removals, or configured); None: unknown."""
        eng = self._engines.get(name)
        if eng is None or eng.capacity_tokens == math.inf:
            return None
        return eng.capacity_tokens

    def estimates(self, now: float) -> dict[str, EngineEstimate]:
        """What the model believes of each engine it has routed to."""
        return {
            name: EngineEstimate(
                queue_s=eng.queue_s(now),
                queued_prefills=len(eng.pending),
                prefill_tokens_per_s=eng.fit.rate,
                prefill_overhead_s=eng.fit.overhead,
                fit_samples=eng.own_fit.samples,
                capacity_tokens=None if eng.capacity_tokens == math.inf else int(eng.capacity_tokens),
                predictions=len(eng.predictions),
                resident_new_tokens=eng.resident_new,
                residence_s=eng.residence_s,
            )
            for name, eng in self._engines.items()
        }

    # --- credit ----------------------------------------------------------------------

    def credit(
        self, known: dict[str, PrefixCredit], hashes: Sequence[int], index_workers: Sequence[str], now: float
    ) -> None:
        """Adjust ``known`` in place: bridged predictions, then the survival trim.

        A prediction reaching deeper than the index credits the prompt as the
        request in flight will store it; then every credit is cut to the
        blocks expected to survive until this request's prefill starts (the
        engine's eviction horizon against the blocks' ages on its insertion
        clock). Last, :attr:`last_history` says whether the prompt carries a
        session's own history (one engine's credit a block deeper than any
        other's); the route that follows folds it into the share.
        """
        abs_ = self._block_size
        band = self._config.survival_band
        engines = self._engines
        if self._config.predict_on_route_ttl_s > 0:
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
        first, second = self._two_deepest(known)
        self.last_history = first - second >= abs_

    # --- the choice ------------------------------------------------------------------

    def choose(
        self,
        pool: str,
        candidates: Sequence[str],
        num_tokens: int,
        known: Mapping[str, PrefixCredit],
        counters: Mapping[str, LoadCounters],
        peers: Mapping[str, WorkerLoad] | None,
        hashes: Sequence[int] | None,
        now: float,
        trace: list[PoolTrace] | None,
    ) -> str:
        """The candidate with the lowest estimated TTFT (module docstring).

        ``counters``: this router's own in-flight counts per candidate;
        ``peers``: other replicas' (not added to a load provider's answer,
        which is taken as the worker's whole load). ``trace`` (explain):
        append this pool's terms per candidate, the choice, the tied set and
        whether it was sampled.
        """
        w = self._weights
        pw, qw, dw, rw = w.prefill_weight, w.queue_weight, w.decode_weight, w.request_weight
        pressure = w.inflight_factor * self.followup_share
        provider = self._load_provider
        room = self._config.admission_wait and provider is None
        hot = self._two_deepest(known)[1] if self._config.replicate_hot_prefixes else 0.0
        get_known = known.get
        costs: dict[str, float] = {}
        terms: list[CostTerms] | None = [] if trace is not None else None
        best = math.inf
        for name in candidates:
            eng = self.engine(name)
            fit = eng.fit
            rate, overhead = fit.rate, fit.overhead
            load: Any = counters[name]
            external = provider(name) if provider is not None else None
            k = get_known(name)
            uncached = num_tokens - k.credit_tokens if k is not None else num_tokens
            if uncached < 0:
                uncached = 0
            peer = None
            if external is not None:
                load = external
                rate = external.prefill_tokens_per_s or rate
                if external.prefill_overhead_s is not None:
                    overhead = external.prefill_overhead_s
                queue_s = external.queue_s if external.queue_s is not None else external.pending_prefill_tokens / rate
            else:
                queue_s = eng.queue_s(now)
                peer = peers.get(name) if peers else None
                if peer is not None and not self._peer_clocks:  # other replicas' queued prefill, at this rate
                    queue_s += peer.pending_prefill_tokens / rate
            active, requests = load.active_tokens, load.active_requests
            if peer is not None:
                active += peer.active_tokens
                requests += peer.active_requests
            own = pw * uncached
            if hot and pw > 1.0:
                # the part of a hot prefix this engine lacks costs its recompute, once (a new replica)
                replica = min(uncached, max(hot - (k.credit_tokens if k is not None else 0.0), 0.0))
                own -= (pw - 1.0) * replica
            admission = eng.admission_wait_s(uncached, k.credit_tokens if k is not None else 0.0) if room else 0.0
            work = overhead + own / rate  # this request's own prefill there
            if pressure and requests > 0:
                work *= 1.0 + pressure * requests
            cost = qw * queue_s + admission + work + (dw * active + rw * requests) / rate
            costs[name] = cost
            if cost < best:
                best = cost
            if terms is not None:
                queue_tokens = load.pending_prefill_tokens + (peer.pending_prefill_tokens if peer is not None else 0)
                terms.append(CostTerms(pool, name, k, float(uncached), queue_tokens, active, requests, cost,
                                       queue_s=queue_s + admission, prefill_tokens_per_s=rate,
                                       prefill_overhead_s=overhead))
        sampled = self._config.temperature > 0.0
        tied = lowest_tied(costs, best=best)
        if sampled:
            choice = sample_softmax(costs, self._config.temperature, self._rng)
        elif len(tied) == 1:
            choice = tied[0]
        else:
            choice = self._tie_break(tied, known, counters, peers if provider is None else None, hashes)
        if trace is not None and terms is not None:
            trace.append((terms, choice, frozenset(tied), sampled))
        return choice

    @staticmethod
    def _two_deepest(known: Mapping[str, PrefixCredit]) -> tuple[float, float]:
        """The deepest and second-deepest credits among the candidates.

        The second is how deep a *hot* prefix reaches: every engine up to it
        holds the prompt's blocks up to there too (credits are leading
        prefixes), so it is a prefix cached twice or more -- shared, not one
        session's own. What the deepest holds beyond it is one engine's
        alone: a session's own history.
        """
        first = second = 0.0
        for k in known.values():
            c = k.credit_tokens
            if c > first:
                first, second = c, first
            elif c > second:
                second = c
        return first, second

    def _tie_break(
        self,
        tied: list[str],
        known: Mapping[str, PrefixCredit],
        counters: Mapping[str, LoadCounters],
        peers: Mapping[str, WorkerLoad] | None,
        hashes: Sequence[int] | None,
    ) -> str:
        """Fewest in flight first (this router's and the other replicas'), then rendezvous."""
        def in_flight(n: str) -> int:
            peer = peers.get(n) if peers else None
            return counters[n].active_requests + (peer.active_requests if peer is not None else 0)

        fewest = min(in_flight(n) for n in tied)
        least = [n for n in tied if in_flight(n) == fewest]
        if len(least) == 1:
            return least[0]
        if hashes:
            depth = max((known[n].tokens for n in least if n in known), default=0) // self._block_size
            return rendezvous_pick(int(hashes[min(depth, len(hashes) - 1)]), sorted(least), self._name_keys)
        return min(least, key=lambda n: (counters[n].last_pick, n))

    # --- the life of a request ------------------------------------------------------

    def admit(self, request_id: str, now: float, uncached: int, site: str, decode: str,
              hashes: Sequence[int] | None, predict: bool, *, history: bool | None = None) -> None:
        """Queue the prefill on ``site``'s clock, touch its blocks, predict its store (``predict``:
        ``site`` publishes events and is indexed), and count the route in the share of requests
        carrying a session's own history (``history``; None: :attr:`last_history`, this router's
        own last credit)."""
        self._fold_history(self.last_history if history is None else history)
        eng = self.engine(site)
        eng.admit(request_id, uncached, now)
        if not hashes:
            return
        eng.touch(hashes)
        c = self._config
        if predict and c.predict_on_route_ttl_s > 0:
            # Until its BlockStored can have arrived: at most twice the expected wait plus
            # the grace, and never beyond the TTL (a request that never reports back).
            wait = max(eng.free_at - now, 0.0)
            deadline = now + min(2 * wait + c.prediction_grace_s, c.predict_on_route_ttl_s)
            eng.predict(request_id, list(hashes), deadline)
        if decode != site:
            self.engine(decode).touch(hashes)

    def prefill_done(self, request_id: str, workers: Sequence[str], now: float, uncached: int | None) -> None:
        """First token: re-anchor the queue clock, fit the service time, end the prediction at the next store."""
        grace = now + self._config.prediction_grace_s
        for name in workers:
            eng = self._engines.get(name)
            if eng is not None and request_id in eng.pending:
                eng.done(request_id, now, uncached, fit=self._config.fit_prefill)
                eng.prediction_done(request_id, grace)

    def release(self, request_id: str, workers: Sequence[str], now: float) -> None:
        for name in workers:
            eng = self._engines.get(name)
            if eng is not None:
                eng.release(request_id, now)

    def peer_routed(self, hashes: Sequence[int], workers: Sequence[str], indexed: Callable[[str], bool],
                    now: float, *, request: str = "", site: str | None = None, uncached: int = 0,
                    history: bool = False) -> None:
        """Another replica routed this prompt there (``peer_work.py``).

        With its key, the prefill joins ``site``'s clock exactly as if this
        router had routed it, and its prediction follows the same life (ended
        by the peer's first token and end), and ``history`` counts in the
        share of requests carrying a session's own history as this router's
        own routes do (the replicas learn one share); without (a peer of an
        older release), a bridged prediction for as long as its prefill can
        take.
        """
        c = self._config
        hs = list(hashes)
        if request and site is not None:
            self._peer_clocks = True
            self._peer_sites[request] = site
            self.admit(request, now, uncached, site, workers[-1], hs, indexed(site), history=history)
            return
        for name in workers:
            eng = self.engine(name)
            eng.touch(hs)
            if indexed(name) and c.predict_on_route_ttl_s > 0:
                wait = eng.queue_s(now) + eng.fit.predict(len(hs) * self._block_size)
                deadline = now + min(2 * wait + c.prediction_grace_s, c.predict_on_route_ttl_s)
                eng.predict(f"peer-{next(self._peer_ids)}", hs, deadline)

    def peer_prefill_done(self, request: str, now: float) -> None:
        site = self._peer_sites.get(request)
        if site is not None:
            self.prefill_done(request, (site,), now, None)

    def peer_ended(self, request: str, now: float) -> None:
        site = self._peer_sites.pop(request, None)
        if site is not None:
            self.release(request, (site,), now)

    # --- what the index says -----------------------------------------------------------

    def applied(self, worker: str, stored_blocks: int, removed_blocks: int, held_blocks: int | None,
                block_size: int) -> None:
        """An event batch of ``worker`` was applied: a store ends the predictions whose prefill is
        over (the index holds them now); an eviction tells the engine's capacity."""
        eng = self._engines.get(worker)
        if eng is None:
            return
        if stored_blocks:
            eng.stored()
        if removed_blocks and held_blocks is not None and block_size:
            eng.saw_removal(held_blocks * block_size, removed_blocks * block_size)

    def cleared(self, worker: str) -> None:
        """``worker``'s entries were dropped (restart, resync): its predictions end too."""
        eng = self._engines.get(worker)
        if eng is not None:
            eng.cleared()
