"""One OpenAI request through the gateway: route, forward, relay, learn, release.

::

    parse (openai.py) -> token ids (as given, or tokenize.py)
      -> RouterService.route(): the decision, with the index's view of the prompt
         (for the truth loop) from the same, single index walk
      -> one leg to the chosen worker, or the two P/D legs (prefill, then decode)
      -> relay: JSON answer as is, or SSE event by event (sse.py)
      -> usage.cached_tokens -> TruthLoop.observe()
      -> RouterService.release()  (always: end, error, client disconnect)

Failures: a connection refused, reset or dropped before the engine sent its
first byte marks the worker down (upstream.py) and the request is routed again
among the others, at most ``upstream_retries`` times; a stream that breaks
after its first byte ends with an SSE error event; an engine that answers
with an error status is relayed as it is (its body is already OpenAI-shaped).
A timeout is a 504, not a retry: a slow engine is busy, not gone.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from typing import Any

import msgspec

from tokenspeed_router.asgi import Send, send_response
from tokenspeed_router.gateway.accounting import GatewayStats, Plan, RequestAccounting
from tokenspeed_router.gateway.config import GatewayConfig
from tokenspeed_router.gateway.explain import ROUTE_HEADER, route_header
from tokenspeed_router.gateway.host import GatewayHost
from tokenspeed_router.gateway.http1 import ConnectFailed, Http1Response, UpstreamError
from tokenspeed_router.gateway.openai import OpenAIError, ParsedRequest, body_asking_usage
from tokenspeed_router.gateway.sse import SseRelay, sse_error_event
from tokenspeed_router.gateway.tokenize import PromptTokenizer
from tokenspeed_router.gateway.tracing import RequestSpan
from tokenspeed_router.gateway.truth import TruthLoop
from tokenspeed_router.gateway.upstream import Target, Upstreams, is_timeout, is_unreachable

__all__ = ["GatewayStats", "Proxy"]

logger = logging.getLogger(__name__)

_decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()
_JSON = b"application/json"


#: what a failing engine connection can raise
_TRANSPORT = (UpstreamError, asyncio.TimeoutError, OSError)


class _Unreachable(Exception):
    """The worker failed before its first byte (retry on another)."""

    def __init__(self, target: Target, err: BaseException) -> None:
        super().__init__(f"{type(err).__name__}: {err}")
        self.target = target
        #: no connection could be made (refused, unroutable, connect timeout); otherwise an
        #: established connection was closed or reset before the answer started
        self.refused = isinstance(err, ConnectFailed)


def _before_first_byte(target: Target, err: BaseException, what: str) -> Exception:
    """The error to raise for a transport failure before the client got anything."""
    if is_unreachable(err):
        return _Unreachable(target, err)
    if is_timeout(err):
        return OpenAIError(504, f"{what} {target.worker!r} timed out", code="upstream_timeout")
    return OpenAIError(502, f"{what} {target.worker!r} failed: {type(err).__name__}: {err}", code="upstream_error")


class Proxy:
    """Carries requests to engines; one per gateway."""

    def __init__(self, service: GatewayHost, config: GatewayConfig, upstreams: Upstreams,
                 tokenizer: PromptTokenizer, truth: TruthLoop) -> None:
        self._config = config
        self._up = upstreams
        self.stats = GatewayStats()
        #: the router's books for each request (shared with the endpoint picker: accounting.py)
        self._books = RequestAccounting(service, upstreams, tokenizer, truth, self.stats)
        # request ids: unique per process by the counter, across gateway replicas sharing a state
        # backend by the random prefix (uuid4 per request cost a urandom syscall on the hot path)
        self._id_prefix = f"gw-{uuid.uuid4().hex[:16]}-"
        self._ids = itertools.count()

    async def token_ids(self, req: ParsedRequest) -> list[int]:
        """The prompt's token ids; ``[]`` (route on load) when tokenizing fails."""
        return await self._books.token_ids(req)

    # --- the request ---------------------------------------------------------------

    async def handle(self, req: ParsedRequest, tokens: list[int], send: Send,
                     headers: dict[str, str], explain: bool = False, *,
                     trace: RequestSpan | None = None) -> None:
        """Answer ``req`` on ``send``; raises :class:`OpenAIError` before anything is sent.

        ``explain``: the client sent ``x-tokenspeed-explain: 1``; an explained
        decision (asked for, or sampled by ``--explain-sample``) is answered in
        the ``x-tokenspeed-route`` header (``gateway/explain.py``).
        ``trace`` (``--otlp-traces-endpoint``) is told each routing decision.
        """
        request_id = f"{self._id_prefix}{next(self._ids)}"
        attempts = 0
        dropped = False  # a connection already dropped before answering for this request
        try:
            while True:
                plan = self._books.plan(tokens, request_id, explain)
                if trace is not None:
                    trace.routed(plan.decision, req.kind)
                try:
                    if plan.remote_prefill:
                        await self._disaggregated(req, tokens, plan, send, headers)
                    else:
                        await self._one_leg(req, tokens, plan, plan.site, None, send, headers,
                                            observe=True, extra=None)
                    return
                except _Unreachable as err:
                    if err.refused or dropped:
                        self._up.mark_down(err.target, str(err))
                    else:
                        # A pooled keep-alive connection the engine closed at the same moment
                        # looks like this too: try again (a fresh connection) before calling
                        # the worker down; a dead engine then refuses the connection.
                        dropped = True
                    self.stats.count(err.target.stream, "unreachable")
                    attempts += 1
                    if attempts > self._config.upstream_retries:
                        raise OpenAIError(
                            502, f"worker {err.target.worker!r} unreachable ({err}) after {attempts} attempt(s)",
                            code="upstream_unreachable") from None
                    self.stats.retries += 1
        finally:
            self._books.release(request_id)

    async def _disaggregated(self, req: ParsedRequest, tokens: list[int], plan: Plan, send: Send,
                             headers: dict[str, str]) -> None:
        """vLLM's P/D protocol: a 1-token prefill leg, then the decode leg with its kv_transfer_params."""
        body = dict(req.body)
        body["max_tokens"] = 1
        if req.kind == "chat":
            body["max_completion_tokens"] = 1
        body["stream"] = False
        body.pop("stream_options", None)
        body["kv_transfer_params"] = {"do_remote_decode": True}
        site = plan.site
        resp = await self._open(site, req.path, _encoder.encode(body), headers, "prefill worker")
        try:
            content = await resp.read()
        except _TRANSPORT as err:
            resp.close()
            raise _before_first_byte(site, err, "prefill worker") from err
        resp.release()
        if resp.status != 200:
            self.stats.count(site.stream, f"http_{resp.status}")
            await send_response(send, resp.status, content, _content_type(resp), _with_route([
                (b"x-tokenspeed-worker", site.stream.encode()),
                (b"x-tokenspeed-prefill-worker", site.stream.encode())], plan))
            return
        try:
            answer = _decoder.decode(content)
        except msgspec.DecodeError:
            answer = None
        if not isinstance(answer, dict):
            raise OpenAIError(502, f"prefill worker {site.worker!r} answered invalid JSON", code="upstream_error")
        self.stats.count(site.stream, "prefill")
        self._books.learn(site.stream, plan, tokens, answer.get("usage"))
        self._books.prefill_done(plan.request_id)
        kv = answer.get("kv_transfer_params")
        if kv is None:
            logger.debug("prefill worker %s returned no kv_transfer_params: decode prefills locally", site.worker)
        decode_body = dict(req.body)
        decode_body["kv_transfer_params"] = kv
        await self._one_leg(req, tokens, plan, plan.decode, decode_body, send, headers, observe=False,
                            extra=[(b"x-tokenspeed-prefill-worker", site.stream.encode())])

    async def _one_leg(self, req: ParsedRequest, tokens: list[int], plan: Plan, target: Target,
                       body: dict[str, Any] | None, send: Send, headers: dict[str, str], *, observe: bool,
                       extra: list[tuple[bytes, bytes]] | None) -> None:
        strip = req.stream and not req.client_wants_usage()
        if strip:
            data = body_asking_usage(req, body)
        elif body is None and req.raw is not None:
            data = req.raw  # the client's own bytes: no re-encoding (one decode, no encode)
        else:
            data = _encoder.encode(body if body is not None else req.body)
        resp = await self._open(target, req.path, data, headers, "worker")
        worker_headers = _with_route([(b"x-tokenspeed-worker", target.stream.encode()), *(extra or [])], plan)
        done = False
        try:
            if resp.status != 200 or not req.stream:
                try:
                    content = await resp.read()
                except _TRANSPORT as err:
                    raise _before_first_byte(target, err, "worker") from err
                done = True
                if resp.status == 200 and observe:
                    self._books.learn_json(target.stream, plan, tokens, content)
                self.stats.count(target.stream, "ok" if resp.status == 200 else f"http_{resp.status}")
                await send_response(send, resp.status, content, _content_type(resp), worker_headers)
                return
            done = await self._relay(resp, target, plan, tokens, send, worker_headers, strip=strip,
                                     observe=observe)
        finally:
            # a fully read answer returns its connection to the pool; anything else closes it
            # (a cancelled request: the engine sees the connection go and aborts)
            if done:
                resp.release()
            else:
                resp.close()

    async def _open(self, target: Target, path: str, data: bytes, headers: dict[str, str],
                    what: str) -> Http1Response:
        """POST the JSON ``data`` to ``target`` and wait for the answer's head."""
        if target.dp_rank is not None:
            headers = {**headers, **target.headers()}
        try:
            return await self._up.pool().post(target.url, path, data, headers)
        except _TRANSPORT as err:
            raise _before_first_byte(target, err, what) from err

    async def _relay(self, resp: Http1Response, target: Target, plan: Plan, tokens: list[int],
                     send: Send, worker_headers: list[tuple[bytes, bytes]], *, strip: bool,
                     observe: bool) -> bool:
        """Relay an SSE answer; True when the engine's stream was read to its end."""
        relay = SseRelay(strip_usage=strip)
        started = False
        # the prefill is done at the first *generated* token, not the first byte: a chat
        # stream's role chunk comes before the prefill runs (see sse.py)
        prefilled = not observe
        try:
            while (chunk := await resp.next_chunk()) is not None:
                out = relay.feed(chunk)
                if not prefilled and relay.generated:
                    prefilled = True
                    self._books.prefill_done(plan.request_id)
                if not out:
                    continue
                if not started:
                    started = True
                    await send({"type": "http.response.start", "status": 200, "headers": [
                        (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                        *worker_headers]})
                await send({"type": "http.response.body", "body": out, "more_body": True})
        except _TRANSPORT as err:
            if not started:
                raise _before_first_byte(target, err, "worker") from err
            self.stats.count(target.stream, "stream_error")
            reason = "timed out" if is_timeout(err) else f"{type(err).__name__}: {err}"
            logger.warning("stream from worker %s broke after %d event(s): %s", target.worker, relay.events, reason)
            await send({"type": "http.response.body",
                        "body": sse_error_event(f"worker {target.worker!r} failed mid-stream: {reason}",
                                                code="upstream_error"), "more_body": False})
            return False
        rest = relay.flush()
        if not started:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), *worker_headers]})
        await send({"type": "http.response.body", "body": rest, "more_body": False})
        self.stats.count(target.stream, "ok")
        if observe:
            self._books.learn(target.stream, plan, tokens, relay.usage)
        return True


def _with_route(headers: list[tuple[bytes, bytes]], plan: Plan) -> list[tuple[bytes, bytes]]:
    """``headers`` plus ``x-tokenspeed-route`` when the decision was explained (one test otherwise)."""
    explanation = plan.decision.explanation
    if explanation is not None:
        headers.append((ROUTE_HEADER, route_header(explanation)))
    return headers


def _content_type(resp: Http1Response) -> bytes:
    return resp.header(b"content-type") or _JSON
