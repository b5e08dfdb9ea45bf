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
  decoding: 413 past it.
* Authentication, when a token is configured, is checked before the body is
  read; ``/health`` stays open for load balancers and probes.
* Handlers are plain ``async def`` functions on Starlette routes without
  middleware (Starlette's ``BaseHTTPMiddleware`` costs a task per request);
  JSON is encoded and decoded by msgspec.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tokenspeed_router.errors import ConfigError
from tokenspeed_router.server.api import (
    ApiError,
    MatchRequest,
    ReleaseRequest,
    RouteRequest,
    check_bearer,
    decode_json,
    request_id_text,
    validate_request,
)
from tokenspeed_router.server.app import RouterService
from tokenspeed_router.server.config import HostPort, WorkerSpec, is_loopback_host
from tokenspeed_router.server.metrics import CONTENT_TYPE

__all__ = ["HttpServer", "bind_socket", "create_app"]

logger = logging.getLogger(__name__)

_json = msgspec.json.Encoder()
_match_decoder = msgspec.json.Decoder(MatchRequest)
_route_decoder = msgspec.json.Decoder(RouteRequest)
_release_decoder = msgspec.json.Decoder(ReleaseRequest)
_any_decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder()
_JSON_HEADERS = {"content-type": "application/json"}

Handler = Callable[[Request], Awaitable[Response]]


def _json_response(body: Any, status: int = 200) -> Response:
    return Response(_json.encode(body), status_code=status, headers=_JSON_HEADERS)


def _error(status: int, message: str) -> Response:
    headers = dict(_JSON_HEADERS)
    if status == 401:
        headers["www-authenticate"] = "Bearer"
    return Response(_json.encode({"error": message}), status_code=status, headers=headers)


def create_app(service: RouterService) -> Starlette:
    """The Starlette application serving ``service`` (DESIGN §6 routes)."""
    limits = service.config.limits
    token = service.config.auth_token
    expected = token.encode() if token else None
    max_body = limits.max_body_bytes

    async def read_body(request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                raise ApiError(400, f"invalid Content-Length {length!r}") from None
            if declared > max_body:
                raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {max_body}")
        # ASGI messages read directly (Request.stream() is an async generator per call)
        chunks: list[bytes] = []
        size = 0
        receive = request.receive
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise ApiError(400, "client disconnected before sending the body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > max_body:
                raise ApiError(413, f"request body exceeds the limit of {max_body} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def endpoint(fn: Callable[[Request], Awaitable[Any]], *, auth: bool = True) -> Handler:
        """Wrap a handler: auth, ApiError -> JSON error, anything else -> logged 500."""

        async def handle(request: Request) -> Response:
            try:
                if auth and expected is not None:
                    check_bearer(request.headers.get("authorization"), expected, header=True)
                result = await fn(request)
            except ApiError as err:
                service.metrics.api_errors.labels("http", str(err.status)).inc()
                return _error(err.status, err.message)
            except Exception:
                logger.exception("unhandled error in %s %s", request.method, request.url.path)
                service.metrics.api_errors.labels("http", "500").inc()
                return _error(500, "internal error (logged by the router)")
            if isinstance(result, Response):
                return result
            return _json_response(result)

        return handle

    async def match(request: Request) -> Any:
        req: MatchRequest = decode_json(_match_decoder, await read_body(request))
        validate_request(req, limits)
        return service.match(req.token_ids, lora_id=req.lora_id, salt=req.salt)

    async def route(request: Request) -> Any:
        req: RouteRequest = decode_json(_route_decoder, await read_body(request))
        validate_request(req, limits)
        rid = request_id_text(req.request_id, limits)
        return service.route(req.token_ids, request_id=rid, lora_id=req.lora_id, salt=req.salt)

    async def release(request: Request) -> Any:
        req: ReleaseRequest = decode_json(_release_decoder, await read_body(request))
        rid = request_id_text(req.request_id, limits)
        assert rid is not None
        service.release(rid)
        return {}

    async def workers(request: Request) -> Any:
        return service.workers()

    async def health(request: Request) -> Any:
        return service.health()

    async def metrics(request: Request) -> Any:
        return Response(service.metrics_text(), headers={"content-type": CONTENT_TYPE})

    async def put_worker(request: Request) -> Any:
        name = request.path_params["name"]
        data = decode_json(_any_decoder, await read_body(request))
        try:
            spec = WorkerSpec.from_mapping(data, name=name, source=f"PUT /workers/{name}")
        except ConfigError as err:
            raise ApiError(400, str(err)) from None
        created, streams = await asyncio.to_thread(service.put_worker, spec)
        return _json_response(
            {"worker": spec.to_dict(), "streams": streams, "created": created}, 201 if created else 200
        )

    async def delete_worker(request: Request) -> Any:
        name = request.path_params["name"]
        streams = await asyncio.to_thread(service.delete_worker, name)
        return {"removed": streams}

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        if status == 404:
            return _error(404, f"no such endpoint: {request.method} {request.url.path}")
        if status == 405:
            return _error(405, f"method {request.method} not allowed on {request.url.path}")
        detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
        return _error(status, str(detail))

    routes = [
        Route("/match", endpoint(match), methods=["POST"]),
        Route("/route", endpoint(route), methods=["POST"]),
        Route("/release", endpoint(release), methods=["POST"]),
        Route("/workers", endpoint(workers), methods=["GET"]),
        Route("/workers/{name:path}", endpoint(put_worker), methods=["PUT"]),
        Route("/workers/{name:path}", endpoint(delete_worker), methods=["DELETE"]),
        Route("/health", endpoint(health, auth=False), methods=["GET"]),
        Route("/metrics", endpoint(metrics), methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: not_found})


def bind_socket(address: HostPort) -> socket.socket:
    """Bind the listen socket ourselves so ``--http 127.0.0.1:0`` can report its port."""
    family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
    # proto must be IPPROTO_TCP explicitly: asyncio only sets TCP_NODELAY on accepted
    # sockets whose proto says TCP, and without it Nagle + delayed ACKs add 40 ms to
    # every response uvicorn writes in two parts (head, body).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address.host, address.port))
    except OSError as err:
        sock.close()
        raise ConfigError(f"cannot listen on {address}: {err}") from err
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class HttpServer:
    """uvicorn serving :func:`create_app` on a socket bound at construction.

    Binding up front makes ``--http 127.0.0.1:0`` usable (``address`` is the
    real port) and reports "address in use" as a :class:`ConfigError` before
    anything else starts. :meth:`run` blocks; :meth:`request_shutdown` is
    thread-safe (signal handlers and tests call it). Uses uvloop and httptools
    when installed (``uvicorn[standard]``), the pure-Python h11 stack otherwise.
    """

    def __init__(self, service: RouterService, address: HostPort) -> None:
        if not is_loopback_host(address.host):
            auth = service.config.auth_token is not None
            logger.log(
                logging.INFO if auth else logging.WARNING,
                "HTTP API listening on non-loopback %s (auth %s)", address, "on" if auth else "OFF",
            )
        self._sock = bind_socket(address)
        self.address = HostPort(address.host, self._sock.getsockname()[1])
        config = uvicorn.Config(
            create_app(service),
            log_level="warning",
            access_log=False,
            lifespan="off",
            server_header=False,
            date_header=False,
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
                self.started.set()
            await serving

        try:
            asyncio.run(main())
        finally:
            self._sock.close()

    def request_shutdown(self) -> None:
        self._server.should_exit = True

    def start_background(self, timeout_s: float = 10.0) -> threading.Thread:
        """Run in a daemon thread (tests, benchmarks, ``replay --serve`` helpers)."""
        thread = threading.Thread(target=self.run, name="tokenspeed-http", daemon=True)
        thread.start()
        if not self.started.wait(timeout_s):
            raise RuntimeError(f"HTTP server did not start within {timeout_s}s")
        return thread
