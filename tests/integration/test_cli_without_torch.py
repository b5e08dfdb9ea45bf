"""The router-only install (no torch) runs every router-side command (DESIGN §2).

Each command runs as a real ``tokenspeed-router`` subprocess whose interpreter
cannot import torch (``support.without_packages_env``: an import hook that
refuses ``torch`` exactly as a missing package would). The
commands that need torch must say so in one line (exit 2), not with a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO_ROOT, without_packages_env
from support.server import ServeProcess

from tokenspeed_router.endpoints import free_tcp_port


@pytest.fixture(scope="module")
def no_torch_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return without_packages_env(tmp_path_factory.mktemp("no_torch"), "torch")


def cli(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenspeed_router.cli", *args],
        cwd=REPO_ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout,
    )


def test_the_blocker_blocks_torch(no_torch_env: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "import torch"],
        env={**os.environ, **no_torch_env}, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode != 0
    assert "No module named 'torch'" in proc.stderr


TRACE = str(REPO_ROOT / "tokenspeed_router" / "sim" / "data" / "mooncake_synthetic_slice.jsonl")
TORCH_COMMANDS = {
    "demo": ["demo"],
    "simulate": ["simulate", "--trace", TRACE, "--workers", "2"],
    "engine-sim": ["engine-sim", "--port", "0", "--events", "tcp://127.0.0.1:0"],
}


@pytest.mark.parametrize("command", sorted(TORCH_COMMANDS))
def test_torch_commands_say_what_to_install(no_torch_env: dict[str, str], command: str) -> None:
    args = TORCH_COMMANDS[command]
    proc = cli(no_torch_env, *args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"tokenspeed-router {command}: error: needs torch: ")
    assert "pip install 'tokenspeed-router[torch]'" in lines[0]


def test_inspect_and_replay_without_torch(no_torch_env: dict[str, str], captures: Path,
                                          tmp_path: Path) -> None:
    folder = str(captures / "sglang-0.5.23")
    inspect = cli(no_torch_env, "inspect", folder, "--json")
    assert inspect.returncode == 0, inspect.stderr
    assert json.loads(inspect.stdout)["records"] > 0

    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps({"token_ids": list(range(32))}) + "\n")
    replay = cli(no_torch_env, "replay", folder, "--queries", str(queries), "--no-progress")
    assert replay.returncode == 0, replay.stderr
    assert "scores" in json.loads(replay.stdout.splitlines()[0])


def test_record_without_torch(no_torch_env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "events.tslog"
    port = free_tcp_port()
    proc = cli(no_torch_env, "record", "--worker", f"name=w0,events=tcp://127.0.0.1:{port}",
               "--out", str(out), "--duration", "0.3", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert out.is_file()


def test_bench_without_torch(no_torch_env: dict[str, str]) -> None:
    proc = cli(no_torch_env, "bench", "--quick", "--workers", "2", "--blocks", "2000",
               "--queries", "5", "--repeat", "1")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_without_torch(no_torch_env: dict[str, str], tmp_path: Path) -> None:
    port = free_tcp_port()
    with ServeProcess(["--worker", f"name=w0,events=tcp://127.0.0.1:{port}"], tmp_path,
                      env=no_torch_env) as serve:
        serve.start()
        assert "w0" in serve.workers()
        answer = serve.post("/route", {"token_ids": list(range(64))})
        assert answer["worker"] == "w0"


def test_serve_without_the_epp_extra(tmp_path: Path) -> None:
    """Without grpc and Envoy's protos the router installs and serves as before; ``--epp`` says
    what to install, in one line (exit 2)."""
    env = without_packages_env(tmp_path / "no_grpc", "torch", "grpc", "grpc_health", "envoy")
    port = free_tcp_port()
    with ServeProcess(["--worker", f"name=w0,events=tcp://127.0.0.1:{port}"], tmp_path, env=env) as serve:
        serve.start()
        assert serve.post("/route", {"token_ids": list(range(64))})["worker"] == "w0"
    proc = cli(env, "serve", "--http", "127.0.0.1:0", "--epp", "127.0.0.1:0",
               "--worker", f"name=w0,url=http://127.0.0.1:9,events=tcp://127.0.0.1:{port}")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("tokenspeed-router serve: error: --epp needs the epp extra: "), proc.stderr
    assert "pip install 'tokenspeed-router[epp]'" in lines[-1]


def test_doctor_without_torch(no_torch_env: dict[str, str]) -> None:
    """The doctor is a router-side command: it runs, and an unreachable engine is a failed check."""
    events, http = free_tcp_port(), free_tcp_port()
    proc = cli(no_torch_env, "doctor", "--worker", f"name=w0,url=http://127.0.0.1:{http},"
               f"events=tcp://127.0.0.1:{events}", "--timeout", "1", "--json")
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    [engine] = report["engines"]
    assert not engine["ok"] and all(c["cause"] for c in engine["checks"])
    events_check = next(c for c in engine["checks"] if c["name"] == "events")
    assert "accepts a connection" in events_check["cause"], events_check
    assert "Traceback" not in proc.stderr


def test_trace_without_torch(no_torch_env: dict[str, str], tmp_path: Path) -> None:
    """Writing a workload shape is lab-side but needs no cache: it runs on the router-only install."""
    out = tmp_path / "agentic.jsonl"
    proc = cli(no_torch_env, "trace", "--shape", "agentic", "--requests", "20", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert len(out.read_text().splitlines()) == 20
    listing = cli(no_torch_env, "trace", "--list")
    assert listing.returncode == 0 and "agentic:" in listing.stdout
