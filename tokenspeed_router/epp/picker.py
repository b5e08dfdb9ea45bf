"""What the endpoint picker decides and learns, one request at a time (no gRPC here).

The picker keeps the router's books exactly as the HTTP gateway does, through
the gateway's own :class:`~tokenspeed_router.gateway.accounting.RequestAccounting`
(same tokenizer, same truth loop, same in-flight accounting): only the
carrying differs, Envoy carries the bytes. Per request:

* :meth:`EndpointPicker.pick` — the body parsed as the gateway parses it
  (a completions or chat body; another JSON body is routed on load), the
  prompt tokenized as the gateway does, the decision taken among the
  subset hint's workers (``RouterService.pick``: the ``/route`` decision,
  with the other candidates ranked by cost), and the endpoints named:
  the chosen worker's ``url=`` host:port first, then up to ``fallbacks``
  others, cheapest first;
* :meth:`EndpointPicker.served` — Envoy says which endpoint served it; a
  fallback means the primary failed: it is marked down (probed on
  ``/health`` as the gateway does) and the request is counted where it runs;
* :meth:`EndpointPicker.response_chunk` — the first chunk carrying a
  generated token ends the prefill (``sse.py``, as the gateway);
* :meth:`EndpointPicker.response_end` — the usage's ``cached_tokens`` goes to
  the truth loop, and the request is released;
* :meth:`EndpointPicker.release` — the release on every other path (the
  stream dropped, an error): idempotent.

Errors are :class:`~tokenspeed_router.gateway.openai.OpenAIError` (status and
OpenAI-shaped body): the exchange answers them as ImmediateResponses.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import socket
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

from tokenspeed_router.epp.names import DP_RANK_HEADER, PREFILLER_HEADER
from tokenspeed_router.gateway.accounting import GatewayStats, Plan, RequestAccounting
from tokenspeed_router.gateway.explain import (
    EXPLAIN_HEADER,
    ROUTE_HEADER,
    explain_requested,
    route_header,
)
from tokenspeed_router.gateway.host import GatewayHost
from tokenspeed_router.gateway.openai import (
    OpenAIError,
    ParsedRequest,
    body_asking_usage,
    decode_object,
    parse_chat,
    parse_completion,
)
from tokenspeed_router.gateway.sse import SseRelay
from tokenspeed_router.gateway.tokenize import PromptTokenizer
from tokenspeed_router.gateway.tracing import TRACE_HEADERS, OtelTracer, RequestSpan
from tokenspeed_router.gateway.truth import TruthLoop
from tokenspeed_router.gateway.upstream import Target, Upstreams
from tokenspeed_router.router.decision import RouteDecision

__all__ = ["EndpointPicker", "EppStats", "Pick", "PickerHost", "PickerSettings", "resolve_endpoint"]

logger = logging.getLogger(__name__)

#: how often workers' host names are resolved again
ENDPOINT_REFRESH_S = 10.0
#: a JSON answer's bytes kept to read its usage at the end (larger answers are not learned from)
_MAX_KEPT_ANSWER = 4 << 20
_EXPLAIN = EXPLAIN_HEADER.decode()
_ROUTE = ROUTE_HEADER.decode()


class PickerHost(GatewayHost, Protocol):
    """The router process as the picker sees it: the gateway's calls, and the ranked pick."""

    def pick(self, token_ids: list[int], *, request_id: str | None = None, explain: bool = False,
             only: Collection[str] | None = None, ranked: bool = True) -> tuple[RouteDecision, tuple[str, ...]]: ...


@dataclass(frozen=True, kw_only=True)
class PickerSettings:
    """``--epp-fallbacks`` and ``--epp-max-in-flight`` (docs/epp.md)."""

    #: endpoints named after the chosen one, cheapest first (0: the primary alone)
    fallbacks: int = 2
    #: requests in flight through the picker past which new ones get 429 (0: never shed)
    max_in_flight: int = 0


@dataclass
class EppStats:
    """The picker's counters (``tokenspeed_epp_*``), mutated on the event loop only."""

    outcomes: dict[str, int] = field(default_factory=dict)
    streams: int = 0

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


def resolve_endpoint(url: str) -> str:
    """A worker ``url=`` as the ``ip:port`` the picker names: the protocol names endpoints by
    address (Envoy's ORIGINAL_DST cluster connects to it; the subset hint lists pod IPs), so a
    host name (a StatefulSet pod's stable DNS name) is resolved. Blocking (DNS): called off the
    event loop except for a worker's very first pick; unresolvable names stay as they are."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as err:
            logger.warning("endpoint picker: cannot resolve %s (%s): naming it %s:%d", host, err, host, port)
        else:
            host = str(infos[0][4][0])
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Pick:
    """One routed request, from the pick to its release."""

    __slots__ = ("endpoints", "kept", "kept_bytes", "plan", "prefilled", "relay", "released", "span", "status",
                 "strip_usage", "tokens")

    def __init__(self, plan: Plan, tokens: list[int], endpoints: list[str], strip_usage: bool,
                 span: RequestSpan | None) -> None:
        self.plan = plan
        self.tokens = tokens
        #: named endpoints, primary first
        self.endpoints = endpoints
        #: the picker asked the engine for the usage chunk the client did not ask for
        self.strip_usage = strip_usage
        self.span = span
        self.relay: SseRelay | None = None
        self.status = 0
        self.prefilled = False
        self.released = False
        self.kept: list[bytes] = []
        self.kept_bytes = 0

    @property
    def request_id(self) -> str:
        return self.plan.request_id

    @property
    def primary(self) -> str:
        return self.endpoints[0]


class EndpointPicker:
    """The picker's decisions over one router process (module docstring); one per server."""

    def __init__(self, service: PickerHost, upstreams: Upstreams, tokenizer: PromptTokenizer, truth: TruthLoop,
                 stats: GatewayStats, settings: PickerSettings, tracer: OtelTracer | None = None) -> None:
        self._service = service
        self._up = upstreams
        self._books = RequestAccounting(service, upstreams, tokenizer, truth, stats)
        self.settings = settings
        self.stats = EppStats()
        self._tracer = tracer
        self._max_tokens = service.config.limits.max_tokens
        self.max_body_bytes = service.config.limits.max_body_bytes
        self._endpoints: dict[str, str] = {}  # url -> host:port
        self._id_prefix = f"epp-{uuid.uuid4().hex[:16]}-"
        self._ids = itertools.count()
        #: requests picked and not yet released
        self.in_flight = 0
        self._warned_mode = False

    # --- endpoints ---------------------------------------------------------------------

    def endpoint(self, target: Target) -> str:
        """``target``'s ``ip:port`` (resolved once, then kept fresh by :meth:`refresh_endpoints`)."""
        ep = self._endpoints.get(target.url)
        if ep is None:
            ep = self._endpoints[target.url] = resolve_endpoint(target.url)
        return ep

    async def refresh_endpoints(self, interval_s: float = ENDPOINT_REFRESH_S) -> None:
        """Resolve the workers' host names again every ``interval_s`` (a pod restarted with a new IP)."""
        while True:
            await asyncio.sleep(interval_s)
            for url in [t.url for t in self._up.targets().values()]:
                ep = await asyncio.to_thread(resolve_endpoint, url)
                if self._endpoints.get(url) != ep:
                    logger.info("endpoint picker: %s is now %s", url, ep)
                    self._endpoints[url] = ep

    def allowed(self, subset: Sequence[str] | None) -> frozenset[str] | None:
        """The streams the subset hint allows (None: no hint, every worker). An entry is
        ``host:port`` or a bare host (every port of it). Raises the protocol's 503 when
        the hint names no worker of this router."""
        if subset is None:
            return None
        wanted = set(subset)
        out = frozenset(name for name, t in self._up.targets().items()
                        if (ep := self.endpoint(t)) in wanted or ep.rsplit(":", 1)[0].strip("[]") in wanted)
        if not out:
            shown = ", ".join(subset[:8]) + (" ..." if len(subset) > 8 else "")
            raise OpenAIError(503, f"no eligible endpoint: the subset hint names no worker of this router "
                              f"({shown or 'an empty list'})", code="no_worker_available")
        return out

    # --- the request phase -----------------------------------------------------------------

    def explain_asked(self, headers: dict[str, str]) -> bool:
        value = headers.get(_EXPLAIN)
        return value is not None and explain_requested(value.encode("latin-1", "replace"))

    async def pick(self, headers: dict[str, str], raw: bytes | None, subset: Sequence[str] | None, *,
                   ask_usage: bool) -> tuple[Pick, list[tuple[str, str]], bytes | None]:
        """Route one request: its pick, the request headers to set beside the destination, and
        the body to send on (None: unchanged). ``raw`` None: no body (routed on load).
        ``ask_usage``: the body may be rewritten to ask a stream for its usage chunk (the
        response is streamed back through the picker, which strips it again)."""
        explain = self.explain_asked(headers)
        req = self._parse(headers.get(":path", ""), raw) if raw is not None else None
        limit = self.settings.max_in_flight
        if limit and self.in_flight >= limit:
            self.stats.count("shed")
            raise OpenAIError(429, f"the router sheds this request: {self.in_flight} requests in flight "
                              f"through the picker (--epp-max-in-flight {limit})", code="shed", type_="rate_limit")
        only = self.allowed(subset)
        tokens = await self._books.token_ids(req) if req is not None else []
        request_id = f"{self._id_prefix}{next(self._ids)}"
        span = None
        if self._tracer is not None:
            span = self._tracer.start({k: headers[k] for k in _TRACE if k in headers}, headers.get(":path", ""))
        ranking: tuple[str, ...] = ()

        def decide() -> RouteDecision:
            nonlocal ranking
            decision, ranking = self._service.pick(tokens, request_id=request_id, explain=explain, only=only,
                                                   ranked=self.settings.fallbacks > 0)
            return decision

        try:
            plan = self._books.plan_with(decide, tokens)
        except BaseException as err:
            if span is not None:
                span.end(err)
            raise
        self.in_flight += 1
        targets = self._up.targets()
        primary = self.endpoint(plan.decode)
        endpoints = [primary]
        for name in ranking:
            if len(endpoints) > self.settings.fallbacks:
                break
            t = targets.get(name)
            if t is not None and (ep := self.endpoint(t)) not in endpoints:
                endpoints.append(ep)
        strip = bool(ask_usage and req is not None and req.stream and not req.client_wants_usage())
        pick = Pick(plan, tokens, endpoints, strip, span)
        set_headers: list[tuple[str, str]] = []
        if plan.decode.dp_rank is not None:
            set_headers.append((DP_RANK_HEADER, str(plan.decode.dp_rank)))
        if plan.remote_prefill:
            set_headers.append((PREFILLER_HEADER, self.endpoint(plan.site)))
        if span is not None:
            span.routed(plan.decision, req.kind if req is not None else "other")
            set_headers.extend(span.outgoing({}).items())
        body = None
        if strip:
            assert req is not None
            body = body_asking_usage(req)
        self.stats.count("routed")
        return pick, set_headers, body

    def _parse(self, path: str, raw: bytes) -> ParsedRequest | None:
        """The body as the gateway reads it; None for a JSON body of another API (routed on load)."""
        path = path.split("?", 1)[0]
        if path.endswith("/chat/completions"):
            return parse_chat(raw, max_tokens=self._max_tokens)
        if path.endswith("/completions"):
            return parse_completion(raw, max_tokens=self._max_tokens)
        body = decode_object(raw)
        if "messages" in body:
            return parse_chat(raw, max_tokens=self._max_tokens)
        if "prompt" in body:
            return parse_completion(raw, max_tokens=self._max_tokens)
        return None

    def pick_on_load(self, headers: dict[str, str], subset: Sequence[str] | None) -> list[str]:
        """The endpoint for a request that carries no prompt (a ``GET /v1/models``): the least
        loaded allowed worker, not counted in flight."""
        only = self.allowed(subset)
        request_id = f"{self._id_prefix}{next(self._ids)}"
        plan = self._books.plan_with(
            lambda: self._service.pick([], request_id=request_id, only=only, ranked=False)[0], [])
        self._books.release(request_id)
        self.stats.count("routed_without_body")
        return [self.endpoint(plan.decode)]

    def warn_mode_once(self, what: str) -> None:
        if not self._warned_mode:
            self._warned_mode = True
            logger.warning("endpoint picker: %s; configure request_body_mode FULL_DUPLEX_STREAMED (or BUFFERED) "
                           "in the ext_proc filter for prefix-aware picks (docs/epp.md)", what)

    # --- the response phase ---------------------------------------------------------------

    def served(self, pick: Pick, endpoint: str | None) -> None:
        """Envoy's ``x-gateway-destination-endpoint-served``: count the request where it runs."""
        if endpoint is None or endpoint == pick.primary or pick.released:
            return
        if endpoint not in pick.endpoints:
            self.stats.count("served_elsewhere")
            logger.warning("Envoy served request %s on %s, an endpoint the picker did not name (%s)",
                           pick.request_id, endpoint, ",".join(pick.endpoints))
            return
        self.stats.count("fallback_served")
        plan = pick.plan
        self._up.mark_down(plan.decode, f"Envoy moved a request to the fallback {endpoint}")
        streams = frozenset(n for n, t in self._up.targets().items() if self.endpoint(t) == endpoint)
        tokens = pick.tokens
        try:
            pick.plan = self._books.plan_with(
                lambda: self._service.pick(tokens, request_id=plan.request_id, only=streams, ranked=False)[0],
                tokens)
        except OpenAIError as err:  # the fallback left routing meanwhile: the request is still released at its end
            logger.warning("request %s served on %s: not counted there (%s)", pick.request_id, endpoint, err.message)

    def response_headers(self, pick: Pick, status: int, content_type: str) -> list[tuple[str, str]]:
        """The answer's status and type; the headers the client gets beside the engine's."""
        pick.status = status
        if status == 200 and "text/event-stream" in content_type:
            pick.relay = SseRelay(strip_usage=pick.strip_usage)
        out = [("x-tokenspeed-worker", pick.plan.decode.stream)]
        explanation = pick.plan.decision.explanation
        if explanation is not None:
            out.append((_ROUTE, route_header(explanation).decode("latin-1")))
        return out

    def response_chunk(self, pick: Pick, chunk: bytes) -> bytes:
        """Bytes to send on for ``chunk`` of the answer (an SSE stream: whole events, the usage
        chunk stripped when the picker asked for it)."""
        relay = pick.relay
        if relay is not None:
            out = relay.feed(chunk)
            if not pick.prefilled and relay.generated:
                pick.prefilled = True
                self._books.prefill_done(pick.request_id)
            return out
        if pick.status == 200 and pick.kept_bytes <= _MAX_KEPT_ANSWER:
            pick.kept.append(chunk)
            pick.kept_bytes += len(chunk)
        return chunk

    def response_end(self, pick: Pick) -> bytes:
        """The answer ended: what is left to send, the truth loop's sample, the release."""
        rest = b""
        plan = pick.plan
        if not pick.released and pick.status == 200 and not plan.remote_prefill:
            stream = plan.site.stream
            if pick.relay is not None:
                rest = pick.relay.flush()
                self._books.learn(stream, plan, pick.tokens, pick.relay.usage)
            elif pick.kept and pick.kept_bytes <= _MAX_KEPT_ANSWER:
                self._books.learn_json(stream, plan, pick.tokens, b"".join(pick.kept))
        elif pick.relay is not None:
            rest = pick.relay.flush()
        pick.kept = []
        self.release(pick, "completed")
        return rest

    def release(self, pick: Pick, outcome: str) -> None:
        """Stop counting ``pick`` in flight (once; every path ends here)."""
        if pick.released:
            return
        pick.released = True
        self.in_flight -= 1
        self._books.release(pick.request_id)
        self.stats.count(outcome)
        if pick.span is not None:
            pick.span.end(None if outcome == "completed" else RuntimeError(f"request {outcome}"))


_TRACE = tuple(h.decode() for h in TRACE_HEADERS)
