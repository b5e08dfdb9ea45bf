"""``RouterService``: one process, one index, one writer.

The service is the process around one routing core: lifecycle, transports,
metrics, the decision log. Its parts each have one job: ``router/core.py``
(``RoutingCore``: index, ingestor, router, roles, cold/trust/reachability),
``server/workers.py`` (``WorkerRegistry``: who is configured, the membership
rules), ``server/worker_report.py``
(what ``/workers`` and ``/metrics`` say per worker), ``server/ingest_loop.py``
(the subscriber thread). It raises domain errors (``tokenspeed_router.errors``);
``server/api.py:api_error`` is the one place they become HTTP statuses.

Threads and who touches what::

    tokenspeed-ingest   owns the subscriber sockets; every item it receives goes
                        through ONE seam, IngestSink.submit(item) (a pass at once
                        through submit_many when the sink has it), on this thread
    HTTP event loop     queries (match/route/release/workers) and PUT/DELETE /workers
    tokenspeed-zmq-api  the same queries over a ROUTER socket

Routing state lives in one :class:`~tokenspeed_router.router.core.RoutingCore`
(the index, its ingestor and the router, wired once; ``simulate``, ``replay``
and the state backend run the same class). The core owns the two locks and
their order (the ingest lock, one writer into the ingestor and the index;
the router lock, the router's state): an item is applied holding only the
ingest lock, the index locks each event and each query itself, so ``/match``
and ``/route`` never wait behind a whole batch. The service adds a small
lock of its own for its query counters and explain sampling, taken before
the core's when both are held. The replay round trips of a subscriber
happen on the ingestion thread without any lock.

The ingestion seam (for the Redis state backend and anything else that wants
to sit between the wire and the index)::

    class IngestSink(Protocol):
        def submit(self, item: SubscriberItem) -> None   # ingestion thread, in order
        def close(self) -> None                          # at shutdown, after the last submit

The default :class:`LocalIngestSink` calls :meth:`RouterService.apply_item`
directly. A replicated backend instead appends the item to its shared stream
and, from whatever thread reads the stream back (every replica, leader
included), calls :meth:`RouterService.apply_item` (a live item) or
:meth:`RouterService.apply_record` (a recorded batch) — the only two ways
into the index, both taking the lock. For multi-step work (snapshot, restore)
it holds :meth:`RouterService.locked` and may use ``index``, ``ingestor``,
:meth:`RouterService.replace_index` and :meth:`RouterService.ensure_worker_locked`.
A sink whose ``manages_ingestion`` attribute is true starts with no
subscription: it calls :meth:`RouterService.start_ingestion` (optionally from
given seqs) when it becomes the leader and :meth:`RouterService.stop_ingestion`
when it steps down. ``serve --state URL`` builds that sink with
``tokenspeed_router.state.create_ingest_sink(url, service)`` (a
:data:`SinkFactory`, called once from :meth:`RouterService.start`).
``--record FILE`` wraps whatever sink is in use in a :class:`RecordingSink`,
so the log holds exactly what came off the wire.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import zmq

from tokenspeed_router.errors import (
    ConfigError,
    InvalidRequestError,
    ServiceNotIngestingError,
)
from tokenspeed_router.events.log import EventLogWriter
from tokenspeed_router.events.schema import KVEventBatch
from tokenspeed_router.events.subscriber import BatchReceived, SubscriberItem
from tokenspeed_router.router.core import RoutingCore
from tokenspeed_router.router.decision import RouteDecision, rank_candidates
from tokenspeed_router.router.index import KvIndex, MatchDetail
from tokenspeed_router.router.ingest import IndexIngestor, WorkerState
from tokenspeed_router.router.router import PeerLoad, Router, WorkerRole
from tokenspeed_router.router.scoring import WorkerLoad
from tokenspeed_router.server.api import api_errors
from tokenspeed_router.server.config import ServerConfig, SubscriberSpec, WorkerSpec
from tokenspeed_router.server.decision_log import DecisionLogCollector, DecisionLogWriter
from tokenspeed_router.server.explain import ExplainSampler, ExplainStats, ExplainStatsCollector
from tokenspeed_router.server.ingest_loop import IngestLoop
from tokenspeed_router.server.metrics import (
    IndexCoreCollector,
    IngestQueueCollector,
    ServiceMetrics,
    WorkerSample,
    WorkerStateCollector,
)
from tokenspeed_router.server.worker_report import worker_entries, worker_samples
from tokenspeed_router.server.workers import WorkerRegistry

__all__ = [
    "IngestSink",
    "LocalIngestSink",
    "RecordingSink",
    "RouterService",
    "SinkFactory",
]

logger = logging.getLogger(__name__)


class IngestSink(Protocol):
    """Where every subscriber item goes (see the module docstring)."""

    def submit(self, item: SubscriberItem) -> None: ...

    def close(self) -> None: ...


#: ``factory(service) -> sink``; ``serve --state`` resolves one from the state backend.
SinkFactory = Callable[["RouterService"], IngestSink]


class LocalIngestSink:
    """Default sink: apply in this process (``submit_many``: an ingest pass at once)."""

    def __init__(self, service: RouterService) -> None:
        self._apply = service.apply_item
        self.submit_many = service.apply_items

    def submit(self, item: SubscriberItem) -> None:
        self._apply(item)

    def close(self) -> None:
        pass


class NullIngestSink:
    """Applies nothing (``record`` mode: the index is not needed)."""

    def submit(self, item: SubscriberItem) -> None:
        pass

    def close(self) -> None:
        pass


class RecordingSink:
    """Writes every received batch to an event log, then passes the item on.

    Restarts and unhealable gaps need no record of their own: they show in the
    log as the seq going back or jumping, and log replay detects them the same
    way (``IndexIngestor.on_record``).
    """

    def __init__(self, inner: IngestSink, writer: EventLogWriter, metrics: ServiceMetrics | None = None) -> None:
        self._inner = inner
        self._writer = writer
        self._metrics = metrics
        self.records = 0

    def submit(self, item: SubscriberItem) -> None:
        if isinstance(item, BatchReceived):
            self._writer.append(
                item.worker, item.seq, item.payload, recv_time_s=item.recv_time_s, topic=item.topic
            )
            self.records += 1
            if self._metrics is not None:
                self._metrics.record_bytes.inc(len(item.payload))
            # Every batch reaches the file before it reaches the index: a reader
            # (replay of a live log, inspect) never lags the live router, and a
            # crash loses nothing that was routed on. One write per batch.
            self._writer.flush()
        self._inner.submit(item)

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            self._writer.close()


class RouterService:
    """The router process minus its listeners (HTTP and ZMQ serve it).

    Construct, :meth:`start` (subscribes), serve queries, :meth:`stop`.
    Without workers (``replay --serve``) it is a plain, lock-protected index +
    router fed through :meth:`apply_record`.
    """

    def __init__(
        self,
        config: ServerConfig,
        *,
        context: zmq.Context[Any] | None = None,
        sink_factory: SinkFactory | None = None,
        wall_clock: Callable[[], float] = time.time,
        record_source: str = "tokenspeed-router serve",
    ) -> None:
        self.config = config
        self._workers = WorkerRegistry()  # configured workers and streams
        #: the index, its ingestor and the router, wired once (router/core.py)
        self._core = RoutingCore(config.router, role_of=self._workers.role_of_stream)
        self._lock = threading.Lock()  # this process's query counters and explain sampling
        self.metrics = ServiceMetrics(self._lock)
        self.metrics.add_collector(WorkerStateCollector(self._worker_samples))
        self.metrics.add_collector(IndexCoreCollector(lambda: self._core.index.implementation))
        self.metrics.add_collector(
            IngestQueueCollector(lambda: self._loop.queue_stats() if self._loop is not None else {})
        )
        self._wall_clock = wall_clock
        self._started_s = time.monotonic()
        self._own_context = context is None
        self._ctx: zmq.Context[Any] = context if context is not None else zmq.Context()
        self._sink_factory = sink_factory
        self._sink: IngestSink | None = None
        self.recorder: RecordingSink | None = None
        self._loop: IngestLoop | None = None
        self._serving = False
        self._stopped = False
        self._ingesting = False
        #: notified when the ingestion loop starts and when the service stops
        self._loop_changed = threading.Condition()
        self._state_health: Callable[[], dict[str, Any]] | None = None
        #: the ``source`` written in the header of a ``--record`` log
        self.record_source = record_source
        # why this worker (server/explain.py): None when --explain-sample is 0, so the
        # hot path pays one ``is None`` test; the decision log opens at start()
        rate = config.explain.sample_rate
        self._sampler: ExplainSampler | None = ExplainSampler(rate) if rate > 0 else None
        self._explained = ExplainStats()
        self.metrics.add_collector(ExplainStatsCollector(self._explained))
        self.decision_log: DecisionLogWriter | None = None

    # --- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Register the configured workers, build the sink, subscribe, start ingesting.

        When any step fails, everything started so far is undone before the
        error propagates (the ingestion thread stopped, the sink and event log
        closed, every socket of an owned context closed with linger 0 and the
        context terminated), so a failed start never leaves a process that
        hangs at exit. ZeroMQ and file errors come out as :class:`ConfigError`.
        """
        if self._stopped:
            raise RuntimeError("a stopped RouterService cannot be started again")
        try:
            self._start()
        except BaseException as err:
            self._abort_start()
            if isinstance(err, zmq.ZMQError):
                raise ConfigError(f"cannot start the router: {err}") from err
            raise

    def _start(self) -> None:
        # Workers (and their roles) are known before the sink exists: a replicated
        # sink may apply items from its shared stream as soon as it is built.
        subs = self.config.subscribers()
        for spec in self.config.workers:
            self._workers.specs[spec.name] = spec
        self._register(subs)
        base = self._sink_factory(self) if self._sink_factory is not None else LocalIngestSink(self)
        self._sink = base
        self._state_health = getattr(base, "health", None)  # state backend status for /health
        if self.config.record:
            meta = {"source": self.record_source, "workers": [w.to_dict() for w in self.config.workers]}
            try:
                writer = EventLogWriter(self.config.record, meta=meta)
            except OSError as err:
                raise ConfigError(f"cannot write the event log {self.config.record!r}: {err}") from err
            self.recorder = RecordingSink(base, writer, self.metrics)
            self._sink = self.recorder
        self.open_decision_log()
        # A replicated backend subscribes only while it leads (start_ingestion/stop_ingestion).
        self._ingesting = not getattr(base, "manages_ingestion", False)
        self._loop = IngestLoop(
            context=self._ctx,
            submit=self._submit,
            # a sink that can take a drain at once (the local one; not the recorder or a state backend)
            submit_many=getattr(self._sink, "submit_many", None),
            on_stale=self._mark_stale,
            on_error=self.metrics.ingest_errors.inc,
            stale_after_s=self.config.stale_after_s,
            replay_timeout_s=self.config.replay_timeout_s,
            max_lag_s=self.config.ingest_max_lag_s,
            queue_capacity=self.config.ingest_queue,
        )
        self._loop.start(subs if self._ingesting else [])
        self._serving = True
        self._notify_loop_changed()
        logger.info("router service started with %d stream(s), index core %s", len(subs),
                    self._core.index.implementation)

    def _abort_start(self) -> None:
        """Undo a partial :meth:`start` (best effort, never raises)."""
        self._stopped = True
        self._serving = False
        self._notify_loop_changed()
        if self._loop is not None:
            try:
                self._loop.stop()
            except Exception:
                logger.exception("stopping the ingestion loop after a failed start")
        if self._sink is not None:
            try:
                self._sink.close()
            except Exception:
                logger.exception("closing the ingest sink after a failed start")
        self._close_decision_log()
        if self._own_context and (self._loop is None or not self._loop.running):
            # Every socket made on our context (subscribers, monitors, a ZMQ API
            # socket bound before start) is closed with linger 0: ctx.term() alone
            # would block forever on any socket a failed step left open.
            self._ctx.destroy(linger=0)

    def stop(self) -> None:
        """Stop ingesting, close the sink (flushes the event log). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._serving = False
        self._notify_loop_changed()  # a state backend waiting for the loop gives up now
        if self._loop is not None:
            self._loop.stop()
        if self._sink is not None:
            try:
                self._sink.close()
            except Exception:
                logger.exception("closing the ingest sink failed")
        self._close_decision_log()
        if self._own_context:
            if self._loop is not None and self._loop.running:
                logger.error("ingestion thread still running: not terminating the ZeroMQ context")
            else:
                self._ctx.term()
        # a service that never subscribed (replay, inspect) stops quietly
        logger.log(logging.INFO if self._loop is not None else logging.DEBUG, "router service stopped")

    def open_decision_log(self) -> None:
        """Start writing explained decisions to ``config.explain.decision_log`` (if set; idempotent).

        Called by :meth:`start`; tools that serve without starting (``replay
        --serve``) may call it themselves. Raises :class:`ConfigError` when
        the file cannot be opened.
        """
        path = self.config.explain.decision_log
        if path is None or self.decision_log is not None:
            return
        writer = DecisionLogWriter(path, max_bytes=self.config.explain.decision_log_max_bytes)
        self.decision_log = writer
        self.metrics.add_collector(DecisionLogCollector(writer))
        logger.info("decision log %s (explain sample rate %g)", path, self.config.explain.sample_rate)

    def _close_decision_log(self) -> None:
        writer = self.decision_log
        if writer is not None:
            try:
                writer.close()
            except Exception:
                logger.exception("closing the decision log failed")

    def __enter__(self) -> RouterService:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def context(self) -> zmq.Context[Any]:
        return self._ctx

    @property
    def serving(self) -> bool:
        return self._serving

    def start_ingestion(self, start_seqs: Mapping[str, int] | None = None, timeout_s: float = 10.0) -> None:
        """Subscribe to every configured stream not yet subscribed (a leader taking over).

        ``start_seqs[name]``: the first seq that stream still needs (the
        subscriber asks the worker's replay ring for it at once).
        """
        loop = self._require_loop()
        self._ingesting = True
        subs = list(self._workers.streams.values())
        seqs = dict(start_seqs or {})

        def open_missing() -> None:
            have = set(loop.stream_names())
            loop.open_streams([s for s in subs if s.name not in have], seqs)

        loop.call(open_missing, timeout_s)
        logger.info("ingestion started for %d stream(s)", len(subs))

    def stop_ingestion(self, timeout_s: float = 10.0) -> None:
        """Unsubscribe from every stream (a leader stepping down); the index is kept."""
        loop = self._require_loop()
        self._ingesting = False
        loop.call(lambda: [loop.close_stream(n) for n in loop.stream_names()], timeout_s)
        logger.info("ingestion stopped")

    @property
    def ingesting(self) -> bool:
        return self._ingesting

    @property
    def ingest_loop_running(self) -> bool:
        """True while the ingestion thread runs (subscribed or not)."""
        return self._loop is not None and self._loop.running

    def wait_ingest_loop(self, timeout_s: float) -> bool:
        """Block until the ingestion loop runs (True), or the service stops or ``timeout_s`` passes (False).

        A state backend that wins the lease while :meth:`start` is still
        building the loop waits here instead of polling :meth:`health`.
        """
        with self._loop_changed:
            self._loop_changed.wait_for(lambda: self._stopped or self.ingest_loop_running, timeout_s)
        return self.ingest_loop_running and not self._stopped

    def _notify_loop_changed(self) -> None:
        with self._loop_changed:
            self._loop_changed.notify_all()

    @property
    def core(self) -> RoutingCore:
        """The routing core this process runs (index, ingestor, router)."""
        return self._core

    @property
    def index(self) -> KvIndex:
        """The block index (replaced whole by a warm start: read it under :meth:`locked`)."""
        return self._core.index

    @property
    def ingestor(self) -> IndexIngestor:
        """Per-worker ingestion state over :attr:`index`."""
        return self._core.ingestor

    @property
    def router(self) -> Router:
        """The routing decisions over :attr:`index`."""
        return self._core.router

    def _require_loop(self) -> IngestLoop:
        if self._loop is None or not self._loop.running:
            raise ServiceNotIngestingError("the service is not running its ingestion loop")
        return self._loop

    # --- the way into the index -------------------------------------------------------

    def _submit(self, item: SubscriberItem) -> None:
        assert self._sink is not None
        self._sink.submit(item)

    def apply_item(self, item: SubscriberItem) -> None:
        """Apply one subscriber item (any thread; items of a worker in order)."""
        self._core.apply_item(item)
        if isinstance(item, BatchReceived) and item.batch_ts > 0:
            # publisher's timestamp -> visible to queries (same host clock assumed)
            self.metrics.queries.visible_delay.observe(max(0.0, self._wall_clock() - item.batch_ts))

    def apply_items(self, items: Sequence[SubscriberItem]) -> list[tuple[SubscriberItem, Exception]]:
        """Apply a drain of subscriber items in order (``RoutingCore.apply_items``); the failed ones back."""
        failed = self._core.apply_items(items)
        now = self._wall_clock()
        visible = self.metrics.queries.visible_delay
        for item in items:
            if isinstance(item, BatchReceived) and item.batch_ts > 0:
                visible.observe(max(0.0, now - item.batch_ts))
        return failed

    def apply_record(
        self, worker: str, seq: int, batch: KVEventBatch, recv_time_s: float, *, payload: bytes | None = None
    ) -> None:
        """Apply one recorded batch (log replay, shared-stream followers)."""
        self._core.apply_record(worker, seq, batch, recv_time_s, payload=payload)

    def ensure_worker_locked(self, name: str) -> None:
        """Make ``name`` routable with its current ingestion state (caller holds :meth:`locked`).

        For state backends that fold items into :attr:`ingestor` directly
        (snapshot restore): the router learns the worker and its cold flag.
        """
        self._core.ensure_worker(name)

    def set_distrusted(self, name: str, distrusted: bool) -> None:
        """Route ``name`` on load only (its prefix score ignored) while ``distrusted``.

        The gateway's truth loop calls this for a worker whose engine keeps
        reporting cached tokens that disagree with the index (DESIGN §10).
        """
        self._core.set_distrusted(name, distrusted)

    def set_trust(self, name: str, trust: float) -> None:
        """Scale the credit of ``name``'s prefix by ``trust`` in [0, 1] (the gateway's truth loop)."""
        self._core.set_trust(name, trust)

    def set_reachable(self, name: str, reachable: bool) -> None:
        """Take ``name`` out of routing (its engine refuses connections) or put it back.

        Its index entries stay: they are still what the engine holds. Its
        in-flight load is forgotten while it is out.
        """
        self._core.set_reachable(name, reachable)

    def is_cold(self, name: str) -> bool:
        """Whether ``name`` is routed on load alone (entries resyncing or stale, or distrusted)."""
        return self._core.is_cold(name)

    def mark_prefill_done(self, request_id: str) -> bool:
        """The request's first token arrived: its prefill no longer counts as queued load."""
        return self._core.mark_prefill_done(request_id)

    def worker_specs(self) -> dict[str, WorkerSpec]:
        """The configured workers (``--worker`` and ``PUT /workers``) by name."""
        return dict(self._workers.specs)

    def stream_specs(self) -> dict[str, SubscriberSpec]:
        """Every subscribed stream (one per worker, or one per DP rank) by stream name."""
        return dict(self._workers.streams)

    def _mark_stale(self, name: str) -> None:
        self._core.mark_stale(name)

    def preset_roles(self, roles: Mapping[str, WorkerRole | str]) -> None:
        """Declare roles of workers known only from a log (``replay`` reads them from its header)."""
        self._core.preset_roles(roles)

    def replace_index(self, index: KvIndex) -> None:
        """Adopt a restored index (warm start from a snapshot): the core swaps its parts.

        Requests in flight are forgotten (a warm start happens before
        serving); every known worker keeps its role; its ingestion state
        starts ``live``.
        """
        self._core.replace_index(index)

    def _register(self, subs: Iterable[SubscriberSpec]) -> None:
        core = self._core
        with core.locked():
            for sub in subs:
                self._workers.streams[sub.name] = sub
                core.ensure_worker(sub.name)
                if core.roles[sub.name] != sub.role:  # first seen in a stream, before its spec
                    core.add_worker(sub.name, sub.role)
        self.metrics.workers.set(len(self._workers.streams))

    # --- queries ---------------------------------------------------------------------

    def match(self, token_ids: list[int], lora_id: int | str | None = None, salt: str | None = None) -> MatchDetail:
        """``POST /match``: per-worker leading blocks held, block sizes, per-tier detail.

        Typed (``MatchDetail.to_dict()`` is the JSON); raises
        :class:`~tokenspeed_router.errors.WireError` for token ids that cannot be hashed.
        """
        t0 = time.perf_counter()
        # The index locks each query and each event itself: a match never
        # waits behind a whole batch, and takes no lock of ours.
        detail = self._core.match(token_ids, lora_id=lora_id, salt=salt)
        self.metrics.queries.match_latency.observe(time.perf_counter() - t0)
        return detail

    def route(
        self,
        token_ids: list[int],
        *,
        request_id: str | None = None,
        lora_id: int | str | None = None,
        salt: str | None = None,
        explain: bool = False,
    ) -> RouteDecision:
        """``POST /route``: choose a worker and count the request in flight.

        The typed decision (``to_dict()`` is the JSON) carries the index's view
        from the one walk and per-worker credits, so the gateway needs no
        ``match`` of its own; ``explain=True`` adds the cost breakdown, as does
        ``--explain-sample`` for the decisions it picks (``server/explain.py``);
        explained decisions go to the decision log when one is open. Raises
        :class:`~tokenspeed_router.errors.NoWorkerAvailableError` (no worker
        can take it) and :class:`~tokenspeed_router.errors.WireError` (bad
        token ids); the transports map them to statuses (``server/api.py``).
        """
        return self._route(token_ids, request_id, lora_id, salt, explain, False, None)[0]

    def pick(
        self,
        token_ids: list[int],
        *,
        request_id: str | None = None,
        explain: bool = False,
        only: Collection[str] | None = None,
        ranked: bool = True,
    ) -> tuple[RouteDecision, tuple[str, ...]]:
        """:meth:`route` for the endpoint picker (``epp/``): the same decision, counted and
        sampled alike, among ``only`` when given (the subset hint), with every candidate
        of the chosen worker's pool ranked by cost, cheapest first (the fallbacks; ``ranked``
        False: none, and no cost terms recorded).

        The ranking comes from the cost terms an explanation records; the decision
        carries ``explanation`` only when it was asked for or sampled, as from :meth:`route`.
        """
        return self._route(token_ids, request_id, None, None, explain, ranked, only)

    def _route(
        self, token_ids: list[int], request_id: str | None, lora_id: int | str | None, salt: str | None,
        explain: bool, ranked: bool, only: Collection[str] | None,
    ) -> tuple[RouteDecision, tuple[str, ...]]:
        t0 = time.perf_counter()
        ranking: tuple[str, ...] = ()
        with self._lock:
            sampled = False
            if not explain and self._sampler is not None:
                explain = sampled = self._sampler.take()
            d = self._core.route(token_ids, request_id=request_id, lora_id=lora_id, salt=salt,
                                 explain=explain or ranked, only=only)
            q = self.metrics.queries
            q.route_latency.observe(time.perf_counter() - t0)
            q.observe_route(d.worker, d.matched_tokens, len(token_ids))
            if ranked and d.explanation is not None:
                ranking = rank_candidates(d.explanation, d.decode_worker)
                if not explain:
                    d = msgspec.structs.replace(d, explanation=None)
            if d.explanation is not None:
                self._log_explained(d, sampled, token_ids, lora_id, salt)
        return d, ranking

    def _log_explained(self, d: RouteDecision, sampled: bool, token_ids: Any, lora_id: Any, salt: Any) -> None:
        # under the lock: exact counters, one queue append (the writer thread encodes)
        if sampled:
            self._explained.sampled += 1
        else:
            self._explained.asked += 1
        log = self.decision_log
        if log is not None:
            log.submit(d, time_s=self._wall_clock(), cause="sampled" if sampled else "asked",
                       token_ids=token_ids, lora_id=lora_id, salt=salt)

    def release(self, request_id: str) -> bool:
        """``POST /release``: True when the request was in flight (unknown ids are not errors)."""
        found = self._core.release(request_id)
        with self._lock:
            self.metrics.queries.releases["released" if found else "unknown"] += 1
        return found

    def attach_peer_load(self, peer_load: PeerLoad | None) -> None:
        """Add other router replicas' in-flight load to routing (None: stop).

        The Redis state backend calls it once its ``SharedLoad`` runs; it
        survives :meth:`replace_index`.
        """
        self._core.set_peer_load(peer_load)

    def local_load(self) -> dict[str, WorkerLoad]:
        """This process's own in-flight load per worker (any thread; takes the lock)."""
        return self._core.load()

    def workers(self) -> dict[str, Any]:
        """``GET /workers``: ``{name: info}`` per stream (see :func:`worker_entries`)."""
        now = self._wall_clock()
        connected = self._loop.connected() if self._loop is not None else {}
        stats = self._loop.statistics() if self._loop is not None else {}
        lag = self._loop.lag() if self._loop is not None else {}
        problems = self._loop.stream_problems() if self._loop is not None else {}
        core = self._core
        peer_load = core.router.peer_load
        with core.locked():
            peers = peer_load.peers() if peer_load is not None else {}
            out = worker_entries(
                self._workers, core, stats, connected, now, peers=peers, ingest_lag=lag,
                stream_problems=problems,
            )
        # what the cost model believes of each engine it routed to (docs/routing.md): its queue,
        # fitted speed, cache horizon and pinned blocks; None until this router routed there
        beliefs = core.engine_estimates()
        for entry in out.values():
            belief = beliefs.get(entry["worker"])
            entry["engine_belief"] = belief.to_dict() if belief is not None else None
        if peer_load is not None:
            # other replicas' in-flight work: "shared", or "degraded" (Redis down: local view only)
            sharing = "degraded" if getattr(peer_load, "degraded", False) else "shared"
            for entry in out.values():
                entry["in_flight_sharing"] = sharing
        return out

    def health(self) -> dict[str, Any]:
        """``GET /health``: a cheap summary, and whether routing can be trusted.

        ``status`` is ``ok``; ``unavailable`` when every configured stream is
        stale (no event stream reaches us: the index cannot be trusted) or the
        state backend reports itself disconnected; ``degraded`` (still
        serving) when the state backend shares no in-flight work, or a stream
        connects but delivers nothing for a named cause (``stream_problems``:
        a failed handshake, a foreign topic); ``stopping`` during shutdown. ``problems`` says why. HTTP answers 503 for anything but
        ``ok``/``degraded`` (see ``server/http.py``).
        """
        state = self._state_health() if self._state_health is not None else None
        lag = self._loop.lag() if self._loop is not None else {}
        problems: list[str] = []
        if self._workers.streams:
            states = [st.state for st in self._core.statuses().values()]
            if states and all(s is WorkerState.STALE for s in states):
                problems.append(f"every worker is stale ({len(states)} stream(s) unreachable)")
        if state is not None and state.get("connected") is False:
            problems.append("state backend unreachable")
        status = "ok" if self._serving or self._loop is None else "stopping"
        if problems and status == "ok":
            status = "unavailable"
        if status == "ok" and state is not None and state.get("sharing") == "degraded":
            status = "degraded"  # serving on this replica's view of in-flight work only
        # streams that connect but deliver nothing, with the cause (a failed handshake, a foreign topic)
        stream_problems = self._loop.stream_problems() if self._loop is not None else {}
        problems.extend(f"worker {name}: {cause}" for name, cause in sorted(stream_problems.items()))
        if stream_problems and status == "ok":
            status = "degraded"
        return {
            "status": status,
            "problems": problems,
            "uptime_s": round(time.monotonic() - self._started_s, 3),
            "workers": len(self._core.roles),
            "index_core": self._core.index.implementation,  # native, or reference (pure Python: slow)
            "ingesting": self._loop is not None and self._loop.running,  # the loop runs
            "subscribed": self._ingesting,  # False while a replicated backend leads elsewhere
            # streams whose events reach the index late (informational: still served, see /workers)
            "lagging": sorted(n for n, st in lag.items() if st.lagging),
            "stream_problems": dict(sorted(stream_problems.items())),
            **({"state": state} if state is not None else {}),
        }

    # --- run-time membership -----------------------------------------------------------

    def put_worker(self, spec: WorkerSpec, timeout_s: float = 10.0) -> tuple[bool, list[str]]:
        """Add or replace a configured worker; returns (created, stream names).

        Replacing a worker with a different spec drops its index entries (they
        described the old streams). The same spec again is a no-op. While a
        replicated backend holds ingestion elsewhere, the worker is registered
        and subscribed at the next :meth:`start_ingestion`.
        """
        with api_errors():
            return self._put_worker(spec, timeout_s)

    def _put_worker(self, spec: WorkerSpec, timeout_s: float) -> tuple[bool, list[str]]:
        if self._loop is None or not self._loop.running:
            raise ServiceNotIngestingError("the service is not ingesting (no run-time workers here)")
        if self._workers.specs.get(spec.name) == spec:
            return False, [s.name for s in spec.subscribers()]
        old = self._workers.check_put(spec, self._core.roles)
        new_subs = list(spec.subscribers())
        if old is not None:
            self._delete_worker(spec.name, timeout_s)
        loop = self._loop
        try:
            if self._ingesting:
                loop.call(lambda: loop.open_streams(new_subs), timeout_s)
        except (ConfigError, zmq.ZMQError, ValueError) as err:
            raise InvalidRequestError(f"cannot subscribe to worker {spec.name!r}: {err}") from None
        self._workers.specs[spec.name] = spec
        self._register(new_subs)
        logger.info("worker %s added at run time (%d stream(s))", spec.name, len(new_subs))
        return old is None, [s.name for s in new_subs]

    def delete_worker(self, name: str, timeout_s: float = 10.0) -> list[str]:
        """Unsubscribe and forget a worker (a configured name or one stream name)."""
        with api_errors():
            return self._delete_worker(name, timeout_s)

    def _delete_worker(self, name: str, timeout_s: float) -> list[str]:
        names = self._workers.streams_of(name, self._core.roles)
        if self._loop is not None and self._loop.running:
            loop = self._loop
            loop.call(lambda: [loop.close_stream(n) for n in names], timeout_s)
        for n in names:
            self._core.remove_worker(n)
        self._workers.forget(names)
        self.metrics.workers.set(len(self._workers.streams))
        self._workers.specs.pop(name, None)
        logger.info("worker %s removed at run time", name)
        return names

    # --- metrics ---------------------------------------------------------------------

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    def _worker_samples(self) -> Iterator[WorkerSample]:
        now = self._wall_clock()
        stats = self._loop.statistics() if self._loop is not None else {}
        lag = self._loop.lag() if self._loop is not None else {}
        with self._core.locked():
            samples = worker_samples(self._core, stats, now, lag)
        return iter(samples)

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the core's locks: nothing is applied or routed meanwhile (tools that read or replace the index)."""
        with self._core.locked():
            yield


if TYPE_CHECKING:
    from tokenspeed_router.epp.picker import PickerHost
    from tokenspeed_router.gateway.host import GatewayHost
    from tokenspeed_router.state.service import ServiceHost

    def _fits_state_backend(service: RouterService) -> ServiceHost:
        """mypy checks here that the service is what ``serve --state`` needs."""
        return service

    def _fits_gateway(service: RouterService) -> GatewayHost:
        """mypy checks here that the service is what the gateway needs (gateway/host.py)."""
        return service

    def _fits_picker(service: RouterService) -> PickerHost:
        """mypy checks here that the service is what the endpoint picker needs (epp/picker.py)."""
        return service
