"""Reading and building Envoy ext_proc messages (the generated protos of ``xds-protos``).

Importing this module imports gRPC's protobuf runtime and Envoy's generated
``envoy.service.ext_proc.v3`` messages; :func:`load` turns their absence into
one :class:`~tokenspeed_router.errors.ConfigError` that names the extra.
Everything the picker reads or writes on the wire goes through here, so the
exchange (``exchange.py``) deals in bytes, strings and lists only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tokenspeed_router.epp.names import (
    DESTINATION_HEADER,
    LB_NAMESPACE,
    SERVED_KEY,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)
from tokenspeed_router.errors import ConfigError

try:
    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.type.v3 import http_status_pb2
    from google.protobuf import struct_pb2
except ImportError as _err:  # pragma: no cover - exercised by the no-extra CLI test
    _MISSING: ImportError | None = _err
else:
    _MISSING = None

__all__ = [
    "BodyMode",
    "body_chunk",
    "body_continue",
    "destination",
    "header_map",
    "headers_continue",
    "immediate",
    "load",
    "served_endpoint",
    "subset_hint",
    "trailers_continue",
]


def load() -> None:
    """Raise :class:`ConfigError` naming the ``epp`` extra when its packages are missing."""
    if _MISSING is not None:
        from tokenspeed_router.epp.names import EPP_EXTRA_HINT

        raise ConfigError(f"{EPP_EXTRA_HINT} ({_MISSING})")


class BodyMode:
    """``ProcessingMode.BodySendMode`` values the exchange tells apart (ints, as on the wire)."""

    NONE = 0
    STREAMED = 1
    BUFFERED = 2
    BUFFERED_PARTIAL = 3
    FULL_DUPLEX_STREAMED = 4
    GRPC = 5


if _MISSING is None:  # the enum's values, checked against the generated code once
    _mode = processing_mode_pb2.ProcessingMode
    assert BodyMode.FULL_DUPLEX_STREAMED == _mode.FULL_DUPLEX_STREAMED
    assert BodyMode.BUFFERED == _mode.BUFFERED and BodyMode.STREAMED == _mode.STREAMED


def header_map(headers: Any) -> dict[str, str]:
    """An ``HttpHeaders`` message as ``{lower-case name: value}`` (``raw_value`` preferred, as Envoy
    sends it; a repeated name keeps its last value)."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        raw = h.raw_value
        out[h.key.lower()] = raw.decode("utf-8", "replace") if raw else h.value
    return out


def _strings(value: Any) -> list[str] | None:
    """A ``google.protobuf.Value`` as endpoint strings: a list, or one comma-separated string."""
    kind = value.WhichOneof("kind")
    items: Iterable[str]
    if kind == "list_value":
        items = (v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value")
    elif kind == "string_value":
        items = (value.string_value,)
    elif kind == "null_value":
        return []
    else:
        return None
    return [part.strip() for item in items for part in item.split(",") if part.strip()]


def subset_hint(request: Any) -> list[str] | None:
    """The subset hint of a ``ProcessingRequest``: None when absent, else its endpoints
    (possibly none: an empty list means no endpoint is eligible). A value that is not a
    list or string of endpoints raises ValueError."""
    if not request.HasField("metadata_context"):
        return None
    ns = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    out = _strings(ns.fields[SUBSET_KEY])
    if out is None:
        raise ValueError(f"{SUBSET_NAMESPACE}.{SUBSET_KEY} must be a list of ip:port strings")
    return out


def served_endpoint(request: Any) -> str | None:
    """``envoy.lb`` / ``x-gateway-destination-endpoint-served`` of a ``ProcessingRequest`` (or None)."""
    if not request.HasField("metadata_context"):
        return None
    ns = request.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if ns is None or SERVED_KEY not in ns.fields:
        return None
    got = _strings(ns.fields[SERVED_KEY])
    return got[0] if got else None


def _header_option(key: str, value: str) -> Any:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()))


def destination(endpoints: str, headers: Sequence[tuple[str, str]], *, in_body: bool) -> Any:
    """The answer that names the endpoint(s): the header and ``envoy.lb`` dynamic metadata set to
    the same value, the route cache cleared (the header picks the ORIGINAL_DST host), plus
    ``headers``. ``in_body``: answer a buffered body (the header mutation rides on the body
    response); otherwise answer the request headers."""
    common = pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=[
            _header_option(DESTINATION_HEADER, endpoints), *(_header_option(k, v) for k, v in headers)]),
        clear_route_cache=True,
    )
    meta = struct_pb2.Struct()
    meta.fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = endpoints
    if in_body:
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=meta)
    return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=meta)


def headers_continue(*, response: bool, headers: Sequence[tuple[str, str]] = ()) -> Any:
    """Let request (or response) headers go on, with ``headers`` set."""
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(
        set_headers=[_header_option(k, v) for k, v in headers])) if headers else pb.CommonResponse()
    answer = pb.HeadersResponse(response=common)
    return pb.ProcessingResponse(response_headers=answer) if response else pb.ProcessingResponse(request_headers=answer)


def body_chunk(data: bytes, end_of_stream: bool, *, response: bool) -> Any:
    """A full-duplex body chunk sent back to Envoy (``StreamedBodyResponse``)."""
    answer = pb.BodyResponse(response=pb.CommonResponse(body_mutation=pb.BodyMutation(
        streamed_response=pb.StreamedBodyResponse(body=data, end_of_stream=end_of_stream))))
    return pb.ProcessingResponse(response_body=answer) if response else pb.ProcessingResponse(request_body=answer)


def body_continue(*, response: bool) -> Any:
    """Let a (buffered or streamed, not full-duplex) body chunk go on unchanged."""
    answer = pb.BodyResponse(response=pb.CommonResponse())
    return pb.ProcessingResponse(response_body=answer) if response else pb.ProcessingResponse(request_body=answer)


def trailers_continue(*, response: bool) -> Any:
    answer = pb.TrailersResponse()
    return pb.ProcessingResponse(response_trailers=answer) if response else pb.ProcessingResponse(
        request_trailers=answer)


def immediate(status: int, body: bytes, details: str) -> Any:
    """Answer the client now with ``status`` and a JSON ``body`` (the request goes nowhere)."""
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=pb.HeaderMutation(set_headers=[_header_option("content-type", "application/json")]),
        body=body, details=details[:200]))
