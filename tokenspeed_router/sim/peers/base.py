"""What every peer emulation shares: the real event path, in-flight counters, the backend protocol.

A peer router is emulated by a pure *choice function* (one per peer module,
unit-tested on hand-made states) over the same inputs the peer reads in its
own source: the event-fed prefix index (here the project's real
:class:`~tokenspeed_router.router.index.KvIndex`, fed through the real
:class:`~tokenspeed_router.router.ingest.IndexIngestor`, so restarts and gaps
clear a worker the way they do for ``kv_aware``) and the router-side
request counters the peers keep. :class:`PeerBackend` is the
``sim.cluster.RoutingBackend`` around such a function; subclasses implement
:meth:`PeerBackend.choose` and, where the peer keeps its own memory of what it
routed, :meth:`PeerBackend.after_route`.

Deterministic: a peer that breaks ties at random gets a ``random.Random``
seeded from the cluster seed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenspeed_router.events.schema import Event, KVEventBatch
from tokenspeed_router.sim.cluster import ClusterConfig, RouteChoice, WorkerView
from tokenspeed_router.sim.traces import TraceRequest

__all__ = ["PeerBackend", "PeerLoad", "RouteInput"]


@dataclass(slots=True)
class PeerLoad:
    """Router-side counters of one worker, as the peers keep them.

    ``requests``: in flight (routed, not finished) — vllm-router's and
    SGLang's ``Worker::load()``. ``prefill_tokens``: uncached prompt tokens of
    requests whose prefill has not finished, oldest first (Dynamo's active
    prefill tokens; the head is the running prefill). ``blocks``: KV blocks of
    the requests in flight (Dynamo's active decode blocks).
    """

    requests: int = 0
    prefill: dict[str, tuple[int, float]] = field(default_factory=dict)  # id -> (tokens, routed at)
    blocks: int = 0

    def prefill_tokens(self) -> int:
        return sum(t for t, _ in self.prefill.values())

    def waiting(self) -> int:
        """Requests queued behind the running prefill (the engine's ``num_requests_waiting``)."""
        return max(len(self.prefill) - 1, 0)


@dataclass(frozen=True, slots=True)
class RouteInput:
    """One decision's inputs: the prompt, the index's answer, the counters."""

    workers: tuple[str, ...]  # in configuration order (the peers iterate their worker list)
    num_tokens: int
    block_size: int
    matched_blocks: dict[str, int]  # leading blocks each worker holds per the event index
    loads: dict[str, PeerLoad]
    now: float


class PeerBackend:
    """A peer emulation as the simulator drives it (``sim.cluster.RoutingBackend``)."""

    name = "peer"
    needs_events = True

    def __init__(self, cluster: ClusterConfig, view: WorkerView) -> None:
        from tokenspeed_router.router.core import RoutingCore

        self._cluster = cluster
        self._view = view
        self._rng = random.Random(cluster.seed)
        self._workers = tuple(cluster.worker_names())
        # The same index and ingestion rules as ours (router/core.py); the peer's own
        # policy replaces the router's.
        self._core = RoutingCore(clock=view.now)
        for name in self._workers:
            self._core.add_worker(name)
        self._loads = {w: PeerLoad() for w in self._workers}
        self._placed: dict[str, tuple[str, int]] = {}  # request id -> (worker, blocks)
        self.block_size = cluster.page_size

    # --- RoutingBackend ------------------------------------------------------
    def route(self, request: TraceRequest, tokens: np.ndarray) -> RouteChoice:
        if self._cluster.disaggregated:
            raise NotImplementedError(f"{self.name}: the peer emulations model aggregated serving only")
        detail = self._core.match(tokens) if self.needs_events else None
        scores = dict(detail.scores) if detail is not None else {}
        matched = {w: int(scores.get(w, 0)) for w in self._workers}
        now = self._view.now()
        inp = RouteInput(self._workers, len(tokens), self.block_size, matched, self._loads, now)
        worker = self.choose(inp, tokens)
        self.after_route(inp, tokens, worker)
        bs = self.block_size
        uncached = self.prefill_tokens(inp, worker)
        load = self._loads[worker]
        blocks = math.ceil(len(tokens) / bs)
        load.requests += 1
        load.blocks += blocks
        load.prefill[request.request_id] = (uncached, now)
        self._placed[request.request_id] = (worker, blocks)
        return RouteChoice(worker=worker, predicted_hit_tokens=self.predicted_hit(inp, worker))

    def deliver(self, worker: str, seq: int, events: list[Event], now: float) -> None:
        self._core.apply_record(worker, seq, KVEventBatch(ts=now, events=events), now)

    def prefill_done(self, request_id: str, now: float) -> None:
        placed = self._placed.get(request_id)
        if placed is not None:
            self._loads[placed[0]].prefill.pop(request_id, None)

    def finished(self, request_id: str, now: float) -> None:
        placed = self._placed.pop(request_id, None)
        if placed is None:
            return
        load = self._loads[placed[0]]
        load.prefill.pop(request_id, None)
        load.requests -= 1
        load.blocks -= placed[1]

    # --- what a peer module provides ------------------------------------------
    def choose(self, inp: RouteInput, tokens: np.ndarray) -> str:
        raise NotImplementedError

    def prefill_tokens(self, inp: RouteInput, worker: str) -> int:
        """The prompt tokens the peer counts as ``worker``'s new prefill work (default: past the match)."""
        return max(inp.num_tokens - inp.matched_blocks.get(worker, 0) * inp.block_size, 0)

    def after_route(self, inp: RouteInput, tokens: np.ndarray, worker: str) -> None:
        """Update the peer's own memory of what it routed (default: none)."""
        return None

    def predicted_hit(self, inp: RouteInput, worker: str) -> int | None:
        """The prefix the peer believes ``worker`` holds, in tokens (for ``prediction_error``)."""
        return inp.matched_blocks.get(worker, 0) * inp.block_size

    @property
    def index(self) -> Any:
        return self._core.index
