"""Smoke test of the fault matrix (benchmarks/faults.py): two faults, quick volumes.

Runs the benchmark as a real process (real engines' caches and publishers, a
real ``serve``, a frame-dropping proxy between them) and checks its verdicts,
not its timings: the faults were injected, the router detected them, and the
index equals the engines' own caches afterwards with nothing lost.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO_ROOT

pytestmark = pytest.mark.slow


def test_quick_fault_matrix_recovers_from_loss_duplicates_and_engine_restart(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/faults.py", "--quick", "--only", "loss_10pct,dup,engine_restart",
         "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["fault"]: r for r in json.loads(out.read_text())["rows"]}
    loss = rows["frame loss 10%"]
    restart = rows["engine (publisher) restart"]
    dup = rows["duplicated frames (10%)"]
    for row in (loss, restart, dup):
        assert row["recovered"] and row["truth"], row
        assert row["crashes"] == 0 and row["lost"] == 0, row
    assert loss["extra"]["dropped"] > 0, "the proxy must actually drop frames"
    assert loss["extra"]["gaps"] > 0 and loss["extra"]["replayed_batches"] >= loss["extra"]["dropped"]
    assert dup["extra"]["duplicated"] > 0 and dup["extra"]["duplicates"] >= dup["extra"]["duplicated"]
    assert restart["extra"]["restarts"] == 4  # 2 engines x 2 restarts, each seen by the router
    assert "| frame loss 10% |" in proc.stdout  # the printed table
