"""Relay command line and the router's CURVE worker-spec keys: clear errors, no tracebacks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenspeed_router.cli import main
from tokenspeed_router.errors import ConfigError
from tokenspeed_router.events.curve import CurveClientKeys, generate_key_files, load_key_pair
from tokenspeed_router.server.config import WorkerSpec


def test_worker_spec_curve_keys(tmp_path: Path) -> None:
    relay_pub, _ = generate_key_files(tmp_path, "relay")
    router_pub, router_secret = generate_key_files(tmp_path, "router")
    spec = WorkerSpec.parse(
        f"name=w0,events=tcp://127.0.0.1:6557,replay=tcp://127.0.0.1:6558,dp_ranks=2,"
        f"curve_server_key={relay_pub},curve_key={router_secret}"
    )
    subs = spec.subscribers()
    public, secret = load_key_pair(router_secret)
    assert all(s.curve == CurveClientKeys(relay_pub.read_bytes().split(b'"')[1], public, secret) for s in subs)
    assert spec.to_dict()["curve_key"] == str(router_secret)
    with pytest.raises(ConfigError, match="both curve_server_key"):
        WorkerSpec.parse(f"name=w0,events=tcp://127.0.0.1:6557,curve_server_key={relay_pub}")
    with pytest.raises(ConfigError, match="holds no secret key"):
        WorkerSpec.parse(f"name=w0,events=tcp://127.0.0.1:6557,curve_server_key={relay_pub},curve_key={router_pub}")
    with pytest.raises(ConfigError, match="cannot read CURVE public key"):
        WorkerSpec.parse(f"name=w0,events=tcp://127.0.0.1:6557,curve_server_key={tmp_path / 'nope'},"
                         f"curve_key={router_secret}")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["relay", "--publish", "tcp://127.0.0.1:0", "--replay", "tcp://127.0.0.1:0"], "--engine is required"),
        (["relay", "--engine", "tcp://*:5557", "--publish", "tcp://127.0.0.1:0", "--replay", "tcp://127.0.0.1:0"],
         "only works for binding"),
        (["relay", "--engine", "tcp://127.0.0.1:5557", "--publish", "tcp://127.0.0.1:0", "--replay",
          "tcp://127.0.0.1:0", "--curve-allow", "x.key"], "needs --curve-secret-key"),
        (["relay", "--engine", "tcp://127.0.0.1:5557", "--publish", "tcp://127.0.0.1:0", "--replay",
          "tcp://127.0.0.1:0", "--buffer-steps", "0"], "buffer_steps must be >= 1"),
        (["relay", "--engine", "tcp://127.0.0.1:5557", "--publish", "tcp://127.0.0.1:0", "--replay",
          "tcp://127.0.0.1:0", "--curve-secret-key", "missing.key_secret", "--curve-allow", "x.key"],
         "cannot read CURVE key pair"),
    ],
)
def test_relay_cli_errors_are_clear(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_gen_keys_writes_a_usable_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["relay", "--gen-keys", str(tmp_path), "--key-name", "edge"]) == 0
    assert "edge.key_secret" in capsys.readouterr().out
    public, secret = load_key_pair(tmp_path / "edge.key_secret")
    assert len(public) == len(secret) == 40
