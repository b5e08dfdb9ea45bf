"""The truth loop end to end: engines whose KV events disagree with what they reuse get flagged.

engine-sim's fault knobs make the two classic misconfigurations: a
``/tokenize`` that differs from the tokens the engine caches (a BOS or chat
template mismatch), and events published with a block size the engine does
not use. Each must be flagged ``misaligned`` within 50 requests, with the
likely cause, in ``/workers``, ``/health`` and ``/metrics``, and routed on
load only; a healthy neighbour must stay trusted.
"""

from __future__ import annotations

from pathlib import Path

from support.engine_sim import words
from support.gateway import Gateway

#: shared prefixes the requests come back to, each followed by a fresh tail
NUM_PREFIXES = 4


def _prompt(i: int, prefix_words: int) -> str:
    return words(100_000 * (1 + i % NUM_PREFIXES), prefix_words) + " " + words(10_000_000 + 100 * i, 6)


def _until_flagged(gw: Gateway, worker: str, prefix_words: int, limit: int = 50) -> int:
    for i in range(limit):
        gw.complete(_prompt(i, prefix_words))
        if gw.workers()[worker]["misaligned"]:
            return i + 1
    raise AssertionError(f"{worker} not flagged within {limit} requests: {gw.workers()[worker]['truth']}")


def test_tokenizer_skew_is_flagged_with_its_cause(tmp_path: Path) -> None:
    with Gateway(tmp_path, [["--instant", "--fault-tokenizer-skew"]]) as gw:
        used = _until_flagged(gw, "w0", 48)
        assert used <= 50
        truth = gw.workers()["w0"]["truth"]
        assert "tokenizer" in truth["cause"]
        assert truth["reported_cached_tokens"] > 4 * truth["predicted_cached_tokens"]
        health = gw.client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert "tokenizer" in health.json()["misaligned"]["w0"]
        assert gw.metric("tokenspeed_gateway_worker_misaligned", worker="w0") == 1
        assert "misaligned" in gw.serve.stderr() and "tokenizer" in gw.serve.stderr()


def test_wrong_published_block_size_is_flagged_and_routed_on_load(tmp_path: Path) -> None:
    with Gateway(tmp_path, [["--instant"], ["--instant", "--fault-publish-block-size", "32"]]) as gw:
        # 56-word prefixes: the engine reuses 48 tokens (3 blocks of 16); events in 32s predict 32
        _until_flagged(gw, "w1", 56)
        workers = gw.workers()
        assert workers["w1"]["truth"]["cause"].startswith("block size")
        assert not workers["w0"]["misaligned"]
        # routed on load only: a prompt w1 holds no longer pulls requests to it by prefix
        assert gw.serve.post("/route", {"token_ids": list(range(100_000, 100_056))})["scores"]["w1"] == 0
