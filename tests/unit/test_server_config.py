"""Router process configuration: worker specs, sources and precedence, validation errors."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.server.config import (
    ApiLimits,
    HostPort,
    ServerConfig,
    WorkerSpec,
    load_server_config,
    parse_host_port,
)


def test_worker_spec_parses_flag_form() -> None:
    spec = WorkerSpec.parse(
        "name=w0,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558,role=prefill,topic=kv"
    )
    assert spec == WorkerSpec(
        name="w0", events="tcp://127.0.0.1:5557", replay="tcp://127.0.0.1:5558", role="prefill", topic="kv"
    )
    (sub,) = spec.subscribers()
    assert sub.name == "w0" and sub.dp_rank == 0 and sub.events == spec.events


def test_dp_ranks_offset_ports_like_vllm() -> None:
    spec = WorkerSpec.parse("name=w1,events=tcp://127.0.0.1:5567,replay=tcp://[::1]:6000,dp_ranks=3,role=decode")
    subs = spec.subscribers()
    assert [s.name for s in subs] == ["w1/dp0", "w1/dp1", "w1/dp2"]
    assert [s.events for s in subs] == [f"tcp://127.0.0.1:{5567 + r}" for r in range(3)]
    assert [s.replay for s in subs] == [f"tcp://[::1]:{6000 + r}" for r in range(3)]
    assert all(s.role == "decode" and s.worker == "w1" for s in subs)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name=w0", "missing required key 'events'"),
        ("events=tcp://127.0.0.1:1", "missing required key 'name'"),
        ("name=w0,events=tcp://127.0.0.1:1,colour=red", "unknown key(s) 'colour'"),
        ("name=w0,events=http://x:1", "not a ZeroMQ endpoint"),
        ("name=w0,events=tcp://127.0.0.1:99999", "out of range"),
        ("name=w0,events=tcp://127.0.0.1:1,role=router", "role must be one of"),
        ("name=w0,events=tcp://127.0.0.1:1,dp_ranks=0", "dp_ranks must be in"),
        ("name=w0,events=tcp://127.0.0.1:1,dp_ranks=two", "dp_ranks must be an integer"),
        ("name=w/0,events=tcp://127.0.0.1:1", "is invalid"),
        ("name=w0,events=tcp://127.0.0.1:65535,dp_ranks=2", "exceeds port 65535"),
        ("name=w0,events=ipc:///tmp/x,dp_ranks=2", "need tcp://HOST:PORT"),
        ("name=w0,name=w1,events=tcp://127.0.0.1:1", "given twice"),
        ("name=w0,events", "not key=value (write name=NAME,events=ENDPOINT[,KEY=VALUE...]"),
        # the router connects to worker endpoints: bind-only forms are refused, naming the endpoint
        ("name=w0,events=tcp://*:5999", "'tcp://*:5999' has host '*', which only works for binding"),
        ("name=w0,events=tcp://127.0.0.1:1,replay=tcp://*:2", "replay: 'tcp://*:2' has host '*'"),
        ("name=w0,events=tcp://127.0.0.1:*", "needs an explicit port"),
        ("name=w0,events=tcp://127.0.0.1:0", "has port 0"),
        ("name=w0,events=tcp://a b:5", "not a ZeroMQ endpoint"),
        ("name=w0,events=tcp://127.0.0.1:1,dp_ranks=2,dp_ranks=3", "key 'dp_ranks' given twice"),
    ],
)
def test_bad_worker_specs_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        WorkerSpec.parse(text)


def test_duplicate_names_and_shared_endpoints_are_rejected() -> None:
    a = WorkerSpec.parse("name=a,events=tcp://127.0.0.1:5000")
    with pytest.raises(ConfigError, match="duplicate worker name 'a'"):
        ServerConfig(workers=(a, WorkerSpec.parse("name=a,events=tcp://127.0.0.1:6000")))
    with pytest.raises(ConfigError, match="same endpoint"):
        ServerConfig(workers=(a, WorkerSpec.parse("name=b,events=tcp://127.0.0.1:5000")))
    # dp-rank offsets collide too: b/dp1 would listen where c does
    b = WorkerSpec.parse("name=b,events=tcp://127.0.0.1:7000,dp_ranks=2")
    c = WorkerSpec.parse("name=c,events=tcp://127.0.0.1:7001")
    with pytest.raises(ConfigError, match="same endpoint"):
        ServerConfig(workers=(b, c))


def test_worker_keys_have_one_spelling() -> None:
    """``dp_ranks`` is written with '_' in every source; ``dp-ranks`` is an unknown key."""
    assert WorkerSpec.parse("name=w0,events=tcp://127.0.0.1:5557,dp_ranks=2").dp_ranks == 2
    with pytest.raises(ConfigError, match="unknown key"):
        WorkerSpec.parse("name=w0,events=tcp://127.0.0.1:5557,dp-ranks=2")


def test_zmq_api_bind_endpoint_may_use_wildcards() -> None:
    assert load_server_config({"zmq_api": "tcp://*:8001"}, {}).zmq_api == "tcp://*:8001"


def test_host_port_forms() -> None:
    assert parse_host_port("127.0.0.1:8000", what="http") == HostPort("127.0.0.1", 8000)
    assert parse_host_port("[::1]:9", what="http") == HostPort("::1", 9)
    assert parse_host_port(":0", what="http") == HostPort("127.0.0.1", 0)
    for bad in ("8000", "host:port", "h:70000"):
        with pytest.raises(ConfigError):
            parse_host_port(bad, what="http")


def test_defaults_bind_loopback() -> None:
    config = load_server_config({}, {})
    assert config.http == HostPort("127.0.0.1", 8000)
    assert config.zmq_api is None and config.auth_token is None and config.workers == ()


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "router.toml"
    path.write_text(text)
    return path


def test_precedence_flags_over_env_over_file(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
http = "127.0.0.1:7000"
zmq_api = "tcp://127.0.0.1:7001"
auth_token = "from-file"
max_tokens = 100

policy = "round_robin"

[router]
queue_weight = 0.5
decode_weight = 0.2

[[workers]]
name = "file-worker"
events = "tcp://127.0.0.1:5557"
""",
    )
    env = {
        "TOKENSPEED_ROUTER_HTTP": "127.0.0.1:7100",
        "TOKENSPEED_ROUTER_AUTH_TOKEN": "from-env",
        "TOKENSPEED_ROUTER_WORKERS": "name=e0,events=tcp://127.0.0.1:6000;name=e1,events=tcp://127.0.0.1:6001",
        "TOKENSPEED_ROUTER_ROUTER_OPTIONS": "decode_weight=0.3",
    }
    config = load_server_config({"http": "127.0.0.1:7200", "router": ["queue_weight=0.7"]}, env, path)
    assert config.http == HostPort("127.0.0.1", 7200)  # flag
    assert config.auth_token == "from-env"  # env over file
    assert config.zmq_api == "tcp://127.0.0.1:7001"  # file only
    assert [w.name for w in config.workers] == ["e0", "e1"]  # env replaces the file's list whole
    assert config.limits == ApiLimits(max_tokens=100)
    rc = config.router  # knobs merged per knob: flag 0.7, env 0.3, the file's policy
    assert rc.queue_weight == 0.7 and rc.decode_weight == 0.3 and rc.policy_name == "round_robin"


def test_config_file_path_from_env_and_worker_tables(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
[[workers]]
name = "p0"
events = "tcp://127.0.0.1:5557"
replay = "tcp://127.0.0.1:6557"
role = "prefill"
dp_ranks = 2
""",
    )
    config = load_server_config({}, {"TOKENSPEED_ROUTER_CONFIG": str(path)})
    assert [s.name for s in config.subscribers()] == ["p0/dp0", "p0/dp1"]
    assert config.subscribers()[1].replay == "tcp://127.0.0.1:6558"
    # events 5557 + replay 5558 with two ranks would overlap: rank 1 publishes on 5558
    with pytest.raises(ConfigError, match=re.escape("same endpoint tcp://127.0.0.1:5558")):
        load_server_config(
            {"workers": ["name=p0,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558,dp_ranks=2"]}, {}
        )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("htp = '127.0.0.1:1'", "unknown key(s) 'htp'"),
        ("http = ", "not valid TOML"),
        ("[[workers]]\nname = 'a'\nevents = 'tcp://127.0.0.1:1'\nport = 3", "unknown key(s) 'port'"),
        ("stale_after_s = -1", "positive"),
        ("max_body_bytes = 'big'", "expected an integer"),
    ],
)
def test_bad_config_files(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_server_config({}, {}, _write(tmp_path, text))


def test_missing_file_and_unknown_router_knob(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_server_config({}, {}, tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="colour"):
        load_server_config({"router": ["colour=1"]}, {})
    with pytest.raises(ConfigError, match="unknown policy"):
        load_server_config({"policy": "best"}, {})


def test_auth_token_file_and_http_none(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    config = load_server_config({"auth_token_file": str(token_file), "http": "none"}, {})
    assert config.auth_token == "s3cret" and config.http is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--worker", "name=w0,events=tcp://127.0.0.1:1,colour=red", "--http", "none"], "colour"),
        (["serve", "--worker", "name=w0,events=tcp://127.0.0.1:1", "--http", "127.0.0.1:99999"], "out of range"),
        (["serve", "--zmq-api", "nonsense", "--http", "none"], "zmq_api"),
        (["replay", "/nonexistent/events.tslog"], "no such file"),
        (["record", "--out", "/tmp/never.tslog", "--duration", "1"], "no workers"),
        (["inspect", "/nonexistent"], "no such file"),
    ],
)
def test_cli_reports_config_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenspeed_router.cli import main

    for var in [v for v in os.environ if v.startswith("TOKENSPEED_ROUTER_")]:
        monkeypatch.delenv(var)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_serve_refuses_a_port_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    from tokenspeed_router.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--http", f"127.0.0.1:{port}"]) == 2
    assert "cannot listen on" in capsys.readouterr().err


def test_env_workers_and_separators(caplog: pytest.LogCaptureFixture) -> None:
    """``TOKENSPEED_ROUTER_WORKERS``: specs split on ';' or newlines; the flag still wins."""
    specs = "name=a,events=tcp://127.0.0.1:6000\nname=b,events=tcp://127.0.0.1:6001;name=c,events=tcp://127.0.0.1:6002\n"
    config = load_server_config({}, {"TOKENSPEED_ROUTER_WORKERS": specs})
    assert [w.name for w in config.workers] == ["a", "b", "c"]
    config = load_server_config({"workers": ["name=f,events=tcp://127.0.0.1:7000"]},
                                {"TOKENSPEED_ROUTER_WORKERS": specs})
    assert [w.name for w in config.workers] == ["f"]
    # the old singular spelling is not read (it is logged as unknown, naming the right one)
    with caplog.at_level(logging.WARNING, logger="tokenspeed_router.server.config"):
        assert load_server_config({}, {"TOKENSPEED_ROUTER_WORKER": specs}).workers == ()
    assert "TOKENSPEED_ROUTER_WORKER (write TOKENSPEED_ROUTER_WORKERS)" in caplog.text
    config = load_server_config({}, {"TOKENSPEED_ROUTER_ROUTER_OPTIONS": "queue_weight=0.25"})
    assert config.router.queue_weight == 0.25


def test_every_setting_from_toml_with_one_spelling(tmp_path: Path) -> None:
    """Each flag's key in TOML is the flag with '_' (``zmq_api``); workers are ``[[workers]]``."""
    token = tmp_path / "token"
    token.write_text("t0k\n")
    path = _write(
        tmp_path,
        f"""
http = "127.0.0.1:7000"
zmq_api = "tcp://127.0.0.1:7001"
auth_token_file = "{token}"
stale_after_s = 3
replay_timeout_s = 0.5
inflight_timeout_s = 60
max_body_bytes = 1000
max_tokens = 100
policy = "round_robin"
record = "{tmp_path / 'events.tslog'}"
tokenizer = "engine"
upstream_retries = 0

[router]
queue_weight = 0.5

[[workers]]
name = "p0"
events = "tcp://127.0.0.1:5557"
dp_ranks = 2
role = "prefill"

[[workers]]
name = "d0"
events = "tcp://127.0.0.1:5600"
""",
    )
    config = load_server_config({}, {}, path)
    assert config.zmq_api == "tcp://127.0.0.1:7001" and config.auth_token == "t0k"
    assert config.stale_after_s == 3 and config.replay_timeout_s == 0.5 and config.router.inflight_timeout_s == 60
    assert config.limits == ApiLimits(max_body_bytes=1000, max_tokens=100)
    assert config.record == str(tmp_path / "events.tslog") and config.router.policy_name == "round_robin"
    assert config.router.queue_weight == 0.5 and config.gateway.upstream_retries == 0
    assert [s.name for s in config.subscribers()] == ["p0/dp0", "p0/dp1", "d0"]
    assert config.workers[0].role == "prefill"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("zmq-api = 'tcp://127.0.0.1:1'", "unknown key(s) 'zmq-api' (write 'zmq_api')"),
        ("[[worker]]\nname = 'a'\nevents = 'tcp://127.0.0.1:1'", "unknown key(s) 'worker' (write 'workers')"),
        ("[workers.a]\nevents = 'tcp://127.0.0.1:1'", "write the worker list as [[workers]] tables"),
        ("workers = ['name=a,events=tcp://127.0.0.1:1']", "write the worker list as [[workers]] tables"),
        ("[router]\npolicy = 'random'", "policy is a setting of its own"),
        ("[router]\ninflight_timeout_s = 5", "inflight_timeout_s is a setting of its own"),
        ("[[workers]]\nname = 'a'\nevents = 'tcp://127.0.0.1:1'\nport = 3", "unknown key(s) 'port'"),
        ("[[workers]]\nname = 'a'\nevents = 'tcp://*:1'", "has host '*'"),
        ("http = 'off'", "expected HOST:PORT"),
    ],
)
def test_other_spellings_in_toml_are_errors(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_server_config({}, {}, _write(tmp_path, text))


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://", "names no host"),
        ("redis://h:notaport/0", "is not a valid URL"),
        ("redis://h:70000/0", "out of range"),
        ("redis://h:6379/zero", "the database must be a number"),
        ("http://h:6379/0", "must be redis://, rediss:// or unix://"),
        ("unix://", "names no socket path"),
    ],
)
def test_bad_state_urls_fail_at_config_time(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_server_config({"state": url}, {})


def test_good_state_urls_pass() -> None:
    for url in ("redis://127.0.0.1:6379/0", "rediss://user:pw@h/3?cluster=a", "redis://h", "unix:///run/redis.sock"):
        assert load_server_config({"state": url}, {}).state == url


def test_record_path_is_checked_at_config_time(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="directory '/nonexistent/dir' does not exist"):
        load_server_config({"record": "/nonexistent/dir/x"}, {})
    with pytest.raises(ConfigError, match="is a directory"):
        load_server_config({"record": str(tmp_path)}, {})
    assert load_server_config({"record": "x.tslog"}, {}).record == "x.tslog"  # cwd


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--worker", "name=w0,events=tcp://*:5999", "--http", "127.0.0.1:0"], "'tcp://*:5999' has host '*'"),
        (["serve", "--worker", "name=w0,events=" + "ipc:///tmp/" + "x" * 200, "--http", "127.0.0.1:0",
          "--zmq-api", "tcp://127.0.0.1:0"], "cannot connect to its events endpoint ipc:///tmp/xxx"),
        (["serve", "--state", "redis://", "--http", "127.0.0.1:0"], "names no host"),
        (["serve", "--state", "redis://h:notaport/0", "--http", "127.0.0.1:0"], "notaport"),
        (["serve", "--record", "/nonexistent/dir/x", "--http", "127.0.0.1:0"], "'/nonexistent/dir' does not exist"),
        (["record", "--out", "/nonexistent/x", "--worker", "name=w0,events=tcp://127.0.0.1:1"],
         "--out: cannot write '/nonexistent/x'"),
    ],
)
def test_cli_startup_errors_are_one_line_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenspeed_router.cli import main

    for var in [v for v in os.environ if v.startswith("TOKENSPEED_ROUTER_")]:
        monkeypatch.delenv(var)
    assert main(argv) == 2  # returns (a failed start must not hang in Context.term)
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert f"tokenspeed-router {argv[0]}: error: " in err


def test_epp_settings_from_flags_environment_and_file(tmp_path: Path) -> None:
    config = load_server_config({}, {"TOKENSPEED_ROUTER_EPP": "127.0.0.1:9002",
                                     "TOKENSPEED_ROUTER_EPP_FALLBACKS": "0"})
    assert config.epp == HostPort("127.0.0.1", 9002) and config.epp_fallbacks == 0
    assert config.epp_max_in_flight == 0 and config.epp_leader_only is False
    toml = tmp_path / "router.toml"
    toml.write_text('epp = "0.0.0.0:9002"\nepp_max_in_flight = 8\nepp_leader_only = true\n'
                    'state = "redis://127.0.0.1:6379/0?ingest=stream"\n')
    config = load_server_config({"epp_fallbacks": 3}, {}, toml)
    assert (config.epp_fallbacks, config.epp_max_in_flight, config.epp_leader_only) == (3, 8, True)
    with pytest.raises(ConfigError, match="epp_leader_only needs"):
        load_server_config({"epp": "127.0.0.1:9002", "epp_leader_only": True}, {})
    with pytest.raises(ConfigError, match="epp_fallbacks"):
        load_server_config({"epp": "127.0.0.1:9002", "epp_fallbacks": -1}, {})
    assert load_server_config({"epp": "none"}, {}).epp is None
