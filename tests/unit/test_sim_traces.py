"""Trace loading, token synthesis and the synthetic workload."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.sim.shapes import WorkloadConfig, generate_workload
from tokenspeed_router.sim.traces import (
    TokenSynthesizer,
    TraceRequest,
    TraceWindow,
    load_mooncake,
    parse_mooncake,
    trace_summary,
)


def _line(ts: int, n: int, ids: list[int], out: int = 10) -> str:
    return json.dumps({"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids})


def test_equal_ids_give_equal_tokens_and_shared_prefixes() -> None:
    reqs = parse_mooncake([_line(0, 1024, [7, 8]), _line(5, 1500, [7, 8, 9]), _line(9, 600, [7, 11])])
    synth = TokenSynthesizer(key=3)
    a, b, c = (synth.tokens(r) for r in reqs)
    assert np.array_equal(a, b[:1024])  # blocks 7, 8 identical
    assert np.array_equal(a[:512], c[:512])  # block 7 identical
    assert not np.array_equal(a[512:600], c[512:600])  # 8 vs 11 differ
    # Same key, fresh synthesizer: same tokens (no hidden state); other key: different.
    assert np.array_equal(TokenSynthesizer(key=3).tokens(reqs[1]), b)
    assert not np.array_equal(TokenSynthesizer(key=4).tokens(reqs[1]), b)


def test_partial_last_block_length() -> None:
    (req,) = parse_mooncake([_line(0, 1100, [1, 2, 3])])
    assert [req.block_length(i) for i in range(3)] == [512, 512, 76]
    tokens = TokenSynthesizer().tokens(req)
    assert tokens.shape == (1100,)
    assert tokens.dtype == np.int64 and tokens.min() >= 0
    full = TokenSynthesizer().block(3, 512)
    assert np.array_equal(tokens[1024:], full[:76])  # a partial block is a prefix of the full one


def test_window_rate_scale_and_max_requests() -> None:
    lines = [_line(t * 1000, 512, [t]) for t in range(10)]
    reqs = parse_mooncake(lines, TraceWindow(start_s=2.0, duration_s=5.0, rate_scale=2.0))
    assert [r.request_id for r in reqs] == ["r2", "r3", "r4", "r5", "r6"]
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert len(parse_mooncake(lines, TraceWindow(max_requests=3))) == 3


def test_bad_lines_are_named() -> None:
    with pytest.raises(ConfigError, match="trace:1"):
        parse_mooncake(['{"timestamp": 0}'])
    with pytest.raises(ConfigError, match="block_tokens"):
        parse_mooncake([_line(0, 2000, [1])])
    with pytest.raises(ConfigError):
        TraceWindow(rate_scale=0)


def test_shipped_traces_load(traces) -> None:  # type: ignore[no-untyped-def]
    reqs = load_mooncake(traces / "mooncake" / "synthetic_trace.jsonl", TraceWindow(max_requests=50))
    assert len(reqs) == 50
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in reqs)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 3000), block=st.sampled_from([16, 64, 512]))
def test_token_count_matches_input_length(n: int, block: int) -> None:
    ids = tuple(range(-(-n // block)))
    req = TraceRequest("x", 0.0, n, 1, ids, block_tokens=block)
    assert TokenSynthesizer().tokens(req).shape == (n,)


def test_workload_is_deterministic_and_prefix_consistent() -> None:
    cfg = WorkloadConfig(num_requests=300, seed=5)
    a, b = generate_workload(cfg), generate_workload(cfg)
    assert a == b
    assert a != generate_workload(WorkloadConfig(num_requests=300, seed=6))
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)
    # Prefix property: an id at position i always has the same ids before it.
    prefix_of: dict[int, tuple[int, ...]] = {}
    for r in a:
        assert len(r.hash_ids) == -(-r.input_length // r.block_tokens)
        for i, h in enumerate(r.hash_ids):
            assert prefix_of.setdefault(h, r.hash_ids[:i]) == r.hash_ids[:i]
    stats = trace_summary(a)
    assert 0.3 < stats["ideal_hit_ratio"] < 1.0  # shared system prompts and growing chats


def test_demo_slice_ships_as_package_data() -> None:
    from tokenspeed_router.sim.demo import demo_requests

    reqs = demo_requests(rate_scale=8.0)
    assert len(reqs) == 399
    assert reqs[-1].arrival_s < 130.0  # 1022 s of trace, 8x faster
    assert trace_summary(reqs)["ideal_hit_ratio"] > 0.7


def test_sample_prefix_groups_keeps_whole_groups_deterministically() -> None:
    """The demo's shipped slice is 60 whole prefix groups of the synthetic trace
    (`sample_prefix_groups(full, prefix_blocks=1, groups=60, seed=1)` on the whole
    file, which the repository does not ship): sampling all its groups gives it
    back, and fewer groups are whole, seeded and time-scaled."""
    from tokenspeed_router.sim.demo import demo_requests
    from tokenspeed_router.sim.traces import sample_prefix_groups

    shipped = demo_requests(rate_scale=1.0)
    again = sample_prefix_groups(shipped, prefix_blocks=1, groups=60, seed=1)
    assert [(r.input_length, r.hash_ids) for r in again] == [(r.input_length, r.hash_ids) for r in shipped]
    picked = sample_prefix_groups(shipped, prefix_blocks=1, groups=20, seed=1)
    assert picked == sample_prefix_groups(shipped, prefix_blocks=1, groups=20, seed=1)
    roots = {r.hash_ids[0] for r in picked}
    assert len(roots) == 20
    # whole groups: every request of the slice under a picked root is kept
    assert len(picked) == sum(1 for r in shipped if r.hash_ids[0] in roots)
    fast = sample_prefix_groups(shipped, prefix_blocks=1, groups=20, seed=1, speedup=10.0)
    assert fast[0].arrival_s == 0.0
    assert fast[-1].arrival_s == pytest.approx(picked[-1].arrival_s / 10.0)
    other = sample_prefix_groups(shipped, prefix_blocks=1, groups=20, seed=2)
    assert {r.hash_ids[0] for r in other} != roots
    with pytest.raises(ConfigError, match="prefix groups"):
        sample_prefix_groups(shipped[:10], prefix_blocks=1, groups=60, seed=1)
