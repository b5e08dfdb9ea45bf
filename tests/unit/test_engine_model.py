"""The shared engine scheduler on a virtual clock: hand-computed FIFO and chunked timelines."""

from __future__ import annotations

import pytest

from tokenspeed_router.cache import PrefixCache
from tokenspeed_router.engine_model import EngineCore, ModelRequest, reported_hit
from tokenspeed_router.errors import ConfigError
from tokenspeed_router.timing import TimingModel


class Log:
    """Records what the core reports, as (kind, request id, value, time)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str, object, float]] = []

    def tokens(self, r: ModelRequest, count: int, t: float) -> None:
        self.items.append(("tokens", r.request_id, count, t))

    def prefill_done(self, r: ModelRequest, t: float) -> None:
        self.items.append(("prefilled", r.request_id, r.cached_tokens, t))

    def done(self, r: ModelRequest, reason: str, t: float) -> None:
        self.items.append(("done", r.request_id, reason, t))

    def first_tokens(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for kind, rid, _, t in self.items:
            if kind == "tokens" and rid not in out:
                out[rid] = t
        return out

    def ends(self) -> dict[str, float]:
        return {rid: t for kind, rid, _, t in self.items if kind == "done"}


def _core(profile: str, *, pages: int = 64, token_events: bool = True, max_num_seqs: int = 8,
          **timing: float) -> tuple[EngineCore, Log]:
    log = Log()
    cache = PrefixCache.with_capacity(pages, page_size=16, max_num_reqs=max_num_seqs + 1,
                                      max_context_len=pages * 16, debug_checks=False)
    model = TimingModel(profile=profile, **timing)  # type: ignore[arg-type]
    return EngineCore(model, cache, log, block_size=16, max_num_seqs=max_num_seqs,
                      token_events=token_events), log


def _run(core: EngineCore, arrivals: list[tuple[float, ModelRequest]]) -> None:
    """Drive ``core`` like a simulator: submit at arrival times, advance to each due event."""
    pending = sorted(arrivals, key=lambda a: a[0])
    while True:
        due = core.next_event_s()
        if pending and (due is None or pending[0][0] < due):
            t, r = pending.pop(0)
            core.advance(t)
            core.submit(r, t)
            continue
        if due is None:
            return
        core.advance(due)


def test_fifo_one_prefill_at_a_time_then_free_decode() -> None:
    # 1000 tok/s, 10 ms overhead, 100 ms per decode token
    core, log = _core("fifo", prefill_tokens_per_s=1000.0, prefill_overhead_s=0.01, decode_s_per_token=0.1)
    a = ModelRequest("a", list(range(100)), max_tokens=3)
    b = ModelRequest("b", list(range(100)) + [7] * 28, max_tokens=1)  # shares a's 6 full blocks
    _run(core, [(0.0, a), (0.05, b)])
    first = log.first_tokens()
    assert first["a"] == pytest.approx(0.11)  # 10 ms + 100 tokens
    # b waits for a's prefill (FIFO), then reuses a's 96 cached tokens: 10 ms + 32 tokens
    assert b.cached_tokens == 96 and b.admitted_s == pytest.approx(0.11)
    assert first["b"] == pytest.approx(0.11 + 0.01 + 0.032)
    # a decodes beside b's prefill, without contention: tokens at +0.1 s each
    assert log.ends()["a"] == pytest.approx(0.31)
    assert core.num_finished == 2 and core.running == [] and core.next_event_s() is None


def test_fifo_folded_decode_gives_the_same_times() -> None:
    per_token, folded = _core("fifo", decode_s_per_token=0.02), _core("fifo", decode_s_per_token=0.02,
                                                                      token_events=False)
    for core, _ in (per_token, folded):
        _run(core, [(0.0, ModelRequest("a", list(range(64)), max_tokens=10)),
                    (0.001, ModelRequest("b", list(range(200, 300)), max_tokens=4))])
    assert per_token[1].ends() == pytest.approx(folded[1].ends())
    assert per_token[1].first_tokens() == pytest.approx(folded[1].first_tokens())
    assert per_token[0].generation_tokens == folded[0].generation_tokens == 14


def test_chunked_steps_share_a_token_budget() -> None:
    # budget 64 tokens a step; 1000 tok/s; decode 10 ms with one sequence, +50 % per extra
    core, log = _core("chunked", prefill_tokens_per_s=1000.0, decode_s_per_token=0.01,
                      decode_batch_cost=0.5, max_batched_tokens=64)
    a = ModelRequest("a", list(range(100)), max_tokens=2)
    _run(core, [(0.0, a)])
    # step 1: 64 prefill tokens (64 ms); step 2: 36 tokens (36 ms) -> first token at 100 ms;
    # step 3: one decoding sequence (10 ms) -> second token, done
    assert log.first_tokens()["a"] == pytest.approx(0.100)
    assert log.ends()["a"] == pytest.approx(0.110)
    assert core.num_steps == 3


def test_a_decoding_request_pins_its_prefix() -> None:
    # 8 pages of 16; a (4 pages) decodes for a long time; b (6 pages) cannot fit beside it
    core, log = _core("fifo", pages=8, decode_s_per_token=1.0)
    a = ModelRequest("a", list(range(64)), max_tokens=3)
    b = ModelRequest("b", list(range(1000, 1096)), max_tokens=1)
    _run(core, [(0.0, a), (0.1, b)])
    # b waits (head of line) until a releases its pages at its last token, then evicts a
    assert b.admitted_s == pytest.approx(log.ends()["a"])
    assert log.ends()["a"] == pytest.approx(0.02 + 64 / 20_000 + 2.0)


def test_aborted_requests_end_without_their_tokens() -> None:
    core, log = _core("fifo", decode_s_per_token=0.5)
    a = ModelRequest("a", list(range(32)), max_tokens=100)
    b = ModelRequest("b", list(range(500, 532)), max_tokens=5)
    core.submit(a, 0.0)
    core.submit(b, 0.0)
    core.advance(0.0)
    core.abort(b)  # still queued behind a's prefill
    due = core.next_event_s()
    assert due is not None
    core.advance(due)  # a's first token
    core.abort(a)
    while (due := core.next_event_s()) is not None:
        core.advance(due)
    assert log.ends().keys() == {"a", "b"}
    assert ("done", "b", "abort", pytest.approx(0.0216)) in log.items  # when the lane freed
    assert core.num_aborted == 2 and core.running == []


def test_reported_hit_and_profile_validation() -> None:
    assert reported_hit(64, 64, 16) == 48  # the last token is always computed
    assert reported_hit(32, 64, 16) == 32
    assert TimingModel(profile="fifo").prefill_s(0) == pytest.approx(0.02)
    assert TimingModel(profile="chunked").chunk_step_s(0, 0) == 0.0
    assert TimingModel(profile="fifo", time_scale=0).prefill_s(10_000) == 0.0
    with pytest.raises(ConfigError):
        TimingModel(profile="lifo")  # type: ignore[arg-type]
