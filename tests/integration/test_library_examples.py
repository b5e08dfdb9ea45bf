"""The examples that test_server_examples.py and test_cache_worker_example.py do not run, run here.

docs/development.md promises every script in examples/ runs as a test: a
user copies from them, so an API change must break a test, not the example.
"""

from __future__ import annotations

import subprocess
import sys

from support import REPO_ROOT


def _run(script: str, *args: str) -> str:
    out = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / script), *args], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def test_event_roundtrip_example() -> None:
    stdout = _run("event_roundtrip.py")
    assert "received  seq=4" in stdout and "subscriber statistics" in stdout, stdout


def test_sim_compare_policies_example() -> None:
    stdout = _run("sim_compare_policies.py")
    assert all(f"{policy} " in stdout for policy in ("round_robin", "kv_aware", "oracle")), stdout


def test_redis_replicas_example(redis_url: str) -> None:
    stdout = _run("redis_replicas.py", redis_url)
    assert "ingestion: ['direct', 'direct']" in stdout, stdout
    assert "both replicas: [{'w0': 2}, {'w0': 2}]" in stdout, stdout
    assert "r1 sees r0's request (in_flight_peers 1)" in stdout, stdout
    assert "after SIGKILL of r0: r1 answers {'w0': 4}, r0's request expired" in stdout, stdout
