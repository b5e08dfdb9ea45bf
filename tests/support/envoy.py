"""Envoy's side of ext_proc, for the endpoint picker's tests and benchmarks (not a test module).

No Envoy binary runs here: the picker gets exactly the messages Envoy's
ext_proc filter sends (``tokenspeed_router.epp.client`` builds them from the
generated ``envoy.service.ext_proc.v3`` protos; over real gRPC on loopback),
in the order the filter sends them for each ``processing_mode``:

* :class:`ExtProcStream`: one bidirectional stream (send, receive with a
  deadline, half-close, cancel);
* :func:`envoy_request`: a whole request's exchange in one of the modes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc

from tokenspeed_router.epp.client import (
    BUFFERED,
    FULL_DUPLEX,
    NONE,
    STREAMED,
    destination,
    health,
    request_body,
    request_headers,
    request_trailers,
    response_body,
    response_headers,
    set_headers,
)

__all__ = ["BUFFERED", "FULL_DUPLEX", "NONE", "STREAMED", "ExtProcStream", "envoy_request", "health",
           "request_body", "request_headers", "request_trailers", "response_body", "response_headers",
           "set_headers"]

_END = object()


class ExtProcStream:
    """One ext_proc stream to the picker, driven message by message from this thread."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._out: queue.Queue[Any] = queue.Queue()
        stub = external_processor_pb2_grpc.ExternalProcessorStub(channel)
        self._call = stub.Process(self._requests())
        self._answers: queue.Queue[Any] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _requests(self) -> Iterator[Any]:
        while (msg := self._out.get()) is not _END:
            yield msg

    def _read(self) -> None:
        try:
            for answer in self._call:
                self._answers.put(answer)
            self._answers.put(_END)
        except grpc.RpcError as err:
            self._answers.put(err)

    def send(self, msg: pb.ProcessingRequest) -> None:
        self._out.put(msg)

    def recv(self, timeout_s: float = 30.0) -> pb.ProcessingResponse | None:
        """The next answer; None when the picker ended the stream (raises its gRPC error)."""
        got = self._answers.get(timeout=timeout_s)
        if isinstance(got, grpc.RpcError):
            raise got
        return None if got is _END else got

    def recv_n(self, n: int, timeout_s: float = 30.0) -> list[pb.ProcessingResponse]:
        out = []
        for _ in range(n):
            got = self.recv(timeout_s)
            assert got is not None, f"the picker ended the stream after {len(out)} of {n} answers"
            out.append(got)
        return out

    def nothing_pending(self) -> bool:
        return self._answers.empty()

    def close(self) -> None:
        """Half-close (Envoy's end of the HTTP request's stream)."""
        self._out.put(_END)

    def cancel(self) -> None:
        """Drop the stream mid-way (Envoy resets it: the client went away, a timeout)."""
        self._call.cancel()
        self._out.put(_END)

    def done(self, timeout_s: float = 30.0) -> None:
        """Wait for the picker to end the stream."""
        self._reader.join(timeout_s)
        assert not self._reader.is_alive(), "the picker did not end the stream"


@dataclass
class Exchanged:
    """What one request's exchange gave back."""

    answers: list[pb.ProcessingResponse] = field(default_factory=list)
    endpoint: str = ""  # the destination header's value
    metadata: str = ""  # the same in envoy.lb dynamic metadata
    body_sent_on: bytes = b""  # the request body as the picker sent it back (full duplex)
    immediate: pb.ImmediateResponse | None = None
    response_sent_on: bytes = b""


def envoy_request(channel: grpc.Channel, body: bytes, *, path: str = "/v1/completions", chunk_bytes: int = 0,
                  trailers: bool = False, modes: tuple[int, int] | None = (FULL_DUPLEX, FULL_DUPLEX),
                  extra_headers: dict[str, str] | None = None, subset: Any = None,
                  response: Sequence[bytes] | None = None, content_type: str = "text/event-stream",
                  served: str | None = None, status: int = 200,
                  upstream: Callable[[str, bytes], tuple[int, str, Sequence[bytes]]] | None = None) -> Exchanged:
    """One request as Envoy's ext_proc filter drives it, in ``modes`` (request, response body).

    The body goes in ``chunk_bytes`` chunks (0: one). ``response``: the engine's answer
    chunks to feed through the response phase (None: stop after the request phase and
    half-close, as when Envoy's upstream fails). ``upstream(endpoint, body)``: Envoy's
    upstream call instead (the endpoint the picker named first, the body it sent on),
    giving the status, content type and answer chunks to feed back.
    """
    stream = ExtProcStream(channel)
    out = Exchanged()
    req_mode = modes[0] if modes is not None else FULL_DUPLEX
    resp_mode = modes[1] if modes is not None else FULL_DUPLEX
    try:
        stream.send(request_headers(path, extra=extra_headers, subset=subset, modes=modes))
        if req_mode != FULL_DUPLEX:  # Envoy waits for the headers answer before the body
            first = stream.recv()
            assert first is not None
            out.answers.append(first)
            if first.HasField("immediate_response"):
                out.immediate = first.immediate_response
                return out
        size = chunk_bytes or max(1, len(body))
        chunks = [body[i:i + size] for i in range(0, len(body), size)] or [b""]
        if req_mode == BUFFERED:
            chunks = [body]
        for i, c in enumerate(chunks):
            stream.send(request_body(c, end_of_stream=(i == len(chunks) - 1) and not trailers))
        if trailers:
            stream.send(request_trailers())
        # the answers of the request phase: headers, then each body chunk, then trailers (full duplex)
        while True:
            got = stream.recv()
            if got is None:
                break
            out.answers.append(got)
            if got.HasField("immediate_response"):
                out.immediate = got.immediate_response
                return out
            if got.HasField("request_body"):
                sr = got.request_body.response.body_mutation.streamed_response
                out.body_sent_on += sr.body
                if req_mode != FULL_DUPLEX or (sr.end_of_stream and not trailers):
                    break
            if got.HasField("request_trailers") or (req_mode == STREAMED and got.HasField("request_headers")):
                break
        named = next((a for a in out.answers if a.HasField("dynamic_metadata")), None)
        if named is not None:
            out.endpoint, out.metadata = destination(named)
        if req_mode == STREAMED:
            stream.send(request_body(body, end_of_stream=True))
            stream.recv()
        if upstream is not None and out.endpoint:
            status, content_type, response = upstream(out.endpoint.split(",")[0], out.body_sent_on or body)
        if response is None:
            stream.close()
            stream.done()
            return out
        stream.send(response_headers(status, content_type, served=served))
        out.answers.append(stream.recv_n(1)[0])
        for i, c in enumerate(response):
            stream.send(response_body(c, end_of_stream=i == len(response) - 1))
            if resp_mode != FULL_DUPLEX:
                out.answers.append(stream.recv_n(1)[0])
        if resp_mode == FULL_DUPLEX:
            while True:  # chunks come back at the picker's pace (whole SSE events), the last with eos
                got = stream.recv()
                assert got is not None
                out.answers.append(got)
                sr = got.response_body.response.body_mutation.streamed_response
                out.response_sent_on += sr.body
                if sr.end_of_stream:
                    break
        stream.close()
        stream.done()
        return out
    finally:
        stream.cancel()
