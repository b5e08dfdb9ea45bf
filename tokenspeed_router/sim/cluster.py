"""Simulated cluster: real worker caches, the engines' own scheduler, a virtual clock.

Every simulated worker owns a real :class:`~tokenspeed_router.cache.PrefixCache`
with a finite number of pages and its eviction policy, and the scheduler that
``engine-sim`` runs (:class:`~tokenspeed_router.engine_model.EngineCore`):
admission locks a request's prefix at its prefill start (evictions are
published then), its blocks are stored when its prefill ends (``BlockStored``
published then) and stay pinned until its last token. Only *time* is
modelled, by the timing model ``engine-sim`` shares
(:mod:`tokenspeed_router.timing`), in one of its profiles:

* ``fifo`` (the default): one prefill at a time per worker in arrival order,
  ``overhead + uncached_tokens / prefill_rate``; decode one token every
  ``decode_s_per_token`` beside it, without contention. Defaults
  (:class:`CostModel`): 10,000 tokens/s + 20 ms, the rate used by
  ``research/trace_stats.py`` and the low end of what an 8B model reaches on
  one H100-class GPU (16 GFLOP/token at 989 TFLOPS and 40-55 % MFU gives
  25-35 k tokens/s for short prompts; long prompts pay the quadratic
  attention term, so an effective 10-20 k tokens/s is a fair average), and
  20 ms TPOT (an 8B model at moderate batch);
* ``chunked``: vLLM-style steps with a token budget, decode batched with
  prefill chunks (see :mod:`tokenspeed_router.timing`).

**Disaggregated** runs add a decode pool: the prompt's KV moves from the
prefill worker to the decode worker at ``kv_transfer_tokens_per_s``
(400 k tokens/s: 128 KiB/token for an 8B model over ~50 GB/s RDMA), only for
the tokens the decode worker does not already hold; the transfer is part of
TTFT. A decode worker is a cache without a prefill queue.

Events become visible when the engine publishes them plus the configured
event delay (and are dropped with the configured loss probability). The run
is a discrete-event loop over a virtual clock; :class:`Pacer` lets the same
loop run in real time for the live mode. No global state: the RNG and the
clock are owned by the :class:`Simulator` instance.
"""

from __future__ import annotations

import heapq
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from tokenspeed_router.engine_model import EngineCore, ModelRequest, reported_hit
from tokenspeed_router.errors import ConfigError
from tokenspeed_router.events.schema import Event
from tokenspeed_router.sim.traces import TokenSynthesizer, TraceRequest
from tokenspeed_router.timing import PROFILES, Profile, TimingModel

__all__ = [
    "ClusterConfig",
    "CostModel",
    "NoPacer",
    "Pacer",
    "RouteChoice",
    "RoutingBackend",
    "RunResult",
    "SimWorker",
    "Simulator",
    "WorkerView",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """How work turns into time (see the module docstring for the sources).

    ``profile``, ``decode_batch_cost`` and ``max_batched_tokens`` are the
    shared timing model's (:meth:`timing`); the chunked profile's overhead
    is per step that prefills.
    """

    prefill_tokens_per_s: float = 10_000.0
    prefill_overhead_s: float = 0.020
    decode_s_per_token: float = 0.020
    kv_transfer_tokens_per_s: float = 400_000.0
    profile: Profile = "fifo"
    decode_batch_cost: float = 0.02
    max_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.kv_transfer_tokens_per_s <= 0:
            raise ConfigError("prefill and transfer rates must be > 0")
        if self.prefill_overhead_s < 0 or self.decode_s_per_token < 0:
            raise ConfigError("overhead and decode time must be >= 0")
        if self.profile not in PROFILES:
            raise ConfigError(f"timing profile must be one of {', '.join(PROFILES)}, got {self.profile!r}")

    def timing(self) -> TimingModel:
        """The engines' timing model (modelled seconds: time scale 1)."""
        return TimingModel(profile=self.profile, prefill_tokens_per_s=self.prefill_tokens_per_s,
                           prefill_overhead_s=self.prefill_overhead_s,
                           decode_s_per_token=self.decode_s_per_token,
                           decode_batch_cost=self.decode_batch_cost,
                           max_batched_tokens=self.max_batched_tokens)

    def prefill_s(self, uncached_tokens: int) -> float:
        """Service time of one whole prefill with ``uncached_tokens`` to compute (FIFO)."""
        return self.prefill_overhead_s + max(0, uncached_tokens) / self.prefill_tokens_per_s


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterConfig:
    """Shape of the simulated cluster.

    ``num_decode_workers > 0`` makes a disaggregated cluster: the
    ``num_workers`` workers do prefill only, and a separate decode pool
    receives the KV. ``capacity_tokens`` is per worker (400 k tokens is the KV
    room of an 8B Llama-3 on an 80 GB GPU: 128 KiB/token).
    """

    num_workers: int = 8
    num_decode_workers: int = 0
    capacity_tokens: int = 400_000
    page_size: int = 16
    eviction_policy: str = "lru"
    cost: CostModel = field(default_factory=CostModel)
    event_delay_s: float = 0.0
    #: how long after the engine's first token the router hears of it (a gateway's streaming hop)
    first_token_delay_s: float = 0.0
    event_loss_rate: float = 0.0
    seed: int = 0
    token_key: int = 0
    #: requests running at once per worker (engine-sim's ``--max-num-seqs``)
    max_num_seqs: int = 64
    #: engine restarts: ``(time_s, worker)`` pairs (virtual seconds since the first arrival)
    restarts: tuple[tuple[float, str], ...] = ()

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ConfigError("max_num_seqs must be > 0")
        if self.num_workers <= 0 or self.num_decode_workers < 0:
            raise ConfigError("num_workers must be > 0 and num_decode_workers >= 0")
        names = {*self.worker_names(), *self.decode_names()}
        for when, name in self.restarts:
            if name not in names or not when >= 0:
                raise ConfigError(f"restart {name}@{when}: unknown worker or negative time")
        if self.page_size <= 0 or self.capacity_tokens < self.page_size:
            raise ConfigError("page_size must be > 0 and capacity_tokens >= page_size")
        if self.event_delay_s < 0 or not 0.0 <= self.event_loss_rate < 1.0:
            raise ConfigError("event_delay_s must be >= 0 and event_loss_rate in [0, 1)")
        if not self.first_token_delay_s >= 0:
            raise ConfigError("first_token_delay_s must be >= 0")

    @property
    def disaggregated(self) -> bool:
        return self.num_decode_workers > 0

    def worker_names(self) -> list[str]:
        return [f"w{i}" for i in range(self.num_workers)]

    def decode_names(self) -> list[str]:
        return [f"d{i}" for i in range(self.num_decode_workers)]


def _make_cache(config: ClusterConfig) -> Any:
    # Imported here: the cache needs torch, and only building workers needs it.
    from tokenspeed_router.cache import PrefixCache

    return PrefixCache.with_capacity(
        config.capacity_tokens // config.page_size,
        page_size=config.page_size,
        eviction_policy=config.eviction_policy,
        enable_kv_cache_events=True,
        max_num_reqs=config.max_num_seqs + 1,  # the scheduler's running requests (+ a decode admit)
        max_context_len=config.capacity_tokens,  # never truncate a prompt that fits
        debug_checks=False,  # page-accounting asserts cost time and are tested elsewhere
    )


class SimWorker:
    """One simulated engine: a real prefix cache and, unless it only decodes, its scheduler."""

    __slots__ = ("cache", "core", "decode_busy_s", "epoch", "name", "num_requests", "role", "seq")

    def __init__(self, name: str, role: str, cache: Any, core: EngineCore | None = None) -> None:
        self.epoch = 0  # bumped by a restart: batches of an older epoch are never delivered
        self.name = name
        self.role = role
        self.cache = cache
        self.core = core
        self.decode_busy_s = 0.0  # a decode worker's own short prefills (no queue)
        self.num_requests = 0
        self.seq = 0  # next event-batch sequence number

    @property
    def busy_s(self) -> float:
        """Total prefill service time given (modelled seconds)."""
        return self.decode_busy_s + (self.core.busy_s if self.core is not None else 0.0)

    def backlog_s(self, now: float) -> float:
        """Seconds of queued prefill work ahead of a request arriving now (an estimate)."""
        return self.core.backlog_s(now) if self.core is not None else 0.0

    def expected_hit_tokens(self, tokens: np.ndarray, cached_tokens: int) -> int:
        """What a request routed here now will find cached at its prefill start (an oracle's view).

        ``cached_tokens`` is the cache's read-only probe now; the prompts queued
        or prefilling ahead of it (FIFO) will be cached by then too (unless
        evicted meanwhile). Capped as engines report it (the last token is
        always computed).
        """
        best = cached_tokens
        if self.core is not None:
            page = self.cache.page_size
            for r in (*self.core.running, *self.core.waiting):
                if r.prefilled:
                    continue
                other = r.prompt
                n = min(len(other), len(tokens))
                if n <= best:
                    continue
                diff = np.flatnonzero(np.asarray(other[:n]) != tokens[:n])
                common = int(diff[0]) if diff.size else n
                best = max(best, common // page * page)
        return reported_hit(best, len(tokens), self.cache.page_size)

    def admit(self, tokens: np.ndarray) -> tuple[int, list[Event]]:
        """Serve a prompt start to finish in the cache at once: (hit tokens, events it caused)."""
        hit = int(self.cache.admit(tokens))
        return hit, list(self.cache.take_events())


class _CoreListener:
    """One worker's scheduler telling the simulator what happened (see ``Simulator``)."""

    __slots__ = ("sim", "worker")

    def __init__(self, sim: Simulator, worker: SimWorker) -> None:
        self.sim = sim
        self.worker = worker

    def tokens(self, r: ModelRequest, count: int, t: float) -> None:
        if r.num_output == count:  # its first token
            self.sim._first_token(self.worker, r, t)

    def prefill_done(self, r: ModelRequest, t: float) -> None:
        return None  # its BlockStored events go out with the step's batch

    def done(self, r: ModelRequest, reason: str, t: float) -> None:
        self.sim._request_done(r, t)


class WorkerView(Protocol):
    """What an oracle may read: the true caches and queues, right now."""

    def prefill_workers(self) -> Sequence[SimWorker]: ...

    def decode_workers(self) -> Sequence[SimWorker]: ...

    def now(self) -> float: ...


@dataclass(frozen=True, slots=True)
class RouteChoice:
    """Where one request goes (``decode_worker`` only when disaggregated)."""

    worker: str
    decode_worker: str | None = None
    predicted_hit_tokens: int | None = None


class RoutingBackend(Protocol):
    """A routing policy as the simulator drives it.

    ``needs_events`` false lets the fast mode skip event delivery for
    policies that never read the index (it changes nothing else).
    """

    name: str
    needs_events: bool

    def route(self, request: TraceRequest, tokens: np.ndarray) -> RouteChoice: ...

    def deliver(self, worker: str, seq: int, events: list[Event], now: float) -> None: ...

    def prefill_done(self, request_id: str, now: float) -> None: ...

    def finished(self, request_id: str, now: float) -> None: ...


class Pacer(Protocol):
    """Maps virtual time to wall time: nothing (fast) or waiting (live)."""

    def wait_until(self, sim_time_s: float) -> None: ...


class NoPacer:
    """Fast mode: virtual time never waits."""

    def wait_until(self, sim_time_s: float) -> None:
        return None


@dataclass(slots=True)
class RunResult:
    """Raw per-request outcomes of one run (metrics live in ``report``)."""

    policy: str
    worker_names: list[str]
    arrival_s: np.ndarray
    ttft_s: np.ndarray
    queue_s: np.ndarray
    input_tokens: np.ndarray
    hit_tokens: np.ndarray
    predicted_hit_tokens: np.ndarray  # -1 where the policy makes no prediction
    worker_index: np.ndarray
    busy_s: np.ndarray  # per worker
    load_times_s: np.ndarray  # sample times
    load_backlog_s: np.ndarray  # [sample, worker] queued prefill seconds
    num_prefill_workers: int = 0  # the first entries of worker_names/busy_s
    events_published: int = 0
    events_lost_batches: int = 0
    wall_s: float = 0.0


# Heap item kinds, ordered so that at equal times the engines step first, then
# events are delivered, then a request completes, and completions come before
# the next arrival is routed. A disaggregated decode worker's admission (KV
# arrival) comes right after the engines' steps.
_ENGINE, _ADMIT, _DELIVER, _PREFILL_DONE, _FINISH, _RESTART = 0, 1, 2, 3, 4, 5


class Simulator:
    """Replays requests through workers and one routing backend.

    One instance per run: it owns the workers (fresh caches), the RNG for
    event loss, and the virtual clock that the backend reads through
    :meth:`now`.
    """

    def __init__(
        self,
        config: ClusterConfig,
        *,
        synthesizer: TokenSynthesizer | None = None,
        cache_factory: Callable[[ClusterConfig], Any] = _make_cache,
        pacer: Pacer | None = None,
        load_sample_every_s: float = 5.0,
    ) -> None:
        self.config = config
        self._synth = synthesizer or TokenSynthesizer(key=config.token_key)
        role = "prefill" if config.disaggregated else "both"
        timing = config.cost.timing()
        self._cache_factory = cache_factory
        self._backend: RoutingBackend | None = None
        self._prefill = []
        for n in config.worker_names():
            worker = SimWorker(n, role, cache_factory(config))
            worker.core = EngineCore(timing, worker.cache, _CoreListener(self, worker),
                                     block_size=config.page_size, max_num_seqs=config.max_num_seqs,
                                     token_events=False)
            self._prefill.append(worker)
        self._decode = [SimWorker(n, "decode", cache_factory(config)) for n in config.decode_names()]
        self._all = [*self._prefill, *self._decode]
        self._by_name = {w.name: w for w in self._all}
        self._rng = random.Random(config.seed)
        self._pacer: Pacer = pacer or NoPacer()
        self._now = 0.0
        self._heap: list[tuple[float, int, int, Any]] = []
        self._order = 0
        self._sample_every_s = load_sample_every_s
        self._published = 0  # event batches numbered in the current run
        self._lost = 0  # of which dropped by the loss model
        #: per request of the current run: its decode worker (disaggregated), output length
        self._decode_of: dict[int, SimWorker] = {}
        self._ttft = np.zeros(0)
        self._queue = np.zeros(0)
        self._hits = np.zeros(0, dtype=np.int64)
        self._output: list[int] = []
        #: the time of each worker's one valid scheduled engine event
        self._engine_at: dict[str, float] = {}

    # WorkerView ------------------------------------------------------------
    def now(self) -> float:
        """The virtual clock (seconds since the first arrival of the run)."""
        return self._now

    def prefill_workers(self) -> Sequence[SimWorker]:
        return self._prefill

    def decode_workers(self) -> Sequence[SimWorker]:
        return self._decode

    def worker(self, name: str) -> SimWorker:
        try:
            return self._by_name[name]
        except KeyError as err:
            raise ConfigError(f"policy routed to unknown worker {name!r}") from err

    # Loop ------------------------------------------------------------------
    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._order += 1
        heapq.heappush(self._heap, (t, kind, self._order, payload))

    def _drain_until(self, t: float, backend: RoutingBackend) -> None:
        while self._heap and self._heap[0][0] <= t:
            when, kind, _, payload = heapq.heappop(self._heap)
            self._pacer.wait_until(when)
            self._now = max(self._now, when)
            if kind == _ENGINE:
                worker = payload
                if self._engine_at.get(worker.name) != when:
                    continue  # superseded by an earlier wake-up
                del self._engine_at[worker.name]
                worker.core.advance(when)
                events = worker.cache.take_events()
                if events:
                    self._publish(worker, events, when, backend)
                self._wake(worker)
            elif kind == _DELIVER:
                name, events, lost, epoch = payload
                # Numbered when sent, so each worker's stream is in time order.
                worker = self._by_name[name]
                if epoch != worker.epoch:
                    continue  # published by the engine before it restarted: never sent
                seq = worker.seq
                worker.seq += 1
                if not lost:
                    backend.deliver(name, seq, events, self._now)
            elif kind == _ADMIT:
                worker, tokens = payload
                _, events = worker.admit(tokens)
                self._publish(worker, events, self._now, backend)
            elif kind == _PREFILL_DONE:
                backend.prefill_done(payload, self._now)
            elif kind == _RESTART:
                self._restart(payload)
            else:
                backend.finished(payload, self._now)

    def _publish(self, worker: SimWorker, events: list[Event], visible_at: float,
                 backend: RoutingBackend) -> None:
        """Schedule one event batch; a lost one still takes its seq (a gap)."""
        if not events:
            return
        self._published += 1
        if not backend.needs_events:
            return
        lost = bool(self.config.event_loss_rate) and self._rng.random() < self.config.event_loss_rate
        self._lost += lost
        self._push(visible_at + self.config.event_delay_s, _DELIVER, (worker.name, events, lost, worker.epoch))

    def _restart(self, worker: SimWorker) -> None:
        """The engine restarts: an empty cache, its event seq back to 0.

        Batches it had not sent yet are lost with it (their blocks are gone).
        The router learns of the restart from the next batch (seq 0), as from
        a restarted publisher. Requests already running finish against the
        old cache (a simplification: a real engine would abort them and the
        client retry).
        """
        cache = self._cache_factory(self.config)
        worker.cache = cache
        if worker.core is not None:
            worker.core.cache = cache
        worker.epoch += 1
        worker.seq = 0

    def _wake(self, worker: SimWorker) -> None:
        """Schedule ``worker``'s scheduler for its next due event (one valid entry per worker)."""
        assert worker.core is not None
        due = worker.core.next_event_s()
        if due is None:
            return
        due = max(due, self._now)
        current = self._engine_at.get(worker.name)
        if current is not None and current <= due:
            return
        self._engine_at[worker.name] = due
        self._push(due, _ENGINE, worker)

    def _first_token(self, worker: SimWorker, r: ModelRequest, t: float) -> None:
        """A prefill ended at ``t``: TTFT (after the KV transfer when disaggregated)."""
        cost = self.config.cost
        i = r.tag
        self._queue[i] = (r.admitted_s or r.arrival_s) - r.arrival_s
        self._hits[i] = r.cached_tokens
        first_token = t
        dec = self._decode_of.pop(i, None)
        if dec is not None:
            d_hit = dec.cache.cached_prefix_length(r.prompt)
            first_token = t + (len(r.prompt) - d_hit) / cost.kv_transfer_tokens_per_s
            self._push(first_token, _ADMIT, (dec, r.prompt))
            self._push(first_token + self._output[i] * cost.decode_s_per_token, _FINISH, r.request_id)
        self._ttft[i] = first_token - r.arrival_s
        self._push(t + self.config.first_token_delay_s, _PREFILL_DONE, r.request_id)

    def _request_done(self, r: ModelRequest, t: float) -> None:
        if not r.prefill_only:
            self._push(t, _FINISH, r.request_id)

    def _serve(self, i: int, req: TraceRequest, tokens: np.ndarray, choice: RouteChoice, now: float,
               backend: RoutingBackend) -> SimWorker:
        """Hand one routed request to its worker; its outcome is filled in as it happens.

        In a disaggregated run the prefill worker's request ends with its first
        token and the decode worker's cache takes the KV when the transfer
        completes; the transfer moves what a read-only probe says it lacks then.
        """
        cost = self.config.cost
        worker = self.worker(choice.worker)
        worker.num_requests += 1
        if worker.core is None:
            # The router let a decode worker prefill a short tail itself: it does so
            # inside its running batch (no prefill queue), and its events go out at
            # once, so that its stream stays in the order its cache changed.
            hit, events = worker.admit(tokens)
            service = cost.prefill_s(req.input_length - hit)
            worker.decode_busy_s += service
            self._publish(worker, events, now, backend)
            self._hits[i] = hit
            self._ttft[i] = service
            self._push(now + service, _PREFILL_DONE, req.request_id)
            self._push(now + service + req.output_length * cost.decode_s_per_token, _FINISH,
                       req.request_id)
            return worker
        remote = choice.decode_worker is not None and choice.decode_worker != worker.name
        if remote:
            assert choice.decode_worker is not None
            dec = self.worker(choice.decode_worker)
            dec.num_requests += 1
            self._decode_of[i] = dec
        r = ModelRequest(req.request_id, tokens, max(1, req.output_length), prefill_only=remote, tag=i,
                         estimate_uncached=len(tokens) - worker.cache.cached_prefix_length(tokens))
        assert worker.core is not None
        worker.core.submit(r, now)
        self._wake(worker)
        return worker

    def run(
        self,
        requests: Sequence[TraceRequest],
        backend: RoutingBackend,
        *,
        progress: Callable[[int, int], None] | None = None,
    ) -> RunResult:
        """Replay ``requests`` (sorted by arrival) and return raw outcomes."""
        n = len(requests)
        self._ttft = ttft = np.zeros(n)
        self._queue = queue = np.zeros(n)
        self._hits = hits = np.zeros(n, dtype=np.int64)
        self._output = [r.output_length for r in requests]
        self._decode_of = {}
        pred = np.full(n, -1, dtype=np.int64)
        inputs = np.zeros(n, dtype=np.int64)
        widx = np.zeros(n, dtype=np.int64)
        arrivals = np.zeros(n)
        index_of = {w.name: i for i, w in enumerate(self._all)}
        sample_t: list[float] = []
        sample_b: list[list[float]] = []
        next_sample = 0.0
        self._published = self._lost = 0
        t0 = requests[0].arrival_s if n else 0.0
        self._backend = backend
        for when, name in self.config.restarts:
            self._push(when, _RESTART, self._by_name[name])
        for i, req in enumerate(requests):
            t = req.arrival_s - t0
            self._drain_until(t, backend)
            self._pacer.wait_until(t)
            self._now = now = max(self._now, t)
            while next_sample <= now:
                sample_t.append(next_sample)
                sample_b.append([w.backlog_s(next_sample) for w in self._all])
                next_sample += self._sample_every_s
            tokens = self._synth.tokens(req)
            choice = backend.route(req, tokens)
            worker = self._serve(i, req, tokens, choice, now, backend)
            arrivals[i] = t
            inputs[i] = req.input_length
            widx[i] = index_of[worker.name]
            if choice.predicted_hit_tokens is not None:
                pred[i] = choice.predicted_hit_tokens
            if progress is not None:
                progress(i + 1, n)
        self._drain_until(float("inf"), backend)
        return RunResult(
            policy=backend.name,
            worker_names=[w.name for w in self._all],
            arrival_s=arrivals,
            ttft_s=ttft,
            queue_s=queue,
            input_tokens=inputs,
            hit_tokens=hits,
            predicted_hit_tokens=pred,
            worker_index=widx,
            busy_s=np.array([w.busy_s for w in self._all]),
            load_times_s=np.array(sample_t),
            load_backlog_s=np.array(sample_b).reshape(len(sample_t), len(self._all)),
            num_prefill_workers=len(self._prefill),
            events_published=self._published,
            events_lost_batches=self._lost,
        )
