"""Every workload shape end to end: ``trace`` writes it, ``simulate`` and ``loadgen`` run it.

Real ``tokenspeed-router`` subprocesses; ``loadgen`` replays a shape against a
real engine-sim (``--instant``, started by loadgen's own Fleet) on loopback.
Small traces, so each run takes seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO_ROOT

from tokenspeed_router.loadgen.fleet import EngineSimOptions, Fleet
from tokenspeed_router.sim.shapes import SHAPES
from tokenspeed_router.sim.traces import load_mooncake

REQUESTS = 40


def cli(*args: str, timeout: float = 110) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tokenspeed_router.cli", *args], cwd=REPO_ROOT,
                          env=dict(os.environ), capture_output=True, text=True, timeout=timeout)


def write_trace(shape: str, path: Path, requests: int = REQUESTS) -> None:
    proc = cli("trace", "--shape", shape, "--seed", "0", "--requests", str(requests), "--out", str(path))
    assert proc.returncode == 0, proc.stderr
    assert f"trace {shape} seed 0: {requests} requests" in proc.stderr


@pytest.mark.parametrize("shape", list(SHAPES))
def test_simulate_runs_every_shape(shape: str, tmp_path: Path) -> None:
    trace = tmp_path / f"{shape}.jsonl"
    write_trace(shape, trace)
    assert len(load_mooncake(trace)) == REQUESTS
    out = tmp_path / "sim"
    proc = cli("simulate", "--trace", str(trace), "--workers", "2", "--policies", "round_robin,kv_aware",
               "--quiet", "--no-plots", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    doc = json.loads((out / "results.json").read_text())
    assert doc["trace_stats"]["requests"] == REQUESTS
    runs = doc["policies"]
    assert {p: runs[p]["requests"] for p in runs} == {"round_robin": REQUESTS, "kv_aware": REQUESTS}
    if shape == "cold":
        assert runs["kv_aware"]["hit_ratio"] == 0.0 == runs["round_robin"]["hit_ratio"]
    else:  # reuse to find: routing on it finds at least what spreading finds
        assert runs["kv_aware"]["hit_ratio"] > 0.0
        assert runs["kv_aware"]["hit_ratio"] >= runs["round_robin"]["hit_ratio"]


def test_loadgen_replays_a_shape_against_an_engine(tmp_path: Path) -> None:
    trace = tmp_path / "agentic.jsonl"
    write_trace("agentic", trace, requests=12)
    fleet = Fleet(tmp_path / "fleet")
    try:
        (engine,) = fleet.start_engines(["sim-a"], [EngineSimOptions(model="tokenspeed-sim", extra=("--instant",))])
        out = tmp_path / "loadgen"
        # 512-token ids as 64 tokens (same sharing, an eighth of the bytes), 50x faster than the trace.
        proc = cli("loadgen", "--trace", str(trace), "--target", engine.url, "--time-scale", "50",
                   "--scale-prompts", "0.125", "--quiet", "--out", str(out))
    finally:
        fleet.close()
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "results.json").read_text())["summary"]
    assert summary["requests"] == 12 and summary["errors"] == 0
    assert summary["hit_ratio"] > 0.5  # the shared system prompt and the growing sessions are cached
