"""The fast-mode simulator: hand-computed outcomes, determinism, results schema."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import pytest

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.events.schema import Event
from tokenspeed_router.sim import cli_simulate
from tokenspeed_router.sim.cluster import ClusterConfig, CostModel, RouteChoice, Simulator
from tokenspeed_router.sim.policies import OracleBackend, RouterBackend
from tokenspeed_router.sim.report import POLICY_ORDER, policy_metrics
from tokenspeed_router.sim.runner import run_policies, run_policy
from tokenspeed_router.sim.shapes import WorkloadConfig, generate_workload
from tokenspeed_router.sim.traces import TokenSynthesizer, TraceRequest


def _req(i: int, t: float, n: int, ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(f"q{i}", t, n, 4, ids, block_tokens=32)


# Trace blocks of 32 tokens = 2 pages of 16. Round robin over w0, w1:
#   q0 -> w0: [1,2] 64 tokens, cold                       hit 0
#   q1 -> w1: [1,3] 64 tokens, cold                       hit 0
#   q2 -> w0: [1,2,4] 80 tokens, w0 holds [1,2]           hit 64
#   q3 -> w1: [1,3] 50 tokens = 3 full pages, all held    hit 48
TINY = [
    _req(0, 0.0, 64, (1, 2)),
    _req(1, 0.0, 64, (1, 3)),
    _req(2, 0.01, 80, (1, 2, 4)),
    _req(3, 0.5, 50, (1, 3)),
]
TINY_CLUSTER = ClusterConfig(
    num_workers=2, capacity_tokens=4096, page_size=16,
    cost=CostModel(prefill_tokens_per_s=1000.0, prefill_overhead_s=0.0, decode_s_per_token=0.0),
)


def test_tiny_trace_matches_hand_computation() -> None:
    run = run_policy("round_robin", TINY, TINY_CLUSTER)
    assert run.hit_tokens.tolist() == [0, 0, 64, 48]
    m = policy_metrics(run)
    assert m["hit_ratio"] == pytest.approx(112 / 258)
    # q2 waits for q0 (64 ms of prefill, arrived 10 ms later), then prefills 16 tokens.
    assert run.queue_s.tolist() == pytest.approx([0.0, 0.0, 0.054, 0.0])
    assert run.ttft_s.tolist() == pytest.approx([0.064, 0.064, 0.070, 0.002])
    # Busy time: w0 64 + 16 tokens = 80 ms, w1 64 + 2 = 66 ms; mean 73 ms.
    assert m["load_imbalance"] == pytest.approx(0.080 / 0.073)


def test_oracle_sees_exact_caches_and_queues() -> None:
    run = run_policy("oracle", TINY, TINY_CLUSTER)
    # q2 and q3 go where their prefix is (zero delay, exact caches).
    assert run.hit_tokens[2] == 64 and run.hit_tokens[3] == 48
    assert (run.predicted_hit_tokens == run.hit_tokens).all()


def test_probe_is_read_only() -> None:
    sim = Simulator(TINY_CLUSTER)
    cache = sim.prefill_workers()[0].cache
    tokens = TokenSynthesizer().tokens(TINY[2])
    assert cache.cached_prefix_length(tokens) == 0
    cache.admit(tokens[:64])
    cache.take_events()
    before = cache.statistics()
    assert cache.cached_prefix_length(tokens) == 64
    assert cache.cached_prefix_length(tokens[:40]) == 32
    assert cache.statistics() == before
    assert cache.take_events() == []


def _workload() -> list[TraceRequest]:
    return generate_workload(WorkloadConfig(num_requests=150, seed=2, session_rate_per_s=2.0))


def _cluster(**kw: object) -> ClusterConfig:
    base = dict(num_workers=3, capacity_tokens=40_000, page_size=16, event_delay_s=0.01, seed=7)
    base.update(kw)
    return ClusterConfig(**base)  # type: ignore[arg-type]


def test_deterministic_for_a_seed() -> None:
    reqs = _workload()
    a = run_policies(("random", "kv_aware", "oracle"), reqs, _cluster())
    b = run_policies(("random", "kv_aware", "oracle"), reqs, _cluster())
    for name in a:
        assert np.array_equal(a[name].worker_index, b[name].worker_index), name
        assert np.array_equal(a[name].ttft_s, b[name].ttft_s), name
        assert np.array_equal(a[name].hit_tokens, b[name].hit_tokens), name
    other = run_policy("random", reqs, _cluster(seed=8))
    assert not np.array_equal(other.worker_index, a["random"].worker_index)


def test_kv_aware_uses_events_and_lost_events_hurt() -> None:
    reqs = _workload()
    cache_blind = policy_metrics(run_policy("round_robin", reqs, _cluster()))
    kv = policy_metrics(run_policy("kv_aware", reqs, _cluster()))
    assert kv["hit_ratio"] > cache_blind["hit_ratio"] + 0.1
    lossy = run_policy("kv_aware", reqs, _cluster(event_loss_rate=0.5))
    assert lossy.events_lost_batches > 0
    assert policy_metrics(lossy)["hit_ratio"] < kv["hit_ratio"]


def test_disaggregated_run_moves_kv() -> None:
    reqs = _workload()[:80]
    cluster = _cluster(num_workers=2, num_decode_workers=2)
    for policy in ("oracle", "round_robin"):
        run = run_policy(policy, reqs, cluster)
        assert run.worker_names == ["w0", "w1", "d0", "d1"]
        assert (run.ttft_s > 0).all()
    # Every worker's event stream reaches the index in order: no gaps, no
    # unknown parents, although decode workers take KV out of routing order.
    sim = Simulator(cluster)
    backend = RouterBackend("kv_aware", cluster, sim)
    run = sim.run(reqs, backend)
    assert run.events_published > 0
    statuses = backend.ingest_statuses()
    assert set(statuses) == {"w0", "w1", "d0", "d1"}
    for name, status in statuses.items():
        assert (status.resyncs, status.events_rejected) == (0, 0), name


def test_results_json_schema_and_plots(tmp_path: Path) -> None:
    trace = tmp_path / "tiny.jsonl"
    trace.write_text("\n".join(
        json.dumps({"timestamp": int(r.arrival_s * 1000), "input_length": r.input_length,
                    "output_length": 4, "hash_ids": list(r.hash_ids)}) for r in TINY) + "\n")
    parser = argparse.ArgumentParser()
    cli_simulate.add_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args(["--trace", str(trace), "--trace-block-tokens", "32", "--workers", "2",
                              "--capacity-tokens", "4096", "--out", str(out), "--quiet",
                              "--sweep-event-delay-ms", "0,100", "--sweep-event-loss", "0.5"])
    assert cli_simulate.run(args) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["trace"] == "tiny.jsonl" and doc["workers"] == 2
    assert list(doc["policies"]) == list(POLICY_ORDER)
    for m in doc["policies"].values():
        for key in ("hit_ratio", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_mean_s",
                    "load_imbalance"):
            assert isinstance(m[key], float), key
    assert len(doc["sweeps"]["event_delay"]) == 2 and len(doc["sweeps"]["event_loss"]) == 1
    for name in ("policies.png", "load.png"):
        assert (out / name).stat().st_size > 1000


def test_oracle_breaks_ties_with_its_rng() -> None:
    sim = Simulator(TINY_CLUSTER)
    a = OracleBackend(TINY_CLUSTER, sim, rng=random.Random(1))
    tokens = TokenSynthesizer().tokens(TINY[0])
    picks = {a.route(TINY[0], tokens).worker for _ in range(20)}
    assert picks == {"w0", "w1"}  # both idle and cold: ties are spread, not always w0


def test_simulate_cli_accepts_the_synthetic_generator(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    cli_simulate.add_arguments(parser)
    args = parser.parse_args(["--trace", "synthetic", "--synthetic-requests", "60", "--workers", "2",
                              "--capacity-tokens", "100000", "--policies", "round_robin,kv_aware",
                              "--router-option", "prefill_weight=2", "--quiet"])
    assert cli_simulate.run(args) == 0
    table = capsys.readouterr().out
    assert "\nround_robin " in table and "\nkv_aware " in table and "\noracle " not in table


class _Recorder:
    """A backend that sends everything to w0 and writes down when it hears of each first token."""

    name = "recorder"
    needs_events = False

    def __init__(self) -> None:
        self.heard: dict[str, float] = {}

    def route(self, request: TraceRequest, tokens: np.ndarray) -> RouteChoice:
        return RouteChoice("w0")

    def deliver(self, worker: str, seq: int, events: list[Event], now: float) -> None:
        return None

    def prefill_done(self, request_id: str, now: float) -> None:
        self.heard[request_id] = now

    def finished(self, request_id: str, now: float) -> None:
        return None


def test_first_token_delay_is_what_the_router_hears_not_the_ttft() -> None:
    """``first_token_delay_s``: the router hears of a first token that much later (a gateway's
    streaming hop); the engine's TTFT is unchanged."""
    runs, heard = [], []
    for delay in (0.0, 0.25):
        backend = _Recorder()
        cluster = ClusterConfig(num_workers=1, capacity_tokens=4096, page_size=16, first_token_delay_s=delay,
                                cost=TINY_CLUSTER.cost)
        runs.append(Simulator(cluster).run(TINY, backend))
        heard.append(backend.heard)
    assert runs[0].ttft_s.tolist() == pytest.approx(runs[1].ttft_s.tolist())
    assert heard[1].keys() == heard[0].keys() == {r.request_id for r in TINY}
    assert all(heard[1][k] == pytest.approx(heard[0][k] + 0.25) for k in heard[0])
    with pytest.raises(ConfigError):
        ClusterConfig(first_token_delay_s=-1.0)
