"""Sessions in flight and room in the cache: the two terms issue 31 added to the cost model.

Checked on the real index with a frozen clock, so the queues, requests in
flight and pinned blocks are exactly what the router routed:

* the share of requests that carry a session's own history is learnt from
  the routes (one engine's credit a block deeper than any other's) and
  stays near 0 for traffic that only shares a prefix;
* with sessions in flight, a request's own prefill on an engine costs more
  the more requests are in flight there (the queue is not multiplied: it
  holds those prefills already), so a new session goes where fewer live sessions will
  come back (vllm-router's ``kv_aware`` prices the same pressure);
* a prompt whose new blocks do not fit beside the blocks requests in flight
  pin waits for some of them to finish, and the router prices that wait.
"""

from __future__ import annotations

import math

import pytest
from support.router import FakeClock

from tokenspeed_router.events.schema import BlockStored, KVEventBatch
from tokenspeed_router.hashing import block_hashes
from tokenspeed_router.router import KvIndex, Router, RouterConfig
from tokenspeed_router.router.cost import CostModel
from tokenspeed_router.router.engine_belief import EngineBelief, PrefillFit

BS = 16
RATE = 10_000.0
SYSTEM = list(range(1, 8001))  # an 8k-token system prompt


def _store(index: KvIndex, worker: str, tokens: list[int]) -> None:
    ev = BlockStored(block_hashes=block_hashes(tokens, BS), parent_block_hash=None, token_ids=tokens,
                     block_size=BS)
    index.apply(worker, KVEventBatch(1.0, [ev]))


def _router(index: KvIndex, clock: FakeClock | None = None, **options: object) -> Router:
    config = RouterConfig(request_id_prefix="t", predict_on_route_ttl_s=0.0, fit_prefill=False,
                          prefill_tokens_per_s=RATE, prefill_overhead_s=0.0, **options)  # type: ignore[arg-type]
    router = Router(index, config, clock=clock or FakeClock())
    for w in ("h0", "h1", "idle"):
        router.add_worker(w)
    return router


def _own(n: int, length: int) -> list[int]:
    return [10_000_000 + 100_000 * n + j for j in range(length)]


def test_the_share_learns_sessions_and_not_shared_prefixes() -> None:
    index = KvIndex()
    for holder in ("h0", "h1"):
        _store(index, holder, SYSTEM)  # a system prompt two engines hold: shared, nobody's own
    router = _router(index)
    assert router.followup_share == 0.0
    for n in range(300):
        d = router.route([*SYSTEM, *_own(n, 300)])
        router.release(d.request_id)
    assert router.followup_share == 0.0  # first turns of new sessions: no history anywhere
    for n in range(20):  # 20 sessions, each with 2k tokens of its own history on h0
        _store(index, "h0", [*SYSTEM, *_own(n, 2000)])
    for i in range(300):
        d = router.route([*SYSTEM, *_own(i % 20, 2000), *_own(1000 + i, 200)])
        router.release(d.request_id)
    followups = router.followup_share
    assert followups == pytest.approx(1.0 - (1.0 - CostModel.SHARE_GAIN) ** 300)  # every one a follow-up
    for n in range(300, 600):
        d = router.route([*SYSTEM, *_own(n, 300)])
        router.release(d.request_id)
    assert router.followup_share == pytest.approx(followups * (1.0 - CostModel.SHARE_GAIN) ** 300)


def _sessions_in_flight(router: Router, worker: str, count: int, tokens: int) -> None:
    for i in range(count):
        router.route(_own(500 + 50 * i + len(worker), tokens), request_id=f"live-{worker}-{i}", only=[worker])


@pytest.mark.parametrize(("share", "factor", "expected"), [(0.0, 1.0, "h0"), (1.0, 1.0, "h1"), (1.0, 0.0, "h0")])
def test_live_sessions_push_a_new_session_to_the_holder_with_fewer(share: float, factor: float,
                                                                   expected: str) -> None:
    index = KvIndex()
    for holder in ("h0", "h1"):
        _store(index, holder, SYSTEM)
    router = _router(index, inflight_factor=factor)
    router.pin_followup_share(share)
    _sessions_in_flight(router, "h0", 4, 100)  # four sessions live on h0: 0.04 s queued
    _sessions_in_flight(router, "h1", 1, 600)  # one on h1: 0.06 s queued
    # A new session (the system prompt and 2k tokens of its own): 0.2 s of prefill on either
    # holder. Queue alone: h0 (0.24 s vs 0.26 s). With every request a follow-up: h0's four
    # sessions will come back, 0.04 + 0.2 x 5 = 1.04 s against h1's 0.06 + 0.2 x 2 = 0.46 s
    # (and the idle engine's 1.0 s recompute of the system prompt).
    decision = router.route([*SYSTEM, *_own(9999, 2000)], explain=True)
    assert decision.worker == expected
    ex = decision.explanation
    assert ex is not None and ex.weights.followup_share == share and ex.weights.inflight_factor == factor
    h0 = ex.candidate("h0")
    assert h0.cost == pytest.approx(0.04 + 0.2 * (1 + factor * share * 4) + 0.02 * 400 / RATE)


def test_the_wait_for_cache_room_is_what_the_pinned_blocks_leave() -> None:
    eng = EngineBelief(PrefillFit(RATE, 0.0), capacity_tokens=100_000.0, capacity_fixed=True)
    assert eng.admission_wait_s(150_000, 0.0) == 0.0  # nothing in flight: nothing to wait for
    eng.admit("a", 60_000, 0.0)
    assert eng.admission_wait_s(60_000, 0.0) == 0.0  # no request seen leaving yet: no residence
    eng.release("a", 10.0)
    assert eng.residence_s == 10.0 and eng.resident_new == 0
    eng.admit("b", 60_000, 20.0)
    eng.admit("c", 20_000, 20.0)
    assert eng.resident_new == 80_000
    assert eng.admission_wait_s(20_000, 0.0) == 0.0  # fits: 100k - 80k pinned
    assert eng.admission_wait_s(30_000, 0.0) == pytest.approx(10.0 * 10_000 / 80_000)
    assert eng.admission_wait_s(30_000, 10_000.0) == pytest.approx(10.0 * 20_000 / 80_000)  # its prefix is held too
    assert eng.admission_wait_s(500_000, 0.0) == 10.0  # at most every pinned request's stay
    eng.release("b", 22.0)
    assert eng.resident_new == 20_000 and eng.residence_s == pytest.approx(10.0 + 0.5 * (2.0 - 10.0))
    unknown = EngineBelief(PrefillFit(RATE, 0.0))
    unknown.admit("a", 60_000, 0.0)
    unknown.release("a", 10.0)
    unknown.admit("b", 60_000, 20.0)
    assert unknown.capacity_tokens == math.inf and unknown.admission_wait_s(10**9, 0.0) == 0.0


@pytest.mark.parametrize("admission_wait", [True, False])
def test_a_full_engine_sends_a_prompt_where_it_fits(admission_wait: bool) -> None:
    index = KvIndex()
    prefix = list(range(1, 4001))
    _store(index, "h0", prefix)  # h0 holds 4k tokens of the prompt
    clock = FakeClock()
    router = _router(index, clock, engine_capacity_tokens=20_000, admission_wait=admission_wait,
                     inflight_factor=0.0)
    first = router.route(_own(1, 15_000), request_id="first", only=["h0"])
    router.mark_prefill_done(first.request_id)
    clock.now += 5.0
    router.release("first")  # a request stays about 5 s
    router.route(_own(2, 15_000), request_id="pinning", only=["h0"])
    router.mark_prefill_done("pinning")  # its prefill is over; its 15k new tokens stay pinned
    # h0: 4k cached + 4k new, but only 20k - 15k - 4k = 1k of room: 3k must wait for 3/15 of the
    # pinned blocks, 1 s; then 0.4 s of prefill. The idle engine: 0.8 s of prefill.
    d = router.route([*prefix, *_own(3, 4000)], explain=True)
    assert d.worker == ("idle" if admission_wait else "h0")
    ex = d.explanation
    assert ex is not None
    assert ex.candidate("h0").queue_s == pytest.approx(1.0 if admission_wait else 0.0)


def test_a_question_stays_with_the_busy_holder_of_its_document() -> None:
    """Only the request's own prefill is multiplied, not the queue (which holds the prefills in
    flight already): a busy holder of a 20k-token document keeps its questions while its queue is
    shorter than the document's recompute. Multiplying the queue too sent them away and, on the
    document-QA shape, churned every cache (issue 31)."""
    index = KvIndex()
    document = list(range(1, 20_001))
    _store(index, "h0", document)
    router = _router(index)
    router.pin_followup_share(1.0)  # the document is one engine's alone: it reads as a history
    _sessions_in_flight(router, "h0", 10, 500)  # ten requests in flight: 0.5 s queued
    decision = router.route([*document, *_own(7777, 100)])
    assert decision.worker == "h0"  # 0.5 + 0.01 x 11 = 0.61 s against a 2.01 s recompute
