"""The routing core: the index, its ingestor and the router, wired once.

Everything that routes runs this class: ``serve`` (inside ``RouterService``,
which adds the process around it: lifecycle, transports, metrics),
``simulate`` (on the virtual clock), the Redis state backend, ``replay`` and
decision replay, ``bench``. Before it, eight places built a
:class:`~tokenspeed_router.router.index.KvIndex`, an
:class:`~tokenspeed_router.router.ingest.IndexIngestor` and a
:class:`~tokenspeed_router.router.router.Router` by hand, and the wirings had
drifted apart (one never told the cost model of stores, so ``simulate`` did
not run what ``serve`` runs). Replacing the index is a swap inside the core
(:meth:`RoutingCore.replace_index`).

What is wired here, once:

* the ingestor's state changes make a worker *cold* in the router (resyncing
  or stale entries are not trusted), as does the gateway's truth loop
  (:meth:`RoutingCore.set_distrusted`); a resyncing worker the truth loop does
  not distrust is *recovering*: the router credits it with what it routes
  there and, from those prompts, names the lost parents of its orphaned
  stores for the ingestor (``Router.name_parent``; docs/faults.md, "What is
  trusted when"), and the ingestor reads the engine's capacity the cost
  model learnt (``Router.capacity_blocks``);
* every batch the index applies, and every clear, reaches the router's cost
  model (``Router.on_index_applied`` / ``on_index_cleared``: stores end the
  predictions they confirm, removals tell an engine's capacity);
* a worker first seen in a stream or a log becomes routable with the role
  ``role_of(name)`` says (``both`` unless told).

Two doors in: :meth:`apply_item` (a live subscriber item: the subscriber has
already sequenced it; :meth:`apply_items` for a drain of them, applied in
order with the locks taken once and runs of batches in one native call) and
:meth:`apply_record` (a recorded batch: the
ingestor applies the same sequence rules, ``events/sequencing.py``). The
simulator delivers its engines' batches through :meth:`apply_record`, the
door a log replay uses, with the same rules for restarts and gaps.

Threads. Two re-entrant locks, always taken in this order: the *ingest*
lock (one writer into the ingestor and the index at a time) and the
*router* lock (the router's state: workers, cold flags, requests in
flight). An item is applied holding only the ingest lock: the index locks
each event and each query itself, so :meth:`match` takes no lock of ours
and :meth:`route` never waits behind a whole batch. :meth:`locked` holds
both, for multi-step work (snapshots, restores).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from tokenspeed_router.events.schema import KVEventBatch
from tokenspeed_router.events.subscriber import BatchReceived, SubscriberItem
from tokenspeed_router.router.decision import RouteDecision
from tokenspeed_router.router.index import KvIndex, MatchDetail
from tokenspeed_router.router.ingest import IndexIngestor, WorkerState, WorkerStatus
from tokenspeed_router.router.router import (
    EngineEstimate,
    LoadProvider,
    PeerLoad,
    Router,
    RouterConfig,
    RouterStatistics,
    WorkerRole,
)
from tokenspeed_router.router.scoring import PrefixIndex, WorkerLoad

__all__ = ["RoutingApi", "RoutingCore"]


class RoutingApi(Protocol):
    """What a caller that routes needs (the gateway, ``simulate``, decision replay, ``bench``).

    :class:`RoutingCore` is it; so is ``RouterService``, which adds metrics
    and sampled explanations around the same calls.
    """

    def route(
        self,
        token_ids: Any,
        *,
        request_id: str | None = None,
        lora_id: int | str | None = None,
        salt: str | None = None,
        explain: bool = False,
    ) -> RouteDecision: ...

    def match(self, token_ids: Any, lora_id: int | str | None = None, salt: str | None = None) -> MatchDetail: ...

    def mark_prefill_done(self, request_id: str) -> bool: ...

    def release(self, request_id: str) -> bool: ...

    def set_trust(self, name: str, trust: float) -> None: ...

    def set_distrusted(self, name: str, distrusted: bool) -> None: ...

    def set_reachable(self, name: str, reachable: bool) -> None: ...

    def is_cold(self, name: str) -> bool: ...


class RoutingCore:
    """The index, the ingestor and the router of one router process (module docstring).

    ``config``: the router's policy and cost model. ``index``: an index to
    adopt (default: a new :class:`KvIndex`). ``clock`` (monotonic seconds)
    drives in-flight expiry, the cost model's queue clocks and the
    ingestor's state timestamps; ``rng`` the random policies.
    ``load_provider`` and ``peer_load``: see :class:`Router`. ``match_view``:
    what the router matches prompts against instead of the index (decision
    replay's logged credits); events still go into the index.
    ``recovery_batches`` and ``raw_ingest``: see :class:`IndexIngestor`.
    ``role_of(name)``: the role of a worker first seen in a stream or a log.
    """

    def __init__(
        self,
        config: RouterConfig | None = None,
        *,
        index: KvIndex | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        load_provider: LoadProvider | None = None,
        peer_load: PeerLoad | None = None,
        match_view: PrefixIndex | None = None,
        recovery_batches: int = 8,
        raw_ingest: bool = True,
        role_of: Callable[[str], WorkerRole] | None = None,
    ) -> None:
        self._config = config if config is not None else RouterConfig()
        self._clock = clock
        self._rng = rng
        self._load_provider = load_provider
        self._peer_load = peer_load
        self._match_view = match_view
        self._recovery_batches = recovery_batches
        self._raw_ingest = raw_ingest
        self._role_of = role_of
        self._ingest_lock = threading.RLock()
        self._lock = threading.RLock()
        #: routable workers' roles (streams, workers named in a log, workers added)
        self._roles: dict[str, WorkerRole] = {}
        #: workers without KV events (their prefixes come from what this router sent there)
        self._no_events: set[str] = set()
        self._distrusted: set[str] = set()
        self._unreachable: set[str] = set()
        self._replayed: dict[str, int] = {}
        self._trust: dict[str, float] = {}
        self._index, self._ingestor, self._router = self._build(index if index is not None else KvIndex())

    def _build(self, index: KvIndex) -> tuple[KvIndex, IndexIngestor, Router]:
        router = Router(
            self._match_view if self._match_view is not None else index, self._config,
            clock=self._clock, rng=self._rng, load_provider=self._load_provider, peer_load=self._peer_load,
        )
        ingestor = IndexIngestor(
            index, recovery_batches=self._recovery_batches, clock=self._clock, raw=self._raw_ingest,
            on_state_change=self._on_state_change, on_applied=self._on_applied, on_cleared=self._on_cleared,
            name_parent=self._name_parent, capacity_blocks=self._capacity_blocks,
        )
        return index, ingestor, router

    # --- the parts (read them under locked() when a restore may swap them) -----------

    @property
    def config(self) -> RouterConfig:
        return self._config

    @property
    def index(self) -> KvIndex:
        """The block index (replaced whole by :meth:`replace_index`)."""
        return self._index

    @property
    def ingestor(self) -> IndexIngestor:
        """Per-worker ingestion state over :attr:`index`."""
        return self._ingestor

    @property
    def router(self) -> Router:
        """The routing decisions over :attr:`index`."""
        return self._router

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold both locks: nothing is applied or routed meanwhile."""
        with self._ingest_lock, self._lock:
            yield

    # --- the two doors in ----------------------------------------------------------

    def apply_item(self, item: SubscriberItem) -> None:
        """Apply one subscriber item (any thread; a worker's items in order)."""
        with self._ingest_lock:
            with self._lock:
                self._ensure(item.worker)
                if isinstance(item, BatchReceived) and item.replayed:
                    self._replayed[item.worker] = self._replayed.get(item.worker, 0) + 1
            self._ingestor.on_item(item)  # the index locks per event: queries run meanwhile

    def apply_items(self, items: Sequence[SubscriberItem]) -> list[tuple[SubscriberItem, Exception]]:
        """Apply live items in order, as :meth:`apply_item` one by one would (the applying
        thread's drain): the locks taken once for the drain, runs of live batches applied
        by the index in one native call (``IndexIngestor.on_items``). Returns the items
        that failed, with their errors (the others are applied whatever one of them did)."""
        with self._ingest_lock:
            with self._lock:
                for item in items:
                    self._ensure(item.worker)
                    if isinstance(item, BatchReceived) and item.replayed:
                        self._replayed[item.worker] = self._replayed.get(item.worker, 0) + 1
            return self._ingestor.on_items(items)  # the index locks per event: queries run meanwhile

    def apply_record(
        self, worker: str, seq: int, batch: KVEventBatch, recv_time_s: float, *, payload: bytes | None = None
    ) -> None:
        """Apply one recorded batch (log replay, shared-stream followers, the simulator)."""
        with self._ingest_lock:
            with self._lock:
                self._ensure(worker)
            self._ingestor.on_record(worker, seq, batch, recv_time_s, payload=payload)

    def mark_stale(self, name: str) -> None:
        """Stop trusting ``name``'s entries (its stream went silent) until it proves alive."""
        with self._ingest_lock, self._lock:
            self._ensure(name)
            self._ingestor.mark_stale(name)

    # --- membership --------------------------------------------------------------------

    def add_worker(self, name: str, role: WorkerRole | str = WorkerRole.BOTH, *, events: bool = True) -> None:
        """Make ``name`` routable with ``role`` (again: the role and event mode are updated)."""
        parsed = WorkerRole(role)
        with self._ingest_lock, self._lock:
            if not events:
                self._no_events.add(name)
            else:
                self._no_events.discard(name)
            self._roles[name] = parsed
            self._ingestor.add_worker(name)
            if name not in self._unreachable:
                self._router.add_worker(name, parsed, events=events)
                self._set_router_cold(name)

    def ensure_worker(self, name: str) -> None:
        """Make ``name`` routable with its current ingestion state (no-op when known)."""
        with self._lock:
            self._ensure(name)

    #: what the state backend calls under :meth:`locked` after a snapshot restore
    ensure_worker_locked = ensure_worker

    def _ensure(self, name: str) -> None:
        # under the router lock
        if name in self._roles:
            return
        role = self._role_of(name) if self._role_of is not None else WorkerRole.BOTH
        self._roles[name] = role
        self._ingestor.add_worker(name)
        if name not in self._unreachable:
            self._router.add_worker(name, role)
            if self.is_cold(name):
                self._set_router_cold(name)

    def remove_worker(self, name: str) -> None:
        """Forget ``name`` everywhere: routing, ingestion state, index entries, marks."""
        with self._ingest_lock, self._lock:
            self._router.remove_worker(name)
            self._ingestor.remove_worker(name)
            self._roles.pop(name, None)
            self._no_events.discard(name)
            self._distrusted.discard(name)
            self._unreachable.discard(name)
            self._replayed.pop(name, None)
            self._trust.pop(name, None)

    def preset_roles(self, roles: Mapping[str, WorkerRole | str]) -> None:
        """Declare the roles of workers not seen yet (``replay`` reads them from its log's header)."""
        with self._ingest_lock, self._lock:
            for name, role in roles.items():
                if name not in self._roles:
                    self.add_worker(name, role)

    @property
    def roles(self) -> Mapping[str, WorkerRole]:
        """Every routable (or taken out) worker's role."""
        return self._roles

    @property
    def replayed(self) -> Mapping[str, int]:
        """Batches a worker's replay ring filled in, per worker."""
        return self._replayed

    # --- trust, reachability, coldness -------------------------------------------------

    def is_cold(self, name: str) -> bool:
        """True when ``name``'s prefixes are not trusted: its entries are resyncing or stale,
        or the truth loop distrusts them. It is routed on load alone."""
        return self._ingestor.is_cold(name) or name in self._distrusted

    def set_distrusted(self, name: str, distrusted: bool) -> None:
        """Route ``name`` on load only while ``distrusted`` (the gateway's truth loop, DESIGN §10)."""
        with self._lock:
            if distrusted:
                self._distrusted.add(name)
            else:
                self._distrusted.discard(name)
            self._refresh_cold(name)

    def set_trust(self, name: str, trust: float) -> None:
        """Scale the credit of ``name``'s prefix by ``trust`` in [0, 1] (the truth loop, gradually)."""
        with self._lock:
            self._router.set_trust(name, trust)  # validates
            if trust >= 1.0:
                self._trust.pop(name, None)
            else:
                self._trust[name] = float(trust)

    def set_reachable(self, name: str, reachable: bool) -> None:
        """Take ``name`` out of routing (its engine refuses connections) or put it back.

        Its index entries stay (still what the engine holds); its in-flight
        load is forgotten while it is out.
        """
        with self._lock:
            if name not in self._roles:
                return
            if reachable:
                if name in self._unreachable:
                    self._unreachable.discard(name)
                    self._router.add_worker(name, self._roles[name], events=name not in self._no_events)
                    self._set_router_cold(name)
            elif name not in self._unreachable:
                self._unreachable.add(name)
                self._router.remove_worker(name)

    @property
    def distrusted(self) -> frozenset[str]:
        return frozenset(self._distrusted)

    @property
    def unreachable(self) -> frozenset[str]:
        return frozenset(self._unreachable)

    def _refresh_cold(self, name: str) -> None:
        # under the router lock
        if name in self._roles and name not in self._unreachable:
            self._set_router_cold(name)

    def _set_router_cold(self, name: str) -> None:
        # under the router lock: cold when not trusted; recovering when only lost events are why
        recovering = name not in self._distrusted and self._ingestor.is_recovering(name)
        self._router.set_cold(name, self.is_cold(name), recovering=recovering)

    # --- the ingestor's and the index's callbacks (under the ingest lock) -----------------

    def _on_state_change(self, worker: str, state: WorkerState) -> None:
        with self._lock:
            self._refresh_cold(worker)

    def _on_applied(self, worker: str, stats: object) -> None:
        with self._lock:
            self._router.on_index_applied(worker, stats)

    def _on_cleared(self, worker: str) -> None:
        with self._lock:
            self._router.on_index_cleared(worker)

    def _name_parent(self, worker: str, root: int, block_bytes: bytes) -> list[int] | None:
        with self._lock:
            return self._router.name_parent(worker, root, block_bytes)

    def _capacity_blocks(self, worker: str) -> int | None:
        with self._lock:
            return self._router.capacity_blocks(worker)

    # --- routing -----------------------------------------------------------------------------

    def route(
        self,
        token_ids: Any,
        *,
        request_id: str | None = None,
        lora_id: int | str | None = None,
        salt: str | None = None,
        explain: bool = False,
        only: Collection[str] | None = None,
    ) -> RouteDecision:
        """Choose a worker (or a prefill/decode pair) and count the request in flight;
        ``only``: among these workers alone (see ``Router.route``)."""
        with self._lock:
            return self._router.route(token_ids, request_id=request_id, lora_id=lora_id, salt=salt, explain=explain,
                                      only=only)

    def match(self, token_ids: Any, lora_id: int | str | None = None, salt: str | None = None) -> MatchDetail:
        """Per worker, the leading blocks of ``token_ids`` it holds, by tier (no side effect, no lock of ours)."""
        return self._index.match_detail(token_ids, lora_id=lora_id, salt=salt)

    def mark_prefill_done(self, request_id: str, *, uncached_tokens: int | None = None) -> bool:
        """The request's first token came out: its prefill no longer counts as queued."""
        with self._lock:
            return self._router.mark_prefill_done(request_id, uncached_tokens=uncached_tokens)

    def release(self, request_id: str) -> bool:
        """The request finished (True when it was in flight)."""
        with self._lock:
            return self._router.release(request_id)

    def set_peer_load(self, peer_load: PeerLoad | None) -> None:
        """Add other router replicas' in-flight load to routing (None: stop); survives :meth:`replace_index`."""
        with self._lock:
            self._peer_load = peer_load
            self._router.set_peer_load(peer_load)

    # --- statistics ---------------------------------------------------------------------------

    def load(self) -> dict[str, WorkerLoad]:
        """This router's own in-flight load per worker."""
        with self._lock:
            return self._router.load()

    def engine_estimates(self) -> dict[str, EngineEstimate]:
        """The cost model's view of each engine it routed to."""
        with self._lock:
            return self._router.engine_estimates()

    def statuses(self) -> dict[str, WorkerStatus]:
        """Every worker's ingestion status."""
        with self._lock:
            return self._ingestor.statuses()

    def statistics(self) -> RouterStatistics:
        with self._lock:
            return self._router.statistics()

    # --- replacing the index ------------------------------------------------------------------

    def replace_index(self, index: KvIndex) -> None:
        """Adopt a restored index (warm start from a snapshot): a swap of the parts.

        The ingestor and the router are built anew around it (requests in
        flight are forgotten: a warm start happens before serving); every
        known worker keeps its role, marks and trust; ingestion state starts
        ``live``.
        """
        with self._ingest_lock, self._lock:
            self._index, self._ingestor, self._router = self._build(index)
            for name, role in self._roles.items():
                self._ingestor.add_worker(name)
                if name not in self._unreachable:
                    self._router.add_worker(name, role, events=name not in self._no_events)
                    self._set_router_cold(name)
            for name, trust in self._trust.items():
                self._router.set_trust(name, trust)
