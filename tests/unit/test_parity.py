"""The parity harness: the warm-up both sides replay (nothing in the slice shares it), and what compare reports."""

from __future__ import annotations

import dataclasses

import pytest

from tokenspeed_router.loadgen.parity import (
    AT_LOAD,
    AT_LOAD_TOLERANCES,
    ParitySetup,
    SideResult,
    compare,
    format_comparison,
    prepare,
    simulate_side,
    simulate_spread,
    warm_up_requests,
)
from tokenspeed_router.sim.cli_trace import DEFAULT_CAPACITY_TOKENS_PER_S
from tokenspeed_router.sim.shapes import WorkloadConfig, generate_workload
from tokenspeed_router.sim.traces import TraceRequest


def _slice() -> list[TraceRequest]:
    workload = generate_workload(WorkloadConfig(num_requests=20, seed=1, block_tokens=32, system_prompt_tokens=256,
                                                question_tokens=64, answer_tokens=32))
    return prepare(workload, ParitySetup(num_workers=2))


def _side(name: str, workers: list[str | None]) -> SideResult:
    n = len(workers)
    return SideResult(name=name, workers=workers, ttft_s=[0.1] * n, cached_tokens=[0] * n, prompt_tokens=[10] * n)


def test_warm_up_comes_first_shares_no_block_and_shifts_the_slice() -> None:
    requests = _slice()
    setup = ParitySetup(num_workers=2, warm_up_requests=5, warm_up_gap_s=0.25)
    replayed = warm_up_requests(requests, setup)
    warm, rest = replayed[:5], replayed[5:]
    assert [r.request_id for r in rest] == [r.request_id for r in requests]
    assert all(r.request_id.startswith("warm-up-") for r in warm)
    assert max(r.arrival_s for r in warm) < min(r.arrival_s for r in rest)
    offsets = {round(b.arrival_s - a.arrival_s, 9) for a, b in zip(requests, rest, strict=True)}
    assert len(offsets) == 1  # the slice keeps its own spacing
    trace_blocks = {h for r in requests for h in r.hash_ids}
    warm_blocks = [h for r in warm for h in r.hash_ids]
    assert len(set(warm_blocks)) == len(warm_blocks) and not trace_blocks & set(warm_blocks)
    assert warm_up_requests(requests, ParitySetup(warm_up_requests=0)) == requests


def test_simulate_side_leaves_the_warm_up_out() -> None:
    requests = _slice()
    side = simulate_side(requests, ParitySetup(num_workers=2, capacity_tokens=4000, warm_up_requests=4))
    assert isinstance(side, SideResult)
    assert len(side.workers) == len(side.ttft_s) == len(side.prompt_tokens) == len(requests)
    assert side.prompt_tokens == [r.input_length for r in requests]


def test_warm_up_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        ParitySetup(warm_up_requests=-1)
    with pytest.raises(ValueError):
        ParitySetup(warm_up_gap_s=0.0)


def test_compare_reports_requests_placed_alike() -> None:
    same = compare(_side("simulate", ["w0", "w1", "w0"]), _side("live", ["w0", "w1", "w0"]), ["w0", "w1"])
    assert same["live_wall"]["placed_alike"] == 3 and same["live_wall"]["first_apart"] is None
    apart = compare(_side("simulate", ["w0", "w1", "w0", "w1"]), _side("live", ["w0", "w0", "w1", "w1"]), ["w0", "w1"])
    assert apart["live_wall"]["placed_alike"] == 2 and apart["live_wall"]["first_apart"] == 1
    assert "the first placed apart: #1" in format_comparison(apart)


def test_worker_shares_are_compared_by_shape_not_by_name() -> None:
    """Two runs that put the same load on swapped engines agree; a lopsided one does not."""
    sim = _side("simulate", ["w0"] * 30 + ["w1"] * 10)
    swapped = compare(sim, _side("live", ["w1"] * 30 + ["w0"] * 10), ["w0", "w1"])
    row = swapped["rows"]["requests_per_worker"]
    assert row["ok"] and row["diff"] == 0.0 and row["named_diff"] == 0.5
    lopsided = compare(sim, _side("live", ["w0"] * 40), ["w0", "w1"])["rows"]["requests_per_worker"]
    assert not lopsided["ok"] and lopsided["diff"] == 0.25


def test_the_spread_reports_each_request_in_the_slice_order() -> None:
    """Runs with late arrivals give one outcome per request of the slice, in its order."""
    requests = _slice()
    setup = ParitySetup(num_workers=2, capacity_tokens=4000, warm_up_requests=2, spread_runs=3)
    exact = simulate_side(requests, setup)
    runs = simulate_spread(requests, setup)
    assert len(runs) == 3
    for run in runs:
        assert run.prompt_tokens == exact.prompt_tokens  # request i is request i, whatever its new arrival
        assert len(run.workers) == len(requests) and all(w in {"w0", "w1"} for w in run.workers)
    unmoved = simulate_spread(requests, dataclasses.replace(setup, spread_delay_wall_s=0.0))
    assert all(r.workers == exact.workers and r.ttft_s == exact.ttft_s for r in unmoved)
    assert simulate_spread(requests, dataclasses.replace(setup, spread_runs=0)) == []


def test_the_at_load_fleet_is_the_headline_fleet_at_its_load() -> None:
    """8 engines of 10k tokens/s (the ``trace --load`` default capacity), load 0.35, 1,000 requests, real time."""
    assert AT_LOAD.setup.num_workers == 8 and AT_LOAD.setup.capacity_tokens == 150_000
    assert AT_LOAD.capacity_tokens_per_s == DEFAULT_CAPACITY_TOKENS_PER_S == 80_000
    assert AT_LOAD.load == 0.35 and AT_LOAD.requests >= 1000 and AT_LOAD.prompt_scale == 1.0
    assert AT_LOAD.traces == ("agentic", "chat", "docqa") and AT_LOAD.setup.time_scale == 1.0
    assert AT_LOAD_TOLERANCES.ttft_p99 == 0.20 and AT_LOAD_TOLERANCES.hit_points == 0.01


def test_reported_rows_are_shown_but_not_judged() -> None:
    """At load the per-engine shares and p50 are reported beside the verdicts on p99 and hit, not judged."""
    sim = _side("simulate", ["w0"] * 30 + ["w1"] * 10)
    live = dataclasses.replace(_side("live", ["w0"] * 40), ttft_s=[0.5] * 40)
    judged = compare(sim, live, ["w0", "w1"])
    assert not judged["rows"]["requests_per_worker"]["ok"] and not judged["ok"]
    result = compare(sim, live, ["w0", "w1"], AT_LOAD_TOLERANCES)
    shares = result["rows"]["requests_per_worker"]
    assert shares["ok"] and not shares["judged"] and shares["diff"] == 0.25
    assert shares["shares"] == {"simulate": {"w0": 0.75, "w1": 0.25}, "live": {"w0": 1.0, "w1": 0.0}}
    assert result["rows"]["ttft_p50_s"]["ok"] and not result["rows"]["ttft_p50_s"]["judged"]
    p99 = next(v for k, v in result["rows"].items() if k.startswith("ttft_p99"))
    assert p99["judged"] and not p99["ok"]  # 0.5 s against 0.1 s: out of 20 %
    assert not result["ok"]
    text = format_comparison(result)
    assert "(reported)" in text and "NO" in text
