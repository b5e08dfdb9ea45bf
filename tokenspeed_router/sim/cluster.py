"""Simulated cluster: real worker caches, a cost model, one FIFO queue each.

Every simulated worker owns a real :class:`~tokenspeed_router.cache.PrefixCache`
with a finite number of pages and its eviction policy; admitting a request to
it yields the real hit length and the real KV events (``BlockStored`` /
``BlockRemoved``) that an engine would publish. Only *time* is modelled:

* **prefill** of a request takes ``overhead + uncached_tokens / prefill_rate``
  on its worker, which serves one prefill at a time in arrival order (FIFO).
  Defaults (:class:`CostModel`): 10,000 tokens/s + 20 ms, the rate used by
  ``research/trace_stats.py`` and the low end of what an 8B model reaches on
  one H100-class GPU (16 GFLOP/token at 989 TFLOPS and 40-55 % MFU gives
  25-35 k tokens/s for short prompts; long prompts pay the quadratic
  attention term, so an effective 10-20 k tokens/s is a fair average);
* **decode** takes ``output_length * decode_s_per_token`` (20 ms TPOT, an 8B
  model at moderate batch); it runs batched beside prefill, so it does not
  block the prefill queue, but the request stays in flight until it ends;
* **disaggregated** runs add a decode pool: the prompt's KV moves from the
  prefill worker to the decode worker at ``kv_transfer_tokens_per_s``
  (400 k tokens/s: 128 KiB/token for an 8B model over ~50 GB/s RDMA), only for
  the tokens the decode worker does not already hold; the transfer is part of
  TTFT.

Because each worker's cache is touched only by its own requests, in FIFO
order, admitting at routing time yields the same cache state sequence as
admitting at prefill start, and lets the prefill duration be known at once.
The events, however, become visible when the engine would publish them:
evictions at prefill start, stores at prefill end, each plus the configured
event delay (and dropped with the configured loss probability).

The run is a discrete-event loop over a virtual clock; :class:`Pacer` lets
the same loop run in real time for the live mode. No global state: the RNG
and the clock are owned by the :class:`Simulator` instance.
"""

from __future__ import annotations

import heapq
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.events.schema import BlockRemoved, Event
from tokenspeed_router.sim.traces import TokenSynthesizer, TraceRequest

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
    """How work turns into time (see the module docstring for the sources)."""

    prefill_tokens_per_s: float = 10_000.0
    prefill_overhead_s: float = 0.020
    decode_s_per_token: float = 0.020
    kv_transfer_tokens_per_s: float = 400_000.0

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.kv_transfer_tokens_per_s <= 0:
            raise ConfigError("prefill and transfer rates must be > 0")
        if self.prefill_overhead_s < 0 or self.decode_s_per_token < 0:
            raise ConfigError("overhead and decode time must be >= 0")

    def prefill_s(self, uncached_tokens: int) -> float:
        """Service time of one prefill with ``uncached_tokens`` to compute."""
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
    event_loss_rate: float = 0.0
    seed: int = 0
    token_key: int = 0
    #: engine restarts: ``(time_s, worker)`` pairs (virtual seconds since the first arrival)
    restarts: tuple[tuple[float, str], ...] = ()

    def __post_init__(self) -> None:
        if self.num_workers <= 0 or self.num_decode_workers < 0:
            raise ConfigError("num_workers must be > 0 and num_decode_workers >= 0")
        if self.page_size <= 0 or self.capacity_tokens < self.page_size:
            raise ConfigError("page_size must be > 0 and capacity_tokens >= page_size")
        if self.event_delay_s < 0 or not 0.0 <= self.event_loss_rate < 1.0:
            raise ConfigError("event_delay_s must be >= 0 and event_loss_rate in [0, 1)")
        names = {*self.worker_names(), *self.decode_names()}
        for when, name in self.restarts:
            if name not in names or not when >= 0:
                raise ConfigError(f"restart {name}@{when}: unknown worker or negative time")

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
        max_num_reqs=2,  # admit() holds one request at a time
        max_context_len=config.capacity_tokens,  # never truncate a prompt that fits
        debug_checks=False,  # page-accounting asserts cost time and are tested elsewhere
    )


class SimWorker:
    """One simulated engine: a real prefix cache plus a FIFO prefill queue."""

    __slots__ = ("busy_s", "cache", "epoch", "free_at", "name", "num_requests", "restarts", "role", "seq")

    def __init__(self, name: str, role: str, cache: Any) -> None:
        self.epoch = 0  # bumped by a restart: batches of an older epoch are never delivered
        self.restarts = 0
        self.name = name
        self.role = role
        self.cache = cache
        self.free_at = 0.0  # virtual time at which the prefill queue drains
        self.busy_s = 0.0  # total prefill service time given
        self.num_requests = 0
        self.seq = 0  # next event-batch sequence number

    def backlog_s(self, now: float) -> float:
        """Seconds of queued prefill work ahead of a request arriving now."""
        return max(0.0, self.free_at - now)

    def admit(self, tokens: np.ndarray) -> tuple[int, list[Event]]:
        """Admit a prompt to the cache: (hit tokens, events it caused)."""
        hit = int(self.cache.admit(tokens))
        return hit, list(self.cache.take_events())


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


# Heap item kinds, ordered so that at equal times events are delivered before
# a request completes and completions before the next arrival is routed.
# A disaggregated decode worker's admission (KV arrival) comes first.
_ADMIT, _DELIVER, _PREFILL_DONE, _FINISH, _RESTART = 0, 1, 2, 3, 4


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
        self._cache_factory = cache_factory
        self._prefill = [SimWorker(n, role, cache_factory(config)) for n in config.worker_names()]
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
            if kind == _DELIVER:
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
        self._push(visible_at + self.config.event_delay_s, _DELIVER,
                   (worker.name, events, lost, worker.epoch))

    def _restart(self, worker: SimWorker) -> None:
        """The engine restarts: an empty cache, its event seq back to 0.

        Batches it had not sent yet are lost with it (their blocks are gone).
        The router learns of the restart from the next batch (seq 0), as from
        a restarted publisher. Requests already queued there keep the timing
        computed when they were admitted (a simplification: a real engine would
        abort and the client retry them).
        """
        worker.cache = self._cache_factory(self.config)
        worker.epoch += 1
        worker.restarts += 1
        worker.seq = 0

    def _serve(self, req: TraceRequest, tokens: np.ndarray, choice: RouteChoice, now: float,
               backend: RoutingBackend) -> tuple[SimWorker, int, float, float]:
        """Run one routed request through its workers: (worker, hit, start, first token).

        Evictions are published at prefill start, stores at prefill end (an
        engine announces blocks once computed). In a disaggregated run the
        decode worker's cache takes the KV when the transfer completes; the
        transfer moves what a read-only probe says it lacks at routing time.
        """
        cost = self.config.cost
        worker = self.worker(choice.worker)
        hit, events = worker.admit(tokens)
        if worker.role == "decode":
            # The router let a decode worker prefill a short tail itself: it does so
            # inside its running batch (no prefill queue), and its events go out at
            # once, so that its stream stays in the order its cache changed.
            service = cost.prefill_s(req.input_length - hit)
            worker.busy_s += service
            worker.num_requests += 1
            self._publish(worker, events, now, backend)
            self._push(now + service, _PREFILL_DONE, req.request_id)
            self._push(now + service + req.output_length * cost.decode_s_per_token, _FINISH,
                       req.request_id)
            return worker, hit, now, now + service
        start = max(now, worker.free_at)
        service = cost.prefill_s(req.input_length - hit)
        end = start + service
        worker.free_at = end
        worker.busy_s += service
        worker.num_requests += 1
        split = 0
        while split < len(events) and isinstance(events[split], BlockRemoved):
            split += 1
        self._publish(worker, events[:split], start, backend)
        self._publish(worker, events[split:], end, backend)
        first_token = end
        if choice.decode_worker is not None and choice.decode_worker != worker.name:
            dec = self.worker(choice.decode_worker)
            d_hit = dec.cache.cached_prefix_length(tokens)
            first_token = end + (req.input_length - d_hit) / cost.kv_transfer_tokens_per_s
            dec.num_requests += 1
            self._push(first_token, _ADMIT, (dec, tokens))
        self._push(end, _PREFILL_DONE, req.request_id)
        self._push(first_token + req.output_length * cost.decode_s_per_token, _FINISH,
                   req.request_id)
        return worker, hit, start, first_token

    def run(
        self,
        requests: Sequence[TraceRequest],
        backend: RoutingBackend,
        *,
        progress: Callable[[int, int], None] | None = None,
    ) -> RunResult:
        """Replay ``requests`` (sorted by arrival) and return raw outcomes."""
        n = len(requests)
        ttft = np.zeros(n)
        queue = np.zeros(n)
        hits = np.zeros(n, dtype=np.int64)
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
            worker, hit, start, first_token = self._serve(req, tokens, choice, now, backend)
            observed = getattr(backend, "observed", None)
            if observed is not None:  # the engine's usage report, as a gateway would read it
                observed(req.request_id, req.input_length - hit)
            arrivals[i] = t
            ttft[i] = first_token - now
            queue[i] = start - now
            hits[i] = hit
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
