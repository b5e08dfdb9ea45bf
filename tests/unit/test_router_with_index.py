"""Router over the real KvIndex and IndexIngestor: tiers, LoRA, cold wiring."""

from __future__ import annotations

from support.router import FakeClock

from tokenspeed_router.events.schema import BlockStored, KVEventBatch
from tokenspeed_router.events.subscriber import ResyncNeeded
from tokenspeed_router.hashing import block_hashes
from tokenspeed_router.router import IndexIngestor, KvIndex, Router, RouterConfig, WorkerState

BS = 16
PROMPT = list(range(1, 3201))  # 200 blocks


def store(index: KvIndex, worker: str, tokens: list[int], **extra: object) -> None:
    hashes = block_hashes(tokens, BS)
    event = BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=BS, **extra
    )  # type: ignore[arg-type]
    index.apply(worker, KVEventBatch(ts=1.0, events=[event]))


def make(index: KvIndex) -> Router:
    # predict-on-route off: these tests check what the index alone says
    config = RouterConfig(request_id_prefix="t", predict_on_route_ttl_s=0.0)
    router = Router(index, config, clock=FakeClock())
    for w in ("a", "b", "c"):
        router.add_worker(w)
    return router


def test_tier_detail_from_the_index_feeds_the_credits() -> None:
    index = KvIndex()
    store(index, "a", PROMPT[:1600], medium="cpu")  # 100 CPU blocks = 75 credited
    store(index, "b", PROMPT[: 16 * 80])  # 80 GPU blocks
    d = make(index).route(PROMPT)
    assert d.worker == "b" and d.scores == {"a": 100, "b": 80, "c": 0}
    store(index, "c", PROMPT[: 16 * 70])
    store(index, "c", PROMPT[:1600], medium="storage")
    # c: 70 GPU + 30 storage (credit 0.25) = 77.5 < 80
    assert make(index).route(PROMPT).worker == "b"


def test_lora_namespaces_do_not_mix() -> None:
    index = KvIndex()
    store(index, "a", PROMPT, lora_id=7)
    router = make(index)
    plain = router.route(PROMPT)
    assert plain.scores == {"a": 0, "b": 0, "c": 0}
    router.release(plain.request_id)
    d = router.route(PROMPT, lora_id=7)
    assert d.worker == "a" and d.matched_blocks == 200 and d.matched_tokens == 3200


def test_resyncing_worker_is_cold_through_the_state_hook() -> None:
    index = KvIndex()
    router = make(index)
    ingestor = IndexIngestor(
        index, on_state_change=lambda w, s: router.set_cold(w, s is not WorkerState.LIVE)
    )
    store(index, "a", PROMPT)
    assert router.route(PROMPT).worker == "a"
    ingestor.on_item(ResyncNeeded("a", 3, 9, "replay unavailable", 0))
    # Rebuilt entries exist, but the worker stays cold until it recovers.
    store(index, "a", PROMPT)
    assert router.workers()["a"].cold
    d = router.route(PROMPT)
    assert d.scores["a"] == 0
    ingestor.mark_live("a")
    assert not router.workers()["a"].cold
    assert router.route(PROMPT).scores == {"a": 200, "b": 0, "c": 0}


def test_approx_workers_accept_lora_names() -> None:
    router = Router(None, RouterConfig(policy="approx", request_id_prefix="t"), clock=FakeClock())
    router.add_worker("x")
    router.add_worker("y")
    first = router.route(PROMPT, lora_id="adapter-1")
    router.release(first.request_id)
    again = router.route(PROMPT, lora_id="adapter-1")
    assert again.worker == first.worker and again.matched_tokens == 3200
    assert router.route(PROMPT, lora_id="adapter-2").scores == {"x": 0, "y": 0}


def test_numpy_prompts_route_like_lists() -> None:
    import numpy as np

    index = KvIndex()
    store(index, "b", PROMPT)
    arr = np.asarray(PROMPT, dtype=np.int64)
    assert make(index).route(arr).scores == make(index).route(PROMPT).scores == {"a": 0, "b": 200, "c": 0}
    router = Router(None, RouterConfig(policy="approx", request_id_prefix="t"), clock=FakeClock())
    router.add_worker("x")
    router.route(arr)
    assert router.route(PROMPT).matched_tokens == 3200
