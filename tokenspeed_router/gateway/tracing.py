"""W3C trace context through the gateway, and (optional) one OpenTelemetry span per request.

* Always: a client's ``traceparent`` and ``tracestate`` headers go to the
  engine unchanged (picked up in the same pass over the request headers
  that reads ``authorization``; nothing else is parsed), so a vLLM or Dynamo
  deployment that collects OTLP traces sees the engine's spans under the
  client's trace.
* With ``serve --otlp-traces-endpoint URL`` (needs the ``otel`` extra:
  ``pip install 'tokenspeed-router[otel]'``, the OpenTelemetry SDK and its
  OTLP/HTTP exporter): the gateway emits one ``tokenspeed.route`` span per
  request, a child of the client's context when it sent one, with the
  routing decision as attributes (:data:`SPAN_ATTRIBUTES`), and the engine
  receives *that* span's ``traceparent``, so its spans nest under the
  router's. Spans leave in batches on the SDK's own thread
  (``BatchSpanProcessor``; its ``OTEL_BSP_*`` variables apply), never on the
  event loop.
* Without the setting nothing of OpenTelemetry is imported (the import sits
  in :func:`load_tracer`) and the request path pays one ``is None`` test.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenspeed_router.errors import ConfigError

__all__ = ["SPAN_ATTRIBUTES", "TRACE_HEADERS", "OtelTracer", "RequestSpan", "load_tracer"]

logger = logging.getLogger(__name__)

#: request headers forwarded to the engine as they came (W3C Trace Context)
TRACE_HEADERS = (b"traceparent", b"tracestate")
SPAN_NAME = "tokenspeed.route"
#: what a span says about the routing decision
SPAN_ATTRIBUTES = (
    "tokenspeed.worker",
    "tokenspeed.prefill_worker",
    "tokenspeed.decode_worker",
    "tokenspeed.matched_tokens",
    "tokenspeed.matched_blocks",
    "tokenspeed.prompt_tokens",
    "tokenspeed.request_id",
    "tokenspeed.kind",
)
OTEL_HINT = ("--otlp-traces-endpoint needs the otel extra: pip install 'tokenspeed-router[otel]' "
             "(opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)")


class RequestSpan:
    """One request's span: started from the client's headers, told the decision, ended once."""

    __slots__ = ("_span", "_tracer")

    def __init__(self, tracer: OtelTracer, span: Any) -> None:
        self._tracer = tracer
        self._span = span

    def outgoing(self, headers: dict[str, str]) -> dict[str, str]:
        """``headers`` with this span's ``traceparent`` (and the client's ``tracestate``)."""
        return self._tracer.inject(self._span, headers)

    def routed(self, decision: Any, kind: str) -> None:
        """Record the routing decision (a :class:`~tokenspeed_router.router.decision.RouteDecision`)."""
        attrs: dict[str, Any] = {
            "tokenspeed.worker": decision.worker,
            "tokenspeed.decode_worker": decision.decode_worker,
            "tokenspeed.matched_tokens": int(decision.matched_tokens),
            "tokenspeed.matched_blocks": int(decision.matched_blocks),
            "tokenspeed.prompt_tokens": int(decision.num_tokens),
            "tokenspeed.request_id": decision.request_id,
            "tokenspeed.kind": kind,
        }
        if decision.prefill_worker is not None:
            attrs["tokenspeed.prefill_worker"] = decision.prefill_worker
        self._span.set_attributes(attrs)

    def end(self, error: BaseException | None = None) -> None:
        if error is not None:
            self._span.record_exception(error)
            self._tracer.set_error(self._span, error)
        self._span.end()


class OtelTracer:
    """The OpenTelemetry SDK, exporting OTLP over HTTP to ``endpoint`` (imported on construction)."""

    def __init__(self, endpoint: str, service_name: str = "tokenspeed-router") -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as err:
            raise ConfigError(f"{OTEL_HINT} ({err})") from None
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("tokenspeed_router.gateway")
        self._propagator = TraceContextTextMapPropagator()
        self._kind = SpanKind.SERVER
        self._set_span_in_context = set_span_in_context
        self._status = (Status, StatusCode)
        self.endpoint = endpoint

    def start(self, headers: dict[str, str], path: str) -> RequestSpan:
        """A span for one request, a child of the context ``headers`` carry (if any)."""
        parent = self._propagator.extract(headers) if "traceparent" in headers else None
        span = self._tracer.start_span(SPAN_NAME, context=parent, kind=self._kind,
                                       attributes={"http.route": path})
        return RequestSpan(self, span)

    def inject(self, span: Any, headers: dict[str, str]) -> dict[str, str]:
        out = dict(headers)
        self._propagator.inject(out, context=self._set_span_in_context(span))
        return out

    def set_error(self, span: Any, error: BaseException) -> None:
        status, code = self._status
        span.set_status(status(code.ERROR, f"{type(error).__name__}: {error}"))

    def shutdown(self) -> None:
        """Flush what is queued and stop the exporter thread."""
        self._provider.shutdown()


def load_tracer(endpoint: str | None) -> OtelTracer | None:
    """The tracer for ``--otlp-traces-endpoint`` (None when unset: then nothing is imported)."""
    if not endpoint:
        return None
    tracer = OtelTracer(endpoint)
    logger.info("OTLP traces: one span per gateway request, exported to %s", endpoint)
    return tracer
