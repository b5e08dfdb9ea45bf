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
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenspeed_router.asgi import Send, send_response
from tokenspeed_router.errors import NoWorkerAvailableError, TokenspeedError, api_error
from tokenspeed_router.gateway.config import GatewayConfig
from tokenspeed_router.gateway.explain import ROUTE_HEADER, route_header
from tokenspeed_router.gateway.host import GatewayHost
from tokenspeed_router.gateway.http1 import ConnectFailed, Http1Response, UpstreamError
from tokenspeed_router.gateway.openai import OpenAIError, ParsedRequest
from tokenspeed_router.gateway.sse import SseRelay, sse_error_event
from tokenspeed_router.gateway.tokenize import PromptTokenizer, TokenizeError
from tokenspeed_router.gateway.tracing import RequestSpan
from tokenspeed_router.gateway.truth import TruthLoop, TruthSample, cap_prediction
from tokenspeed_router.gateway.upstream import Target, Upstreams, is_timeout, is_unreachable
from tokenspeed_router.router.decision import RouteDecision

__all__ = ["GatewayStats", "Proxy"]

logger = logging.getLogger(__name__)

_decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()
_JSON = b"application/json"


class _UsageOnly(msgspec.Struct):
    """An answer's ``usage`` (msgspec skips every other field without building it)."""

    usage: Any = None


_usage_decoder = msgspec.json.Decoder(_UsageOnly)
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


@dataclass
class GatewayStats:
    """Plain counters, mutated on the event loop only and exported at scrape time."""

    requests: dict[tuple[str, str], int] = field(default_factory=dict)  # (worker, outcome) -> n
    retries: int = 0
    tokenize_failures: int = 0
    disconnects: int = 0

    def count(self, worker: str, outcome: str) -> None:
        key = (worker, outcome)
        self.requests[key] = self.requests.get(key, 0) + 1


@dataclass
class _Plan:
    """A routing decision turned into destinations."""

    request_id: str
    site: Target  # where the prompt is prefilled
    decode: Target  # where tokens are generated (== site unless remote prefill)
    remote_prefill: bool
    predicted: int  # index view of the site's prefix, in tokens (0 when unknown)
    block_size: int  # the site's, from the index (0: it has stored nothing yet)
    peer_block_size: int  # what the other workers use (the truth loop's unit when block_size is 0)
    decision: RouteDecision


class Proxy:
    """Carries requests to engines; one per gateway."""

    def __init__(self, service: GatewayHost, config: GatewayConfig, upstreams: Upstreams,
                 tokenizer: PromptTokenizer, truth: TruthLoop) -> None:
        self._service = service
        self._config = config
        self._up = upstreams
        self._tokenizer = tokenizer
        self._truth = truth
        self.stats = GatewayStats()
        self._turn = 0
        self._warned_tokenize = False
        # request ids: unique per process by the counter, across gateway replicas sharing a state
        # backend by the random prefix (uuid4 per request cost a urandom syscall on the hot path)
        self._id_prefix = f"gw-{uuid.uuid4().hex[:16]}-"
        self._ids = itertools.count()

    # --- token ids -----------------------------------------------------------------

    async def token_ids(self, req: ParsedRequest) -> list[int]:
        """The prompt's token ids; ``[]`` (route on load) when tokenizing fails."""
        if req.token_ids is not None:
            return req.token_ids
        self._turn += 1
        url = self._up.any_url(self._turn)
        try:
            if req.kind == "chat":
                return await self._tokenizer.chat_tokens(req.body, url)
            assert req.text is not None
            return await self._tokenizer.completion_tokens(req.text, req.body, url)
        except TokenizeError as err:
            self.stats.tokenize_failures += 1
            if not self._warned_tokenize:
                self._warned_tokenize = True
                logger.warning("tokenizing a prompt failed (%s): routing such requests on load only "
                               "(tokenspeed_gateway_tokenize_failures_total counts them)", err)
            return []

    # --- routing -------------------------------------------------------------------

    def _plan(self, tokens: list[int], request_id: str, explain: bool = False) -> _Plan:
        service = self._service
        try:
            decision: RouteDecision = service.route(tokens, request_id=request_id, explain=explain)
            # the truth loop's prediction: the event index's view from the routing walk itself;
            # a policy that reads no index (a baseline, approx) leaves it to one walk here
            view = decision.index_match
            if view is None and tokens:
                view = service.match(tokens)
        except NoWorkerAvailableError as err:
            down = sorted(self._up.down())
            message = f"no worker available (down: {', '.join(down)})" if down else api_error(err).message
            raise OpenAIError(503, message, code="no_worker_available") from None
        except TokenspeedError as err:
            refused = api_error(err)
            raise OpenAIError(refused.status, refused.message, code="invalid_value") from None
        targets = self._up.targets()
        site_name = decision.worker
        decode_name = decision.decode_worker
        site = targets.get(site_name)
        decode = targets.get(decode_name)
        if site is None or decode is None:
            service.release(request_id)
            missing = site_name if site is None else decode_name
            if not targets:
                raise OpenAIError(503, "no worker has a url: give workers url=http://HOST:PORT to proxy to them",
                                  code="no_worker_available")
            raise OpenAIError(503, f"the router chose worker {missing!r}, which has no url to proxy to",
                              code="no_worker_available")
        predicted, block_size, peer_block_size = 0, 0, 16
        if view is not None:
            block_size = view.block_size.get(site_name) or 0
            predicted = view.scores.get(site_name, 0) * block_size
            peer_block_size = max(view.block_size.values(), default=16) or 16
        return _Plan(request_id, site, decode, decision.prefill_worker is not None, predicted, block_size,
                     peer_block_size, decision)

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
                plan = self._plan(tokens, request_id, explain)
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
            self._service.release(request_id)

    def _prefill_done(self, request_id: str) -> None:
        self._service.mark_prefill_done(request_id)

    async def _disaggregated(self, req: ParsedRequest, tokens: list[int], plan: _Plan, send: Send,
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
        self._learn(site.stream, plan, tokens, answer.get("usage"))
        self._prefill_done(plan.request_id)
        kv = answer.get("kv_transfer_params")
        if kv is None:
            logger.debug("prefill worker %s returned no kv_transfer_params: decode prefills locally", site.worker)
        decode_body = dict(req.body)
        decode_body["kv_transfer_params"] = kv
        await self._one_leg(req, tokens, plan, plan.decode, decode_body, send, headers, observe=False,
                            extra=[(b"x-tokenspeed-prefill-worker", site.stream.encode())])

    async def _one_leg(self, req: ParsedRequest, tokens: list[int], plan: _Plan, target: Target,
                       body: dict[str, Any] | None, send: Send, headers: dict[str, str], *, observe: bool,
                       extra: list[tuple[bytes, bytes]] | None) -> None:
        strip = req.stream and not req.client_wants_usage()
        data: bytes | None = None
        if body is None and req.raw is not None:
            # the client's own bytes: no re-encoding (the common case costs one decode, no encode)
            data = _with_usage(req.raw, req) if strip else req.raw
        if body is None:
            body = req.body
        if data is None:
            if strip:
                body = dict(body)
                opts = dict(body.get("stream_options") or {})
                opts["include_usage"] = True
                body["stream_options"] = opts
            data = _encoder.encode(body)
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
                    self._learn_json(target.stream, plan, tokens, content)
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

    async def _relay(self, resp: Http1Response, target: Target, plan: _Plan, tokens: list[int],
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
                    self._prefill_done(plan.request_id)
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
            self._learn(target.stream, plan, tokens, relay.usage)
        return True

    # --- truth loop -------------------------------------------------------------------

    def _learn_json(self, stream: str, plan: _Plan, tokens: list[int], content: bytes) -> None:
        if b'"usage"' not in content:
            return
        try:
            answer = _usage_decoder.decode(content)
        except msgspec.DecodeError:  # ValidationError (not an object) included
            return
        self._learn(stream, plan, tokens, answer.usage)

    def _learn(self, stream: str, plan: _Plan, tokens: list[int], usage: Any) -> None:
        """Compare the engine's reported reuse with the index's prediction for ``stream``."""
        if not tokens or not isinstance(usage, dict):
            return
        details = usage.get("prompt_tokens_details")
        reported = details.get("cached_tokens") if isinstance(details, dict) else None
        if type(reported) is not int:
            self._truth.observe_unreported(stream)
            return
        # a lock-free read of one worker's state (benign race: at worst one sample more or less)
        if self._service.is_cold(stream):
            return  # its index entries are known to be incomplete (stale, resyncing): no evidence
        prompt_tokens = usage.get("prompt_tokens")
        n = prompt_tokens if type(prompt_tokens) is int and prompt_tokens > 0 else len(tokens)
        # the worker had published nothing we held when routed: judge in the block size its peers use
        bs = plan.block_size if plan.block_size > 0 else plan.peer_block_size
        predicted = cap_prediction(plan.predicted, n, bs)
        sample = TruthSample(predicted, reported, bs)
        if sample.too_high():
            # Did events explain it meanwhile (a sibling's blocks)? A second look, taken now,
            # only for the rare answer that reused more than predicted.
            view = self._service.match(tokens)
            after = view.scores.get(stream, 0) * (view.block_size.get(stream) or bs)
            if after:
                sample = TruthSample(predicted, reported, bs, cap_prediction(after, n, bs))
        self._truth.observe(stream, sample)


_WITH_USAGE = b'{"stream_options":{"include_usage":true},'


def _with_usage(raw: bytes, req: ParsedRequest) -> bytes | None:
    """``raw`` with ``stream_options.include_usage`` added by a byte patch, or None to re-encode.

    Patchable when the client sent no ``stream_options`` at all (else its
    object must be merged): the key goes first, ahead of the body's own. The
    body is a non-empty object here (``prompt`` or ``messages`` is required).
    """
    if req.has_stream_options:
        return None
    text = raw.lstrip()
    if not text.startswith(b"{"):
        return None
    return _WITH_USAGE + text[1:]


def _with_route(headers: list[tuple[bytes, bytes]], plan: _Plan) -> list[tuple[bytes, bytes]]:
    """``headers`` plus ``x-tokenspeed-route`` when the decision was explained (one test otherwise)."""
    explanation = plan.decision.explanation
    if explanation is not None:
        headers.append((ROUTE_HEADER, route_header(explanation)))
    return headers


def _content_type(resp: Http1Response) -> bytes:
    return resp.header(b"content-type") or _JSON
