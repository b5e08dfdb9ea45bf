"""The bounded fuzz run CI makes: every native decoder target, a few seconds each, under ASan + UBSan.

``fuzz/run.py smoke`` builds the targets from the same csrc/*.c as the
extension (libFuzzer when clang has it, else fuzz/driver.c with gcc: see
docs/development.md, "Fuzzing the native decoders"), replays the seeds (the
engine captures), the kept corpus and every past finding (fuzz/regressions/),
then mutates for FUZZ_SMOKE_SECONDS each. Any sanitizer report, failed check
or leaked allocation fails it. Never skipped: a C compiler is what the
extension itself needs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fuzz_smoke_run_finds_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "FUZZ_OUT": str(tmp_path / "fuzz"), "FUZZ_SMOKE_SECONDS": "5"}
    proc = subprocess.run([sys.executable, str(ROOT / "fuzz" / "run.py"), "smoke"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=110)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    for target in ("ingest", "msgpack", "convert"):
        assert f"{target}: exit 0" in proc.stdout, out[-4000:]
