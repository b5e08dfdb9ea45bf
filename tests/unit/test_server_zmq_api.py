"""ZeroMQ query API and its Python client: same operations and errors as HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import zmq
from support.server import batch, stored, tokens

from tokenspeed_router.errors import RouterApiError
from tokenspeed_router.server import RouterService, ServerConfig, ZmqApiServer, ZmqRouterClient


@pytest.fixture
def api() -> Iterator[tuple[RouterService, ZmqApiServer]]:
    service = RouterService(ServerConfig(http=None, auth_token="s3cret"))
    service.apply_record("w0", 0, batch(stored(tokens(1, 4))), 1.0)
    server = ZmqApiServer(service, "tcp://127.0.0.1:*")
    server.start()
    yield service, server
    server.stop()
    service.stop()


def test_operations_match_http_shapes(api: tuple[RouterService, ZmqApiServer]) -> None:
    service, server = api
    with ZmqRouterClient(server.endpoint, auth_token="s3cret", timeout_s=5) as client:
        assert client.health()["status"] == "ok"
        m = client.match(tokens(1, 4))
        assert m == service.match(tokens(1, 4)).to_dict()
        assert m["scores"] == {"w0": 4}
        r = client.route(tokens(1, 4), request_id="z1")
        assert r["worker"] == "w0" and r["matched_tokens"] == 64 and r["request_id"] == "z1"
        workers = client.workers()
        # the GET /workers object: {name: info} at the top level
        assert set(workers) == set(service.workers()) == {"w0"} and workers["w0"]["in_flight"] == 1
        assert workers["w0"]["blocks_held"] == workers["w0"]["blocks"] == 4
        assert client.release("z1") == {}
        assert client.workers()["w0"]["in_flight"] == 0


def test_lora_by_name_or_id(api: tuple[RouterService, ZmqApiServer]) -> None:
    service, server = api
    service.apply_record("named", 0, batch(msgspec.structs.replace(stored(tokens(2, 2)), lora_name="sql")), 1.0)
    with ZmqRouterClient(server.endpoint, auth_token="s3cret", timeout_s=5) as client:
        assert client.match(tokens(2, 2), lora_id="sql")["scores"]["named"] == 2
        assert client.match(tokens(2, 2), lora_id=7)["scores"].get("named", 0) == 0
        assert client.route(tokens(2, 2), lora_id="sql")["worker"] == "named"
        with pytest.raises(RouterApiError, match=r"\$\.lora_id") as err:
            client.match([1], lora_id="")
        assert err.value.status == 400


def test_errors_and_auth(api: tuple[RouterService, ZmqApiServer]) -> None:
    _, server = api
    with ZmqRouterClient(server.endpoint, timeout_s=5) as anon:
        assert anon.health()["status"] == "ok"  # open, like GET /health
        with pytest.raises(RouterApiError) as err:
            anon.match([1, 2])
        assert err.value.status == 401
    with ZmqRouterClient(server.endpoint, auth_token="wrong", timeout_s=5) as bad, \
            pytest.raises(RouterApiError, match="invalid bearer token"):
        bad.route([1])
    with ZmqRouterClient(server.endpoint, auth_token="Bearer s3cret", timeout_s=5) as client:
        with pytest.raises(RouterApiError, match=r"\$\.token_ids\[0\]") as err:
            client.match([-1])
        assert err.value.status == 400
        with pytest.raises(RouterApiError, match="Invalid value 'drop'"):
            client.call("drop")
        with pytest.raises(RouterApiError, match="missing required field `request_id`"):
            client.call("release")


def test_malformed_requests_get_answers_and_the_server_lives(api: tuple[RouterService, ZmqApiServer]) -> None:
    _, server = api
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(server.endpoint)
    poller = zmq.Poller()
    poller.register(dealer, zmq.POLLIN)

    def ask(*frames: bytes) -> dict[str, object]:
        dealer.send_multipart(list(frames))
        assert poller.poll(5000), "no reply"
        reply = msgspec.msgpack.decode(dealer.recv_multipart()[-1])
        assert isinstance(reply, dict)
        return reply

    garbage = ask(b"\xc1\xff\x00")
    assert garbage["status"] == 400 and "malformed msgpack" in str(garbage["error"])
    not_a_map = ask(msgspec.msgpack.encode([1, 2, 3]))
    assert not_a_map["status"] == 400
    deep = ask(b"\x91" * 100_000 + b"\x00")
    assert deep["status"] == 400
    no_op = ask(msgspec.msgpack.encode({"token_ids": [1]}))
    assert "missing required field `op`" in str(no_op["error"])
    two = ask(b"a", b"b", b"c")
    assert two["status"] == 400 and "payload frame" in str(two["error"])
    ok = ask(msgspec.msgpack.encode({"op": "match", "id": 7, "auth": "s3cret", "token_ids": tokens(1, 4)}))
    assert ok["status"] == 200 and ok["id"] == 7
    # a REQ client (empty delimiter) works too
    req = ctx.socket(zmq.REQ)
    req.linger = 0
    req.connect(server.endpoint)
    req.send(msgspec.msgpack.encode({"op": "health"}))
    assert req.poll(5000)
    assert msgspec.msgpack.decode(req.recv())["status"] == 200
    req.close()
    dealer.close()
    ctx.term()
