"""The gateway's pure parts: request checks, SSE relay, truth loop, local tokenizer, settings, /health."""

from __future__ import annotations

import asyncio
import json
import warnings
from pathlib import Path

import pytest
from support import wait_until

from tokenspeed_router.endpoints import free_tcp_port
from tokenspeed_router.errors import ConfigError
from tokenspeed_router.gateway.config import GatewayConfig
from tokenspeed_router.gateway.openai import OpenAIError, parse_chat, parse_completion
from tokenspeed_router.gateway.sse import SseRelay, sse_error_event
from tokenspeed_router.gateway.tokenize import LocalTokenizer, TokenizeError
from tokenspeed_router.gateway.truth import TruthLoop, TruthSample, cap_prediction
from tokenspeed_router.server import RouterService, ServerConfig, WorkerSpec, create_app
from tokenspeed_router.server.config import load_server_config

with warnings.catch_warnings():
    from starlette.exceptions import StarletteDeprecationWarning

    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from starlette.testclient import TestClient


# --------------------------------------------------------------------------- request checks


def _bad(fn: object, raw: bytes) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        fn(raw, max_tokens=100)  # type: ignore[operator]
    return info.value


def test_completion_prompt_forms() -> None:
    assert parse_completion(b'{"prompt": [1, 2, 3]}', max_tokens=100).token_ids == [1, 2, 3]
    assert parse_completion(b'{"prompt": [[4, 5], [6]]}', max_tokens=100).token_ids == [4, 5]
    text = parse_completion(b'{"prompt": "hi there", "stream": true, "x_unknown": 1}', max_tokens=100)
    assert text.text == "hi there" and text.token_ids is None and text.stream
    assert text.body["x_unknown"] == 1  # unknown fields ride along untouched
    assert parse_completion(b'{"prompt": ["a b", "c"]}', max_tokens=100).text == "a b"


@pytest.mark.parametrize(("raw", "param", "code"), [
    (b"", None, "invalid_json"),
    (b"{nope", None, "invalid_json"),
    (b"[1]", None, "invalid_json"),
    (b"[" * 100_000 + b"]" * 100_000, None, "invalid_json"),  # nesting limit (was a 500)
    (b'{"max_tokens": 3}', "prompt", "missing_required_parameter"),
    (b'{"prompt": 5}', "prompt", "invalid_type"),
    (b'{"prompt": []}', "prompt", "invalid_value"),
    (b'{"prompt": [1, "a"]}', "prompt", "invalid_type"),
    (b'{"prompt": [1, -2]}', "prompt", "invalid_value"),
    (b'{"prompt": [true, 1]}', "prompt", "invalid_type"),
    (b'{"prompt": "x", "stream": "yes"}', "stream", "invalid_type"),
    (b'{"prompt": "x", "model": 3}', "model", "invalid_type"),
    (b'{"prompt": "x", "stream_options": 1}', "stream_options", "invalid_type"),
])
def test_completion_bad_input_in_openai_shape(raw: bytes, param: str | None, code: str) -> None:
    err = _bad(parse_completion, raw)
    assert err.status == 400 and err.param == param and err.code == code
    body = json.loads(err.body())
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]


def test_completion_token_limit() -> None:
    err = _bad(parse_completion, json.dumps({"prompt": list(range(101))}).encode())
    assert err.status == 400 and "limit" in err.message


def test_chat_checks() -> None:
    ok = parse_chat(b'{"messages": [{"role": "user", "content": "hi"}], "stream": true}', max_tokens=10)
    assert ok.kind == "chat" and ok.path == "/v1/chat/completions" and ok.stream
    assert not ok.client_wants_usage()
    assert parse_chat(b'{"messages": [{"role": "user"}], "stream_options": {"include_usage": true}}',
                      max_tokens=10).client_wants_usage()
    assert _bad(parse_chat, b'{"model": "m"}').code == "missing_required_parameter"
    assert _bad(parse_chat, b'{"messages": []}').param == "messages"
    assert _bad(parse_chat, b'{"messages": [{"content": "no role"}]}').param == "messages[0]"


# --------------------------------------------------------------------------- SSE relay


def _usage_chunk(cached: int) -> bytes:
    return b'data: {"choices": [], "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": %d}}}\n\n' % cached


def test_relay_forwards_whole_events_as_they_complete() -> None:
    relay = SseRelay(strip_usage=False)
    assert relay.feed(b'data: {"choices": [{"text": "a"}]}') == b""  # incomplete: held
    assert relay.feed(b"\n\ndata: {\"cho") == b'data: {"choices": [{"text": "a"}]}\n\n'
    assert relay.feed(b'ices": []}\n\n') == b'data: {"choices": []}\n\n'
    assert relay.events == 2 and relay.flush() == b""


def test_relay_sees_the_first_generated_token_not_the_role_chunk() -> None:
    # a chat stream opens with the role chunk, sent before the engine prefills
    chat = SseRelay(strip_usage=False)
    role = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
    assert chat.feed(role) == role and not chat.generated
    assert not chat.feed(b'data: {"choices": [{"delta": {"content": "hi"}}]}')  # held: incomplete
    assert not chat.generated
    chat.feed(b"\n\n")
    assert chat.generated
    completion = SseRelay(strip_usage=False)
    completion.feed(b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n\n')
    assert completion.generated
    for first in (b'data: {"choices": [{"text": "", "finish_reason": "length"}]}\n\n',
                  b'data: {"error": {"message": "boom"}}\n\n', b"data: [DONE]\n\n", b"data: not json\n\n"):
        relay = SseRelay(strip_usage=False)
        relay.feed(first)
        assert relay.generated, first  # the end, an error or an unknown shape: nothing more to prefill


def test_relay_strips_usage_the_client_did_not_ask_for() -> None:
    relay = SseRelay(strip_usage=True)
    stream = b'data: {"choices": [{"text": "a"}]}\n\n' + _usage_chunk(32) + b"data: [DONE]\n\n"
    out = relay.feed(stream[:50]) + relay.feed(stream[50:]) + relay.flush()
    assert out == b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n'
    assert relay.usage is not None and relay.usage["prompt_tokens_details"]["cached_tokens"] == 32
    # usage riding on a chunk with choices: the key goes, the choices stay
    mixed = SseRelay(strip_usage=True)
    out = mixed.feed(b'data: {"choices": [{"text": "b"}], "usage": {"prompt_tokens": 3}}\r\n\r\n')
    assert json.loads(out[len(b"data: "):]) == {"choices": [{"text": "b"}]}
    assert mixed.usage == {"prompt_tokens": 3}


def test_relay_keeps_usage_when_asked_and_error_event_shape() -> None:
    relay = SseRelay(strip_usage=False)
    assert relay.feed(_usage_chunk(16)) == _usage_chunk(16)
    assert relay.usage is not None
    event = sse_error_event("boom", code="upstream_error")
    first, done = event.split(b"\n\n")[:2]
    assert json.loads(first[len(b"data: "):])["error"] == {
        "message": "boom", "type": "server_error", "param": None, "code": "upstream_error"}
    assert done == b"data: [DONE]"


# --------------------------------------------------------------------------- truth loop


class _Flags:
    def __init__(self) -> None:
        self.changes: list[tuple[str, bool]] = []

    def __call__(self, worker: str, flag: bool) -> None:
        self.changes.append((worker, flag))


def test_cap_prediction_matches_engines_recomputing_the_last_token() -> None:
    assert cap_prediction(64, 64, 16) == 48
    assert cap_prediction(64, 65, 16) == 64
    assert cap_prediction(32, 200, 16) == 32
    assert cap_prediction(10, 0, 16) == 0


def test_agreement_and_races_do_not_flag() -> None:
    flags = _Flags()
    truth = TruthLoop(16, flags)
    for i in range(40):
        truth.observe("w0", TruthSample(64, 64 if i % 5 else 48, 16))
        # a sibling's blocks stored between routing and prefill: explained by the second look
        truth.observe("w0", TruthSample(0, 64, 16, predicted_after=64))
        truth.observe("w0", TruthSample(0, 0, 16))  # cold on both sides: no evidence
    assert flags.changes == [] and not truth.status("w0")["misaligned"]
    assert truth.status("w0")["requests"] == 120


def test_tokenizer_mismatch_flagged_then_cleared() -> None:
    flags = _Flags()
    truth = TruthLoop(16, flags)
    n = 0
    while not flags.changes:
        truth.observe("w1", TruthSample(0, 96, 16))  # the engine reuses what the index never matches
        n += 1
        assert n < 50
    assert n == 8  # half a window of evidence
    status = truth.status("w1")
    assert status["misaligned"] and "tokenizer" in status["cause"]
    assert truth.misaligned() == {"w1": status["cause"]}
    for _ in range(16):
        truth.observe("w1", TruthSample(96, 96, 16))
    assert flags.changes == [("w1", True), ("w1", False)]
    assert truth.status("w1")["cause"] is None


def test_causes_predicted_high_reported_zero_and_block_size() -> None:
    flags = _Flags()
    truth = TruthLoop(16, flags)
    for _ in range(8):
        truth.observe("a", TruthSample(128, 0, 16))
    assert "hash seed" in truth.status("a")["cause"]
    for _ in range(8):
        truth.observe("b", TruthSample(128, 48, 16))
    assert "BlockRemoved" in truth.status("b")["cause"]
    # events published in 32-token blocks, engine reuses in 16s: multiples the events never use
    for reported, predicted in [(48, 32), (80, 64), (112, 96), (48, 32), (80, 64), (16, 0), (48, 32), (80, 64)]:
        truth.observe("c", TruthSample(predicted, reported, 32))
    status = truth.status("c")
    assert status["misaligned"] and status["cause"].startswith("block size") and "16" in status["cause"]


def test_coarser_engine_block_is_told_from_coarse_sharing() -> None:
    flags = _Flags()
    truth = TruthLoop(16, flags)
    # events in 16-token blocks, engine caches in 64s: it reports the prediction rounded down to 64
    for predicted in (80, 144, 208, 272, 80, 144, 208, 272):
        truth.observe("coarse", TruthSample(predicted, predicted // 64 * 64, 16))
    status = truth.status("coarse")
    assert status["misaligned"] and status["cause"].startswith("block size") and "64" in status["cause"]
    # Same block size, prefixes shared in 64-token units (a trace replay) under memory
    # pressure: every report is a multiple of 64, predictions differ by evictions, not by
    # rounding. Not a block-size mismatch (and too few disagree to flag at all).
    for predicted, reported in [(2496, 2432), (1280, 1280), (1000, 640), (640, 640), (2000, 1408),
                                (1536, 1536), (1100, 512), (704, 704)]:
        truth.observe("pressure", TruthSample(predicted, reported, 16))
    assert truth.status("pressure")["misaligned"] is False
    assert ("pressure", True) not in flags.changes


def test_unreported_usage_counts_but_never_flags() -> None:
    truth = TruthLoop(8, _Flags())
    for _ in range(20):
        truth.observe_unreported("w")
    assert truth.status("w")["reports_cached_tokens"] is False and not truth.status("w")["misaligned"]


# --------------------------------------------------------------------------- local tokenizer


def _tiny_tokenizer(tmp_path: Path, template: str | None) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"])
    tok.train_from_iterator(["hello world the quick brown fox", "jumps over the lazy dog hello"], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    config: dict[str, object] = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
    if template is not None:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_local_tokenizer_text_and_chat(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    path = _tiny_tokenizer(tmp_path, TEMPLATE)
    tok = LocalTokenizer(path)
    reference = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = asyncio.run(tok.completion_tokens("hello the fox", {}, None))
    assert ids == reference.encode("hello the fox").ids and ids[0] == 1  # BOS from the post-processor
    body = {"messages": [{"role": "user", "content": "hello world"}]}
    assert tok.render_chat(body) == "<s><|user|> hello world <|assistant|>"
    chat = asyncio.run(tok.chat_tokens(body, None))
    assert chat == reference.encode("<s><|user|> hello world <|assistant|>", add_special_tokens=False).ids
    assert chat.count(1) == 1  # the template wrote BOS; tokenizing did not add a second one
    long_text = "hello " * 5000
    assert asyncio.run(tok.completion_tokens(long_text, {}, None)) == reference.encode(long_text).ids


def test_local_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no tokenizer\.json"):
        LocalTokenizer(tmp_path)
    tok = LocalTokenizer(_tiny_tokenizer(tmp_path, None))
    with pytest.raises(TokenizeError, match="no chat template"):
        asyncio.run(tok.chat_tokens({"messages": [{"role": "user", "content": "x"}]}, None))
    raising = LocalTokenizer(_tiny_tokenizer(tmp_path, "{{ raise_exception('only user turns') }}"))
    with pytest.raises(TokenizeError, match="only user turns"):
        raising.render_chat({"messages": [{"role": "system", "content": "x"}]})
    with pytest.raises(ConfigError, match="does not compile"):
        LocalTokenizer(_tiny_tokenizer(tmp_path, "{% for %}"))


# --------------------------------------------------------------------------- settings


def test_worker_url_key() -> None:
    spec = WorkerSpec.parse("name=w0,url=http://10.0.0.5:8000/,events=tcp://10.0.0.5:5557")
    assert spec.url == "http://10.0.0.5:8000" and spec.to_dict()["url"] == spec.url
    assert WorkerSpec.parse("name=w0,events=tcp://h:1").url is None
    for bad in ("ftp://h:1", "http://", "h:8000", "http://h :1"):
        with pytest.raises(ConfigError, match="url"):
            WorkerSpec.parse(f"name=w0,events=tcp://h:1,url={bad}")


def test_gateway_settings_from_flags_env_and_toml(tmp_path: Path) -> None:
    assert load_server_config({}).gateway == GatewayConfig()
    toml = tmp_path / "r.toml"
    toml.write_text('tokenizer = "/models/x"\nupstream_timeout_s = 30\ntruth_window = 8\n')
    env = {"TOKENSPEED_ROUTER_UPSTREAM_RETRIES": "0", "TOKENSPEED_ROUTER_UPSTREAM_TIMEOUT_S": "12.5"}
    gw = load_server_config({"upstream_connect_timeout_s": 1.5}, env, toml).gateway
    assert gw == GatewayConfig(tokenizer="/models/x", upstream_timeout_s=12.5, upstream_connect_timeout_s=1.5,
                               upstream_retries=0, truth_window=8)
    for bad in ({"upstream_timeout_s": -1}, {"upstream_retries": "x"}, {"truth_window": 2},
                {"upstream_max_connections": 0}, {"tokenizer": ""}):
        with pytest.raises(ConfigError):
            load_server_config(bad)


# --------------------------------------------------------------------------- /health


def test_health_503_when_every_worker_is_stale() -> None:
    dead = f"tcp://127.0.0.1:{free_tcp_port()}"  # nothing publishes there
    config = ServerConfig(http=None, stale_after_s=0.3,
                          workers=(WorkerSpec(name="w0", events=dead, url="http://127.0.0.1:9"),))
    service = RouterService(config)
    service.start()
    try:
        with TestClient(create_app(service)) as client:
            wait_until(lambda: client.get("/health").status_code == 503, 20, interval_s=0.05,
                       what="/health to report the stale worker")
            health = client.get("/health").json()
            assert health["status"] == "unavailable"
            assert any("stale" in p for p in health["problems"])
            entry = client.get("/workers").json()["w0"]
            assert entry["url"] == "http://127.0.0.1:9" and entry["reachable"] and not entry["misaligned"]
    finally:
        service.stop()


class _DownStateSink:
    """A state backend that reports itself disconnected (what Redis' sink says when Redis is gone)."""

    def __init__(self, service: RouterService) -> None:
        self._apply = service.apply_item

    def submit(self, item: object) -> None:
        self._apply(item)  # type: ignore[arg-type]

    def close(self) -> None:
        pass

    def health(self) -> dict[str, object]:
        return {"backend": "test", "connected": False}


def test_health_503_when_the_state_backend_is_down() -> None:
    service = RouterService(ServerConfig(http=None), sink_factory=_DownStateSink)
    service.start()
    try:
        with TestClient(create_app(service)) as client:
            resp = client.get("/health")
            assert resp.status_code == 503
            assert resp.json()["status"] == "unavailable"
            assert resp.json()["problems"] == ["state backend unreachable"]
    finally:
        service.stop()


def test_no_worker_with_a_url_is_a_503_in_openai_shape() -> None:
    dead = f"tcp://127.0.0.1:{free_tcp_port()}"
    service = RouterService(ServerConfig(http=None, workers=(WorkerSpec(name="w0", events=dead),)))
    service.start()
    try:
        with TestClient(create_app(service)) as client:
            resp = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
            assert resp.status_code == 503
            assert resp.json()["error"]["code"] == "no_worker_available" and "url" in resp.json()["error"]["message"]
            assert client.get("/workers").json()["w0"]["in_flight"] == 0  # released at once
            assert client.get("/v1/models").status_code == 503
    finally:
        service.stop()


# --- gradual trust (issue 20: lower trust instead of routing on load alone) ----------


def test_truth_trust_falls_gradually_and_load_only_comes_at_zero() -> None:
    from tokenspeed_router.gateway.truth import TruthLoop, TruthSample, trust_of

    assert trust_of(0, 10) == 1.0 and trust_of(5, 10) == 0.5 and trust_of(8, 10) == 0.0
    trusts: list[float] = []
    flags: list[bool] = []
    loop = TruthLoop(8, lambda w, m: flags.append(m), on_trust=lambda w, t: trusts.append(t))
    good, bad = TruthSample(640, 640, 64), TruthSample(640, 0, 64)
    for _ in range(8):
        loop.observe("w0", good)
    assert trusts == [] and flags == []
    for _ in range(3):  # 3 of 8 disagree: trust 0.75, still routed by prefix
        loop.observe("w0", bad)
    assert trusts[-1] == trust_of(3, 8) and flags == []
    for _ in range(5):  # all 8 disagree: trust 0, now routed on load only
        loop.observe("w0", bad)
    assert trusts[-1] == 0.0 and flags == [True] and loop.status("w0")["trust"] == 0.0
    assert loop.status("w0")["misaligned"]
    for _ in range(8):
        loop.observe("w0", good)
    assert trusts[-1] == 1.0 and flags == [True, False]


def test_router_trust_scales_the_credit() -> None:
    from support.router import StubIndex, make_router

    index = StubIndex()
    index.hold("w0", 10)
    router = make_router(index, workers=("w0", "w1"))
    full = router.route(list(range(640)))
    router.release(full.request_id)
    router.set_trust("w0", 0.5)
    half = router.route(list(range(640)))
    assert half.credited_tokens("w0") == full.credited_tokens("w0") / 2
    router.release(half.request_id)
    router.set_trust("w0", 0.0)
    assert router.route(list(range(640))).credits.get("w0") is None
    router.set_trust("w0", 1.0)
    assert router.route(list(range(640))).credited_tokens("w0") == full.credited_tokens("w0")
