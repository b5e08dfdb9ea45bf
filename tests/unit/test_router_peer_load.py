"""Router with other replicas' in-flight load (``peer_load``), without Redis.

The Redis side is tested in tests/integration/test_state_shared_load.py; here
a plain in-memory PeerLoad checks how the router weighs it and when it tells
the publisher that its own load changed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tokenspeed_router.router.peer_work import (
    PeerEnded,
    PeerEvent,
    PeerPrediction,
    PeerPredictions,
    PeerPrefillDone,
)
from tokenspeed_router.router.router import Router, RouterConfig
from tokenspeed_router.router.scoring import WorkerLoad


class StaticPeers:
    """Another replica's load, fixed by the test; counts change notifications."""

    def __init__(self, loads: Mapping[str, WorkerLoad]) -> None:
        self.loads = dict(loads)
        self.changes = 0

    def peers(self) -> Mapping[str, WorkerLoad]:
        return self.loads

    def changed(self) -> None:
        self.changes += 1


def _router(peers: StaticPeers | None, **config: object) -> Router:
    router = Router(None, RouterConfig(**config), peer_load=peers)  # type: ignore[arg-type]
    router.add_worker("w0")
    router.add_worker("w1")
    return router


def test_peer_prefill_queue_steers_away_from_a_busy_worker() -> None:
    prompt = list(range(1000))
    idle = _router(None).route(prompt).worker  # idle cluster: the tie-break's pick
    other = "w1" if idle == "w0" else "w0"
    peers = StaticPeers({idle: WorkerLoad(1, 800, 800)})
    assert _router(peers).route(prompt).worker == other


def test_peer_requests_break_ties_like_local_ones() -> None:
    # request_weight 0: costs tie, the tie-break counts requests of every replica
    peers = StaticPeers({"w0": WorkerLoad(3, 0, 0)})
    router = _router(peers, queue_weight=0.0, decode_weight=0.0)
    assert router.route(list(range(100))).worker == "w1"


def test_load_provider_answers_are_not_doubled_by_peer_load() -> None:
    peers = StaticPeers({"w0": WorkerLoad(5, 10_000, 10_000)})
    router = Router(None, RouterConfig(), peer_load=peers,
                    load_provider=lambda name: WorkerLoad(0, 0, 0))
    router.add_worker("w0")
    router.add_worker("w1")
    alone = Router(None, RouterConfig(), load_provider=lambda name: WorkerLoad(0, 0, 0))
    alone.add_worker("w0")
    alone.add_worker("w1")
    # the provider's view is the worker's whole load: w0 is idle by it, so the choice is
    # the one a router without peers makes (the tie-break's; w0 is not penalised)
    assert router.route(list(range(100))).worker == alone.route(list(range(100))).worker


def test_every_local_load_change_is_announced() -> None:
    peers = StaticPeers({})
    t = [0.0]
    router = Router(None, RouterConfig(inflight_timeout_s=10.0), clock=lambda: t[0], peer_load=peers)
    router.add_worker("w0")
    router.route(list(range(64)), request_id="a")
    assert peers.changes == 1
    router.mark_prefill_done("a")
    assert peers.changes == 2
    router.release("a")
    assert peers.changes == 3
    router.route(list(range(64)), request_id="b")
    t[0] = 11.0  # b expires on the next call
    assert router.load()["w0"].active_requests == 0
    assert peers.changes == 5
    assert router.release("unknown") is False and peers.changes == 5
    router.set_peer_load(None)
    router.route(list(range(64)))
    assert peers.changes == 5 and router.peer_load is None


class LinkedReplicas:
    """Route predictions exchanged in memory between routers (what state/load.py carries)."""

    def __init__(self) -> None:
        self.inboxes: list[list[PeerEvent]] = []

    def member(self) -> LinkedPeer:
        self.inboxes.append([])
        return LinkedPeer(self, len(self.inboxes) - 1)


class LinkedPeer:
    def __init__(self, group: LinkedReplicas, me: int) -> None:
        self.group = group
        self.me = me

    def peers(self) -> Mapping[str, WorkerLoad]:
        return {}

    def changed(self) -> None:
        pass

    def _send(self, event: PeerEvent) -> None:
        for i, inbox in enumerate(self.group.inboxes):
            if i != self.me:
                inbox.append(event)

    def routed(self, workers: tuple[str, ...], hashes: Sequence[int], request: str = "",
               uncached: int = 0, *, history: bool = False) -> None:
        self._send(PeerPrediction(workers, tuple(hashes), f"r{self.me}/{request}", uncached, history=history))

    def prefill_done(self, request: str) -> None:
        self._send(PeerPrefillDone(f"r{self.me}/{request}"))

    def ended(self, request: str) -> None:
        self._send(PeerEnded(f"r{self.me}/{request}"))

    def take_predictions(self) -> list[PeerEvent]:
        out = self.group.inboxes[self.me]
        self.group.inboxes[self.me] = []
        return out


def test_peer_route_predictions_are_remembered_as_own() -> None:
    """Replica A sends prompt P to w1; replica B, which has no load, sends the repeat
    of P to w1 too (its own view alone would pick w0, first by name)."""
    prompt = list(range(1000))
    group = LinkedReplicas()
    a_peer, b_peer = group.member(), group.member()
    assert isinstance(a_peer, PeerPredictions)
    a, b = _router(a_peer), _router(b_peer)  # type: ignore[arg-type]
    busy = a.route(list(range(5000, 6000))).worker  # load at A only (the tie-break's pick)
    target = a.route(prompt).worker
    assert target != busy
    assert _router(None).route(prompt).credits == {}  # B alone would not know
    decision = b.route(prompt)
    assert decision.worker == target and decision.credits[target].tokens == 960  # 15 full 64-token blocks
    sent = group.inboxes[0]
    assert sent and isinstance(sent[0], PeerPrediction) and sent[0].workers == (target,)  # B's route went to A
