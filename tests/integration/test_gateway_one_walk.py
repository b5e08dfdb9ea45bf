"""A gateway request walks the KV index once (issue 20, item 4).

Real parts: two engine-sim subprocesses publishing KV events, an in-process
``RouterService`` subscribed to them with the gateway mounted (Starlette's
TestClient drives it; the gateway proxies to the engines over HTTP). The
index is the real ``KvIndex`` with one change, a counter on its two query
methods, installed through ``RouterService.replace_index``: every index walk
of the process is counted, whoever makes it.

Before this change the gateway asked ``match`` for its prediction and then
``route``, which matched again: two walks per request (three when the
engine's answer needed a second look).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient
from support import wait_until
from support.engine_sim import EngineSim

from tokenspeed_router.router import KvIndex, MatchDetail, RouterConfig
from tokenspeed_router.server import RouterService, ServerConfig, WorkerSpec, create_app


class CountingIndex(KvIndex):
    """The real index, counting its walks (``match`` and ``match_detail``)."""

    walks = 0

    def match(self, token_ids: Any, lora_id: int | str | None = None, salt: str | bytes | None = None) -> dict[str, int]:
        self.walks += 1
        return super().match(token_ids, lora_id, salt)

    def match_detail(self, token_ids: Any, lora_id: int | str | None = None,
                     salt: str | bytes | None = None) -> MatchDetail:
        self.walks += 1
        return super().match_detail(token_ids, lora_id, salt)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineSim]]:
    workdir = tmp_path_factory.mktemp("one-walk")
    started: list[EngineSim] = []
    try:
        for _ in range(2):
            started.append(EngineSim(workdir, ["--prefill-tokens-per-s", "1000000"]).start())
        yield started
    finally:
        for engine in started:
            engine.stop()


def _service(engines: list[EngineSim], policy: str) -> tuple[RouterService, CountingIndex]:
    specs = tuple(WorkerSpec(name=f"w{i}", url=e.url, events=e.events, replay=e.replay_endpoint)
                  for i, e in enumerate(engines))
    service = RouterService(ServerConfig(http=None, workers=specs, router=RouterConfig(policy=policy)))
    index = CountingIndex()
    service.replace_index(index)  # before start: the subscribers feed this one
    return service, index


def _complete(client: TestClient, prompt: list[int], **extra: Any) -> tuple[str, dict[str, Any]]:
    resp = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, **extra})
    assert resp.status_code == 200, resp.text
    return resp.headers["x-tokenspeed-worker"], resp.json()


@pytest.mark.parametrize("policy", ["kv_aware", "round_robin"])
def test_a_gateway_request_walks_the_index_once(engines: list[EngineSim], policy: str) -> None:
    service, index = _service(engines, policy)
    service.start()
    try:
        with TestClient(create_app(service)) as client:
            wait_until(lambda: all(w["connected"] for w in service.workers().values()), 30, interval_s=0.02,
                       what="the router to connect to both engines' events")
            base = 10_000 if policy == "kv_aware" else 20_000
            prompt = list(range(base, base + 64))  # 4 blocks of 16
            worker, first = _complete(client, prompt)
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert index.walks == 1
            wait_until(lambda: service.match(prompt).scores.get(worker) == 4, 20, interval_s=0.02,
                       what="the engine's BlockStored events to reach the index")

            index.walks = 0
            follow = [*prompt, 7, 7, 7]
            again, second = _complete(client, follow)
            assert index.walks == 1  # the routing walk; the prediction came with the decision
            if policy == "kv_aware":
                assert again == worker
            if again == worker:
                assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 64

            index.walks = 0
            with client.stream("POST", "/v1/completions",
                               json={"prompt": [*prompt, 8, 8], "max_tokens": 3, "stream": True}) as resp:
                assert resp.status_code == 200
                lines = list(resp.iter_lines())  # read to the end (leaving early is a disconnect)
            assert "data: [DONE]" in lines
            assert index.walks == 1

            # the truth loop got the index's prediction from the decision: agreement, no flag
            # (a stream is learned from just after its last chunk went out)
            def truth() -> dict[str, Any]:
                return dict(client.get("/workers").json()[worker]["truth"])

            wait_until(lambda: truth()["requests"] == (3 if again == worker else 2), 10, interval_s=0.02,
                       what="the truth loop to learn the streamed answer")
            assert truth()["predicted_cached_tokens"] >= 64 and truth()["reported_cached_tokens"] >= 64
            assert not truth()["misaligned"]
            assert index.walks == 1  # /workers walks nothing
            client.portal.call(client.app.state.gateway.aclose)  # type: ignore[union-attr]
    finally:
        service.stop()
