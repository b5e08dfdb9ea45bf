"""The typed decision of ``Router.route``: per-worker credits, the index's view, the explanation.

Everything is checked against the real ``KvIndex`` fed with real ``BlockStored``
events, ``scoring.credited_tokens`` and a reference of the cost written out
here (``_ttft``: the formula docs/routing.md and ``router/cost.py`` state):
the decision must carry exactly what the router compared, so that no caller
needs a second index walk and ``explain=True`` tells the truth about the
choice.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable, Mapping

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.router import FakeClock

from tokenspeed_router.events.schema import BlockStored, KVEventBatch
from tokenspeed_router.hashing import block_hashes
from tokenspeed_router.router import (
    CreditSource,
    KvIndex,
    PrefixCredit,
    RouteDecision,
    Router,
    RouterConfig,
)
from tokenspeed_router.router.router import EngineEstimate
from tokenspeed_router.router.scoring import (
    CostWeights,
    WorkerLoad,
    credited_tokens,
)

BS = 16
WORKERS = tuple(f"w{i}" for i in range(8))
PROMPT = list(range(1, 1025))  # 1k tokens = 64 blocks of 16


def store(index: KvIndex, worker: str, tokens: list[int], medium: str | None = None) -> None:
    extra = {"medium": medium} if medium is not None else {}
    event = BlockStored(block_hashes=block_hashes(tokens, BS), parent_block_hash=None, token_ids=tokens,
                        block_size=BS, **extra)  # type: ignore[arg-type]
    index.apply(worker, KVEventBatch(ts=1.0, events=[event]))


def router_over(index: KvIndex | None, *, workers: tuple[str, ...] = WORKERS, clock: FakeClock | None = None,
                **options: object) -> Router:
    options.setdefault("request_id_prefix", "t")
    router = Router(index, RouterConfig(**options), clock=clock or FakeClock())  # type: ignore[arg-type]
    for w in workers:
        router.add_worker(w)
    return router


def tiered_index() -> KvIndex:
    """8 workers holding PROMPT to different depths, on different tiers."""
    index = KvIndex()
    store(index, "w0", PROMPT[: 16 * 40])  # 40 GPU blocks
    store(index, "w1", PROMPT[: 16 * 60], medium="cpu")  # 60 CPU blocks
    store(index, "w2", PROMPT[: 16 * 30])
    store(index, "w2", PROMPT[: 16 * 50], medium="storage")  # 30 GPU + 20 storage
    store(index, "w3", PROMPT[: 16 * 8])  # 8 blocks
    store(index, "w4", [9] * 64)  # holds something else
    return index


def test_credits_equal_the_index_match_with_tier_credits() -> None:
    index = tiered_index()
    router = router_over(index, predict_on_route_ttl_s=0.0)
    weights = router.config.weights()
    d = router.route(PROMPT)
    detail = index.match_detail(PROMPT)
    assert d.index_match == detail  # the walk's own answer, handed over
    for w in WORKERS:
        blocks = detail.scores.get(w, 0)
        assert d.scores[w] == blocks
        assert d.predicted_tokens(w) == d.indexed_tokens(w) == blocks * detail.block_size.get(w, 0)
        if blocks == 0:
            assert w not in d.credits and d.credited_tokens(w) == 0.0
            continue
        credit = d.credits[w]
        assert credit == PrefixCredit(blocks, BS, credited_tokens(blocks, BS, detail.tiers[w], weights),
                                      CreditSource.INDEX)
        assert d.block_size_of(w) == BS and d.credited_tokens(w) == credit.credit_tokens
    assert d.credits["w1"].credit_tokens == 0.75 * 60 * BS  # CPU blocks save 3/4 of their prefill
    assert d.credits["w2"].credit_tokens == (30 + 0.25 * 20) * BS
    # 60 CPU blocks (credit 45) beat 40 GPU blocks; matched_* count blocks on any tier
    assert d.worker == "w1" and (d.matched_blocks, d.matched_tokens, d.block_size) == (60, 960, BS)
    assert d.num_tokens == len(PROMPT) and d.explanation is None  # nothing recorded unless asked
    assert d.block_size_of("w4") == BS and d.block_size_of("w5") == 0  # never stored: unknown


def test_predict_on_route_memory_is_credited_until_the_index_reaches_deeper() -> None:
    index = KvIndex()
    # default predict-on-route (15 s, 64-token blocks); own prefill weighed 2.5x, so that the
    # sibling waits for the first's prefill rather than recomputing it beside (at weight 1 the
    # two cost the same: issue 31's defaults, docs/routing.md)
    router = router_over(index, prefill_weight=2.5)
    first = router.route(PROMPT[:1000])
    w = first.worker
    assert first.credits == {}  # nothing known yet
    sibling = router.route([*PROMPT[:1000], 7, 7, 7])
    # routed before the engine's BlockStored: the memory holds 15 full 64-token blocks of it
    assert sibling.worker == w
    assert sibling.credits[w] == PrefixCredit(15, 64, 960.0, CreditSource.PREDICTED)
    assert sibling.predicted_tokens(w) == 960 and sibling.block_size_of(w) == 64
    assert sibling.indexed_tokens(w) == 0  # the events say nothing yet
    assert (sibling.matched_blocks, sibling.matched_tokens, sibling.block_size) == (15, 960, 64)
    store(index, w, PROMPT[:992])  # the full blocks: 62 of 16 = 992 tokens, deeper than the memory
    third = router.route([*PROMPT[:1000], 8])
    assert third.credits[w] == PrefixCredit(62, BS, 992.0, CreditSource.INDEX)
    assert third.indexed_tokens(w) == third.predicted_tokens(w) == 992


def test_a_cold_worker_is_credited_nothing_but_its_index_view_is_kept() -> None:
    index = tiered_index()
    router = router_over(index, predict_on_route_ttl_s=0.0)
    router.set_cold("w0", True)
    d = router.route(PROMPT)
    assert "w0" not in d.credits and d.scores["w0"] == 0
    assert d.indexed_tokens("w0") == 40 * BS  # what the truth loop compares an engine against


def test_baselines_read_no_index_and_say_so() -> None:
    index = tiered_index()
    for policy in ("round_robin", "random", "least_loaded"):
        d = router_over(index, policy=policy).route(PROMPT)
        assert d.index_match is None and d.credits == {} and d.indexed_tokens("w0") == 0
        assert set(d.scores.values()) == {0}


def test_to_dict_is_exactly_the_route_contract() -> None:
    d = router_over(tiered_index()).route(PROMPT, explain=True)
    assert list(d.to_dict()) == ["worker", "matched_blocks", "matched_tokens", "scores", "prefill_worker",
                                 "decode_worker", "request_id"]


# --- the explanation ------------------------------------------------------------------


def _loaded(router: Router, rng: random.Random, n: int) -> None:
    """Put ``n`` requests in flight (some prefills done) so every load term is non-zero somewhere."""
    for i in range(n):
        d = router.route([*PROMPT[: rng.randrange(1, len(PROMPT))], 50_000 + i], request_id=f"load{i}")
        if rng.random() < 0.3:
            router.mark_prefill_done(d.request_id)


def test_explanation_costs_are_the_model_cost_and_the_choice_is_their_argmin() -> None:
    index = tiered_index()
    router = router_over(index, request_weight=3.0)  # every term of the cost counts
    _loaded(router, random.Random(1), 12)
    load = router.load()
    engines = router.engine_estimates()
    share = router.followup_share  # what this decision prices with (the route then folds into it)
    assert share > 0.0  # the loaded prompts' sessions: the in-flight term counts too
    weights = dataclasses.replace(router.config.weights(), followup_share=share)
    d = router.route(PROMPT, explain=True)
    ex = d.explanation
    assert ex is not None and ex.worker == d.worker and ex.num_tokens == len(PROMPT)
    assert ex.policy == "kv_aware" and ex.weights == weights
    assert [c.worker for c in ex.candidates] == list(WORKERS) and {c.pool for c in ex.candidates} == {"all"}
    hot = _second_deepest(c.credited_tokens for c in ex.candidates)
    for c in ex.candidates:
        own = load[c.worker]
        assert (c.active_requests, c.queue_tokens, c.active_tokens) == (
            own.active_requests, own.pending_prefill_tokens, own.active_tokens)
        assert c.credited_tokens == d.credited_tokens(c.worker)
        assert c.matched_tokens == d.predicted_tokens(c.worker) and c.matched_blocks == d.scores[c.worker]
        assert c.uncached_tokens == max(len(PROMPT) - c.credited_tokens, 0)
        assert c.cost == pytest.approx(_reference_cost(len(PROMPT), c.credited_tokens, own, engines.get(c.worker),
                                                       router.config, weights, hot), rel=1e-12)
        eng = engines.get(c.worker)
        assert c.queue_s == (eng.queue_s if eng is not None else 0.0)
        assert sum(c.matched_tokens_by_tier.values()) == c.matched_tokens
    chosen = [c for c in ex.candidates if c.chosen]
    assert [c.worker for c in chosen] == [d.worker]
    assert chosen[0].cost == min(c.cost for c in ex.candidates if c.cost is not None)
    assert chosen[0].reason.startswith("lowest cost")
    assert all(c.reason.startswith(f"higher cost: {c.cost:.6g} vs {chosen[0].cost:.6g} on {d.worker} ")
               for c in ex.candidates if c.cost != chosen[0].cost)
    w1, w2 = ex.candidate("w1"), ex.candidate("w2")
    assert w1.matched_tokens_by_tier == {"gpu": 0, "cpu": 60 * BS, "storage": 0}
    assert w2.matched_tokens_by_tier == {"gpu": 30 * BS, "cpu": 0, "storage": 20 * BS}
    assert w1.credit_source is CreditSource.INDEX
    assert all((c.credit_source is None) == (c.matched_tokens == 0) for c in ex.candidates)


def _ttft(n: int, credit: float, queue_s: float, load: WorkerLoad, rate: float, overhead_s: float,
          weights: CostWeights, hot: float = 0.0) -> float:
    """The cost, written out: queue clock + (overhead + weighted own prefill over the rate) times
    the sessions in flight, plus the load over the rate.

    The part of a hot prefix (``hot`` tokens deep, held by two engines or more)
    this engine lacks is priced at its plain recompute (weight 1), not at the
    prefill weight: one more copy of a shared prefix is not a session's own work.
    """
    uncached = max(n - credit, 0.0)
    own = weights.prefill_weight * uncached
    if hot and weights.prefill_weight > 1.0:
        own -= (weights.prefill_weight - 1.0) * min(uncached, max(hot - credit, 0.0))
    work = (overhead_s + own / rate) * (1.0 + weights.inflight_factor * weights.followup_share * load.active_requests)
    return (weights.queue_weight * queue_s + work
            + (weights.decode_weight * load.active_tokens + weights.request_weight * load.active_requests) / rate)


def _second_deepest(credits: Iterable[float]) -> float:
    """The hot prefix's depth: the second-deepest credit (credits are leading prefixes)."""
    ranked = sorted(credits, reverse=True)
    return ranked[1] if len(ranked) > 1 else 0.0


def _reference_cost(n: int, credit: float, load: WorkerLoad, eng: EngineEstimate | None,
                    config: RouterConfig, weights: CostWeights, hot: float = 0.0) -> float:
    """The cost the explanation must show (an engine never routed to is idle, at the priors)."""
    hot = hot if config.replicate_hot_prefixes else 0.0
    if eng is None:
        return _ttft(n, credit, 0.0, load, config.prefill_tokens_per_s, config.prefill_overhead_s, weights, hot)
    return _ttft(n, credit, eng.queue_s, load, eng.prefill_tokens_per_s, eng.prefill_overhead_s, weights, hot)


def test_ties_and_cold_workers_are_explained() -> None:
    index = tiered_index()
    router = router_over(index, predict_on_route_ttl_s=0.0)
    router.set_cold("w3", True)
    first = router.route([], explain=True)  # an empty prompt costs nothing anywhere: all tie
    ex = first.explanation
    assert ex is not None
    winner = next(c for c in ex.candidates if c.chosen)
    assert winner.worker == "w0" and winner.reason == "lowest cost, won the tie-break"
    assert all(c.reason.startswith("tied on cost") for c in ex.candidates if not c.chosen)
    assert "cold" in ex.candidate("w3").reason and ex.candidate("w3").cold
    router.set_cold("w1", True)  # the deepest holder (60 CPU blocks): credited nothing now
    router.release(first.request_id)  # (v2 charges a queued prefill's overhead even for no tokens)
    ex = router.route(PROMPT, explain=True).explanation
    assert ex is not None and ex.worker == "w0"
    cold = ex.candidate("w1")
    assert cold.cold and cold.matched_tokens == 0 and cold.uncached_tokens == len(PROMPT)
    assert cold.reason.startswith("higher cost: ") and cold.reason.endswith(
        " on w0 (uncached 1024 vs 384 tokens, queued 0 vs 0 s); cold: its prefix is not trusted, routed on load")


def test_other_replicas_load_is_part_of_the_explained_terms() -> None:
    class Peers:
        def peers(self) -> Mapping[str, WorkerLoad]:
            return {"w0": WorkerLoad(2, 700, 900)}

        def changed(self) -> None:
            pass

    router = Router(None, RouterConfig(request_id_prefix="t"), peer_load=Peers())
    router.add_worker("w0")
    router.add_worker("w1")
    weights = router.config.weights()
    ex = router.route(list(range(100)), explain=True).explanation
    assert ex is not None
    c = ex.candidate("w0")
    assert (c.active_requests, c.queue_tokens, c.active_tokens) == (2, 700, 900)
    # the other replica's queued prefill at the (prior) rate, on an idle local clock
    rate = router.config.prefill_tokens_per_s
    expected = _ttft(100, 0.0, 700 / rate, WorkerLoad(2, 0, 900), rate, router.config.prefill_overhead_s, weights)
    assert c.cost == pytest.approx(expected, rel=1e-12) and c.queue_s == pytest.approx(700 / rate)
    assert ex.worker == "w1"


def test_prefill_decode_pools_are_explained_separately() -> None:
    index = KvIndex()
    store(index, "d0", PROMPT[: 16 * 10])
    router = Router(index, RouterConfig(request_id_prefix="t", predict_on_route_ttl_s=0.0), clock=FakeClock())
    for name, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")):
        router.add_worker(name, role)
    d = router.route(PROMPT, explain=True)
    ex = d.explanation
    assert ex is not None and d.prefill_worker is not None
    assert [(c.pool, c.worker) for c in ex.candidates] == [
        ("decode", "d0"), ("decode", "d1"), ("prefill", "p0"), ("prefill", "p1")]
    assert ex.candidate(d.decode_worker, "decode").chosen and ex.candidate(d.worker, "prefill").chosen
    assert (ex.worker, ex.decode_worker, ex.prefill_worker) == (d.worker, d.decode_worker, d.prefill_worker)
    assert sum(c.chosen for c in ex.candidates) == 2


def test_baseline_explanations_name_the_policy_and_compute_no_cost() -> None:
    router = router_over(tiered_index(), policy="round_robin")
    first = router.route(PROMPT, explain=True).explanation
    assert first is not None and first.worker == "w0"
    assert all(c.cost is None and c.uncached_tokens == len(PROMPT) for c in first.candidates)
    assert first.candidate("w0").reason == "round_robin: chosen"
    assert first.candidate("w1").reason == "round_robin: not chosen"
    second = router.route(PROMPT, explain=True).explanation
    assert second is not None and second.worker == "w1" and second.candidate("w0").active_requests == 1


def test_sampled_choices_are_explained_as_sampled() -> None:
    router = router_over(tiered_index(), temperature=0.5)
    ex = router.route(PROMPT, explain=True).explanation
    assert ex is not None and ex.temperature == 0.5
    assert next(c for c in ex.candidates if c.chosen).reason == "sampled (softmax over costs)"


def test_explanation_json_has_the_design_keys() -> None:
    ex = router_over(tiered_index()).route(PROMPT, explain=True).explanation
    assert ex is not None
    data = msgspec.json.decode(msgspec.json.encode(ex.to_dict()))
    assert data["worker"] == ex.worker
    for c in data["candidates"]:
        assert {"worker", "matched_tokens", "uncached_tokens", "queue_tokens", "cost", "reason"} <= set(c)
        assert set(c["matched_tokens_by_tier"]) == {"gpu", "cpu", "storage"}


# --- explain changes nothing -----------------------------------------------------------


def _replay(explain: bool, seed: int, **options: object) -> list[RouteDecision]:
    rng = random.Random(seed)
    index = tiered_index()
    router = Router(index, RouterConfig(request_id_prefix="t", **options),  # type: ignore[arg-type]
                    clock=FakeClock(), rng=random.Random(seed))
    for w in WORKERS:
        router.add_worker(w)
    out = []
    live: list[str] = []
    for i in range(120):
        prompt = PROMPT[: rng.randrange(0, len(PROMPT))] + [rng.randrange(100_000) for _ in range(rng.randrange(40))]
        d = router.route(prompt, request_id=f"r{i}", explain=explain)
        out.append(d)
        live.append(d.request_id)
        if rng.random() < 0.4:
            router.release(live.pop(rng.randrange(len(live))))
    return out


def test_explain_changes_no_decision() -> None:
    for options in ({}, {"temperature": 0.3}, {"policy": "random"}, {"policy": "round_robin"},
                    {"policy": "approx"}, {"policy": "least_loaded"}):
        plain = _replay(False, 5, **options)
        explained = _replay(True, 5, **options)
        assert [d.to_dict() for d in plain] == [d.to_dict() for d in explained], options
        assert all(d.explanation is None for d in plain)
        assert all(d.explanation is not None and d.explanation.worker == d.worker for d in explained)


@settings(max_examples=30, deadline=None)
@given(
    depths=st.lists(st.tuples(st.integers(0, 64), st.sampled_from([None, "cpu", "storage"])),
                    min_size=8, max_size=8),
    in_flight=st.lists(st.integers(1, 1024), max_size=10),
    done=st.sets(st.integers(0, 9), max_size=5),
    advance_s=st.floats(0.0, 0.5),
    cold=st.sets(st.sampled_from(WORKERS), max_size=3),
    length=st.integers(0, 1024),
)
def test_decisions_agree_with_the_index_and_the_cost(
    depths: list[tuple[int, str | None]], in_flight: list[int], done: set[int], advance_s: float,
    cold: set[str], length: int,
) -> None:
    """Reference model: index credit (cold workers none) + the engines' queue clocks + the cost, minimised."""
    index = KvIndex()
    for w, (blocks, medium) in zip(WORKERS, depths, strict=True):
        if blocks:
            store(index, w, PROMPT[: blocks * BS], medium)
    clock = FakeClock()
    router = router_over(index, predict_on_route_ttl_s=0.0, request_weight=1.0, clock=clock)
    for i, n in enumerate(in_flight):
        d = router.route([70_000 + i] * n)
        if i in done:
            router.mark_prefill_done(d.request_id)
    clock.now += advance_s  # queues decay with time
    for w in cold:
        router.set_cold(w, True)
    prompt = PROMPT[:length]
    load, weights, config = router.load(), router.config.weights(), router.config
    engines = router.engine_estimates()
    detail = index.match_detail(prompt)
    d = router.route(prompt, explain=True)
    assert d.explanation is not None
    credits: dict[str, float] = {}
    for w in WORKERS:
        blocks = 0 if w in cold else detail.scores.get(w, 0)
        credits[w] = credited_tokens(blocks, BS, detail.tiers.get(w), weights)
        assert d.scores[w] == blocks and d.credited_tokens(w) == credits[w]
        assert d.indexed_tokens(w) == detail.scores.get(w, 0) * detail.block_size.get(w, 0)
    hot = _second_deepest(credits.values())
    expected = {w: _reference_cost(length, credits[w], load[w], engines.get(w), config, weights, hot)
                for w in WORKERS}
    got = {c.worker: c.cost for c in d.explanation.candidates}
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert expected[d.worker] == pytest.approx(min(expected.values()), rel=1e-9, abs=1e-12)
