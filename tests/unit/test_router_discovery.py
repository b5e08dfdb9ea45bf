"""Router membership: workers the index knows are routable without add_worker; defaults."""

from __future__ import annotations

import pytest
from support.router import FakeClock

from tokenspeed_router.errors import NoWorkerAvailableError
from tokenspeed_router.events.schema import BlockStored, KVEventBatch
from tokenspeed_router.hashing import block_hashes
from tokenspeed_router.router import KvIndex, Router, RouterConfig, WorkerRole

BS = 16
PROMPT = list(range(1, 1601))  # 100 blocks


def store(index: KvIndex, worker: str, tokens: list[int]) -> None:
    event = BlockStored(
        block_hashes=block_hashes(tokens, BS), parent_block_hash=None, token_ids=tokens, block_size=BS
    )
    index.apply(worker, KVEventBatch(ts=1.0, events=[event]))


def test_router_routes_to_workers_the_index_knows() -> None:
    index = KvIndex()
    # predict-on-route off: after the clear below only the index may speak for "b"
    config = RouterConfig(request_id_prefix="t", predict_on_route_ttl_s=0.0)
    router = Router(index, config, clock=FakeClock())
    with pytest.raises(NoWorkerAvailableError):
        router.route(PROMPT)
    store(index, "a", PROMPT[:160])
    store(index, "b", PROMPT[:800])
    d = router.route(PROMPT)
    assert d.worker == "b" and d.matched_blocks == 50
    assert d.scores == {"a": 10, "b": 50}
    info = router.workers()
    assert set(info) == {"a", "b"}
    assert info["a"].role is WorkerRole.BOTH and info["a"].events and not info["a"].cold
    # a cleared worker is still known: routable, scored 0
    index.clear_worker("b")
    router.release(d.request_id)
    d = router.route(PROMPT)
    assert d.worker == "a" and d.scores["b"] == 0
    # set_cold works on a discovered worker
    router.set_cold("a", True)
    assert router.route(PROMPT).scores["a"] == 0
    # the index forgets a worker: so does the router (its load too)
    index.remove_worker("a")
    assert set(router.workers()) == {"b"} and set(router.load()) == {"b"}
    index.remove_worker("b")
    with pytest.raises(NoWorkerAvailableError):
        router.route(PROMPT)


def test_explicit_membership_wins_over_discovery() -> None:
    index = KvIndex()
    store(index, "a", PROMPT[:160])
    store(index, "b", PROMPT[:800])
    router = Router(index, RouterConfig(request_id_prefix="t"), clock=FakeClock())
    router.add_worker("c", role="both")  # not in the index: routable anyway
    router.add_worker("a", role="decode")  # pins the role of a known worker
    router.add_worker("p", role="prefill")
    assert router.workers()["a"].role is WorkerRole.DECODE
    router.remove_worker("b")  # removed explicitly: not rediscovered
    assert set(router.workers()) == {"a", "c", "p"}
    store(index, "b", PROMPT[:1600])
    store(index, "new", PROMPT[:16])
    assert set(router.workers()) == {"a", "c", "p", "new"}
    # an explicit worker stays when the index forgets it
    index.remove_worker("a")
    assert set(router.workers()) == {"a", "c", "p", "new"}
    # add_worker after remove_worker makes it routable again
    router.add_worker("b")
    d = router.route(PROMPT)
    assert d.decode_worker == "b" and d.matched_blocks == 100
    assert set(d.scores) == {"a", "b", "c", "p", "new"}


def test_indexes_without_membership_contribute_nothing() -> None:
    class Bare:
        def match_detail(self, token_ids: object, lora_id: object = None, salt: object = None) -> object:
            raise AssertionError("not reached")

    router = Router(Bare(), RouterConfig(request_id_prefix="t"), clock=FakeClock())  # type: ignore[arg-type]
    with pytest.raises(NoWorkerAvailableError):
        router.route(PROMPT)
    assert Router(None).workers() == {}


def test_defaults_are_the_measured_ones() -> None:
    config = RouterConfig()  # issue 31's, chosen on the train set at load (docs/routing.md)
    assert (config.prefill_weight, config.decode_weight, config.inflight_factor) == (1.0, 0.02, 1.0)
    assert config.admission_wait is True
    assert config.predict_on_route_ttl_s == 15.0
    assert config.weights().prefill_weight == 1.0
