"""The CLI around the service: inspect URLs and logging, truncated-log warnings."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import msgspec
import pytest
from support.server import batch, stored, tokens

from tokenspeed_router.cli import main
from tokenspeed_router.events.codec import encode_batch
from tokenspeed_router.events.log import EventLogWriter
from tokenspeed_router.server import RouterService, ServerConfig
from tokenspeed_router.server.config import HostPort
from tokenspeed_router.server.http import HttpServer
from tokenspeed_router.tools.cli_inspect import router_base_url


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in [v for v in os.environ if v.startswith("TOKENSPEED_ROUTER_")]:
        monkeypatch.delenv(var)


def _log(path: Path, *, torn: bool) -> Path:
    with EventLogWriter(path, meta={"source": "test"}) as writer:
        for seq in range(3):
            writer.append("w0", seq, encode_batch(batch(stored(tokens(seq + 1, 2)))), recv_time_s=100.0 + seq)
    if torn:  # a writer killed mid-append: the last record is cut short
        data = path.read_bytes()
        path.write_bytes(data[:-5])
    return path


@pytest.mark.parametrize("command", ["replay", "inspect"])
def test_truncated_log_is_reported(command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torn = _log(tmp_path / "torn.tslog", torn=True)
    assert main([command, str(torn), *(["--no-progress"] if command == "replay" else ["--json"])]) == 0
    captured = capsys.readouterr()
    assert f"tokenspeed-router {command}: warning: {torn} ends in a truncated" in captured.err
    if command == "inspect":
        summary = json.loads(captured.out)
        assert summary["truncated"] is True and summary["records"] == 2
    else:
        assert json.loads(captured.out)["records"] == 2
    # an intact log: no warning
    whole = _log(tmp_path / "whole.tslog", torn=False)
    assert main([command, str(whole), *(["--no-progress"] if command == "replay" else [])]) == 0
    assert "warning" not in capsys.readouterr().err


def test_router_base_url() -> None:
    for url in ("http://h:1", "http://h:1/", "http://h:1/workers", "http://h:1/workers/", "http://h:1/health"):
        assert router_base_url(url) == "http://h:1", url
    assert router_base_url("http://h:1/prefix/workers") == "http://h:1/prefix"


def test_inspect_url_with_a_path_and_no_httpx_logging(capsys: pytest.CaptureFixture[str],
                                                      caplog: pytest.LogCaptureFixture) -> None:
    service = RouterService(ServerConfig(http=None))
    service.apply_record("w0", 0, batch(stored(tokens(1, 3))), 1.0)
    http = HttpServer(service, HostPort("127.0.0.1", 0))
    thread = http.start_background()
    try:
        caplog.set_level(logging.INFO)
        for suffix in ("/workers", "/health", ""):
            assert main(["inspect", f"http://{http.address}{suffix}", "--json"]) == 0
            summary = json.loads(capsys.readouterr().out)
            assert summary["workers"]["w0"]["blocks"] == 3 and summary["health"]["status"] == "ok"
        assert main(["inspect", f"http://{http.address}/workers"]) == 0
        assert "w0" in capsys.readouterr().out
        noisy = [r for r in caplog.records if r.name.startswith(("httpx", "httpcore")) and r.levelno < logging.WARNING]
        assert noisy == []
    finally:
        http.request_shutdown()
        thread.join(10)
        service.stop()


def test_replay_queries_with_lora_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "lora.tslog"
    a = tokens(1, 2)
    with EventLogWriter(log) as writer:
        ev = msgspec.structs.replace(stored(a), lora_name="sql")
        writer.append("w0", 0, encode_batch(batch(ev)), recv_time_s=1.0)
    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps({"token_ids": a, "lora_id": "sql"}) + "\n" + json.dumps({"token_ids": a}) + "\n")
    assert main(["replay", str(log), "--queries", str(queries), "--no-progress"]) == 0
    named, plain = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert named["scores"] == {"w0": 2} and plain["scores"].get("w0", 0) == 0
