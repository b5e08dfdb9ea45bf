"""How the benchmarks start the real peer routers (``loadgen.fleet.PeerRouter``), find them
(``peer_binary``), and run their emulations on parity's simulated side."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tokenspeed_router.loadgen.fleet import EngineHandle, PeerRouter, peer_binary
from tokenspeed_router.loadgen.parity import ParitySetup, prepare, simulate_side
from tokenspeed_router.sim.peers import PEER_POLICIES, PEER_VALIDATION, validation_label
from tokenspeed_router.sim.workload import WorkloadConfig, generate_workload

ENGINES = [EngineHandle(name=f"e{i}", url=f"http://127.0.0.1:{8000 + i}", events=f"tcp://127.0.0.1:{5000 + i}",
                        replay=f"tcp://127.0.0.1:{6000 + i}") for i in range(2)]


def _values(cmd: list[str], flag: str) -> list[str]:
    return [cmd[i + 1] for i, arg in enumerate(cmd) if arg == flag]


def test_vllm_router_subscribes_to_every_engine_with_its_defaults() -> None:
    cmd = PeerRouter(peer="vllm-router", binary="vr").command(9000, ENGINES)
    assert cmd[:1] == ["vr"] and _values(cmd, "--policy") == ["kv_aware"]
    assert _values(cmd, "--kv-event-source") == [f"{e.url}={e.events}" for e in ENGINES]
    assert _values(cmd, "--kv-event-replay-source") == [f"{e.url}={e.replay}" for e in ENGINES]
    # nothing that changes its routing beyond what the event sources need
    assert not {"--router-temperature", "--kv-aware-session-affinity-ttl-secs"} & set(cmd)
    assert PeerRouter(peer="vllm-router", binary="vr").prompt_format == "tokens"


def test_vllm_router_control_listens_to_dead_ports() -> None:
    cmd = PeerRouter(peer="vllm-router", binary="vr", index_off=True).command(9000, ENGINES)
    sources = _values(cmd, "--kv-event-source")
    assert len(sources) == len(ENGINES)
    assert not {s.split("=", 1)[1] for s in sources} & {e.events for e in ENGINES}
    assert _values(cmd, "--kv-event-replay-source") == []


def test_sglang_router_gets_text_and_its_control_never_uses_the_tree() -> None:
    peer = PeerRouter(peer="sglang-router", binary="smg")
    cmd = peer.command(9000, ENGINES)
    assert cmd[:2] == ["smg", "launch"] and _values(cmd, "--policy") == ["cache_aware"]
    assert "--cache-threshold" not in cmd and peer.prompt_format == "text"
    control = PeerRouter(peer="sglang-router", binary="smg", index_off=True).command(9000, ENGINES)
    assert _values(control, "--cache-threshold") == ["1"]


def test_unknown_peer_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown peer router"):
        PeerRouter(peer="nginx", binary="x").command(9000, ENGINES)


def test_peer_binary_prefers_the_peers_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv_bin = tmp_path / "venv" / "bin"
    on_path = tmp_path / "path"
    for where in (venv_bin, on_path):
        where.mkdir(parents=True)
        exe = where / "vllm-router"
        exe.write_text("#!/bin/sh\n")
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(on_path) + os.pathsep + os.environ.get("PATH", ""))
    assert peer_binary("vllm-router", tmp_path / "venv") == str(venv_bin / "vllm-router")
    assert peer_binary("vllm-router", tmp_path / "elsewhere") == str(on_path / "vllm-router")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert peer_binary("sglang-router", tmp_path / "venv") is None


def test_every_emulation_has_a_validation_status() -> None:
    assert set(PEER_VALIDATION) == set(PEER_POLICIES)
    assert all(validation_label(p) in ("validated", "unvalidated") for p in PEER_POLICIES)
    # the two that were never run live can back no claim
    assert validation_label("dynamo") == validation_label("llmd_precise") == "unvalidated"
    assert validation_label("kv_aware") == ""


@pytest.mark.parametrize("policy", ["vllm_kv_aware", "sglang_cache_aware"])
def test_parity_simulates_a_peer_emulation(policy: str) -> None:
    workload = generate_workload(WorkloadConfig(num_requests=40, seed=2, block_tokens=32, system_prompt_tokens=600,
                                                question_tokens=60, answer_tokens=40, agent_tool_tokens=200))
    setup = ParitySetup(num_workers=3, capacity_tokens=4000, policy=policy, warm_up_requests=3)
    side = simulate_side(prepare(workload, setup), setup)
    assert len(side.workers) == 40 and None not in side.workers
    assert 0.0 < side.hit_ratio() < 1.0
