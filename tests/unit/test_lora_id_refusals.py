"""``lora_id`` means the same on every query transport: an id (int) or an adapter name (str), nothing else.

vLLM publishes a LoRA by ``lora_name`` (its ``lora_id`` is deprecated and
nil), SGLang/TokenSpeed by ``lora_id``; a query may name either
(docs/gateway.md, "LoRA adapters"). Anything else — a bool, a float, a
negative or out-of-range int, an empty or over-long string, an array or
object — is a 400 naming ``$.lora_id`` on ``POST /match``, ``POST /route``
and the ZeroMQ ``match``/``route`` ops alike, and changes nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from support.server import batch, stored, tokens

from tokenspeed_router.errors import RouterApiError
from tokenspeed_router.server import (
    RouterService,
    ServerConfig,
    ZmqApiServer,
    ZmqRouterClient,
    create_app,
)

with warnings.catch_warnings():
    from starlette.exceptions import StarletteDeprecationWarning

    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from starlette.testclient import TestClient

REFUSED: list[Any] = [True, False, 1.0, 1.5, -1, 2**63, 2**64 - 1, "", "x" * 4097, [1], {"id": 1}]
ACCEPTED: list[Any] = [0, 7, 2**63 - 1, "sql", "x" * 4096]
A = tokens(1, 2)


@pytest.fixture
def service() -> Iterator[RouterService]:
    service = RouterService(ServerConfig(http=None))
    service.apply_record("named", 0, batch(msgspec.structs.replace(stored(A), lora_name="sql")), 1.0)
    service.apply_record("numbered", 0, batch(msgspec.structs.replace(stored(A), lora_id=7)), 1.0)
    yield service
    service.stop()


def _in_flight(service: RouterService) -> int:
    return sum(int(w["in_flight"]) for w in service.workers().values())


@pytest.mark.parametrize("value", REFUSED, ids=repr)
def test_http_refuses_what_is_neither_an_id_nor_a_name(service: RouterService, value: Any) -> None:
    with TestClient(create_app(service)) as client:
        for path in ("/match", "/route"):
            resp = client.post(path, json={"token_ids": A, "lora_id": value})
            assert resp.status_code == 400, (path, resp.text)
            assert "$.lora_id" in resp.json()["error"], resp.text
    assert _in_flight(service) == 0


@pytest.mark.parametrize("value", REFUSED, ids=repr)
def test_zmq_refuses_the_same(service: RouterService, value: Any) -> None:
    server = ZmqApiServer(service, "tcp://127.0.0.1:*")
    server.start()
    try:
        with ZmqRouterClient(server.endpoint, timeout_s=5) as client:
            for op in ("match", "route"):
                with pytest.raises(RouterApiError, match=r"\$\.lora_id") as err:
                    client.call(op, token_ids=A, lora_id=value)
                assert err.value.status == 400
    finally:
        server.stop()
    assert _in_flight(service) == 0


@pytest.mark.parametrize("value", ACCEPTED, ids=lambda v: repr(v)[:12])
def test_ids_and_names_are_matched_in_their_own_namespace(service: RouterService, value: Any) -> None:
    want = {"sql": "named", 7: "numbered"}.get(value)
    with TestClient(create_app(service)) as client:
        resp = client.post("/match", json={"token_ids": A, "lora_id": value})
        assert resp.status_code == 200, resp.text
        held = {w for w, n in resp.json()["scores"].items() if n}
        assert held == ({want} if want else set())
