"""``tokenspeed-router demo``: engine-sims + serve gateways + loadgen, as one command.

A reduced run (2 engines, 40 requests, two policies) of the real thing: real
engine-sim and serve subprocesses on loopback, real HTTP streams.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_demo_prints_one_row_per_policy_and_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "tokenspeed_router.cli", "demo", "--engines", "2", "--requests", "40",
         "--policies", "kv_aware,round_robin", "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = [line.split()[0] for line in proc.stdout.splitlines() if line.split()[:1] in (["kv_aware"],
                                                                                         ["round_robin"])]
    assert rows == ["kv_aware", "round_robin"], proc.stdout
    doc = json.loads((out / "results.json").read_text())
    assert doc["setup"]["restart"] == {"engine": "engine1", "after_requests": 5}
    for policy in ("kv_aware", "round_robin"):
        m = doc["policies"][policy]
        assert (m["requests"], m["ok"], m["errors"]) == (40, 40, 0), m
        assert m["usage_reported"] == 40 and 0.0 <= m["hit_ratio"] < 1.0
        assert set(m["requests_per_worker"]) == {"engine0", "engine1"}
        assert m["ttft_p50_s"] is not None and m["ttft_p50_s"] <= m["e2e_p99_s"]
    # Round robin alternates strictly: the gateway's x-tokenspeed-worker header says so.
    assert doc["policies"]["round_robin"]["requests_per_worker"] == {"engine0": 20, "engine1": 20}
    assert (out / "demo.png").is_file()


def test_demo_sim_flag_runs_the_simulation_demo(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tokenspeed_router.cli", "demo", "--sim", "--fast-only", "--requests", "30",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "oracle" in proc.stdout
    assert json.loads((tmp_path / "results.json").read_text())["config"]["mode"] == "demo"
