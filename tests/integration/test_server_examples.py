"""The server examples run end to end on loopback (they start their own publishers and router)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support import REPO_ROOT


@pytest.mark.parametrize(
    ("script", "expect"),
    [
        ("http_client.py", "route chat_a   -> gpu0"),
        ("zmq_client.py", "requests sent to the worker caching their document: 1000/1000"),
        ("record_and_replay.py", "replay answers == live answers"),
        ("prefill_decode.py", "long prompt : prefill on prefill1, decode on decode/dp1"),
    ],
)
def test_example_runs(script: str, expect: str) -> None:
    out = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / script)], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=90, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert expect in out.stdout, out.stdout
