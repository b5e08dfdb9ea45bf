"""engine-sim as a real subprocess on loopback: OpenAI shapes, streaming, cache truth, events, P/D, faults."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import wait_until
from support.engine_sim import EngineSim, words

from tokenspeed_router.events import BatchReceived, EventSubscriber
from tokenspeed_router.events.schema import AllBlocksCleared, BlockStored
from tokenspeed_router.router import KvIndex

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineSim]:
    """One instant engine shared by the tests that do not depend on a fresh cache (distinct prompts)."""
    with EngineSim(tmp_path_factory.mktemp("sim"), ["--instant", "--name", "sim-a"]).start() as engine:
        yield engine


class Follower:
    """A real EventSubscriber (replay from seq 0) feeding a real KvIndex."""

    def __init__(self, engine: EngineSim, worker: str = "w") -> None:
        self.worker = worker
        self.sub = EventSubscriber(worker, engine.events, replay_endpoint=engine.replay_endpoint, start_seq=0)
        self.index = KvIndex()
        self.batches: list[BatchReceived] = []

    def pump(self) -> None:
        for item in self.sub.poll(0.05):
            if isinstance(item, BatchReceived):
                self.batches.append(item)
                self.index.apply(self.worker, item.batch)

    def blocks(self, tokens: list[int]) -> int:
        return self.index.match(tokens).get(self.worker, 0)

    def close(self) -> None:
        self.sub.close()


def test_completion_stream_chunk_by_chunk(sim: EngineSim) -> None:
    body = {"prompt": words(2_000_000, 40), "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks = list(sim.stream("/v1/completions", body))
    assert chunks[-1] == "[DONE]"
    data = [c for c in chunks if isinstance(c, dict)]
    tokens, finish, usage = data[:4], data[4], data[5]
    assert all(c["object"] == "text_completion" and c["system_fingerprint"] == "sim-a" for c in data)
    assert all(c["choices"][0]["text"] and c["choices"][0]["finish_reason"] is None for c in tokens)
    assert finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 40, "completion_tokens": 4, "total_tokens": 44,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    # the engine's own share of the TTFT (what a load generator subtracts), wall and modelled,
    # beside usage (usage itself stays vLLM's shape)
    timing = usage["engine_timing"]
    assert timing["ttft_s"] >= 0 and timing["modelled_ttft_s"] >= 0 and timing["modelled_queue_s"] >= 0
    assert len({c["id"] for c in data}) == 1
    # Without include_usage there is no usage chunk.
    plain = [c for c in sim.stream("/v1/completions", {**body, "stream_options": None}) if isinstance(c, dict)]
    assert len(plain) == 5 and all("usage" not in c for c in plain)


def test_chat_stream_and_full_answer(sim: EngineSim) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    chunks = [c for c in sim.stream("/v1/chat/completions", {"messages": messages, "max_tokens": 3,
                                                             "stream": True}) if isinstance(c, dict)]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [bool(c["choices"][0]["delta"].get("content")) for c in chunks[1:4]] == [True] * 3
    assert chunks[4]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    resp = sim.http.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 2})
    assert resp.status_code == 200 and resp.headers["x-engine-id"] == "sim-a"
    answer = resp.json()
    assert answer["object"] == "chat.completion" and answer["system_fingerprint"] == "sim-a"
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["usage"]["completion_tokens"] == 2
    # Same rendered prompt twice: the second run hits its full blocks (the last token is always computed).
    n = answer["usage"]["prompt_tokens"]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16


def test_cached_tokens_grow_on_a_repeated_prompt(sim: EngineSim) -> None:
    before = sim.metrics()
    first = sim.complete(words(1000, 40))["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    again = sim.complete(words(1000, 40))["usage"]
    assert again["prompt_tokens_details"]["cached_tokens"] == 32
    longer = sim.complete(words(1000, 70))["usage"]  # shares 2 full blocks, adds 2 more
    assert longer["prompt_tokens_details"]["cached_tokens"] == 32
    # Token-id prompts and one-element lists are the same prompt.
    ids = list(range(1000, 1070))
    assert sim.complete(ids)["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    assert sim.complete([ids])["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    assert sim.complete([words(1000, 70)])["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    m = sim.metrics()
    assert m["tokenspeed_engine_sim_cached_prompt_tokens_total"] - before[
        "tokenspeed_engine_sim_cached_prompt_tokens_total"] == 32 + 32 + 64 * 3
    assert m["tokenspeed_engine_sim_requests_total"] - before["tokenspeed_engine_sim_requests_total"] == 6


def test_kv_events_rebuild_what_the_engine_caches(tmp_path: Path) -> None:
    # 7 pages: three 40-token prompts (2 cached pages + 1 partial page while running) fit,
    # a fourth evicts the oldest.
    args = ["--instant", "--capacity-tokens", "112", "--wire-format", "array"]
    with EngineSim(tmp_path, args).start() as engine:
        follower = Follower(engine)
        try:
            prompts = [list(range(s, s + 40)) for s in (10_000, 20_000, 30_000, 40_000)]
            for p in prompts:
                engine.complete(p)

            def caught_up() -> bool:
                follower.pump()
                return [follower.blocks(p) for p in prompts] == [0, 2, 2, 2]

            wait_until(caught_up, timeout_s=30, what="the index to show A evicted and B, C, D cached")
            assert isinstance(follower.batches[0].batch.events[0], AllBlocksCleared)
            assert [b.seq for b in follower.batches] == list(range(len(follower.batches)))
            # What the events say is what the engine reports as cached.
            for p, blocks in ((prompts[2], 2), (prompts[0], 0)):
                cached = engine.complete(p)["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached == blocks * 16
        finally:
            follower.close()


def test_restart_fault_resets_seq_and_cache(tmp_path: Path) -> None:
    with EngineSim(tmp_path, ["--instant", "--fault-restart-after-requests", "2"]).start() as engine:
        a, b = list(range(1, 41)), list(range(100, 140))
        engine.complete(a)
        engine.complete(b)
        wait_until(lambda: engine.metrics()["tokenspeed_engine_sim_restarts_total"] == 1, timeout_s=30,
                   what="the restart fault")
        # The fresh cache forgot everything.
        assert engine.complete(a)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        follower = Follower(engine)
        try:
            def got_a() -> bool:
                follower.pump()
                return follower.blocks(a) == 2

            wait_until(got_a, timeout_s=30, what="the restarted publisher's events")
            first = follower.batches[0]
            assert first.seq == 0 and isinstance(first.batch.events[0], AllBlocksCleared)
            assert follower.blocks(b) == 0
            assert max(x.seq for x in follower.batches) <= 3
        finally:
            follower.close()


def test_prefill_and_decode_legs(tmp_path: Path) -> None:
    with EngineSim(tmp_path, ["--instant", "--role", "prefill", "--name", "p0"]).start() as prefill, \
            EngineSim(tmp_path, ["--instant", "--role", "decode", "--name", "d0"]).start() as decode:
        prompt = list(range(500, 540))
        leg1 = prefill.complete(prompt, max_tokens=50, kv_transfer_params={"do_remote_decode": True})
        assert leg1["usage"]["completion_tokens"] == 1
        kv = leg1["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        assert kv["remote_engine_id"] == "p0" and len(kv["remote_block_ids"]) == 2
        assert kv["remote_port"] == int(prefill.url.rsplit(":", 1)[1])
        leg2 = decode.complete(prompt, max_tokens=5, kv_transfer_params=kv)
        assert leg2["system_fingerprint"] == "d0" and leg2["usage"]["completion_tokens"] == 5
        assert leg2["kv_transfer_params"] is None
        m = decode.metrics()
        assert m["tokenspeed_engine_sim_computed_prompt_tokens_total"] == 0  # transferred, not computed
        # The transferred blocks are in the decode engine's cache now.
        again = decode.complete(prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert again == 32
        # A plain request on the prefill engine is served normally.
        assert prefill.complete(prompt, max_tokens=3)["usage"]["completion_tokens"] == 3


def test_tokenize_gives_the_tokens_the_engine_caches(sim: EngineSim) -> None:
    messages = [{"role": "user", "content": words(7, 50)}]
    tok = sim.post("/tokenize", {"messages": messages})
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 131072
    assert tok["tokens"][1:51] == list(range(7, 57))  # numeric words are their own ids
    # Caching the tokenized ids, then sending the chat: the chat hits them.
    sim.complete(tok["tokens"])
    usage = sim.post("/v1/chat/completions", {"messages": messages})["usage"]
    assert usage["prompt_tokens"] == tok["count"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == (tok["count"] - 1) // 16 * 16
    assert sim.post("/tokenize", {"prompt": "3 1 4"})["tokens"] == [3, 1, 4]
    rendered = sim.post("/v1/completions/render", {"prompt": "3 1 4", "max_tokens": 7})
    assert rendered[0]["token_ids"] == [3, 1, 4] and rendered[0]["sampling_params"]["max_tokens"] == 7
    assert rendered[0]["request_id"].startswith("cmpl-")
    chat = sim.post("/v1/chat/completions/render", {"messages": messages})
    assert chat["token_ids"] == tok["tokens"]


def test_tokenizer_skew_fault_misleads_a_router(tmp_path: Path) -> None:
    with EngineSim(tmp_path, ["--instant", "--fault-tokenizer-skew"]).start() as engine:
        messages = [{"role": "user", "content": words(7, 50)}]
        tok = engine.post("/tokenize", {"messages": messages})["tokens"]
        engine.post("/v1/chat/completions", {"messages": messages})
        # The ids /tokenize gave are not what the engine cached.
        assert engine.complete(tok)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_block_size_fault_publishes_another_grid(tmp_path: Path) -> None:
    with EngineSim(tmp_path, ["--instant", "--fault-publish-block-size", "32"]).start() as engine:
        follower = Follower(engine)
        try:
            prompt = list(range(900, 940))
            engine.complete(prompt)

            def stored() -> list[BlockStored]:
                follower.pump()
                return [e for b in follower.batches for e in b.batch.events if isinstance(e, BlockStored)]

            events = wait_until(stored, timeout_s=30, what="a BlockStored")
            assert {e.block_size for e in events} == {32}
            assert follower.blocks(prompt) == 1  # one 32-token block published...
            cached = engine.complete(prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == 32  # ...while the engine caches two 16-token blocks
        finally:
            follower.close()


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/completions", b"{not json", 400),
        ("/v1/completions", b"[1, 2]", 400),
        ("/v1/completions", b'{"max_tokens": 3}', 400),
        ("/v1/completions", b'{"prompt": "1 2", "max_tokens": -1}', 400),
        ("/v1/completions", b'{"prompt": ["1 2", "3 4"]}', 400),
        ("/v1/completions", b'{"prompt": [1, "x"]}', 400),
        ("/v1/completions", b'{"prompt": ""}', 400),
        ("/v1/completions", b'{"prompt": "1 2", "model": "other"}', 404),
        ("/v1/chat/completions", b'{"messages": [{"content": "no role"}]}', 400),
        ("/v1/chat/completions", b'{"messages": []}', 400),
        ("/tokenize", b'{"prompt": 5}', 400),
        ("/v1/nope", b"{}", 404),
    ],
)
def test_bad_input_gets_an_openai_error(sim: EngineSim, path: str, body: bytes, status: int) -> None:
    resp = sim.http.post(path, content=body)
    assert resp.status_code == status, resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    assert sim.complete("1 2 3")["usage"]["prompt_tokens"] == 3  # still serving


def test_models_health_metrics(sim: EngineSim) -> None:
    models = sim.http.get("/v1/models").json()
    assert models["data"][0]["id"] == "tokenspeed-sim"
    assert sim.http.get("/health").status_code == 200
    before = sim.metrics()["tokenspeed_engine_sim_prompt_tokens_total"]
    sim.complete(words(5_000_000, 20))
    m = sim.metrics()
    assert m["vllm:num_requests_running"] == 0
    assert m["tokenspeed_engine_sim_prompt_tokens_total"] - before == 20
    assert 0 < m["tokenspeed_engine_sim_cache_usage_ratio"] < 1


def test_client_disconnect_frees_the_request(tmp_path: Path) -> None:
    # Modelled time: 1000 decode steps of 20 ms, so the stream is still running when we leave.
    with EngineSim(tmp_path, ["--time-scale", "1"]).start() as engine:
        body = {"prompt": words(1, 40), "max_tokens": 1000, "stream": True}
        with engine.http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line).startswith("data: ")
        wait_until(lambda: engine.metrics()["tokenspeed_engine_sim_aborted_requests_total"] == 1,
                   timeout_s=30, what="the aborted request to be freed")
        m = engine.metrics()
        assert m["tokenspeed_engine_sim_requests_running"] == 0
        # Its prompt blocks stay cached and unlocked: the same prompt hits them.
        again = engine.complete(words(1, 40), max_tokens=1)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


def test_dp_ranks_publish_on_their_own_endpoints(tmp_path: Path) -> None:
    with EngineSim(tmp_path, ["--instant", "--dp-ranks", "2"]).start() as engine:
        assert len(engine.info["events"]) == 2 and len(set(engine.info["events"])) == 2
        sub = EventSubscriber("w", engine.info["events"][1], replay_endpoint=engine.info["replay"][1],
                              start_seq=0)
        try:
            prompt = list(range(3000, 3040))
            resp = engine.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                                    headers={"x-data-parallel-rank": "1"})
            assert resp.status_code == 200
            seen: list[BatchReceived] = []

            def stored() -> bool:
                seen.extend(x for x in sub.poll(0.05) if isinstance(x, BatchReceived))
                return any(isinstance(e, BlockStored) for b in seen for e in b.batch.events)

            wait_until(stored, timeout_s=30, what="rank 1's BlockStored")
            assert {b.batch.data_parallel_rank for b in seen} == {1}
        finally:
            sub.close()
