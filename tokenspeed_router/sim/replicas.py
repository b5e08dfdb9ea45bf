"""Router replicas in the simulator: N real Routers splitting the requests, sharing their work.

``simulate --replicas N`` (and ``benchmarks/bench_shared_load.py``) replays
a trace through N routers behind a round-robin split, request by request, as
an L4 balancer in front of N gateways does. Every replica's index follows
every engine (active-active ingestion, ``ingest=direct``). With sharing, the
replicas exchange the production messages (``state/load.py``'s
``SharedLoad.sync_now`` encodes its per-worker totals and the routes'
prefix hashes; ``receive_now`` folds the peers' into the router's view and
predictions), carried by an in-memory bus on the simulator's clock that
delivers each message ``delay_s`` after it was sent: Redis Pub/Sub's
delivery time, measured by ``benchmarks/bench_flight.py``, is what to put
there. A replica publishes on every change of its work: the live thread's
coalescing (one message per ``load_min_interval_s``, 1 ms) cannot be
modelled here without a timer (the simulator only runs at events, so a
held-back message would wait for the next event, far longer than 1 ms),
and is part of the delay instead.

Sharing: ``None`` (each replica alone), ``"load"`` (totals only, no route
predictions) or ``"all"`` (the production default).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.events.schema import Event
from tokenspeed_router.router.scoring import WorkerLoad
from tokenspeed_router.sim.cluster import ClusterConfig, RouteChoice, Simulator
from tokenspeed_router.sim.policies import RouterBackend
from tokenspeed_router.sim.traces import TraceRequest
from tokenspeed_router.state.config import RedisStateConfig
from tokenspeed_router.state.load import SharedLoad

__all__ = ["BusTransport", "DelayBus", "LoadOnly", "ReplicaSet"]


class DelayBus:
    """Every member's messages reach every other member ``delay_s`` later, on ``clock``."""

    def __init__(self, clock: Callable[[], float], delay_s: float) -> None:
        self.clock = clock
        self.delay_s = delay_s
        self.inboxes: list[list[tuple[float, int, bytes]]] = []
        self._order = itertools.count()

    def member(self) -> BusTransport:
        self.inboxes.append([])
        return BusTransport(self, len(self.inboxes) - 1)


class BusTransport:
    """A ``FlightTransport`` (state/load.py) over a :class:`DelayBus`."""

    def __init__(self, bus: DelayBus, me: int) -> None:
        self.bus = bus
        self.me = me

    def publish(self, payload: bytes) -> None:
        due = self.bus.clock() + self.bus.delay_s
        for i, inbox in enumerate(self.bus.inboxes):
            if i != self.me:
                heapq.heappush(inbox, (due, next(self.bus._order), payload))

    def receive(self, timeout_s: float) -> list[bytes]:
        inbox, now, out = self.bus.inboxes[self.me], self.bus.clock(), []
        while inbox and inbox[0][0] <= now:
            out.append(heapq.heappop(inbox)[2])
        return out

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


class LoadOnly:
    """A SharedLoad seen through ``PeerLoad`` alone: totals shared, route predictions not."""

    def __init__(self, shared: SharedLoad) -> None:
        self.shared = shared

    def peers(self) -> Mapping[str, WorkerLoad]:
        return self.shared.peers()

    def changed(self) -> None:
        self.shared.changed()


class ReplicaSet:
    """N real Routers behind a round-robin split, optionally sharing their work."""

    def __init__(self, n: int, cluster: ClusterConfig, sim: Simulator, *, share: str | None,
                 delay_s: float, run_id: str = "sim", policy: str = "kv_aware",
                 router_options: dict[str, Any] | None = None, signal_prefill_done: bool = True) -> None:
        if share not in (None, "load", "all"):
            raise ConfigError(f"replica sharing must be none, load or all, got {share!r}")
        self.reps = [RouterBackend(policy, cluster, sim, router_options=router_options,
                                   signal_prefill_done=signal_prefill_done) for _ in range(n)]
        self.needs_events = self.reps[0].needs_events
        self.sim = sim
        self.min_interval_s = 0.0  # every change goes out (see the module docstring)
        self.dirty = [False] * n
        self.owner: dict[str, int] = {}
        self.turn = 0
        self.shared: list[SharedLoad] = []
        self.last_sync = [-1e18] * n
        self.syncs = 0
        if share is not None:
            bus = DelayBus(sim.now, delay_s)
            for i, rep in enumerate(self.reps):
                config = RedisStateConfig(url="redis://unused", cluster=run_id, replica_id=f"r{i}",
                                          load_ttl_s=60.0, load_refresh_s=1.0)
                shared = SharedLoad(config, rep.router.load, clock=sim.now, transport=bus.member())
                rep.router.set_peer_load(shared if share == "all" else LoadOnly(shared))
                self.shared.append(shared)
        kind = {None: "not shared", "load": "load only", "all": "shared"}[share]
        self.name = f"{n} replicas, {kind}" + (f" ({delay_s * 1000:g} ms)" if self.shared else "")

    def _sync(self, i: int, now: float) -> None:
        self.shared[i].sync_now()
        self.last_sync[i] = now
        self.dirty[i] = False
        self.syncs += 1

    def _publish_due(self) -> None:
        """As the live ``state-load-pub`` threads do: a replica whose work changed
        publishes once ``load_min_interval_s`` has passed since its last message."""
        now = self.sim.now()
        for j in range(len(self.shared)):
            if self.dirty[j] and now - self.last_sync[j] >= self.min_interval_s:
                self._sync(j, now)

    def _changed(self, i: int) -> None:
        if self.shared:
            self.dirty[i] = True
            self._publish_due()
            for j, shared in enumerate(self.shared):  # as the live receiving threads do: on arrival
                if j != i:
                    shared.receive_now()

    def route(self, request: TraceRequest, tokens: np.ndarray) -> RouteChoice:
        i = self.turn % len(self.reps)
        self.turn += 1
        if self.shared:
            self._publish_due()
            self.shared[i].receive_now()  # what has arrived by now (the live thread's view)
        self.owner[request.request_id] = i
        choice = self.reps[i].route(request, tokens)
        self._changed(i)
        return choice

    def deliver(self, worker: str, seq: int, events: list[Event], now: float) -> None:
        for rep in self.reps:  # every replica's index follows every engine
            rep.deliver(worker, seq, events, now)

    def prefill_done(self, request_id: str, now: float) -> None:
        i = self.owner[request_id]
        self.reps[i].prefill_done(request_id, now)
        self._changed(i)

    def finished(self, request_id: str, now: float) -> None:
        i = self.owner.pop(request_id)
        self.reps[i].finished(request_id, now)
        self._changed(i)

    def close(self) -> None:
        for s in self.shared:
            s.crash()  # no threads ran; nothing to announce on the in-memory bus
