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
from tokenspeed_router.sim.peers.sglang import SglangTree, sglang_cache_aware_choice
from tokenspeed_router.sim.peers.vllm_router import (
    vllm_kv_aware_choice,
    vllm_kv_aware_costs,
    vllm_new_prefill_tokens,
)
from tokenspeed_router.sim.report import policy_metrics
from tokenspeed_router.sim.runner import run_policy
from tokenspeed_router.sim.traces import TraceWindow, load_mooncake

W = ("w0", "w1", "w2", "w3")
TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "mooncake" / "synthetic_trace.jsonl"


# --- vllm-router 0.1.17 kv_aware ------------------------------------------------------


def test_vllm_new_prefill_never_credits_the_last_token() -> None:
    assert vllm_new_prefill_tokens(64, 0, 16) == 64
    assert vllm_new_prefill_tokens(64, 2, 16) == 32
    # a fully held 64-token prompt is credited 3 blocks: (64 - 1) // 16
    assert vllm_new_prefill_tokens(64, 4, 16) == 16
    assert vllm_new_prefill_tokens(65, 9, 16) == 1
    assert vllm_new_prefill_tokens(0, 0, 16) == 0


def test_vllm_cost_is_prefill_work_times_batch_plus_one() -> None:
    costs = vllm_kv_aware_costs(("w0", "w1"), 160, {"w0": 8}, {"w0": 100}, {"w0": 3}, 16)
    assert costs == {"w0": ((32 + 100) * 4.0, 132, 3), "w1": (160.0, 160, 0)}
    # the holder saves 128 tokens but has 3 requests in flight: the idle worker wins
    assert vllm_kv_aware_choice(("w0", "w1"), costs) == "w1"
    idle = vllm_kv_aware_costs(("w0", "w1"), 160, {"w0": 8}, {}, {}, 16)
    assert vllm_kv_aware_choice(("w0", "w1"), idle) == "w0"


def test_vllm_ties_go_to_the_first_worker() -> None:
    costs = vllm_kv_aware_costs(W, 100, {}, {}, {}, 16)
    assert vllm_kv_aware_choice(W, costs) == "w0"
    costs = vllm_kv_aware_costs(W, 100, {}, {}, {"w0": 1}, 16)
    assert vllm_kv_aware_choice(W, costs) == "w1"


def test_vllm_zero_cost_only_without_tokens_and_then_least_batch() -> None:
    costs = vllm_kv_aware_costs(W, 0, {}, {}, {"w0": 2, "w1": 1, "w2": 1}, 16)
    assert vllm_kv_aware_choice(W, costs, has_tokens=False) == "w3"


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


# --- sglang-router 0.3.2 cache_aware ---------------------------------------------------


def test_sglang_imbalanced_load_goes_to_the_least_loaded() -> None:
    loads = {"w0": 100, "w1": 10, "w2": 30, "w3": 40}  # 100 - 10 > 64 and 100 > 1.5 * 10
    assert sglang_cache_aware_choice(W, loads, "w0", 1000, 1000) == "w1"


def test_sglang_balance_needs_both_thresholds() -> None:
    # 71 - 6 > 64 and 71 > 1.5 * 6: imbalanced; 70 - 6 = 64 is not above; 100 vs 80: only 1.25x
    assert sglang_cache_aware_choice(("w0", "w1"), {"w0": 71, "w1": 6}, "w0", 900, 1000) == "w1"
    assert sglang_cache_aware_choice(("w0", "w1"), {"w0": 70, "w1": 6}, "w0", 900, 1000) == "w0"
    assert sglang_cache_aware_choice(("w0", "w1"), {"w0": 100, "w1": 80}, "w0", 900, 1000) == "w0"


def test_sglang_match_rate_threshold_then_least_loaded() -> None:
    loads = {"w0": 5, "w1": 2, "w2": 7, "w3": 2}
    assert sglang_cache_aware_choice(W, loads, "w2", 301, 1000) == "w2"  # rate 0.301 > 0.3
    assert sglang_cache_aware_choice(W, loads, "w2", 300, 1000) == "w1"  # 0.3 is not above: first least loaded


def test_sglang_tree_match_goes_to_the_node_creator() -> None:
    tree = SglangTree()
    tree.insert("1 2 3 4 5", "w0")
    tree.insert("1 2 3 4 5 6 7", "w1")  # passes through w0's node, creates the leaf " 6 7"
    # characters, not tokens: the space after "5" already matches into w1's leaf
    assert tree.prefix_match("1 2 3 4 5 9") == ("w1", 10)
    assert tree.prefix_match("1 2 3 4 5") == ("w0", 9)
    assert tree.prefix_match("1 2 3 4 5 6 7 8") == ("w1", 13)
    # a partial match inside a node ends there and counts its characters
    assert tree.prefix_match("1 2 3 9") == ("w0", 6)
    tree.insert("1 2 8", "w2")  # splits w0's node at "1 2 ": the upper part keeps w0 as last tenant
    assert tree.prefix_match("1 2 7") == ("w0", 4)
    assert tree.prefix_match("1 2 8 0") == ("w2", 5)
    assert tree.prefix_match("9")[1] == 0
    assert tree.chars == {"w0": 9, "w1": 9 + 4, "w2": 4 + 1}


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
