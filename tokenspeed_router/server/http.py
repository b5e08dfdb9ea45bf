"""The HTTP API (DESIGN §6) on Starlette, served by uvicorn.

Every answer is JSON; every refusal is ``{"error": "..."}`` with a 4xx status
that names the problem (bad JSON, wrong type and where, limits, unknown
worker), unknown paths and methods included. Nothing a client sends reaches
the index except through typed, validated request structs, and any
unexpected exception in a handler becomes a logged 500, never a dead process.

Decisions worth knowing:

* ``POST /release`` with an unknown (or already expired) ``request_id``
  answers ``200 {}``: releasing is idempotent, and a gateway whose release
  raced the in-flight timeout must not see an error for it. The
  ``tokenspeed_route_releases_total{outcome="unknown"}`` counter shows them.
* Bodies are read with a hard cap (``max_body_bytes``; ``Content-Length`` is
  checked first, chunked bodies are counted as they stream in) before any
  decoding: 413 past it. The 413 goes out before the rest of the body is
  read; the connection then reads and drops the rest (bounded) before it
  closes, so a client still sending reads the 413 and not a broken pipe
  (``server/http_protocol.py``).
* Authentication, when a token is configured, is checked before the body is
  read; ``/health`` stays open for load balancers and probes.
* Starlette routes requests (paths, parameters, 404/405) to small ASGI
  endpoints (:class:`_Endpoint`) without middleware; JSON is encoded and
  decoded by msgspec.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tokenspeed_router.asgi import JSON, Receive, Scope, Send, read_body, send_response
from tokenspeed_router.auth import check_bearer
from tokenspeed_router.endpoints import HostPort, bind_socket, is_loopback_host
from tokenspeed_router.errors import ConfigError, TokenspeedError
from tokenspeed_router.gateway.app import Gateway
from tokenspeed_router.server.api import (
    MatchRequest,
    ReleaseRequest,
    RouteRequest,
    api_error,
    decode_json,
    request_id_text,
    validate_request,
)
from tokenspeed_router.server.app import RouterService
from tokenspeed_router.server.config import WorkerSpec
from tokenspeed_router.server.explain import decision_answer
from tokenspeed_router.server.gc_policy import GcCollector
from tokenspeed_router.server.http_protocol import http_protocol
from tokenspeed_router.server.loop_lag import LoopLag, LoopLagCollector
from tokenspeed_router.server.metrics import CONTENT_TYPE
from tokenspeed_router.server.openapi import openapi_json

__all__ = ["HttpServer", "create_app"]

logger = logging.getLogger(__name__)

_json = msgspec.json.Encoder()
_match_decoder = msgspec.json.Decoder(MatchRequest)
_route_decoder = msgspec.json.Decoder(RouteRequest)
_release_decoder = msgspec.json.Decoder(ReleaseRequest)
_any_decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder()

#: ``handler(scope, body) -> JSON-able result`` or a :class:`_Reply`
Handler = Callable[[Scope, bytes], Awaitable[Any]]


class _Reply:
    """A non-default answer from a handler: status, raw body, content type."""

    __slots__ = ("body", "content_type", "status")

    def __init__(self, status: int, body: bytes, content_type: bytes = JSON) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type


class _Endpoint:
    """One JSON endpoint as a plain ASGI app that Starlette routes to.

    Starlette does the routing (paths, path parameters, 404/405); the hot path
    skips its per-request ``Request``/``Response`` objects and exception
    wrappers, which cost about a quarter of a ``/route`` in process. Here:
    auth (before reading the body), a capped body read, the handler, JSON out;
    :class:`RouterApiError` becomes its status and ``{"error": ...}``, anything else
    a logged 500.
    """

    def __init__(self, service: RouterService, handler: Handler, *, auth: bool, body: bool) -> None:
        self._service = service
        self._handler = handler
        token = service.config.auth_token
        self._expected = token.encode() if (token and auth) else None
        self._max_body = service.config.limits.max_body_bytes
        self._read = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            length: bytes | None = None
            authorization: bytes | None = None
            for key, value in scope["headers"]:
                if key == b"content-length":
                    length = value
                elif key == b"authorization":
                    authorization = value
            if self._expected is not None:
                presented = authorization.decode("latin-1") if authorization is not None else None
                check_bearer(presented, self._expected, header=True)
            body = await read_body(receive, length, self._max_body) if self._read else b""
            result = await self._handler(scope, body)
        except TokenspeedError as caught:
            err = api_error(caught)
            self._service.metrics.api_errors.labels("http", str(err.status)).inc()
            extra = [(b"www-authenticate", b"Bearer")] if err.status == 401 else None
            await send_response(send, err.status, _json.encode({"error": err.message}), headers=extra)
            return
        except Exception:
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            self._service.metrics.api_errors.labels("http", "500").inc()
            await send_response(send, 500, _json.encode({"error": "internal error (logged by the router)"}))
            return
        if isinstance(result, _Reply):
            await send_response(send, result.status, result.body, result.content_type)
        else:
            await send_response(send, 200, _json.encode(result))


class _ByMethod:
    """One ASGI endpoint answering each method with its own (Starlette has checked the method)."""

    def __init__(self, **endpoints: _Endpoint) -> None:
        self._endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._endpoints[scope["method"]](scope, receive, send)


def create_app(service: RouterService) -> Starlette:
    """The Starlette application serving ``service``: DESIGN §6 routes and the §10 gateway."""
    limits = service.config.limits
    gateway = Gateway(service, service.config.gateway)

    async def match(scope: Scope, body: bytes) -> Any:
        req: MatchRequest = decode_json(_match_decoder, body)
        validate_request(req, limits)
        return service.match(req.token_ids, lora_id=req.lora_id, salt=req.salt).to_dict()

    async def route(scope: Scope, body: bytes) -> Any:
        req: RouteRequest = decode_json(_route_decoder, body)
        validate_request(req, limits)
        rid = request_id_text(req.request_id, limits)
        return decision_answer(
            service.route(req.token_ids, request_id=rid, lora_id=req.lora_id, salt=req.salt, explain=req.explain))

    async def release(scope: Scope, body: bytes) -> Any:
        req: ReleaseRequest = decode_json(_release_decoder, body)
        rid = request_id_text(req.request_id, limits)
        assert rid is not None
        service.release(rid)
        return {}

    async def workers(scope: Scope, body: bytes) -> Any:
        out = service.workers()
        for name, entry in out.items():
            entry.update(gateway.worker_info(name))
        return out

    async def health(scope: Scope, body: bytes) -> Any:
        answer = gateway.annotate_health(service.health())
        # 200 while serving (ok, or degraded: a misaligned worker routed on load); 503 otherwise
        return _Reply(200 if answer["status"] in ("ok", "degraded") else 503, _json.encode(answer))

    async def metrics(scope: Scope, body: bytes) -> Any:
        return _Reply(200, service.metrics_text(), CONTENT_TYPE.encode())

    document = openapi_json()  # built once: it depends on the code only

    async def openapi(scope: Scope, body: bytes) -> Any:
        return _Reply(200, document)

    async def put_worker(scope: Scope, body: bytes) -> Any:
        name = scope["path_params"]["name"]
        data = decode_json(_any_decoder, body)
        try:
            spec = WorkerSpec.from_mapping(data, name=name, source=f"PUT /workers/{name}")
        except ConfigError as err:
            raise api_error(err) from None
        # run-time membership goes through the ingestion thread: do not block the loop
        created, streams = await asyncio.to_thread(service.put_worker, spec)
        answer = {"worker": spec.to_dict(), "streams": streams, "created": created}
        return _Reply(201 if created else 200, _json.encode(answer))

    async def delete_worker(scope: Scope, body: bytes) -> Any:
        streams = await asyncio.to_thread(service.delete_worker, scope["path_params"]["name"])
        return {"removed": streams}

    def endpoint(handler: Handler, *, auth: bool = True, body: bool = False) -> _Endpoint:
        return _Endpoint(service, handler, auth=auth, body=body)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        if status == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif status == 405:
            message = f"method {request.method} not allowed on {request.url.path}"
        else:
            message = str(exc.detail) if isinstance(exc, HTTPException) else "internal error"
        # a 405 keeps Starlette's Allow header (RFC 9110: the methods the path does answer)
        headers = exc.headers if isinstance(exc, HTTPException) else None
        return Response(_json.encode({"error": message}), status_code=status, headers=headers,
                        media_type="application/json")

    routes = [
        Route("/match", endpoint(match, body=True), methods=["POST"]),
        Route("/route", endpoint(route, body=True), methods=["POST"]),
        Route("/release", endpoint(release, body=True), methods=["POST"]),
        Route("/workers", endpoint(workers), methods=["GET"]),
        # one route for both methods: a 405 on the path names both in its Allow header
        Route("/workers/{name:path}", _ByMethod(PUT=endpoint(put_worker, body=True), DELETE=endpoint(delete_worker)),
              methods=["PUT", "DELETE"]),
        Route("/health", endpoint(health, auth=False), methods=["GET"]),
        Route("/metrics", endpoint(metrics), methods=["GET"]),
        Route("/openapi.json", endpoint(openapi, auth=False), methods=["GET"]),
        *gateway.routes(),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: not_found})
    app.state.gateway = gateway  # HttpServer closes its upstream connections at shutdown
    return app


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop when installed, asyncio's otherwise.

    uvicorn picks uvloop only in ``uvicorn.run``/``Server.run``; we drive
    ``Server.serve`` in a loop of our own, so the choice is ours to make (and
    ``asyncio.run`` alone always gave the slower stock loop).
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _run_in_new_loop(main: Coroutine[Any, Any, None]) -> None:
    """``asyncio.run(main)`` on :func:`new_event_loop` (``asyncio.Runner`` needs Python 3.11)."""
    loop = new_event_loop()
    try:
        loop.run_until_complete(main)
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


class HttpServer:
    """uvicorn serving :func:`create_app` on a socket bound at construction.

    Binding up front makes ``--http 127.0.0.1:0`` usable (``address`` is the
    real port) and reports "address in use" as a :class:`ConfigError` before
    anything else starts. :meth:`run` blocks; :meth:`request_shutdown` is
    thread-safe (signal handlers and tests call it). Uses uvloop and httptools
    when installed (``uvicorn[standard]``), the pure-Python h11 stack otherwise.
    """

    def __init__(self, service: RouterService, address: HostPort, *, reuse_port: bool = False,
                 epp: Any = None) -> None:
        if not is_loopback_host(address.host):
            auth = service.config.auth_token is not None
            logger.log(
                logging.INFO if auth else logging.WARNING,
                "HTTP API listening on non-loopback %s (auth %s)", address, "on" if auth else "OFF",
            )
        self._sock = bind_socket(address, reuse_port=reuse_port)
        self.address = HostPort(address.host, self._sock.getsockname()[1])
        self._app = create_app(service)
        #: ``--epp``: the endpoint picker, served on this server's loop with the gateway's parts (epp/server.py)
        self.epp: Any = None
        if epp is not None:
            from tokenspeed_router.epp.server import EppServer

            self.epp = EppServer(service, self._app.state.gateway, epp)
        self._failure: BaseException | None = None
        self.loop_lag = LoopLag()
        service.metrics.add_collector(LoopLagCollector(self.loop_lag))
        service.metrics.add_collector(GcCollector())  # the process's collector pauses (gc_policy.py)
        config = uvicorn.Config(
            # the gateway's POST endpoints skip Starlette's middleware (12% less CPU per proxied request)
            self._app.state.gateway.front(self._app),
            log_level="warning",
            access_log=False,
            lifespan="off",
            # httptools (a dependency): one write per answer, early answers drained (http_protocol.py)
            http=http_protocol(drain_max_bytes=max(64 << 20, 4 * service.config.limits.max_body_bytes)),
            server_header=False,
            date_header=False,
            # no X-Forwarded-* rewriting of the client address: nothing here reads it, and the
            # middleware is one more coroutine layer on every request
            proxy_headers=False,
            timeout_keep_alive=30,
            timeout_graceful_shutdown=5,  # in-flight requests get 5 s at SIGTERM, then we exit
            limit_concurrency=4096,  # beyond this many connections + requests: 503, not memory growth
            backlog=2048,
        )
        self._server = uvicorn.Server(config)
        # Signals are ours (cli_serve installs handlers that call request_shutdown):
        # uvicorn would otherwise re-raise SIGTERM after its shutdown, killing the
        # process before the event log is flushed.
        self._server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
        self.started = threading.Event()

    def run(self) -> None:
        """Serve until :meth:`request_shutdown`; then close the socket."""

        async def main() -> None:
            serving = asyncio.ensure_future(self._server.serve(sockets=[self._sock]))
            while not self._server.started and not serving.done():
                await asyncio.sleep(0.005)
            if self._server.started:
                logger.info("HTTP API on http://%s", self.address)
                self.loop_lag.start()
                if self.epp is not None:
                    try:
                        await self.epp.start()
                    except Exception as err:  # a port taken meanwhile: stop serving, fail the command
                        self._failure = err
                        self._server.should_exit = True
                self.started.set()
            try:
                await serving
            finally:
                self.loop_lag.stop()
                if self.epp is not None:
                    await self.epp.stop()
                await self._app.state.gateway.aclose()

        try:
            _run_in_new_loop(main())
        finally:
            self._sock.close()
        if self._failure is not None:
            raise self._failure

    def request_shutdown(self) -> None:
        self._server.should_exit = True

    def close(self) -> None:
        """Release the listen socket of a server that never ran (idempotent)."""
        self._sock.close()

    def start_background(self, timeout_s: float = 10.0) -> threading.Thread:
        """Run in a daemon thread (tests, benchmarks, ``replay --serve`` helpers)."""
        thread = threading.Thread(target=self.run, name="tokenspeed-http", daemon=True)
        thread.start()
        if not self.started.wait(timeout_s):
            raise RuntimeError(f"HTTP server did not start within {timeout_s}s")
        return thread
