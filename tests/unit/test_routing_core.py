"""The routing core: the index, the ingestor and the router wired once, and everyone runs it."""

from __future__ import annotations

from support.server import BLOCK, batch, removed, stored, tokens

from tokenspeed_router.events import AllBlocksCleared, BatchReceived, ResyncNeeded, encode_batch
from tokenspeed_router.router import KvIndex
from tokenspeed_router.router.core import RoutingCore
from tokenspeed_router.router.router import RouterConfig, WorkerRole


def _item(worker: str, seq: int, *events: object) -> BatchReceived:
    b = batch(*events)  # type: ignore[arg-type]
    return BatchReceived(worker, seq, b, encode_batch(b), b"", 1.0, 0, False)


def test_a_resync_makes_the_worker_cold_and_a_clear_warms_it() -> None:
    core = RoutingCore()
    a = tokens(1, 2)
    core.apply_item(_item("w0", 0, stored(a)))
    core.apply_item(_item("w1", 0, stored(tokens(2, 1))))
    assert core.route(a).worker == "w0" and not core.is_cold("w0")
    core.apply_item(ResyncNeeded("w0", 1, 3, "no_replay_endpoint", 0))
    assert core.is_cold("w0") and core.router.workers()["w0"].cold
    core.apply_item(_item("w0", 3, AllBlocksCleared(), stored(a)))
    assert not core.is_cold("w0") and not core.router.workers()["w0"].cold


def test_the_truth_loop_and_ingestion_both_decide_coldness() -> None:
    core = RoutingCore()
    core.apply_item(_item("w0", 0, stored(tokens(1, 1))))
    core.set_distrusted("w0", True)
    assert core.is_cold("w0") and core.router.workers()["w0"].cold
    core.apply_item(ResyncNeeded("w0", 1, 2, "no_replay_endpoint", 0))
    core.set_distrusted("w0", False)
    assert core.is_cold("w0"), "still resyncing"


def test_the_cost_model_hears_every_store_and_removal() -> None:
    """A prediction bridges a routed prompt until the engine's BlockStored; a removal tells capacity."""
    clock = [0.0]
    core = RoutingCore(RouterConfig(), clock=lambda: clock[0])
    core.add_worker("w0")
    core.add_worker("w1")
    prompt = tokens(5, 4)
    d = core.route(prompt, request_id="r1")
    assert core.engine_estimates()[d.worker].predictions == 1  # the cost model's belief about that engine
    core.mark_prefill_done("r1")
    core.apply_item(_item(d.worker, 0, stored(prompt)))
    assert core.engine_estimates()[d.worker].predictions == 0, "the store ended the prediction it confirms"
    core.apply_item(_item(d.worker, 1, removed(prompt, 3, 1)))
    estimate = core.engine_estimates()[d.worker]
    assert estimate.capacity_tokens == 4 * BLOCK, "the first eviction learns the engine's capacity"


def test_a_drain_is_applied_as_items_one_by_one_and_the_cost_model_hears_it() -> None:
    """apply_items (the applying thread's drain): same index, states and cost-model belief as apply_item."""
    one, many = (RoutingCore(RouterConfig(), clock=lambda: 0.0) for _ in range(2))
    p0, p1 = tokens(5, 4), tokens(6, 2)
    for core in (one, many):
        core.add_worker("w0")
        core.add_worker("w1")
        for name, prompt in (("r0", p0), ("r1", p1)):  # the cost model believes in engines it routed to
            core.route(prompt, request_id=name)
    items = [_item("w0", 0, stored(p0)), _item("w1", 0, stored(p1)), _item("w0", 1, removed(p0, 3, 1)),
             ResyncNeeded("w1", 1, 3, "no_replay_endpoint", 0), _item("w1", 3, stored(tokens(7, 1)))]
    for item in items:
        one.apply_item(item)
    assert many.apply_items(items) == []
    assert many.statuses() == one.statuses() and many.index.snapshot() == one.index.snapshot()
    assert many.is_cold("w1") and not many.is_cold("w0")
    assert many.engine_estimates() == one.engine_estimates()
    assert any(e.capacity_tokens == 4 * BLOCK for e in many.engine_estimates().values()), "the removal was heard"


def test_records_follow_the_sequence_rules() -> None:
    core = RoutingCore()
    a, b = tokens(1, 1), tokens(2, 1)
    core.apply_record("w0", 0, batch(stored(a)), 1.0)
    core.apply_record("w0", 1, batch(stored(b)), 2.0)
    core.apply_record("w0", 0, batch(stored(b), ts=9.0), 3.0)  # seq back to 0, new bytes: a restart
    assert core.statuses()["w0"].restarts == 1
    assert core.match(a).scores["w0"] == 0 and core.match(b).scores["w0"] == 1


def test_replace_index_keeps_roles_marks_and_trust() -> None:
    core = RoutingCore()
    core.add_worker("p", WorkerRole.PREFILL)
    core.add_worker("d", WorkerRole.DECODE)
    core.set_trust("d", 0.5)
    core.set_distrusted("p", True)
    core.set_reachable("d", False)
    fresh = KvIndex()
    core.replace_index(fresh)
    assert core.index is fresh and core.ingestor.status("p") is not None
    assert dict(core.roles) == {"p": WorkerRole.PREFILL, "d": WorkerRole.DECODE}
    assert "d" not in core.router.workers() and core.router.workers()["p"].cold
    core.set_reachable("d", True)
    assert core.router.workers()["d"].role is WorkerRole.DECODE
    assert core.router._trust == {"d": 0.5}


def test_remove_worker_forgets_it_everywhere() -> None:
    core = RoutingCore()
    core.apply_item(_item("w0", 0, stored(tokens(1, 1))))
    core.set_distrusted("w0", True)
    core.remove_worker("w0")
    assert "w0" not in core.roles and "w0" not in core.index.workers() and not core.distrusted


def test_serve_simulate_and_replay_run_the_same_core() -> None:
    from tokenspeed_router.server.app import RouterService
    from tokenspeed_router.server.config import ServerConfig
    from tokenspeed_router.sim.cluster import ClusterConfig
    from tokenspeed_router.sim.policies import RouterBackend
    from tokenspeed_router.state.applier import LocalIndexHost
    from tokenspeed_router.tools.decision_replay import Redecider

    class _View:
        def now(self) -> float:
            return 0.0

    service = RouterService(ServerConfig(http=None))
    try:
        assert type(service.core) is RoutingCore
    finally:
        service.stop()
    backend = RouterBackend("kv_aware", ClusterConfig(num_workers=2), _View())  # type: ignore[arg-type]
    assert type(backend.core) is RoutingCore
    assert type(LocalIndexHost().core) is RoutingCore
    assert type(Redecider(RouterConfig()).core) is RoutingCore
