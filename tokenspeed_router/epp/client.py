"""Envoy's side of ext_proc: the messages its filter sends, a health check, a test pick.

``doctor`` asks a running picker with these (``doctor --epp HOST:PORT``), and
the tests and ``benchmarks/bench_epp.py`` drive the picker with them: the
generated ``envoy.service.ext_proc.v3`` messages, built the way Envoy's
``ext_proc`` filter builds them (``raw_value`` headers, ``protocol_config`` on
the first message, the subset hint and the served endpoint in
``metadata_context``). Needs the ``epp`` extra.
"""

from __future__ import annotations

from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenspeed_router.epp.names import DESTINATION_HEADER, LB_NAMESPACE

__all__ = [
    "BUFFERED",
    "FULL_DUPLEX",
    "NONE",
    "STREAMED",
    "destination",
    "health",
    "pick_once",
    "request_body",
    "request_headers",
    "request_trailers",
    "response_body",
    "response_headers",
    "response_trailers",
    "set_headers",
]

Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX = Mode.FULL_DUPLEX_STREAMED
BUFFERED = Mode.BUFFERED
STREAMED = Mode.STREAMED
NONE = Mode.NONE


def _headers(pairs: dict[str, str]) -> base_pb2.HeaderMap:
    # Envoy sends raw_value (bytes) and leaves value empty
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])


def _meta(namespace: str, key: str, value: Any) -> base_pb2.Metadata:
    meta = base_pb2.Metadata()
    s = struct_pb2.Struct()
    s.update({key: value})
    meta.filter_metadata[namespace].CopyFrom(s)
    return meta


def request_headers(path: str = "/v1/completions", *, method: str = "POST", end_of_stream: bool = False,
                    extra: dict[str, str] | None = None, subset: Any = None,
                    modes: tuple[int, int] | None = (FULL_DUPLEX, FULL_DUPLEX)) -> pb.ProcessingRequest:
    """The first message: the request headers (pseudo-headers included), ``protocol_config``
    (request and response body modes; None: an older Envoy that sends none) and the subset
    hint (``envoy.lb.subset_hint``) when given."""
    pairs = {":authority": "inference-gateway", ":path": path, ":method": method, ":scheme": "http",
             "content-type": "application/json", "x-request-id": "5f1c0d8e-test", **(extra or {})}
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=_headers(pairs), end_of_stream=end_of_stream))
    if modes is not None:
        msg.protocol_config.CopyFrom(pb.ProtocolConfiguration(request_body_mode=modes[0],
                                                               response_body_mode=modes[1]))
    if subset is not None:
        msg.metadata_context.CopyFrom(_meta("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", subset))
    return msg


def request_body(chunk: bytes, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))


def request_trailers() -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_trailers=pb.HttpTrailers(trailers=_headers({"x-trailer": "1"})))


def response_headers(status: int = 200, content_type: str = "text/event-stream", *, served: str | None = None,
                     end_of_stream: bool = False) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest(response_headers=pb.HttpHeaders(
        headers=_headers({":status": str(status), "content-type": content_type}), end_of_stream=end_of_stream))
    if served is not None:
        msg.metadata_context.CopyFrom(_meta("envoy.lb", "x-gateway-destination-endpoint-served", served))
    return msg


def response_body(chunk: bytes, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))


def response_trailers() -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_trailers=pb.HttpTrailers(trailers=_headers({"grpc-status": "0"})))



def destination(answer: pb.ProcessingResponse) -> tuple[str, str]:
    """(header value, ``envoy.lb`` metadata value) of the answer that names the endpoint."""
    common = (answer.request_headers.response if answer.HasField("request_headers")
              else answer.request_body.response)
    header = next((h.header.raw_value.decode() or h.header.value for h in common.header_mutation.set_headers
                   if h.header.key == DESTINATION_HEADER), "")
    meta = answer.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER]
    return header, meta.string_value


def set_headers(answer: pb.ProcessingResponse) -> dict[str, str]:
    """The headers an answer sets (request or response headers, or a buffered body's answer)."""
    kind = answer.WhichOneof("response")
    common = getattr(answer, kind).response
    return {h.header.key: h.header.raw_value.decode() or h.header.value for h in common.header_mutation.set_headers}


def health(channel: grpc.Channel, service: str, timeout_s: float = 5.0) -> str:
    """``grpc.health.v1.Health/Check`` of ``service``: SERVING, NOT_SERVING, or the gRPC code's name."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError as err:
        return err.code().name
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))


def pick_once(channel: grpc.Channel, body: bytes, *, path: str = "/v1/completions",
              timeout_s: float = 10.0) -> pb.ProcessingResponse:
    """One full-duplex request phase, then a half-close with no response phase (as when the
    upstream fails): the picker names an endpoint and releases the pick at once. Returns the
    first answer (the destination, or an ImmediateResponse)."""
    stub = external_processor_pb2_grpc.ExternalProcessorStub(channel)
    messages = [request_headers(path), request_body(body, end_of_stream=True)]
    call = stub.Process(iter(messages), timeout=timeout_s)
    try:
        for answer in call:
            return answer
    finally:
        call.cancel()
    raise RuntimeError("the picker ended the stream without an answer")
