"""loadgen against real engine-sim subprocesses (started through loadgen's own Fleet).

Engines run ``--instant`` (no modelled delays): what is checked is what the
load generator reads off real streams, not timing. Real processes, real
sockets on loopback, OS-chosen ports; waits poll with deadlines.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.loadgen import (
    PromptBuilder,
    PromptConfig,
    ReplayConfig,
    discover_model,
    replay,
    summarize,
)
from tokenspeed_router.loadgen.fleet import EngineHandle, EngineSimOptions, Fleet
from tokenspeed_router.sim.traces import parse_mooncake

MODEL = "tokenspeed-sim"


def _line(ts: int, n: int, ids: list[int], out: int = 3) -> str:
    return json.dumps({"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids})


#: 16-token hash blocks (engine block size 16): requests 1 and 2 share block 0,
#: request 3 repeats request 2 entirely, request 4 shares nothing.
#: 600 ms apart: each answer (instant engine) is complete before the next request,
#: so cache hits do not depend on the machine's load.
TRACE = [_line(0, 40, [1, 2, 3]), _line(600, 36, [1, 4, 5], out=5), _line(1200, 36, [1, 4, 5]),
         _line(1800, 20, [9, 10])]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineHandle]]:
    fleet = Fleet(tmp_path_factory.mktemp("fleet"))
    try:
        opts = EngineSimOptions(model=MODEL, extra=("--instant",))
        yield fleet.start_engines(["sim-a", "sim-b"], [opts, opts])
    finally:
        fleet.close()


def _requests():
    return parse_mooncake(TRACE, block_tokens=16)


def test_replay_reads_streams_usage_and_worker(engines: list[EngineHandle]) -> None:
    # A fresh token key: this test's blocks are not in the shared engines' caches yet.
    config = ReplayConfig(target=engines[0].url)
    assert discover_model(config) == MODEL
    builder = PromptBuilder(PromptConfig(model=MODEL, token_key=11))
    outcome = replay(_requests(), builder, config)
    recs = outcome.records
    assert [r.error for r in recs] == [None] * 4
    assert all(r.worker == "sim-a" for r in recs)
    assert [r.completion_tokens for r in recs] == [3, 5, 3, 3]
    assert [r.prompt_tokens for r in recs] == [40, 36, 36, 20]
    for r in recs:
        assert r.ttft_s is not None and r.e2e_s is not None and 0 < r.ttft_s <= r.e2e_s
        assert len(r.itl_s) == r.output_chunks - 1
    # Block 0 (16 tokens) is cached for request 2; request 3 repeats request 2
    # (its last token is always recomputed, as vLLM does: 32 of 36 cached).
    assert [r.cached_tokens for r in recs] == [0, 16, 32, 0]
    m = summarize(recs, wall_s=outcome.wall_s)
    assert m["hit_ratio"] == pytest.approx(48 / 132)
    assert m["requests_per_worker"] == {"sim-a": 4}


def test_text_prompts_hit_the_same_blocks_as_token_prompts(engines: list[EngineHandle]) -> None:
    reqs = _requests()[:2]
    tokens = replay(reqs[:1], PromptBuilder(PromptConfig(model=MODEL, token_key=12)),
                    ReplayConfig(target=engines[1].url))
    text = replay(reqs[1:], PromptBuilder(PromptConfig(model=MODEL, token_key=12, prompt_format="text")),
                  ReplayConfig(target=engines[1].url))
    assert tokens.records[0].ok and text.records[0].ok
    # The text prompt's digit words are tokenized back to the ids the token prompt cached.
    assert text.records[0].prompt_tokens == 36 and text.records[0].cached_tokens == 16


def test_replicas_split_the_traffic(engines: list[EngineHandle]) -> None:
    config = ReplayConfig(target=engines[0].url, extra_targets=(engines[1].url,))
    outcome = replay(_requests(), PromptBuilder(PromptConfig(model=MODEL, token_key=13)), config)
    assert [r.worker for r in outcome.records] == ["sim-a", "sim-b", "sim-a", "sim-b"]
    # a pinned placement (another run's choices) overrides the round robin
    pinned = ReplayConfig(target=engines[0].url, extra_targets=(engines[1].url,), pinned=(1, 1, 0, 1))
    outcome = replay(_requests(), PromptBuilder(PromptConfig(model=MODEL, token_key=29)), pinned)
    assert [r.worker for r in outcome.records] == ["sim-b", "sim-b", "sim-a", "sim-b"]
    with pytest.raises(ConfigError):
        ReplayConfig(target=engines[0].url, pinned=(0, 1))


def test_unreachable_target_is_counted_not_fatal(engines: list[EngineHandle], tmp_path: Path) -> None:
    from tokenspeed_router.endpoints import free_tcp_port

    dead = f"http://127.0.0.1:{free_tcp_port()}"
    outcome = replay(_requests(), PromptBuilder(PromptConfig(model=MODEL)),
                     ReplayConfig(target=dead, connect_timeout_s=2.0))
    m = summarize(outcome.records, wall_s=outcome.wall_s)
    assert m["errors"] == 4 and m["ok"] == 0 and m["ttft_p50_s"] is None
    assert all("Connect" in (r.error or "") for r in outcome.records)


def test_bad_request_is_an_error_row(engines: list[EngineHandle]) -> None:
    # An unknown model: the engine answers 4xx, the load generator records it.
    outcome = replay(_requests()[:1], PromptBuilder(PromptConfig(model="no-such-model")),
                     ReplayConfig(target=engines[0].url))
    (rec,) = outcome.records
    assert rec.error is not None and rec.error.startswith("HTTP 4")


def test_cli_writes_results_and_prints_the_table(engines: list[EngineHandle], tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(TRACE) + "\n")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "tokenspeed_router.cli", "loadgen", "--trace", str(trace),
         "--target", engines[0].url, "--tokens-per-hash-id", "16",
         "--token-key", "14", "--out", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "TTFT p50" in proc.stdout and "results:" in proc.stdout
    doc = json.loads((out / "results.json").read_text())
    assert doc["summary"]["ok"] == 4 and doc["config"]["model"] == MODEL
    assert doc["summary"]["hit_ratio"] == pytest.approx(48 / 132)
    assert len(doc["requests"]) == 4 and doc["requests"][1]["cached_tokens"] == 16
    assert (out / "loadgen.png").is_file()
    assert "4/4" in proc.stderr  # the progress line


def test_cli_rejects_a_bad_trace(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "tokenspeed_router.cli", "loadgen", "--trace", str(trace),
         "--target", "http://127.0.0.1:9", "--model", "m"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 2 and "not a Mooncake trace line" in proc.stderr
