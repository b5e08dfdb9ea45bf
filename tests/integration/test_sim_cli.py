"""``simulate`` and ``demo`` as a new user meets them: results first, clear errors, Ctrl-C.

Real subprocesses of the CLI on the shipped trace slice (small windows so each
run takes seconds). matplotlib is made unimportable where the test is about
its absence (``support.without_packages_env``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from support import REPO_ROOT, wait_until, without_packages_env

TRACE = REPO_ROOT / "tokenspeed_router" / "sim" / "data" / "mooncake_synthetic_slice.jsonl"


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenspeed_router.cli", *args],
        cwd=REPO_ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture(scope="module")
def no_plot_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return without_packages_env(tmp_path_factory.mktemp("no_matplotlib"), "matplotlib")


def test_simulate_without_matplotlib_writes_results_into_an_existing_out(
    tmp_path: Path, no_plot_env: dict[str, str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text("{}")  # a previous run's folder
    proc = cli("simulate", "--trace", str(TRACE), "--workers", "2", "--max-requests", "20",
               "--policies", "round_robin,kv_aware", "--out", str(out), "--quiet", env=no_plot_env)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "plots skipped" in proc.stderr and "tokenspeed-router[plot]" in proc.stderr
    doc = json.loads((out / "results.json").read_text())
    assert set(doc["policies"]) == {"round_robin", "kv_aware"}
    assert not list(out.glob("*.png"))


def test_simulate_out_that_is_a_file_fails_before_running(tmp_path: Path) -> None:
    out = tmp_path / "taken"
    out.write_text("not a folder")
    proc = cli("simulate", "--trace", str(TRACE), "--workers", "2", "--out", str(out))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"tokenspeed-router simulate: error: --out {out} exists and is not a directory"


@pytest.mark.parametrize("content", [b"\x89PNG\r\n\x1a\n\x00\x00", b"hello world\n"])
def test_simulate_on_a_non_trace_file_is_a_clear_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "not_a_trace.jsonl"
    path.write_bytes(content)
    proc = cli("simulate", "--trace", str(path), "--workers", "2")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokenspeed-router simulate: error: "), proc.stderr
    assert "not a Mooncake trace" in lines[0]


def test_unknown_log_level_is_a_usage_error() -> None:
    proc = cli("--log-level", "foo", "inspect", str(TRACE))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "argument --log-level: unknown level 'foo'" in proc.stderr


def test_demo_writes_to_a_fresh_temp_dir_and_skips_plots(tmp_path: Path, no_plot_env: dict[str, str]) -> None:
    env = {**no_plot_env, "TMPDIR": str(tmp_path)}
    proc = cli("demo", "--sim", "--fast-only", "--requests", "25", "--workers", "2", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "plots skipped" in proc.stderr
    folders = list(tmp_path.glob("tokenspeed-router-demo-*"))
    assert len(folders) == 1, folders
    assert f"results: {folders[0] / 'results.json'}" in proc.stdout
    assert "oracle" in json.loads((folders[0] / "results.json").read_text())["policies"]


def test_ctrl_c_during_simulate_keeps_the_finished_policies(tmp_path: Path) -> None:
    out = tmp_path / "out"
    policies = ["round_robin", "least_loaded", "random", "kv_aware", "approx"]
    stderr: list[str] = []
    with subprocess.Popen(
        [sys.executable, "-m", "tokenspeed_router.cli", "simulate", "--trace", str(TRACE), "--workers", "2",
         "--max-requests", "120", "--policies", ",".join(policies), "--out", str(out), "--no-plots"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # A child inherits an ignored SIGINT across exec, and Python then installs no
        # KeyboardInterrupt handler: when an earlier test in the same pytest-xdist worker
        # left SIGINT ignored, the interrupt was lost and the run finished with 0.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    ) as proc:

        def pump() -> None:
            # Whole chunks as they come (os.read): a reader of one character at a time fell seconds
            # behind the child on a loaded machine, saw the second policy start after the last one
            # had finished, and interrupted a process that had already exited 0.
            assert proc.stderr is not None
            fd = proc.stderr.fileno()
            while chunk := os.read(fd, 65536):
                stderr.append(chunk.decode(errors="replace"))

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            # The progress bar names each policy as it starts: interrupt during the second.
            wait_until(lambda: "least_loaded" in "".join(stderr), 240, interval_s=0.01,
                       what="the second policy to start")
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)  # stdout is a small table: the pipe cannot fill
            assert proc.stdout is not None
            stdout = proc.stdout.read()
            reader.join(10)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = "".join(stderr)
    assert proc.returncode == 130, text
    assert "interrupted: reporting the" in text and "Traceback" not in text
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["interrupted"] is True
    finished = list(doc["policies"])
    assert finished[:1] == ["round_robin"] and len(finished) < len(policies)
    assert "round_robin" in stdout


def test_log_level_is_also_accepted_after_the_command() -> None:
    proc = cli("inspect", "--log-level", "warning", str(TRACE))
    assert "unrecognized arguments" not in proc.stderr
    assert "Traceback" not in proc.stderr
    bad = cli("inspect", "--log-level", "foo", str(TRACE))
    assert bad.returncode == 2
    assert "argument --log-level: unknown level 'foo'" in bad.stderr
