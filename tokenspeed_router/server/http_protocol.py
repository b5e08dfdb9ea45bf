"""uvicorn's httptools protocol, as ``serve`` runs it: one write per answer, early answers drained.

Two changes to the stock protocol, both at the connection level where the
ASGI application cannot reach:

* **One write per answer** (:class:`CoalescingTransport`): uvicorn writes an
  answer's head and body in two ``send`` calls; both go out in one ``write``.
* **An early answer is read before the connection closes.** A refusal sent
  before the request body was read (a 413 for a body over ``max_body_bytes``,
  a 401, a 404 for a POST) used to be followed by a close while the client
  was still sending: the kernel answers the unread bytes with a reset, and a
  client that sends the whole body before reading (Python's ``http.client``
  with ``Connection: close``, HTTP/1.0 clients) saw a broken pipe instead of
  the answer. Now the rest of the body is read and discarded, for at most
  :data:`DRAIN_MAX_S` and ``drain_max_bytes``, and only then is the
  connection closed (a "lingering close", as Apache and nginx do): when the
  answer says ``connection: close`` (the client asked for it, or HTTP/1.0),
  the write side is shut at once (the client sees the answer and its end)
  while the read side drains. A keep-alive connection stays usable once the
  body is drained, as before; past either bound it is closed. A client that
  sent ``Expect: 100-continue`` and no body yet is not waiting to send one:
  its connection is closed at once (RFC 9110 §10.1.1).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

__all__ = ["DRAIN_MAX_S", "CoalescingTransport", "http_protocol"]

#: the longest an early answer's connection keeps reading the rest of its request body
DRAIN_MAX_S = 30.0


class CoalescingTransport:
    """A transport whose writes of one event-loop turn go out as one ``write``.

    uvicorn writes an answer's head as soon as ``http.response.start`` is sent
    and its body on the next ``send``: two syscalls, two loopback segments and
    two wake-ups of the client per answer. Here both are joined and written
    once, when the turn that produced them is over (``call_soon``).

    ``linger``: asked at :meth:`close`; when it returns true (the request body
    is still arriving), the transport shuts its write side instead of closing
    and reports itself closing, and the protocol closes it for real with
    :meth:`close_now` once the body is drained. Everything but ``write``,
    ``close`` and ``is_closing`` is the real transport's.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
                 linger: Callable[[], bool] | None = None) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        self._linger = linger
        self._lingering = False

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    @property
    def lingering(self) -> bool:
        """Closed for the application, still reading the rest of a request body."""
        return self._lingering and not self._transport.is_closing()

    def close(self) -> None:
        self._flush()  # uvicorn closes right after the last write of a non-keep-alive answer
        if self._lingering and not self._transport.is_closing():
            return
        if self._transport.is_closing():
            self._transport.close()
            return
        if self._linger is not None and self._linger() and self._transport.can_write_eof():
            self._lingering = True
            self._transport.write_eof()  # the answer and its end reach the client; reading goes on
            return
        self._transport.close()

    def close_now(self) -> None:
        """Close for real (a lingering close is over, or the connection must go)."""
        self._flush()
        self._lingering = False
        self._transport.close()

    def is_closing(self) -> bool:
        return self._lingering or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def http_protocol(drain_max_bytes: int, drain_max_s: float = DRAIN_MAX_S) -> Any:
    """uvicorn's httptools protocol class with both changes ("auto" without httptools).

    ``drain_max_bytes`` and ``drain_max_s``: how much of a request body is
    read and discarded after an early answer, and for how long, before the
    connection is closed anyway.
    """
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "auto"

    class ServeHttpToolsProtocol(HttpToolsProtocol):
        # per request: the whole message was parsed; any body bytes came; bytes discarded after
        # an early answer; and the timer that ends a drain which takes too long
        _request_done = True
        _body_seen = False
        _drained = 0
        _drain_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self._wrapped = CoalescingTransport(transport, self.loop, self._still_sending)  # type: ignore[arg-type]
            super().connection_made(self._wrapped)  # type: ignore[arg-type]

        def _still_sending(self) -> bool:
            """Is the client still sending the body of a request already answered?"""
            return not self._request_done and not self._waiting_for_continue()

        def _waiting_for_continue(self) -> bool:
            # it asked for "100 Continue" and sent nothing since: it will not send the body
            return self.expect_100_continue and not self._body_seen

        def on_message_begin(self) -> None:
            self._request_done = False
            self._body_seen = False
            self._drained = 0
            super().on_message_begin()

        def on_body(self, body: bytes) -> None:
            self._body_seen = True
            cycle = self.cycle
            if cycle is not None and cycle.response_complete:
                self._drained += len(body)  # answered already: the bytes are dropped
                if self._drained > drain_max_bytes:
                    self._end_drain()
                    return
            super().on_body(body)

        def on_message_complete(self) -> None:
            self._request_done = True
            if self._drain_timer is not None:
                self._drain_timer.cancel()
                self._drain_timer = None
            if self._wrapped.lingering:
                self._wrapped.close_now()  # the whole body is read: nothing to reset
                return
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._request_done or (self._wrapped.is_closing() and not self._wrapped.lingering):
                return
            if self._waiting_for_continue():
                self._wrapped.close_now()
                return
            self.flow.resume_reading()  # uvicorn skips this for a closing transport; drain it
            if self._drain_timer is None:
                self._drain_timer = self.loop.call_later(drain_max_s, self._end_drain)

        def _end_drain(self) -> None:
            self._drain_timer = None
            if not self._request_done:
                self._wrapped.close_now()

        def shutdown(self) -> None:
            if self._wrapped.lingering:  # the server stops: no more waiting for that body
                self._wrapped.close_now()
                return
            super().shutdown()

        def send_400_response(self, msg: str) -> None:
            self._request_done = True  # the parser gave up on this stream: close, nothing to drain
            super().send_400_response(msg)

        def connection_lost(self, exc: Exception | None) -> None:
            self._request_done = True
            if self._drain_timer is not None:
                self._drain_timer.cancel()
                self._drain_timer = None
            super().connection_lost(exc)

    return ServeHttpToolsProtocol
