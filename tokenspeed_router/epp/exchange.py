"""One HTTP request's ext_proc stream, message by message, in the order Envoy sends them.

Envoy opens one bidirectional gRPC stream per HTTP request and sends, as its
``processing_mode`` says: the request headers, the request body (in chunks),
perhaps request trailers, then the response headers, the response body and
perhaps response trailers. The first message carries ``protocol_config``
(Envoy >= 1.33): the body modes. Without it the picker assumes
``FULL_DUPLEX_STREAMED`` for both bodies, the mode the endpoint picker
protocol requires.

Request phase:

* ``FULL_DUPLEX_STREAMED``: the headers answer waits for the whole body (the
  prompt decides the endpoint). At the body's end (``end_of_stream``, or the
  trailers) the picker answers, in order: the headers (the destination
  header, ``envoy.lb`` dynamic metadata, the route cache cleared), the body
  chunks as they came (unchanged, except that a stream is asked for its
  usage chunk: then one rewritten chunk), the trailers.
* ``BUFFERED``: the headers go on at once; the one body message is answered
  with the destination riding on the body response.
* ``STREAMED``/``NONE``: the body cannot hold the headers back, so the pick
  is made on load at the headers (logged once: configure a mode above).
* Headers that end the request (no body): a ``GET``/``HEAD`` (``/v1/models``)
  gets the least loaded endpoint; anything else is a 400.

Response phase: the headers tell the served endpoint
(``envoy.lb``/``x-gateway-destination-endpoint-served``) and the status; each
body chunk is sent back in ``FULL_DUPLEX_STREAMED`` (SSE event by event, the
usage chunk stripped when the picker asked for it) and let through
otherwise; the end of the answer (``end_of_stream``, trailers, or headers
that end it) is the release. A stream that ends early (Envoy dropped it, the
client went away) is released by :meth:`Exchange.close`.

Errors before the destination is named are ImmediateResponses (400 bad body,
413 too large, 429 shed, 503 nothing eligible) and end the stream; errors
after it never touch the response (logged, the bytes go on).
"""

from __future__ import annotations

import logging
from typing import Any

from tokenspeed_router.epp import messages as m
from tokenspeed_router.epp.messages import BodyMode
from tokenspeed_router.epp.picker import EndpointPicker, Pick
from tokenspeed_router.gateway.openai import OpenAIError

__all__ = ["Exchange"]

logger = logging.getLogger(__name__)

_NO_BODY_METHODS = ("GET", "HEAD", "OPTIONS", "DELETE")


class Exchange:
    """The state of one ext_proc stream (module docstring)."""

    __slots__ = ("_body", "_body_bytes", "_headers", "_picker", "_request_mode", "_response_mode", "_subset",
                 "finished", "pick")

    def __init__(self, picker: EndpointPicker) -> None:
        self._picker = picker
        self._request_mode = BodyMode.FULL_DUPLEX_STREAMED
        self._response_mode = BodyMode.FULL_DUPLEX_STREAMED
        self._headers: dict[str, str] = {}
        self._subset: list[str] | None = None
        self._body: list[bytes] = []
        self._body_bytes = 0
        self.pick: Pick | None = None
        #: an ImmediateResponse was sent: nothing more is read from this stream
        self.finished = False

    async def step(self, msg: Any) -> list[Any]:
        """The answers to one ``ProcessingRequest``, in order (possibly none yet)."""
        kind = msg.WhichOneof("request")
        try:
            if kind == "request_headers":
                return await self._request_headers(msg)
            if kind == "request_body":
                return await self._request_body(msg.request_body)
            if kind == "request_trailers":
                return await self._request_trailers()
        except OpenAIError as err:
            return self._refuse(err)
        except Exception as err:  # never a crash: the client gets a 500, the stream ends, nothing leaks
            logger.exception("endpoint picker: request phase failed")
            return self._refuse(OpenAIError(500, f"internal error in the endpoint picker: {type(err).__name__}"))
        try:
            if kind == "response_headers":
                return self._response_headers(msg)
            if kind == "response_body":
                return self._response_body(msg.response_body)
            if kind == "response_trailers":
                return self._response_trailers()
        except Exception:
            # the answer is already on its way: never break it; the release still happens at close()
            logger.exception("endpoint picker: response phase failed")
            return self._pass_through(msg, kind)
        raise OpenAIError(400, f"unexpected ext_proc message {kind!r}")

    def close(self) -> None:
        """The stream ended: release the request if its answer did not end it. With
        ``response_body_mode: NONE`` the stream's end after the response headers is the
        answer's end; any other early end is an abort (Envoy dropped the stream)."""
        pick = self.pick
        if pick is not None and not pick.released:
            done = self._response_mode == BodyMode.NONE and pick.status != 0
            self._picker.release(pick, "completed" if done else "aborted")

    # --- request phase ------------------------------------------------------------------

    async def _request_headers(self, msg: Any) -> list[Any]:
        if self._headers:
            raise OpenAIError(400, "request headers sent twice on one ext_proc stream")
        if msg.HasField("protocol_config"):
            config = msg.protocol_config
            self._request_mode = config.request_body_mode
            self._response_mode = config.response_body_mode
        headers = m.header_map(msg.request_headers)
        self._headers = headers or {":method": ""}
        try:
            self._subset = m.subset_hint(msg)
        except ValueError as err:
            raise OpenAIError(400, str(err)) from None
        self._picker.explain_asked(headers)  # a bad x-tokenspeed-explain is a 400 before any routing
        if msg.request_headers.end_of_stream:
            if headers.get(":method", "").upper() not in _NO_BODY_METHODS:
                raise OpenAIError(400, f"{headers.get(':method', '?')} {headers.get(':path', '?')} has no body: "
                                  "an inference request needs a JSON body", code="invalid_body")
            endpoints = self._picker.pick_on_load(headers, self._subset)
            return [m.destination(",".join(endpoints), (), in_body=False)]
        mode = self._request_mode
        if mode == BodyMode.FULL_DUPLEX_STREAMED:
            return []  # the answer waits for the body
        if mode in (BodyMode.BUFFERED, BodyMode.BUFFERED_PARTIAL):
            return [m.headers_continue(response=False)]
        self._picker.warn_mode_once(f"request_body_mode {mode} sends the headers on before the body: "
                                    "picks are made on load alone")
        return [await self._route(None, in_body=False)]

    async def _request_body(self, body: Any) -> list[Any]:
        if not self._headers:
            raise OpenAIError(400, "a request body before the request headers")
        mode = self._request_mode
        if self.pick is not None:  # STREAMED/NONE: routed at the headers; let the body through
            return [m.body_continue(response=False)]
        chunk = body.body
        self._body_bytes += len(chunk)
        limit = self._picker.max_body_bytes
        if self._body_bytes > limit:
            raise OpenAIError(413, f"the request body is over {limit} bytes (--max-body-bytes)",
                              code="invalid_body")
        if chunk or not self._body:
            self._body.append(chunk)
        end = body.end_of_stream or getattr(body, "end_of_stream_without_message", False)
        if mode == BodyMode.FULL_DUPLEX_STREAMED:
            return await self._full_duplex_done(trailers=False) if end else []
        # BUFFERED (and BUFFERED_PARTIAL): one message, the whole body Envoy holds
        return [await self._route(b"".join(self._body), in_body=True)]

    async def _request_trailers(self) -> list[Any]:
        if self._request_mode == BodyMode.FULL_DUPLEX_STREAMED and self.pick is None:
            if not self._headers:
                raise OpenAIError(400, "request trailers before the request headers")
            return await self._full_duplex_done(trailers=True)
        return [m.trailers_continue(response=False)]

    async def _full_duplex_done(self, *, trailers: bool) -> list[Any]:
        """The whole body is in: name the endpoint, then send the body back, in order."""
        chunks = self._body
        self._body = []
        raw = b"".join(chunks) if len(chunks) != 1 else chunks[0]
        pick, set_headers, rewritten = await self._picker.pick(
            self._headers, raw, self._subset, ask_usage=self._response_mode == BodyMode.FULL_DUPLEX_STREAMED)
        self.pick = pick
        if rewritten is not None:
            chunks = [rewritten]
            set_headers.append(("content-length", str(len(rewritten))))
        out = [m.destination(",".join(pick.endpoints), set_headers, in_body=False)]
        last = len(chunks) - 1
        out.extend(m.body_chunk(c, not trailers and i == last, response=False) for i, c in enumerate(chunks))
        if trailers:
            out.append(m.trailers_continue(response=False))
        return out

    async def _route(self, raw: bytes | None, *, in_body: bool) -> Any:
        """Pick (``raw`` None: on load) and name the endpoint on the headers or the body answer."""
        if raw is None:
            endpoints = self._picker.pick_on_load(self._headers, self._subset)
            return m.destination(",".join(endpoints), (), in_body=in_body)
        pick, set_headers, _ = await self._picker.pick(self._headers, raw, self._subset, ask_usage=False)
        self.pick = pick
        return m.destination(",".join(pick.endpoints), set_headers, in_body=in_body)

    def _refuse(self, err: OpenAIError) -> list[Any]:
        """An ImmediateResponse: the client gets ``err``, the stream ends, nothing stays in flight."""
        self.finished = True
        self._body = []
        if self.pick is not None:
            self._picker.release(self.pick, "refused")
        else:
            self._picker.stats.count(f"http_{err.status}")
        return [m.immediate(err.status, err.body(), err.message)]

    # --- response phase ---------------------------------------------------------------------

    def _response_headers(self, msg: Any) -> list[Any]:
        pick = self.pick
        if pick is None:
            return [m.headers_continue(response=True)]
        headers = m.header_map(msg.response_headers)
        self._picker.served(pick, m.served_endpoint(msg))
        try:
            status = int(headers.get(":status", "0"))
        except ValueError:
            status = 0
        extra = self._picker.response_headers(pick, status, headers.get("content-type", ""))
        if msg.response_headers.end_of_stream:
            self._picker.response_end(pick)
        return [m.headers_continue(response=True, headers=extra)]

    def _response_body(self, body: Any) -> list[Any]:
        pick = self.pick
        end = body.end_of_stream or getattr(body, "end_of_stream_without_message", False)
        full_duplex = self._response_mode == BodyMode.FULL_DUPLEX_STREAMED
        if pick is None or pick.released:
            return [m.body_chunk(body.body, end, response=True) if full_duplex else m.body_continue(response=True)]
        out = self._picker.response_chunk(pick, body.body)
        if end:
            out += self._picker.response_end(pick)
        if not full_duplex:
            return [m.body_continue(response=True)]
        if not out and not end:
            return []  # an SSE event not complete yet: it goes with the next chunk
        return [m.body_chunk(out, end, response=True)]

    def _response_trailers(self) -> list[Any]:
        out: list[Any] = []
        pick = self.pick
        if pick is not None and not pick.released:
            rest = self._picker.response_end(pick)
            if rest and self._response_mode == BodyMode.FULL_DUPLEX_STREAMED:
                out.append(m.body_chunk(rest, False, response=True))
        out.append(m.trailers_continue(response=True))
        return out

    def _pass_through(self, msg: Any, kind: str | None) -> list[Any]:
        """After a failure in the response phase: let the message through unchanged."""
        if kind == "response_headers":
            return [m.headers_continue(response=True)]
        if kind == "response_body":
            body = msg.response_body
            if self._response_mode == BodyMode.FULL_DUPLEX_STREAMED:
                return [m.body_chunk(body.body, body.end_of_stream, response=True)]
            return [m.body_continue(response=True)]
        return [m.trailers_continue(response=True)]
