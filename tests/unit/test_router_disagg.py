"""Prefill/decode pairing and the local-prefill threshold."""

from __future__ import annotations

from support.router import PROMPT, FakeClock, StubIndex

from tokenspeed_router.router.router import Router, RouterConfig
from tokenspeed_router.router.scoring import WorkerLoad


def pd_router(index: StubIndex, **options: object) -> Router:
    options.setdefault("request_id_prefix", "t")
    options.setdefault("predict_on_route_ttl_s", 0.0)  # the stub index is the whole truth
    router = Router(index, RouterConfig(**options), clock=FakeClock())  # type: ignore[arg-type]
    for name in ("p0", "p1"):
        router.add_worker(name, role="prefill")
    for name in ("d0", "d1"):
        router.add_worker(name, role="decode")
    return router


def test_prefill_by_prefix_decode_by_load() -> None:
    index = StubIndex()
    index.hold("p1", 60)
    router = pd_router(index)
    d = router.route(PROMPT)
    assert d.prefill_worker == "p1" and d.worker == "p1"
    assert d.decode_worker in ("d0", "d1")
    assert (d.matched_blocks, d.matched_tokens) == (60, 960)
    # The remote prefill worker queues the uncached part; the decode worker holds the context.
    load = router.load()
    assert load["p1"] == WorkerLoad(1, 2000 - 960, 0)
    assert load[d.decode_worker] == WorkerLoad(1, 0, 2000)
    d2 = router.route(PROMPT)
    assert {d.decode_worker, d2.decode_worker} == {"d0", "d1"}


def test_decode_worker_holding_past_turns_prefills_locally() -> None:
    index = StubIndex()
    index.hold("d1", 100)  # 1600 of 2000 tokens: 400 uncached <= 512
    index.hold("p0", 120)
    router = pd_router(index)
    d = router.route(PROMPT)
    assert d.decode_worker == "d1" and d.prefill_worker is None and d.worker == "d1"
    assert d.matched_blocks == 100
    assert router.load()["d1"] == WorkerLoad(1, 400, 2000)
    assert router.statistics().local_prefills == 1


def test_threshold_is_inclusive_and_configurable() -> None:
    index = StubIndex()
    index.hold("d0", 93)  # 2000 - 1488 = 512 uncached: exactly the threshold
    assert pd_router(index).route(PROMPT).prefill_worker is None
    index.hold("d0", 92)  # 528 uncached
    assert pd_router(index).route(PROMPT).prefill_worker is not None
    assert pd_router(index, local_prefill_threshold_tokens=600).route(PROMPT).prefill_worker is None
    # Threshold 0: only a fully cached prompt skips the remote prefill.
    assert pd_router(StubIndex(), local_prefill_threshold_tokens=0).route([]).prefill_worker is None


def test_short_prompts_never_need_a_remote_prefill() -> None:
    d = pd_router(StubIndex()).route(list(range(300)))
    assert d.prefill_worker is None and d.worker == d.decode_worker


def test_prefill_done_frees_the_prefill_worker() -> None:
    router = pd_router(StubIndex())
    d = router.route(PROMPT)
    assert d.prefill_worker is not None
    assert router.mark_prefill_done(d.request_id)
    load = router.load()
    assert load[d.prefill_worker] == WorkerLoad(0, 0, 0)
    assert load[d.decode_worker] == WorkerLoad(1, 0, 2000)
    assert router.release(d.request_id)
    assert all(v == WorkerLoad(0, 0, 0) for v in router.load().values())


def test_both_workers_join_either_pool_and_never_split_with_themselves() -> None:
    index = StubIndex()
    index.hold("b0", 10)
    config = RouterConfig(request_id_prefix="t", predict_on_route_ttl_s=0.0)
    router = Router(index, config, clock=FakeClock())
    router.add_worker("b0")  # both
    router.add_worker("d0", role="decode")
    d = router.route(PROMPT)
    # b0 wins decode (prefix) and prefill: same worker, so a local prefill.
    assert d.decode_worker == "b0" and d.prefill_worker is None
    d2 = router.route(PROMPT)
    assert d2.decode_worker == "d0"  # b0 now queues 1840 tokens
    assert d2.prefill_worker == "b0"  # the only prefill-capable worker


def test_aggregated_cluster_reports_worker_as_decode_worker() -> None:
    index = StubIndex()
    router = Router(index, RouterConfig(request_id_prefix="t"), clock=FakeClock())
    router.add_worker("a")
    router.add_worker("b")
    for _ in range(4):
        d = router.route(PROMPT)
        assert d.prefill_worker is None and d.worker == d.decode_worker
    # Re-adding with another role switches the router to disaggregated mode.
    router.add_worker("a", role="prefill")
    fresh = [t + 1_000_000 for t in PROMPT]  # cached nowhere: a remote prefill is worth it
    d = router.route(fresh)
    assert d.decode_worker == "b" and d.prefill_worker == "a"
    router.add_worker("a", role="both")
    assert router.route(PROMPT).prefill_worker is None


def test_baselines_pair_too() -> None:
    for policy in ("random", "round_robin", "least_loaded"):
        router = pd_router(StubIndex(), policy=policy)
        d = router.route(PROMPT)
        assert d.prefill_worker in ("p0", "p1") and d.decode_worker in ("d0", "d1")
    rr = pd_router(StubIndex(), policy="round_robin")
    pairs = [(d.prefill_worker, d.decode_worker) for d in (rr.route(PROMPT) for _ in range(4))]
    assert pairs == [("p0", "d0"), ("p1", "d1")] * 2
