"""Routing backends the simulator drives: the real Router, and the oracle.

* :class:`RouterBackend` runs the routing core ``serve`` runs
  (``router/core.py``: a real :class:`KvIndex`, :class:`IndexIngestor` and
  :class:`Router`, wired once), so sequence gaps from lost events take the
  same resync path as in production and the cost model hears every store.
  Its clock is the simulator's virtual clock. One backend per policy name:
  ``kv_aware`` (default), ``random``, ``round_robin``, ``least_loaded``,
  ``approx``.
* :class:`OracleBackend` reads every worker's true cache and queue at
  decision time (zero event delay) and picks the minimum estimated TTFT under
  the simulator's own cost model. It bounds what any router could do with
  perfect information and the same greedy objective.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np

from tokenspeed_router.events.schema import Event, KVEventBatch
from tokenspeed_router.sim.cluster import (
    ClusterConfig,
    RouteChoice,
    SimWorker,
    WorkerView,
)
from tokenspeed_router.sim.peers import PEER_POLICIES, PeerBackend, make_peer_backend
from tokenspeed_router.sim.traces import TraceRequest

__all__ = [
    "KNOWN_POLICIES",
    "ROUTER_POLICIES",
    "OracleBackend",
    "RouterBackend",
    "make_backend",
]

logger = logging.getLogger(__name__)

#: Policies implemented by the real Router; "oracle" is the simulator's own.
ROUTER_POLICIES = ("random", "round_robin", "least_loaded", "approx", "kv_aware")
#: Every name ``make_backend`` accepts: the Router's, the oracle, the peer emulations (``sim/peers``).
KNOWN_POLICIES = (*ROUTER_POLICIES, "oracle", *PEER_POLICIES)


class RouterBackend:
    """The real router, in process, on the virtual clock."""

    def __init__(
        self,
        policy: str,
        cluster: ClusterConfig,
        view: WorkerView,
        *,
        router_options: dict[str, Any] | None = None,
        signal_prefill_done: bool = True,
    ) -> None:
        from tokenspeed_router.router.core import RoutingCore
        from tokenspeed_router.router.router import RouterConfig

        self.name = policy
        self.needs_events = policy == "kv_aware"
        self._signal_prefill_done = signal_prefill_done
        options = dict(router_options or {})
        options.setdefault("seed", cluster.seed)
        # The routing core serve runs (router/core.py), on the virtual clock, fed the
        # engines' batches through the door a log replay uses (the same sequence rules).
        self._core = core = RoutingCore(RouterConfig(policy=policy, **options), clock=view.now)
        role = "prefill" if cluster.disaggregated else "both"
        for name in cluster.worker_names():
            core.add_worker(name, role)
        for name in cluster.decode_names():
            core.add_worker(name, "decode")

    @property
    def core(self) -> Any:
        """The routing core (for inspection)."""
        return self._core

    @property
    def router(self) -> Any:
        """The underlying :class:`Router` (for inspection)."""
        return self._core.router

    def ingest_statuses(self) -> dict[str, Any]:
        """Per worker ingest status (resyncs, rejected events); empty without events."""
        return dict(self._core.statuses()) if self.needs_events else {}

    def route(self, request: TraceRequest, tokens: np.ndarray) -> RouteChoice:
        decision = self._core.route(tokens, request_id=request.request_id)
        predicted = decision.matched_tokens if self.name in ("kv_aware", "approx") else None
        return RouteChoice(worker=decision.worker, decode_worker=decision.decode_worker,
                           predicted_hit_tokens=predicted)

    def deliver(self, worker: str, seq: int, events: list[Event], now: float) -> None:
        if self.needs_events:
            self._core.apply_record(worker, seq, KVEventBatch(ts=now, events=events), now)

    def prefill_done(self, request_id: str, now: float) -> None:
        # What a streaming gateway knows at the first token: that the prefill ended, not how
        # many tokens it computed (engines report usage only when the answer ends). Handing
        # the router the engine's exact uncached tokens here made simulate fit prefill rates
        # the live gateway cannot, and the two disagreed (tests/integration/test_sim_live_parity.py).
        if self._signal_prefill_done:
            self._core.mark_prefill_done(request_id)

    def finished(self, request_id: str, now: float) -> None:
        self._core.release(request_id)


class OracleBackend:
    """Minimum estimated TTFT with exact, instantaneous cache knowledge."""

    needs_events = False

    def __init__(self, cluster: ClusterConfig, view: WorkerView, *, rng: random.Random) -> None:
        self.name = "oracle"
        self._cost = cluster.cost
        self._view = view
        self._rng = rng

    def route(self, request: TraceRequest, tokens: np.ndarray) -> RouteChoice:
        now = self._view.now()
        best: list[tuple[SimWorker, int]] = []
        best_cost = float("inf")
        pages = _Pages(tokens)
        for w in self._view.prefill_workers():
            hit = w.expected_hit_tokens(tokens, w.cache.cached_prefix_pages(pages.get(w.cache.page_size)))
            est = w.backlog_s(now) + self._cost.prefill_s(request.input_length - hit)
            if est < best_cost - 1e-12:
                best, best_cost = [(w, hit)], est
            elif est <= best_cost + 1e-12:
                best.append((w, hit))
        worker, hit = best[0] if len(best) == 1 else self._rng.choice(best)
        decode = None
        decoders = self._view.decode_workers()
        if decoders:
            d_hits = [(d.cache.cached_prefix_pages(pages.get(d.cache.page_size)), -d.num_requests, d.name)
                      for d in decoders]
            decode = max(d_hits)[2]
        return RouteChoice(worker=worker.name, decode_worker=decode, predicted_hit_tokens=hit)

    def deliver(self, worker: str, seq: int, events: list[Event], now: float) -> None:
        return None

    def prefill_done(self, request_id: str, now: float) -> None:
        return None

    def finished(self, request_id: str, now: float) -> None:
        return None


class _Pages:
    """A prompt cut into page tuples once per page size (shared by all probes)."""

    def __init__(self, tokens: np.ndarray) -> None:
        self._tokens = tokens
        self._by_size: dict[int, list[Any]] = {}

    def get(self, page_size: int) -> list[Any]:
        got = self._by_size.get(page_size)
        if got is None:
            from tokenspeed_router.cache.tree import paginate

            got = self._by_size[page_size] = paginate(self._tokens, page_size)
        return got


def make_backend(
    policy: str,
    cluster: ClusterConfig,
    view: WorkerView,
    *,
    router_options: dict[str, Any] | None = None,
    signal_prefill_done: bool = True,
) -> RouterBackend | OracleBackend | PeerBackend:
    """Build the backend for ``policy`` (a Router policy name, ``oracle`` or a peer emulation).

    ``signal_prefill_done`` false models a gateway that only calls
    ``release`` at the end (the HTTP API's behaviour): queued prefill then
    counts as load until the request finishes decoding.
    """
    if policy == "oracle":
        return OracleBackend(cluster, view, rng=random.Random(cluster.seed))
    if policy in PEER_POLICIES:
        return make_peer_backend(policy, cluster, view)
    return RouterBackend(policy, cluster, view, router_options=router_options,
                         signal_prefill_done=signal_prefill_done)
