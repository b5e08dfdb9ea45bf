"""The routing matrix's protocol (benchmarks/routing_matrix.py, issue 31): the witness, the two verdicts, the
tallies over cells where queues formed, the cache key, the load, ``--summary-only``."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tokenspeed_router.router.router import RouterConfig
from tokenspeed_router.sim.shapes import generate_trace, make_shape

ROOT = Path(__file__).resolve().parents[2]


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


rm = _module("routing_matrix")


def _row(p50: float, p99: float, hit: float) -> dict[str, Any]:
    return {"ttft_p50_s": p50, "ttft_p99_s": p99, "hit_ratio": hit}


def _cell(*, witness_p99: float, vllm_p99: float = 2.0, ours_p50: float = 1.0) -> dict[str, dict[str, Any]]:
    """One cell: kv_aware beats approx and sglang; vllm_kv_aware's tail is ``vllm_p99``; round robin's p50 is 1 s."""
    return {
        "kv_aware": _row(ours_p50, 2.0, 0.80),
        "approx": _row(1.0, 2.5, 0.80),
        "sglang_cache_aware": _row(1.2, 3.0, 0.79),
        "vllm_kv_aware": _row(1.0, vllm_p99, 0.80),
        "least_loaded": _row(0.8, 4.0, 0.50),
        "round_robin": _row(1.0, witness_p99, 0.50),
    }


def _data(cells: dict[tuple[str, int, float, str], dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """A results file as main() writes it, from hand-made rows."""
    verdicts = [{"shape": k[0], "seed": k[1], "speed": k[2], "scenario": k[3], **rm.cell_verdict(rows)}
                for k, rows in sorted(cells.items())]
    return {
        "set": "test", "ideal_load": rm.IDEAL_LOAD, "witness": rm.WITNESS, "queue_ratio": rm.QUEUE_RATIO,
        "validated_peers": list(rm.VALIDATED_PEERS), "vllm": rm.VLLM,
        "cells": [{"shape": k[0], "seed": k[1], "speed": k[2], "scenario": k[3], "policy": p, **r}
                  for k, rows in cells.items() for p, r in rows.items()],
        "verdicts": verdicts, "summary": rm.tallies(verdicts),
    }


def test_the_default_policies_hold_the_witness_and_the_vllm_emulation() -> None:
    assert rm.WITNESS == "round_robin" and rm.WITNESS in rm.POLICIES
    assert rm.VLLM in rm.POLICIES and rm.VLLM not in rm.VALIDATED_PEERS
    assert rm.IDEAL_LOAD == 0.35


def test_the_verdict_rule() -> None:
    v = rm.verdict(_cell(witness_p99=10.0))
    assert v["p99_ok"] and v["p50_ok"] and v["hit_ok"]
    assert v["p99_vs_best"] == pytest.approx(2.0 / 2.5) and v["best_p99_by"] == "approx"
    # p50 within 1.05x of the best passes, beyond it fails; hit within 1 point passes
    assert rm.verdict(_cell(witness_p99=10.0, ours_p50=1.05))["p50_ok"]
    assert not rm.verdict(_cell(witness_p99=10.0, ours_p50=1.06))["p50_ok"]
    rows = _cell(witness_p99=10.0)
    rows["approx"] = _row(1.0, 2.5, 0.81)
    assert rm.verdict(rows)["hit_ok"]
    rows["approx"] = _row(1.0, 2.5, 0.8101)
    assert not rm.verdict(rows)["hit_ok"]
    assert rm.verdict({"approx": _row(1.0, 1.0, 1.0)}) == {}


def test_with_vllm_adds_the_vllm_emulation_to_the_rivals() -> None:
    v = rm.cell_verdict(_cell(witness_p99=10.0, vllm_p99=1.5))
    assert v["p99_ok"], "against approx and the validated peer alone, ours has the best tail"
    assert not v["with_vllm"]["p99_ok"] and v["with_vllm"]["best_p99_by"] == "vllm_kv_aware"
    assert v["with_vllm"]["p99_vs_best"] == pytest.approx(2.0 / 1.5)
    # p50 against every policy run: least_loaded's 0.8 is the best
    assert v["best_p50_policy"] == "least_loaded" and v["p50_vs_best_policy"] == pytest.approx(1.0 / 0.8)


def test_queues_formed_is_the_witness_p99_at_least_5x_its_p50() -> None:
    assert rm.cell_verdict(_cell(witness_p99=5.0))["queues_formed"] is True
    light = rm.cell_verdict(_cell(witness_p99=4.99))
    assert light["queues_formed"] is False and light["witness_p99_over_p50"] == pytest.approx(4.99)
    rows = _cell(witness_p99=10.0)
    del rows["round_robin"]
    assert rm.cell_verdict(rows)["queues_formed"] is None


def test_tallies_count_only_cells_where_queues_formed() -> None:
    data = _data({
        ("chat", 1, 1.0, "pressure"): _cell(witness_p99=8.0, vllm_p99=1.5),   # counts; vllm wins the tail
        ("chat", 1, 4.0, "pressure"): _cell(witness_p99=2.0, vllm_p99=1.5),   # light
        ("docqa", 1, 1.0, "pressure"): _cell(witness_p99=6.0, ours_p50=1.2),  # counts; p50 1.5x least_loaded's
        ("docqa", 1, 1.0, "restarts"): _cell(witness_p99=6.0),                # counts; p50 1.25x least_loaded's
    })
    t = data["summary"]
    assert t["cells"] == 4 and t["queues_formed"] == 3
    assert [(c["shape"], c["speed"]) for c in t["light"]] == [("chat", 4.0)]
    assert t["validated"] == {"cells": 3, "p50_ok": 2, "p99_ok": 3, "hit_ok": 3, "all_ok": 2}
    assert t["with_vllm"] == {"cells": 3, "p50_ok": 2, "p99_ok": 2, "hit_ok": 3, "all_ok": 1}
    assert t["docqa_p50_within"] == {"ratio": 1.25, "cells": 2, "ok": 1}
    assert rm.summary_of(data) == t, "the summary is recomputed the same way from the cells alone"


def test_summary_only_prints_the_tallies_of_a_results_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _data({("chat", 1, 1.0, "pressure"): _cell(witness_p99=8.0, vllm_p99=1.5),
                  ("cold", 1, 1.0, "pressure"): _cell(witness_p99=1.5)})
    path = tmp_path / "rm.json"
    path.write_text(json.dumps(data))
    assert rm.main(["--summary-only", str(path)]) == 0
    out = capsys.readouterr().out
    assert "queues formed (round_robin TTFT p99 >= 5x its p50) in 1, light (not counted) 1" in out
    assert "| approx + sglang_cache_aware | 1 | 1 | 1 | 1 | 1 | 0.80 |" in out
    assert "| approx + sglang_cache_aware + vllm_kv_aware | 1 | 1 | 0 | 1 | 0 | 1.33 |" in out
    assert "cold/1 x1 pressure: 1.50" in out


def test_summary_only_reads_a_file_from_before_the_witness(capsys: pytest.CaptureFixture[str],
                                                           tmp_path: Path) -> None:
    """A results file of the protocol before issue 31 (no round robin, no vllm): every cell counts."""
    old = json.loads((ROOT / "docs" / "results" / "routing-matrix-test.json").read_text())
    old["cells"] = [c for c in old["cells"] if c["policy"] not in ("round_robin", "vllm_kv_aware")]
    witness_fields = ("queues_formed", "witness_p99_over_p50", "with_vllm")
    old["verdicts"] = [{k: v for k, v in row.items() if k not in witness_fields} for row in old["verdicts"]]
    for key in ("witness", "vllm", "summary"):
        old.pop(key, None)
    path = tmp_path / "routing-matrix-test.json"
    path.write_text(json.dumps(old))
    assert rm.main(["--summary-only", str(path)]) == 0
    out = capsys.readouterr().out
    assert "queues: not measured" in out
    met = [v for v in old["verdicts"] if "p99_ok" in v]
    p50, p99, hit = (sum(v[k] for v in met) for k in ("p50_ok", "p99_ok", "hit_ok"))
    assert f"| approx + sglang_cache_aware | {len(met)} | {p50} | {p99} | {hit} |" in out
    assert "+ vllm_kv_aware | not run |" in out


def test_the_cache_key_holds_the_router_defaults() -> None:
    shipped = rm.router_defaults_hash()
    changed = rm.router_defaults_hash(RouterConfig(prefill_weight=RouterConfig().prefill_weight + 1.0))
    assert shipped == rm.router_defaults_hash() and shipped != changed
    for policy in ("kv_aware", "approx", "least_loaded", "round_robin"):
        cell = rm.Cell("chat", 1, 1.0, "pressure", policy)
        assert cell.key({}, shipped) != cell.key({}, changed), policy
    peer = rm.Cell("chat", 1, 1.0, "pressure", "sglang_cache_aware")
    assert peer.key({}, shipped) == peer.key({}, changed), "a peer emulation does not read RouterConfig"
    ours = rm.Cell("chat", 1, 1.0, "pressure", "kv_aware")
    assert ours.key({"prefill_weight": 3.0}, shipped) != ours.key({}, shipped)


def test_scaling_puts_a_trace_at_the_ideal_load() -> None:
    reqs = generate_trace(make_shape("rag"), seed=1, requests=300).requests
    for speed in (0.25, 4.0):
        out, k = rm.scaled(reqs, speed)
        assert rm.ideal_load(out, speed) == pytest.approx(rm.IDEAL_LOAD)
        assert k == pytest.approx(rm.ideal_load(reqs, speed) / rm.IDEAL_LOAD)


def test_a_session_shape_reaches_the_load_by_its_session_rate_not_by_compressing_think_times() -> None:
    """agentic's calls come when the previous answer is done; compressing its arrivals to the load broke that."""
    requests = 300
    rate = rm.session_rate("agentic", 0, requests)
    assert rate is not None and rm.session_rate("rag", 0, requests) is None
    trace = generate_trace(make_shape("agentic", rate_per_s=rate), seed=0, requests=requests)
    load = rm.ideal_load(trace.requests, 1.0)
    assert rm.IDEAL_LOAD <= load <= rm.IDEAL_LOAD * (1 + rm.RATE_FIT_SLACK)
    out, k = rm.scaled(trace.requests, 1.0)
    assert k >= 1.0, "the fitted trace is only ever stretched"

    assert _early_follow_ups(out, trace.sessions) == 0
    # The old way, for the record: the default-rate trace compressed to the same load.
    default = generate_trace(make_shape("agentic"), seed=0, requests=requests)
    compressed, k_old = rm.scaled(default.requests, 1.0)
    assert k_old < 1.0 and _early_follow_ups(compressed, default.sessions) > len(compressed) // 2


def _early_follow_ups(reqs: list[Any], sessions: list[int]) -> int:
    """Calls that arrive before the previous call of their session could have decoded its answer (engines at 1x)."""
    last: dict[int, Any] = {}
    early = 0
    for r, session in zip(reqs, sessions, strict=True):
        prev = last.get(session)
        if prev is not None and r.arrival_s - prev.arrival_s < prev.output_length * 0.020:
            early += 1
        last[session] = r
    return early
