"""The gateway's HTTP endpoints, mounted into the router's Starlette app.

``POST /v1/completions``, ``POST /v1/chat/completions`` and ``GET /v1/models``
(DESIGN §10) are plain ASGI endpoints, like the router's own: a capped body
read, then :class:`~tokenspeed_router.gateway.proxy.Proxy`. While a request is
being answered, the endpoint also listens for the client going away; a
disconnect cancels the upstream call (the engine sees its connection close
and aborts) and the router releases the request at once.

Authentication: with ``--auth-token`` set, ``/v1/*`` needs it too (clients
use it as their API key) and the client's ``Authorization`` header is not
passed on; without it, the client's header goes to the engine unchanged.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.routing import Route

from tokenspeed_router.asgi import Receive, Scope, Send, read_body, send_response
from tokenspeed_router.auth import check_bearer
from tokenspeed_router.errors import RouterApiError, TokenspeedError
from tokenspeed_router.gateway.config import GatewayConfig
from tokenspeed_router.gateway.explain import EXPLAIN_HEADER, explain_requested
from tokenspeed_router.gateway.host import GatewayHost
from tokenspeed_router.gateway.openai import (
    OpenAIError,
    ParsedRequest,
    parse_chat,
    parse_completion,
)
from tokenspeed_router.gateway.proxy import Proxy
from tokenspeed_router.gateway.tokenize import TokenizeError, load_tokenizer
from tokenspeed_router.gateway.tracing import TRACE_HEADERS, load_tracer
from tokenspeed_router.gateway.truth import TruthCollector, TruthLoop
from tokenspeed_router.gateway.upstream import Upstreams

__all__ = ["ChatMessage", "DoctorExpectRequest", "Gateway"]

logger = logging.getLogger(__name__)

class Gateway:
    """The OpenAI-compatible front of one :class:`RouterService`."""

    def __init__(self, service: GatewayHost, config: GatewayConfig) -> None:
        self._service = service
        self.config = config
        self.upstreams = Upstreams(service, config)
        self.truth = TruthLoop(config.truth_window, service.set_distrusted, on_trust=service.set_trust)
        #: the ``--tokenizer`` choice; ``POST /doctor/expect`` answers with it too
        self.tokenizer = load_tokenizer(config.tokenizer, self.upstreams.pool)
        self.proxy = Proxy(service, config, self.upstreams, self.tokenizer, self.truth)
        #: ``--otlp-traces-endpoint``: one span per request (None: OpenTelemetry never imported)
        self.tracer = load_tracer(config.otlp_traces_endpoint)
        token = service.config.auth_token
        self._expected = token.encode() if token else None
        self._max_body = service.config.limits.max_body_bytes
        self._max_tokens = service.config.limits.max_tokens
        service.metrics.add_collector(TruthCollector(self.truth))
        service.metrics.add_collector(_GatewayCollector(self))
        specs = service.config.workers
        without = [s.name for s in specs if s.url is None]
        if specs and without and len(without) < len(specs):
            logger.warning("workers %s have no url: the gateway cannot proxy to them if the router picks them",
                           ", ".join(without))

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", _Asgi(self._completions), methods=["POST"]),
            Route("/v1/chat/completions", _Asgi(self._chat), methods=["POST"]),
            Route("/v1/models", _Asgi(self._models), methods=["GET"]),
            Route("/doctor/expect", _Asgi(self._doctor_expect), methods=["POST"]),
        ]

    def front(self, app: Any) -> Any:
        """``app`` with the two POST endpoints answered before Starlette sees them.

        Starlette's middleware wraps every ``send`` of every stream chunk in
        two more coroutines; the proxy path needs none of it (it handles its
        own errors).
        """
        fast = {"/v1/completions": _Asgi(self._completions), "/v1/chat/completions": _Asgi(self._chat)}

        async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and scope["method"] == "POST":
                endpoint = fast.get(scope["path"])
                if endpoint is not None:
                    await endpoint(scope, receive, send)
                    return
            await app(scope, receive, send)

        return asgi

    async def aclose(self) -> None:
        await self.upstreams.aclose()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)  # flush the spans still queued

    # --- what /workers and /health add ---------------------------------------------------

    def worker_info(self, stream: str) -> dict[str, Any]:
        """The gateway's part of a ``GET /workers`` entry."""
        sub = self._service.stream_specs().get(stream)
        worker = sub.worker if sub is not None else stream
        spec = self._service.worker_specs().get(worker)
        truth = self.truth.status(stream)
        return {
            "url": spec.url if spec is not None else None,
            "reachable": not self.upstreams.is_down(worker),
            "misaligned": truth["misaligned"],
            "truth": truth,
        }

    def annotate_health(self, health: dict[str, Any]) -> dict[str, Any]:
        """Add misaligned and down workers to ``GET /health``.

        A misaligned worker turns ``ok`` into ``degraded`` (still 200: the
        gateway serves, routing it on load); no reachable engine at all is
        ``unavailable`` (503).
        """
        misaligned = self.truth.misaligned()
        down = sorted(self.upstreams.down())
        health["misaligned"] = misaligned
        health["down"] = down
        problems = health.setdefault("problems", [])
        for name, cause in sorted(misaligned.items()):
            problems.append(f"worker {name} misaligned: {cause}")
        urls = [s for s in self._service.worker_specs().values() if s.url is not None]
        if urls and len(down) >= len(urls):
            problems.append("every engine is down")
            if health.get("status") in ("ok", "degraded"):
                health["status"] = "unavailable"
        elif (misaligned or down) and health.get("status") == "ok":
            for name in down:
                problems.append(f"worker {name} down (its engine refused or dropped the connection)")
            health["status"] = "degraded"
        return health

    # --- endpoints -------------------------------------------------------------------

    def _check(self, scope: Scope) -> tuple[dict[str, str], bool]:
        """Auth; returns the headers to pass on to the engine (the client's W3C trace context
        too), and whether the client asked for the routing decision (``x-tokenspeed-explain``),
        all read in the same pass."""
        authorization: bytes | None = None
        explain: bytes | None = None
        forward: dict[str, str] = {}
        for key, value in scope["headers"]:
            if key == b"authorization":
                authorization = value
            elif key == EXPLAIN_HEADER:
                explain = value
            elif key in TRACE_HEADERS:
                forward[key.decode("latin-1")] = value.decode("latin-1")
        if self._expected is not None:
            presented = authorization.decode("latin-1") if authorization is not None else None
            try:
                check_bearer(presented, self._expected, header=True)
            except RouterApiError as err:
                raise OpenAIError(err.status, err.message, code="invalid_api_key") from None
        elif authorization is not None:
            forward["authorization"] = authorization.decode("latin-1")
        return forward, (explain is not None and explain_requested(explain))

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        try:
            return await read_body(receive, length, self._max_body)
        except RouterApiError as err:
            raise OpenAIError(err.status, err.message, code="invalid_body") from None

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers, explain = self._check(scope)
        req = parse_completion(await self._body(scope, receive), max_tokens=self._max_tokens)
        await self._serve(req, headers, receive, send, explain)

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers, explain = self._check(scope)
        req = parse_chat(await self._body(scope, receive), max_tokens=self._max_tokens)
        await self._serve(req, headers, receive, send, explain)

    async def _serve(self, req: ParsedRequest, headers: dict[str, str], receive: Receive, send: Send,
                     explain: bool = False) -> None:
        """Run the proxy in this task, cancelling it if the client disconnects first.

        One watcher task listens for the disconnect and cancels this one; the
        proxy itself runs inline (no second task, no ``asyncio.wait``: this is
        on every request's path).
        """
        sent = finished = over = gone = False
        me = asyncio.current_task()
        assert me is not None

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal sent, finished
            sent = True
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True  # from here on, a "disconnect" is just the answer being complete
            await send(message)

        async def watch() -> None:
            nonlocal gone
            await _wait_disconnect(receive)
            if not finished and not over:
                gone = True
                me.cancel()  # the client went away: cancel the upstream call, release at once

        watcher = asyncio.ensure_future(watch())
        span = None
        if self.tracer is not None:
            span = self.tracer.start(headers, "/v1/chat/completions" if req.kind == "chat" else "/v1/completions")
            headers = span.outgoing(headers)
        failure: BaseException | None = None
        try:
            tokens = await self.proxy.token_ids(req)
            await self.proxy.handle(req, tokens, tracked, headers, explain, trace=span)
        except asyncio.CancelledError:
            if not gone:
                raise  # we are being cancelled ourselves (shutdown)
            uncancel = getattr(me, "uncancel", None)  # Python 3.11+: the task is not "being cancelled" any more
            if uncancel is not None:
                uncancel()
            self.proxy.stats.disconnects += 1
            logger.debug("client disconnected: request cancelled")
        except Exception as err:
            failure = err
            if not sent:
                raise  # OpenAIError -> its answer; anything else -> a logged 500
            logger.error("gateway request failed after its answer started: %r", err)
        finally:
            over = True
            watcher.cancel()
            if span is not None:
                span.end(failure)

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers, _ = self._check(scope)
        urls = self.upstreams.worker_urls()
        if not urls:
            raise OpenAIError(503, "no reachable worker with a url", code="no_worker_available")
        pool = self.upstreams.pool()
        timeout_s = min(10.0, self.config.upstream_timeout_s)

        async def ask(url: str) -> list[dict[str, Any]]:
            try:
                status, body = await pool.fetch(b"GET", url, "/v1/models", headers=headers, timeout_s=timeout_s)
                data = json.loads(body).get("data") if status == 200 else None
            except Exception as err:  # one bad engine must not hide the others' models
                logger.debug("GET %s/v1/models failed: %r", url, err)
                return []
            return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)] if isinstance(
                data, list) else []

        answers = await asyncio.gather(*(ask(u) for u in sorted(set(urls.values()))))
        models: dict[str, dict[str, Any]] = {}
        for listing in answers:
            for m in listing:
                models.setdefault(m["id"], m)
        if not models and not any(answers):
            raise OpenAIError(502, "no worker answered GET /v1/models", code="upstream_error")
        await _send_json(send, 200, {"object": "list", "data": list(models.values())})


    async def _doctor_expect(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /doctor/expect``: what this router computes for a prompt sent to one worker.

        Body ``{"worker": NAME, "prompt": TEXT}`` or ``{"worker": NAME, "messages": [...]}``
        (chat-template fields as in a chat request) or ``{"token_ids": [...]}``. Answer
        ``{"token_ids", "scores", "block_size"}``: the tokens this router's ``--tokenizer``
        gives (asking that worker's engine for ``engine``), and the index's match for them.
        ``tokenspeed-router doctor --router URL`` compares these with what the engine
        caches and reports. No side effects (nothing is routed or counted in flight).
        """
        self._check(scope)
        raw = await self._body(scope, receive)
        try:
            body = msgspec.json.decode(raw)
            req = msgspec.convert(body, DoctorExpectRequest)  # typed checks; the dict goes to the tokenizer
        except msgspec.ValidationError as err:
            raise OpenAIError(400, f"invalid request: {err}", code="invalid_body") from None
        except msgspec.DecodeError as err:
            raise OpenAIError(400, f"invalid JSON: {err}", code="invalid_body") from None
        except RecursionError:
            raise OpenAIError(400, "invalid JSON: nested too deeply", code="invalid_body") from None
        spec = self._service.worker_specs().get(req.worker) if req.worker is not None else None
        url = spec.url if spec is not None else None
        try:
            if req.token_ids is not None:
                tokens = req.token_ids
            elif req.messages is not None:
                tokens = await self.tokenizer.chat_tokens(body, url)
            elif req.prompt is not None:
                tokens = await self.tokenizer.completion_tokens(req.prompt, body, url)
            else:
                raise OpenAIError(400, "give token_ids, a string prompt or chat messages", code="invalid_body")
        except TokenizeError as err:
            if err.client_error:  # the engine refused the prompt, or no worker with a url was named
                raise OpenAIError(400, f"tokenizing failed: {err}", param="worker" if url is None else None,
                                  code="tokenize_failed") from None
            raise OpenAIError(502, f"tokenizing failed: {err}", code="tokenize_failed") from None
        try:
            detail = self._service.match(tokens).to_dict()
        except TokenspeedError as err:
            raise OpenAIError(400, str(err), code="invalid_body") from None
        await _send_json(send, 200, {"token_ids": tokens, "scores": detail["scores"],
                                     "block_size": detail["block_size"]})


class ChatMessage(msgspec.Struct):
    """A chat message as the router checks it (the rest goes to the chat template as sent)."""

    role: Annotated[str, msgspec.Meta(min_length=1)]


class DoctorExpectRequest(msgspec.Struct):
    """``POST /doctor/expect``: a prompt as ``token_ids``, a string ``prompt`` or chat ``messages``
    (checked in that order). ``worker`` names the worker whose engine tokenizes
    (``--tokenizer engine``); chat-template fields pass on as in a chat request."""

    worker: str | None = None
    token_ids: list[Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]] | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)] | None = None


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _send_json(send: Send, status: int, obj: Any, body: bytes | None = None) -> None:
    import msgspec

    await send_response(send, status, body if body is not None else msgspec.json.encode(obj))


class _Asgi:
    """An ASGI endpoint whose :class:`OpenAIError` becomes an OpenAI-shaped error answer."""

    def __init__(self, handler: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self._handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._handler(scope, receive, send)
        except OpenAIError as err:
            extra = [(b"www-authenticate", b"Bearer")] if err.status == 401 else []
            await send_response(send, err.status, err.body(), headers=extra)
        except Exception:
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            await _send_json(send, 500, None, OpenAIError(500, "internal error (logged by the router)").body())


class _GatewayCollector(Collector):
    """Request outcomes, retries, down workers (``tokenspeed_gateway_*``)."""

    def __init__(self, gateway: Gateway) -> None:
        self._gw = gateway

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        stats = self._gw.proxy.stats
        requests = CounterMetricFamily("tokenspeed_gateway_requests", "gateway requests by worker and outcome",
                                       labels=["worker", "outcome"])
        for (worker, outcome), n in sorted(stats.requests.items()):
            requests.add_metric([worker, outcome], float(n))
        yield requests
        yield CounterMetricFamily("tokenspeed_gateway_retries", "requests moved to another worker after a "
                                  "connection failure", value=float(stats.retries))
        yield CounterMetricFamily("tokenspeed_gateway_tokenize_failures", "prompts routed on load only because "
                                  "tokenizing failed", value=float(stats.tokenize_failures))
        yield CounterMetricFamily("tokenspeed_gateway_client_disconnects", "requests cancelled because the "
                                  "client went away", value=float(stats.disconnects))
        yield CounterMetricFamily("tokenspeed_gateway_worker_down_events", "times a worker was marked down",
                                  value=float(self._gw.upstreams.down_events))
        down = GaugeMetricFamily("tokenspeed_gateway_worker_down", "1 while the worker is marked down",
                                 labels=["worker"])
        for worker in self._gw.upstreams.down():
            down.add_metric([worker], 1.0)
        yield down
