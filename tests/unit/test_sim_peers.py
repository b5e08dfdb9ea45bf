"""The peer emulations of ``sim/peers``: each choice function on small hand-made states,
and each backend end to end on a short trace (deterministic for a seed)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tokenspeed_router.sim.cluster import ClusterConfig
from tokenspeed_router.sim.peers import PEER_POLICIES
from tokenspeed_router.sim.peers.dynamo import dynamo_choice, dynamo_costs
from tokenspeed_router.sim.peers.llm_d import llmd_choice, llmd_scores
from tokenspeed_router.sim.peers.sglang import sglang_cache_aware_choice
from tokenspeed_router.sim.peers.vllm_router import vllm_kv_aware_choice
from tokenspeed_router.sim.report import policy_metrics
from tokenspeed_router.sim.runner import run_policy
from tokenspeed_router.sim.traces import TraceWindow, load_mooncake

W = ("w0", "w1", "w2", "w3")
TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "mooncake" / "synthetic_trace.jsonl"


# --- vllm-router kv_aware ----------------------------------------------------------


def test_vllm_kv_aware_takes_the_longest_prefix_ignoring_load() -> None:
    assert vllm_kv_aware_choice(W, {"w1": 3, "w2": 5}, {"w2": 100}) == "w2"


def test_vllm_kv_aware_ties_go_to_the_last_worker() -> None:
    # Rust max_by_key keeps the last maximum
    assert vllm_kv_aware_choice(W, {"w0": 4, "w1": 4, "w3": 4}, {}) == "w3"
    assert vllm_kv_aware_choice(W, {"w0": 4, "w1": 4, "w2": 4, "w3": 1}, {}) == "w2"


def test_vllm_kv_aware_falls_back_to_the_first_least_loaded_on_no_hit() -> None:
    assert vllm_kv_aware_choice(W, {}, {"w0": 2, "w1": 1, "w2": 1, "w3": 3}) == "w1"
    assert vllm_kv_aware_choice(W, {}, {}) == "w0"


# --- Dynamo default cost --------------------------------------------------------------


def test_dynamo_cost_is_prefill_after_overlap_plus_decode_blocks() -> None:
    # 10-block request, bs 16: w0 holds 6 blocks and has 32 prefill tokens (2 blocks) queued
    # and 5 decode blocks; w1 holds nothing and is idle.
    costs = dynamo_costs(("w0", "w1"), 10, {"w0": 6}, {"w0": 32}, {"w0": 5}, {"w0": 1}, 16)
    assert costs == {"w0": (2 + 10 - 6) + 5 + 10, "w1": 10.0 + 0 + 10}
    # the decode blocks in flight outweigh the 6-block overlap by one
    assert dynamo_choice(("w0", "w1"), costs, random.Random(0)) == "w1"


def test_dynamo_overlap_never_makes_the_prefill_term_negative() -> None:
    costs = dynamo_costs(("w0",), 4, {"w0": 9}, {}, {}, {}, 16)
    assert costs == {"w0": 0.0 + 0 + 4}


def test_dynamo_ties_are_drawn_uniformly() -> None:
    rng = random.Random(7)
    picks = {dynamo_choice(W, dict.fromkeys(W, 1.0), rng) for _ in range(200)}
    assert picks == set(W)
    assert dynamo_choice(W, {"w0": 2.0, "w1": 1.0, "w2": 3.0, "w3": 1.5}, rng) == "w1"


# --- SGLang cache_aware ----------------------------------------------------------------


def test_sglang_imbalanced_load_goes_to_the_least_loaded() -> None:
    loads = {"w0": 100, "w1": 10, "w2": 30, "w3": 40}  # 100 - 10 > 64 and 100 > 1.5 * 10
    assert sglang_cache_aware_choice(W, loads, {"w0": 1000}, {}, 1000) == "w1"


def test_sglang_balance_needs_both_thresholds() -> None:
    # 71 - 6 > 64 and 71 > 1.5 * 6: imbalanced; 70 - 6 = 64 is not above; 100 vs 80: only 1.25x
    assert sglang_cache_aware_choice(("w0", "w1"), {"w0": 71, "w1": 6}, {"w0": 900}, {}, 1000) == "w1"
    assert sglang_cache_aware_choice(("w0", "w1"), {"w0": 70, "w1": 6}, {"w0": 900}, {}, 1000) == "w0"
    assert sglang_cache_aware_choice(("w0", "w1"), {"w0": 100, "w1": 80}, {"w0": 900}, {}, 1000) == "w0"


def test_sglang_match_rate_threshold_then_smallest_tree() -> None:
    assert sglang_cache_aware_choice(W, {}, {"w2": 301}, {"w2": 5}, 1000) == "w2"  # rate 0.301 > 0.3
    sizes = {"w0": 50, "w1": 20, "w2": 5, "w3": 9}
    assert sglang_cache_aware_choice(W, {}, {"w0": 300}, sizes, 1000) == "w2"  # 0.3 is not above


# --- llm-d precise prefix + kv utilisation + queue ------------------------------------


def test_llmd_scores_weigh_prefix_twice() -> None:
    scores = llmd_scores(("w0", "w1"), {"w0": 5}, 10, {"w0": 0.9, "w1": 0.5}, {"w0": 4, "w1": 0})
    assert scores["w0"] == pytest.approx(2 * 0.5 + 0.1 + 0.0)
    assert scores["w1"] == pytest.approx(0.0 + 0.5 + 1.0)
    assert llmd_choice(("w0", "w1"), scores, random.Random(0)) == "w1"


def test_llmd_equal_queues_score_one_each() -> None:
    scores = llmd_scores(W, {}, 4, {}, dict.fromkeys(W, 3))
    assert set(scores.values()) == {2.0}


# --- backends end to end ----------------------------------------------------------------


@pytest.fixture(scope="module")
def requests() -> list:
    return load_mooncake(TRACE, TraceWindow(max_requests=60, rate_scale=4.0))


@pytest.mark.parametrize("policy", PEER_POLICIES)
def test_peer_backends_replay_a_trace_deterministically(policy: str, requests: list) -> None:
    cluster = ClusterConfig(num_workers=4, capacity_tokens=60_000, seed=3, event_delay_s=0.01,
                            restarts=((5.0, "w1"),))
    a = policy_metrics(run_policy(policy, requests, cluster))
    b = policy_metrics(run_policy(policy, requests, cluster))
    assert a["requests"] == len(requests) and sum(a["requests_per_worker"]) == len(requests)
    assert {k: v for k, v in a.items() if k != "wall_s"} == {k: v for k, v in b.items() if k != "wall_s"}
    assert 0.0 <= a["hit_ratio"] <= 1.0
