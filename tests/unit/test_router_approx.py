"""Approximate (event-less) prefix knowledge: learning, expiry, size bound."""

from __future__ import annotations

from support.router import FakeClock, StubIndex

from tokenspeed_router.hashing import block_hashes
from tokenspeed_router.router.decision import CreditSource
from tokenspeed_router.router.index import ApplyStats
from tokenspeed_router.router.router import Router, RouterConfig
from tokenspeed_router.router.scoring import ApproxPrefixStore


def conv(turn: int, base: int = 0) -> list[int]:
    """A conversation prompt: turn t extends turn t-1 by 640 tokens."""
    return [base + i for i in range(640 * (turn + 1))]


def test_store_matches_prefixes_and_expires() -> None:
    store = ApproxPrefixStore(block_size=64, ttl_s=10.0, max_blocks=1000)
    hashes = store.hash_prompt(conv(2))
    assert hashes == block_hashes(conv(2), 64)
    store.record("a", hashes[:20], now_s=0.0)
    assert store.match(hashes, ["a", "b"], now_s=5.0) == {"a": 20}
    assert store.match(store.hash_prompt(conv(0)), ["a"], now_s=5.0) == {"a": 10}
    assert store.match(store.hash_prompt(conv(0, base=7)), ["a"], now_s=5.0) == {}
    # Lora/salt namespaces never match plain prompts.
    assert store.match(store.hash_prompt(conv(2), lora_id=3), ["a"], now_s=5.0) == {}
    # Touching the first 10 blocks again keeps them alive past the old deadline.
    store.record("a", hashes[:10], now_s=8.0)
    assert store.match(hashes, ["a"], now_s=12.0) == {"a": 10}
    assert store.num_blocks("a") == 10
    assert store.match(hashes, ["a"], now_s=18.0) == {}
    assert store.num_blocks() == 0


def test_store_size_bound_evicts_leaves_first() -> None:
    store = ApproxPrefixStore(block_size=64, ttl_s=100.0, max_blocks=25)
    a = store.hash_prompt(conv(2))  # 30 blocks
    store.record("w", a, now_s=0.0)
    assert store.num_blocks("w") == 25
    assert store.match(a, ["w"], now_s=1.0) == {"w": 25}  # still a prefix
    other = store.hash_prompt(conv(0, base=10_000))  # 10 new blocks
    store.record("w", other, now_s=2.0)
    assert store.match(a, ["w"], now_s=3.0) == {"w": 15}
    assert store.match(other, ["w"], now_s=3.0) == {"w": 10}
    store.clear_worker("w")
    assert store.match(a, ["w"], now_s=3.0) == {}


def test_approx_policy_learns_from_its_own_decisions_without_an_index() -> None:
    clock = FakeClock()
    router = Router(
        None,
        RouterConfig(policy="approx", approx_ttl_s=60.0, request_id_prefix="t"),
        clock=clock,
    )
    for w in ("w0", "w1", "w2"):
        router.add_worker(w)
    first = router.route(conv(0, base=1))
    router.release(first.request_id)
    router.route(conv(0, base=2))  # another conversation, elsewhere
    second = router.route(conv(1, base=1))  # next turn of the first conversation
    assert second.worker == first.worker
    assert (second.matched_blocks, second.matched_tokens) == (10, 640)
    router.release(second.request_id)
    clock.now += 61.0  # past the TTL: forgotten
    third = router.route(conv(2, base=1))
    assert third.matched_blocks == 0 and third.scores == {"w0": 0, "w1": 0, "w2": 0}


def test_kv_aware_uses_memory_for_workers_without_events() -> None:
    index = StubIndex()
    index.hold("ev", 5, block_size=64)  # 320 tokens via events
    # predict-on-route off: the stub index is all "ev" holds (see the next test)
    config = RouterConfig(request_id_prefix="t", predict_on_route_ttl_s=0.0)
    router = Router(index, config, clock=FakeClock())
    router.add_worker("ev")
    router.add_worker("quiet", events=False)
    d1 = router.route(conv(1, base=9))
    assert d1.worker == "ev"  # 320 cached tokens beat nothing
    router.release(d1.request_id)
    # Send the conversation to the quiet worker once (ev is busy), then it remembers.
    busy = router.route(list(range(50_000, 60_000)))
    assert busy.worker == "ev"
    d2 = router.route(conv(1, base=9))
    assert d2.worker == "quiet"
    router.release(busy.request_id)
    router.release(d2.request_id)
    d3 = router.route(conv(2, base=9))
    assert d3.worker == "quiet" and d3.scores["quiet"] == 20 and d3.scores["ev"] == 5
    assert router.workers()["quiet"].events is False


def test_predictions_bridge_only_until_the_store() -> None:
    index = StubIndex()  # the engine has not published anything yet
    clock = FakeClock()
    # own prefill weighed 2.5x: the sibling waits for the first's prefill rather than recomputing
    # its 8000 shared tokens beside it (at weight 1 both cost the same 0.8 s)
    router = Router(index, RouterConfig(request_id_prefix="t", prediction_grace_s=0.5, prefill_weight=2.5),
                    clock=clock)
    for w in ("w0", "w1", "w2", "w3"):
        router.add_worker(w)
    shared = list(range(8000))
    first = router.route([*shared, 1])
    sibling = router.route([*shared, 2])  # first is still prefilling: credited its prompt
    assert sibling.worker == first.worker and sibling.matched_tokens == 8000
    assert sibling.credits[first.worker].source is CreditSource.PREDICTED
    router.release(sibling.request_id)
    router.mark_prefill_done(first.request_id)  # its BlockStored is due within the grace
    during = router.route([*shared, 3])
    assert during.matched_tokens == 8000
    router.release(during.request_id)
    clock.now += 0.6  # no BlockStored arrived in time: the engine does not hold it
    late = router.route([*shared, 4])
    assert late.matched_tokens == 0
    router.release(late.request_id)
    # A BlockStored batch after the first token ends the prediction at once ...
    again = router.route([*shared, 5])
    router.mark_prefill_done(again.request_id)
    router.on_index_applied(again.worker, ApplyStats(1, 10, 0, 0, 0, 0))
    assert router.route([*shared, 6]).matched_tokens == 0
    # ... and a restart (the ingestor's clear) ends every prediction of the engine.
    third = router.route([*shared, 7])
    router.on_index_cleared(third.worker)
    assert router.route([*shared, 8]).credits.get(third.worker) is None
