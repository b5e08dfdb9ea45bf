"""engine-sim parts in process: timing model, tokenizer, the event fault knobs on a real publisher."""

from __future__ import annotations

import pytest

from tokenspeed_router.cache import PrefixCache
from tokenspeed_router.engine_sim import (
    NUMBER_LIMIT,
    EventOutlet,
    OutletConfig,
    SimTokenizer,
    TimingModel,
)
from tokenspeed_router.errors import ConfigError


def test_step_time_follows_uncached_tokens_and_batch() -> None:
    t = TimingModel(prefill_tokens_per_s=1000, decode_s_per_token=0.01, decode_batch_cost=0.5,
                    time_scale=2.0)
    assert t.step_s(500, 0) == pytest.approx(0.25)
    assert t.step_s(0, 1) == pytest.approx(0.005)
    assert t.step_s(0, 3) == pytest.approx(0.01)  # 0.01 * (1 + 0.5 * 2) / 2
    assert TimingModel(time_scale=0).step_s(10_000, 50) == 0.0
    with pytest.raises(ConfigError):
        TimingModel(max_batched_tokens=0)


def test_tokenizer_numbers_hashes_and_template() -> None:
    tok = SimTokenizer()
    assert tok.encode("12 0  7") == [12, 0, 7]
    hashed = tok.encode("hello 99999999999")
    assert all(NUMBER_LIMIT <= h < 2 * NUMBER_LIMIT for h in hashed)
    assert hashed == SimTokenizer().encode("hello 99999999999")  # stable across instances
    chat = tok.encode_chat([{"role": "user", "content": [{"type": "text", "text": "5 6"}]}])
    assert chat[1:3] == [5, 6] and len(chat) == 5
    assert len(tok.encode_chat([{"role": "user", "content": "5"}], add_generation_prompt=False)) == 3
    assert SimTokenizer(skew=True).tokenize([1, 2])[1:] == [1, 2]


def test_drop_fault_drops_batches_before_numbering() -> None:
    outlet = EventOutlet(OutletConfig(events_endpoint="tcp://127.0.0.1:0", drop_ratio=0.5, seed=3))
    try:
        cache = PrefixCache.with_capacity(64, page_size=16)
        outlet.attach(cache, 64 * 16)
        for i in range(40):
            cache.admit(list(range(i * 1000, i * 1000 + 48)))
            outlet.flush(cache)  # the engine flushes once per step
        stats = outlet.publisher.statistics()
        attempted = stats.published + outlet.num_dropped
        assert attempted >= 41  # AllBlocksCleared + one batch per admit (+ evictions)
        assert 0.3 < outlet.num_dropped / attempted < 0.7
        assert stats.next_seq == stats.published  # seq stays contiguous: the loss is silent
    finally:
        outlet.close()
