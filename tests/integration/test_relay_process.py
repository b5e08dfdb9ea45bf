"""``tokenspeed-router relay`` and ``serve`` as real processes: CURVE, hashes-only, snapshot.

The engine (a PrefixCache with a 4-batch replay ring) runs here; the relay
process follows it from the start; the router process joins long after the
engine's ring wrapped, over CURVE, and must answer /match exactly as the
engine's cache would, from content hashes only.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
from support import REPO_ROOT, wait_until
from support.relay import Ctx, Engine, workload
from support.server import ServeProcess

from tokenspeed_router.endpoints import free_tcp_port


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenspeed_router.cli", *args]


def _gen_keys(folder: Path, name: str) -> None:
    out = subprocess.run(_cli("relay", "--gen-keys", str(folder), "--key-name", name),
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True)
    assert f"{name}.key_secret" in out.stdout


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert m is not None, f"{name} not in metrics"
    return float(m.group(1))


def test_relay_and_serve_processes_over_curve_with_hashes_only(ctx: Ctx, tmp_path: Path) -> None:
    _gen_keys(tmp_path / "relay", "relay")
    _gen_keys(tmp_path / "router", "router")
    engine = Engine(ctx, buffer_steps=4)
    publish, replay, metrics = free_tcp_port(), free_tcp_port(), free_tcp_port()
    stderr = open(tmp_path / "relay.stderr", "wb")  # noqa: SIM115 - closed below
    relay = subprocess.Popen(
        _cli("--log-level", "INFO", "relay", "--engine", engine.publisher.endpoint,
             "--engine-replay", str(engine.publisher.replay_endpoint),
             "--publish", f"tcp://127.0.0.1:{publish}", "--replay", f"tcp://127.0.0.1:{replay}",
             "--curve-secret-key", str(tmp_path / "relay" / "relay.key_secret"),
             "--curve-allow", str(tmp_path / "router" / "router.key"),
             "--hashes-only", "--buffer-steps", "8", "--metrics", f"127.0.0.1:{metrics}"),
        cwd=REPO_ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE, stderr=stderr,
    )
    url = f"http://127.0.0.1:{metrics}/metrics"

    def scrape() -> str:
        if relay.poll() is not None:
            raise AssertionError(f"relay exited rc={relay.returncode}: "
                                 f"{(tmp_path / 'relay.stderr').read_text()[-3000:]}")
        try:
            return httpx.get(url, timeout=2.0).text
        except httpx.HTTPError:
            return ""

    try:
        def relay_has_engine() -> bool:
            engine.probe()
            text = scrape()
            return bool(text) and _metric(text, "tokenspeed_relay_batches_in_total") > 0

        wait_until(relay_has_engine, 60, interval_s=0.05, what="the relay process to follow the engine")
        engine.cache.reset()
        engine.run(prompts := workload(seed=21))
        wait_until(lambda: f"tokenspeed_relay_last_engine_seq {engine.last_seq}.0" in scrape(), 30,
                   interval_s=0.02, what="the relay to catch up")
        relay_last = int(_metric(scrape(), "tokenspeed_relay_next_seq")) - 1
        assert relay_last > 16, "the relay's own ring (8) must have wrapped too"

        spec = (f"name=w0,events=tcp://127.0.0.1:{publish},replay=tcp://127.0.0.1:{replay},"
                f"curve_server_key={tmp_path / 'relay' / 'relay.key'},"
                f"curve_key={tmp_path / 'router' / 'router.key_secret'}")
        with ServeProcess(["--worker", spec], tmp_path).start() as router:
            wait_until(lambda: router.workers()["w0"]["last_seq"] == relay_last, 30, interval_s=0.02,
                       what="the router to reach the relay's last seq")
            w0 = router.workers()["w0"]
            assert w0["state"] == "live" and w0["blocks"] == engine.blocks() > 0
            for tokens in prompts:
                scores = router.post("/match", {"token_ids": tokens})["scores"]
                assert scores.get("w0", 0) == engine.truth(tokens), tokens
        text = scrape()
        assert _metric(text, "tokenspeed_relay_snapshots_served_total") >= 1
        assert _metric(text, "tokenspeed_relay_curve_allowed_total") >= 2
        assert _metric(text, "tokenspeed_relay_hashed_blocks_total") > 0
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(30) == 0
        assert relay.stdout is not None
        assert relay.stdout.readline().decode().startswith(f"relay publish=tcp://127.0.0.1:{publish}")
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.wait()
        if relay.stdout is not None:
            relay.stdout.close()
        stderr.close()
        engine.close()
