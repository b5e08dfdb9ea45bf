"""Small Python clients for the router's query API (ZeroMQ and HTTP).

Both expose the same methods (``match``, ``route``, ``release``, ``workers``,
``health``) returning the JSON-shaped answers of DESIGN §6 (``lora_id`` may be
an integer or an adapter name), and raise
:class:`~tokenspeed_router.errors.RouterApiError` (with the HTTP-style
``status``) when the router refuses a request.

:class:`ZmqRouterClient` uses a DEALER socket and tags each request with an
id, so an answer that arrives after its request timed out is recognised and
dropped instead of being returned for the next call. One client per thread
(ZeroMQ sockets are not thread safe).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import msgspec
import zmq

from tokenspeed_router.errors import RouterApiError

__all__ = ["HttpRouterClient", "RouterApiError", "ZmqRouterClient"]


def _tokens(token_ids: Sequence[int] | Any) -> list[int]:
    tolist = getattr(token_ids, "tolist", None)
    return list(tolist() if callable(tolist) else token_ids)


def _body(
    token_ids: Sequence[int] | Any, lora_id: int | str | None, salt: str | None, request_id: str | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {"token_ids": _tokens(token_ids)}
    if lora_id is not None:
        body["lora_id"] = lora_id
    if salt is not None:
        body["salt"] = salt
    if request_id is not None:
        body["request_id"] = request_id
    return body


class ZmqRouterClient:
    """Request/reply client of ``serve --zmq-api`` (msgpack over a DEALER socket)."""

    def __init__(
        self,
        endpoint: str,
        auth_token: str | None = None,
        timeout_s: float = 5.0,
        *,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self._own_context = context is None
        self._ctx: zmq.Context[Any] = context if context is not None else zmq.Context()
        self._sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if endpoint.startswith("tcp://[") or "::" in endpoint:
            self._sock.setsockopt(zmq.IPV6, 1)
        self._sock.connect(endpoint)
        self._auth = auth_token
        self._timeout_ms = max(1, int(timeout_s * 1000))
        self._ids = itertools.count(1)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder()
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    def call(self, op: str, **fields: Any) -> Any:
        """Send one request and wait for its answer; returns the ``result``."""
        req_id = next(self._ids)
        msg: dict[str, Any] = {"op": op, "id": req_id, **fields}
        if self._auth is not None:
            msg["auth"] = self._auth
        self._sock.send(self._enc.encode(msg))
        remaining = self._timeout_ms
        while True:
            if not self._poller.poll(remaining):
                raise TimeoutError(f"router did not answer {op!r} within {self._timeout_ms} ms")
            reply = self._dec.decode(self._sock.recv())
            if not isinstance(reply, dict) or reply.get("id") != req_id:
                continue  # a late answer to an earlier, timed-out request
            status = reply.get("status", 500)
            if status != 200:
                raise RouterApiError(status, str(reply.get("error", "unknown error")))
            return reply.get("result")

    def match(self, token_ids: Sequence[int] | Any, *, lora_id: int | str | None = None, salt: str | None = None) -> Any:
        return self.call("match", **_body(token_ids, lora_id, salt))

    def route(
        self,
        token_ids: Sequence[int] | Any,
        *,
        request_id: str | None = None,
        lora_id: int | str | None = None,
        salt: str | None = None,
        explain: bool = False,
    ) -> Any:
        """``explain=True``: the answer also carries the decision's ``explain`` breakdown (DESIGN §13)."""
        body = _body(token_ids, lora_id, salt, request_id)
        if explain:
            body["explain"] = True
        return self.call("route", **body)

    def release(self, request_id: str) -> Any:
        return self.call("release", request_id=request_id)

    def workers(self) -> Any:
        """``{worker name: info}`` (the ``GET /workers`` object, DESIGN §6)."""
        return self.call("workers")

    def health(self) -> Any:
        return self.call("health")

    def close(self) -> None:
        self._sock.close(linger=0)
        if self._own_context:
            self._ctx.term()

    def __enter__(self) -> ZmqRouterClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class HttpRouterClient:
    """JSON-over-HTTP client of ``serve --http`` (httpx, keep-alive connection)."""

    def __init__(self, base_url: str, auth_token: str | None = None, timeout_s: float = 5.0) -> None:
        import httpx  # imported here: only the HTTP client needs it

        headers = {"content-type": "application/json"}
        if auth_token is not None:
            headers["authorization"] = f"Bearer {auth_token}"
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)
        self._enc = msgspec.json.Encoder()

    def _answer(self, resp: Any) -> Any:
        try:
            data = msgspec.json.decode(resp.content)
        except msgspec.DecodeError:
            data = None
        if resp.status_code >= 400:
            message = data.get("error") if isinstance(data, dict) else resp.text
            raise RouterApiError(resp.status_code, str(message))
        return data

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        return self._answer(self._http.post(path, content=self._enc.encode(body)))

    def match(self, token_ids: Sequence[int] | Any, *, lora_id: int | str | None = None, salt: str | None = None) -> Any:
        return self._post("/match", _body(token_ids, lora_id, salt))

    def route(
        self,
        token_ids: Sequence[int] | Any,
        *,
        request_id: str | None = None,
        lora_id: int | str | None = None,
        salt: str | None = None,
        explain: bool = False,
    ) -> Any:
        """``explain=True``: the answer also carries the decision's ``explain`` breakdown (DESIGN §13)."""
        body = _body(token_ids, lora_id, salt, request_id)
        if explain:
            body["explain"] = True
        return self._post("/route", body)

    def release(self, request_id: str) -> Any:
        return self._post("/release", {"request_id": request_id})

    def workers(self) -> Any:
        """``GET /workers``: ``{worker name: info}`` at the top level (DESIGN §6)."""
        return self._answer(self._http.get("/workers"))

    def health(self) -> Any:
        return self._answer(self._http.get("/health"))

    def wait_ready(self, timeout_s: float = 30.0) -> Any:
        """Poll ``/health`` until the router answers (deploy scripts, examples); returns it."""
        import httpx

        deadline = time.monotonic() + timeout_s
        pause = threading.Event()
        while True:
            try:
                return self.health()
            except (httpx.TransportError, RouterApiError):
                if time.monotonic() > deadline:
                    raise
                pause.wait(0.05)

    def put_worker(self, name: str, spec: dict[str, Any]) -> Any:
        return self._answer(self._http.put(f"/workers/{name}", content=self._enc.encode(spec)))

    def delete_worker(self, name: str) -> Any:
        return self._answer(self._http.delete(f"/workers/{name}"))

    def metrics(self) -> str:
        resp = self._http.get("/metrics")
        if resp.status_code >= 400:
            self._answer(resp)
        return str(resp.text)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> HttpRouterClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
