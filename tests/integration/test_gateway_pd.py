"""Prefill/decode through the gateway (DESIGN §10): vLLM's two legs between two engine-sims."""

from __future__ import annotations

from pathlib import Path

from support.engine_sim import words
from support.gateway import Gateway, sse_events


def test_prefill_leg_then_decode_leg(tmp_path: Path) -> None:
    engine = ["--instant"]
    with Gateway(tmp_path, [[*engine, "--role", "prefill"], [*engine, "--role", "decode"]],
                 roles=["prefill", "decode"],
                 serve_args=["--router-option", "local_prefill_threshold_tokens=0"]) as gw:
        prefill, decode = gw.engines
        resp = gw.post("/v1/completions", {"prompt": words(100, 70), "max_tokens": 5})
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-tokenspeed-worker"] == "w1"
        assert resp.headers["x-tokenspeed-prefill-worker"] == "w0"
        answer = resp.json()
        # the client sees the decode worker's answer, with all its tokens
        assert answer["system_fingerprint"] == decode.name
        assert answer["usage"]["completion_tokens"] == 5 and answer["kv_transfer_params"] is None
        p, d = prefill.metrics(), decode.metrics()
        # prefill leg: max_tokens 1 and do_remote_decode, so one token generated and the prompt computed
        assert p["tokenspeed_engine_sim_generation_tokens_total"] == 1
        assert p["tokenspeed_engine_sim_computed_prompt_tokens_total"] == 70
        # decode leg: the prefill's kv_transfer_params arrived, so the prompt counts as transferred
        assert d["tokenspeed_engine_sim_computed_prompt_tokens_total"] == 0
        assert d["tokenspeed_engine_sim_generation_tokens_total"] == 5

        # chat, streamed: the prefill leg is still one non-stream token, the decode leg streams
        with gw.client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": words(900, 70)}], "max_tokens": 4, "stream": True,
        }) as streamed:
            assert streamed.status_code == 200
            assert streamed.headers["x-tokenspeed-prefill-worker"] == "w0"
            events = list(sse_events(streamed.iter_lines()))
        assert events[-1] == "[DONE]"
        assert sum(1 for e in events if isinstance(e, dict) and e["choices"][0]["delta"].get("content")) == 4
        assert all(isinstance(e, str) or e["system_fingerprint"] == decode.name for e in events)
        assert prefill.metrics()["tokenspeed_engine_sim_generation_tokens_total"] == 2
        assert gw.workers()["w0"]["in_flight"] == 0 and gw.workers()["w1"]["in_flight"] == 0
