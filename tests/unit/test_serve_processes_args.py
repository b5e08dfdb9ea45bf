"""``serve --processes N``: the children's command lines and state URLs (no processes started)."""

from __future__ import annotations

import sys

import pytest

from tokenspeed_router.cli import main
from tokenspeed_router.endpoints import HostPort
from tokenspeed_router.server.processes import child_argv, replica_state_url
from tokenspeed_router.state.config import RedisStateConfig, join_url


def test_child_argv_drops_processes_and_pins_port_and_state() -> None:
    argv = ["--log-level", "INFO", "serve", "--processes", "4", "--worker", "name=w0,events=tcp://h:1",
            "--processes=3", "--http", "0.0.0.0:0"]
    out = child_argv(argv, HostPort("0.0.0.0", 9000), "unix:///tmp/r.sock")
    assert out[:3] == [sys.executable, "-m", "tokenspeed_router.cli"]
    assert "--processes" not in out and not any(a.startswith("--processes=") for a in out)
    assert out[3:] == ["--log-level", "INFO", "serve", "--worker", "name=w0,events=tcp://h:1",
                       "--http", "0.0.0.0:0", "--reuse-port", "--http", "0.0.0.0:9000",
                       "--state", "unix:///tmp/r.sock"]


def test_explicit_replica_ids_differ_per_child() -> None:
    assert replica_state_url("redis://h:1/0?replica_id=gw&cluster=c", 1) == "redis://h:1/0?replica_id=gw.p1&cluster=c"
    assert replica_state_url("unix:///tmp/r.sock?replica_id=gw", 0) == "unix:///tmp/r.sock?replica_id=gw.p0"
    assert replica_state_url("redis://h:1/0", 2) == "redis://h:1/0"  # default ids are unique already


def test_unix_socket_urls_survive_option_parsing() -> None:
    assert join_url("unix", "", "/tmp/r.sock", "db=0") == "unix:///tmp/r.sock?db=0"
    config = RedisStateConfig.from_url("unix:///tmp/r.sock?cluster=c&ingest=stream&db=0")
    assert config.url == "unix:///tmp/r.sock?db=0" and config.ingest == "stream"


@pytest.mark.parametrize(("extra", "message"), [
    (["--zmq-api", "tcp://127.0.0.1:0"], "--zmq-api"),
    (["--record", "x.tslog"], "--record"),
    (["--http", "none"], "--http"),
    (["--processes", "0"], "at least 1"),
])
def test_processes_refuses_what_n_processes_cannot_share(extra: list[str], message: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve", "--processes", "2", *extra]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
