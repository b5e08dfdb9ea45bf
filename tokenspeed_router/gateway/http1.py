"""A lean pooled HTTP/1.1 client for the gateway's legs to the engines (asyncio protocol + httptools).

The one HTTP client for engine calls: the proxy legs, and the side calls
(``/v1/models``, health probes, ``/tokenize``, ``doctor``) through
:meth:`Http1Pool.fetch`. Why not aiohttp (it was the second client until
wave 4): a proxied request is one POST with a JSON body and an
answer relayed chunk by chunk, and aiohttp's general machinery (a request and
a response object graph, header multidicts, a payload writer, tracing hooks,
timer contexts, cookie handling, a stream reader per answer) cost about a
quarter of the gateway's CPU per request. Measured side by side in one run
(``benchmarks/bench_http_stack.py``, docs/gateway.md): this client needs a
fraction of aiohttp's CPU per streamed request against the same upstream.

What it does, and only that:

* keep-alive connections pooled per origin (last used first, so the pool
  stays warm and idle ones age out), at most ``max_connections`` in all
  (callers beyond that wait for one to be released); a connection idle for
  ``keepalive_s`` is closed rather than reused (servers drop idle connections
  after about 5 s: reusing one at that moment is a needless failure);
* the request head and body in one ``write``; the answer parsed by
  httptools (status, headers, ``Content-Length`` or chunked bodies);
* the body handed over as the bytes arrive (:meth:`Http1Response.next_chunk`),
  reading paused while more than :data:`HIGH_WATER_BYTES` wait unread (a slow
  client slows the engine's connection, not the gateway's memory);
* timeouts: ``connect_timeout_s`` to connect, ``read_timeout_s`` for the head
  and for every gap between two body chunks;
* an engine's host name resolved once per :data:`RESOLVE_TTL_S` for all the
  connections it needs (a burst to a cold pool would otherwise queue one
  ``getaddrinfo`` per connection), every address tried in order;
* errors as four types the proxy maps to its retry rules
  (:class:`ConnectFailed`: no connection; :class:`ConnectionDropped`:
  closed or reset; :class:`ReadTimeout`; :class:`ProtocolError`: not
  HTTP/1.1).

A response that was read to its end returns its connection to the pool on
:meth:`Http1Response.release`; anything else (an error, a cancelled request)
closes it on :meth:`Http1Response.close`, which is how an engine learns that
the client went away and aborts the request.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
from collections import deque
from collections.abc import Coroutine, Mapping
from typing import Any
from urllib.parse import urlsplit

import httptools

__all__ = [
    "HIGH_WATER_BYTES",
    "RESOLVE_TTL_S",
    "ConnectFailed",
    "ConnectionDropped",
    "Http1Pool",
    "Http1Response",
    "Origin",
    "ProtocolError",
    "ReadTimeout",
    "UpstreamError",
]

#: unread answer bytes above which the connection stops reading (flow control)
HIGH_WATER_BYTES = 256 * 1024
#: how long an engine's resolved addresses are reused (aiohttp's default DNS cache TTL)
RESOLVE_TTL_S = 10.0


class UpstreamError(Exception):
    """An engine connection failed (base class)."""


class ConnectFailed(UpstreamError):
    """No connection could be made: refused, unroutable, or not within the connect timeout."""


class ConnectionDropped(UpstreamError):
    """An established connection was closed or reset before the answer was complete."""


class ReadTimeout(UpstreamError):
    """The engine sent nothing for ``read_timeout_s`` (the head, or the next chunk)."""


class ProtocolError(UpstreamError):
    """The engine's answer is not valid HTTP/1.1."""


class Origin:
    """Scheme, host and port of an engine URL, with its request-line prefix pre-encoded.

    A URL with a path (``http://host:8000/engine-a``) puts that path before
    every request's (a server behind a path-routing proxy).
    """

    __slots__ = ("host", "host_header", "numeric", "port", "prefix", "ssl")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.ssl = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.ssl else 80)
        self.host_header = parts.netloc.rsplit("@", 1)[-1].encode("idna")
        self.prefix = parts.path.rstrip("/").encode("latin-1")
        try:
            ipaddress.ip_address(self.host)
            self.numeric = True  # nothing to resolve
        except ValueError:
            self.numeric = False


class _Conn(asyncio.Protocol):
    """One keep-alive connection: the parser's callbacks fill the current answer."""

    __slots__ = ("_chunks", "_error", "_paused", "_unread", "_waiter", "complete", "headers", "holds_slot",
                 "idle_since", "keep_alive", "loop", "origin", "parser", "pool", "status", "transport")

    def __init__(self, pool: Http1Pool, origin: Origin, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.origin = origin
        self.loop = loop
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._error: UpstreamError | None = None
        self._chunks: list[bytes] = []
        self._unread = 0
        self._paused = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.complete = False
        self.keep_alive = False
        self.idle_since = 0.0
        self.holds_slot = True  # counted in the pool's open connections until released

    # --- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            self._fail(ProtocolError(f"invalid HTTP answer from {self.origin.host}:{self.origin.port}: {err}"))
            if self.transport is not None:
                self.transport.close()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool._lost(self)
        if not self.complete:
            reason = f"{type(exc).__name__}: {exc}" if exc is not None else "closed by the engine"
            self._fail(ConnectionDropped(f"connection to {self.origin.host}:{self.origin.port} lost: {reason}"))
        self.transport = None

    # --- httptools callbacks ---------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._unread += len(body)
        if self._unread > HIGH_WATER_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # --- the consumer's side -----------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _fail(self, err: UpstreamError) -> None:
        if self._error is None:
            self._error = err
        self._wake()

    async def wait(self, timeout_s: float) -> None:
        """Until the parser has something new (head, chunk, end) or the connection failed."""
        if self._error is not None:
            raise self._error
        waiter = self._waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout_s, self._timed_out, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
        if self._error is not None:
            raise self._error

    def _timed_out(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            waiter.set_exception(ReadTimeout(f"{self.origin.host}:{self.origin.port} sent nothing in time"))
        if self._waiter is waiter:
            self._waiter = None

    def take(self) -> bytes:
        """Every body byte received so far (resumes reading when it was paused)."""
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._unread = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def has_data(self) -> bool:
        return bool(self._chunks)

    def reset(self) -> None:
        """Ready for the next request on this connection."""
        self._chunks = []
        self._unread = 0
        self._error = None
        self._waiter = None
        self.status = 0
        self.headers = []
        self.complete = False
        self.keep_alive = False


class Http1Response:
    """An engine's answer: status and headers now, the body as it arrives."""

    __slots__ = ("_conn", "_done", "_timeout_s", "headers", "status")

    def __init__(self, conn: _Conn, timeout_s: float) -> None:
        self._conn = conn
        self._timeout_s = timeout_s
        self._done = False
        self.status = conn.status
        self.headers = conn.headers

    def header(self, name: bytes, default: bytes | None = None) -> bytes | None:
        """The first header named ``name`` (lower case), else ``default``."""
        for key, value in self.headers:
            if key == name:
                return value
        return default

    @property
    def complete(self) -> bool:
        """The whole answer was received."""
        return self._conn.complete

    async def next_chunk(self) -> bytes | None:
        """Body bytes received since the last call (waiting for some); None at the end."""
        conn = self._conn
        while True:
            if conn.has_data():
                return conn.take()
            if conn.complete:
                return None
            await conn.wait(self._timeout_s)

    async def read(self) -> bytes:
        """The whole body."""
        parts: list[bytes] = []
        while True:
            chunk = await self.next_chunk()
            if chunk is None:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            parts.append(chunk)

    def release(self) -> None:
        """Back to the pool when read to its end on a keep-alive connection, else closed."""
        if self._done:
            return
        self._done = True
        conn = self._conn
        if conn.complete and conn.keep_alive and not conn.has_data():
            conn.pool._put_idle(conn)
        else:
            conn.pool._close(conn)

    def close(self) -> None:
        """Close the connection (the engine sees the client go and aborts the request)."""
        if self._done:
            return
        self._done = True
        self._conn.pool._close(self._conn)


class Http1Pool:
    """Keep-alive connections to engines, bounded in number; see the module docstring."""

    def __init__(self, *, max_connections: int, connect_timeout_s: float, read_timeout_s: float,
                 keepalive_s: float) -> None:
        self._max = max_connections
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._keepalive_s = keepalive_s
        self._idle: dict[Origin, dict[_Conn, None]] = {}
        self._open = 0  # connections open or being opened
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._origins: dict[str, Origin] = {}
        self._resolved: dict[Origin, tuple[float, list[tuple[int, Any]]]] = {}  # -> (valid until, addresses)
        self._resolving: dict[Origin, asyncio.Future[Any]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False
        #: connections opened / reused (statistics, tests)
        self.opened = 0
        self.reused = 0

    def origin(self, url: str) -> Origin:
        """The parsed origin of ``url`` (cached: engines are few)."""
        origin = self._origins.get(url)
        if origin is None:
            origin = self._origins[url] = Origin(url)
        return origin

    @property
    def open_connections(self) -> int:
        return self._open

    def idle_connections(self) -> int:
        return sum(len(d) for d in self._idle.values())

    def post(self, url: str, path: str, body: bytes, headers: Mapping[str, str] | None = None,
             *, content_type: bytes = b"application/json",
             timeout_s: float | None = None) -> Coroutine[Any, Any, Http1Response]:
        """POST ``body`` to ``url + path``; the answer once its status and headers arrived.

        Hands back :meth:`request`'s coroutine itself (no second frame on the
        proxy's path, which posts once per request).
        """
        return self.request(b"POST", url, path, body, headers, content_type=content_type, timeout_s=timeout_s)

    def get(self, url: str, path: str, headers: Mapping[str, str] | None = None, *,
            timeout_s: float | None = None) -> Coroutine[Any, Any, Http1Response]:
        """GET ``url + path``; the answer once its status and headers arrived."""
        return self.request(b"GET", url, path, None, headers, timeout_s=timeout_s)

    async def request(self, method: bytes, url: str, path: str, body: bytes | None,
                      headers: Mapping[str, str] | None = None, *, content_type: bytes = b"application/json",
                      timeout_s: float | None = None) -> Http1Response:
        """``method`` (``body``, if any) to ``url + path``; returns once the status and headers arrived.

        ``timeout_s`` replaces the pool's read timeout for this request (a
        health probe gives up sooner than a completion).
        """
        origin = self.origin(url)
        head = [method, b" ", origin.prefix, path.encode("latin-1"), b" HTTP/1.1\r\nhost: ", origin.host_header]
        if body is not None:
            head += (b"\r\ncontent-type: ", content_type, b"\r\ncontent-length: ", str(len(body)).encode())
        if headers:
            for key, value in headers.items():
                head += (b"\r\n", key.encode("latin-1"), b": ", value.encode("latin-1"))
        head += (b"\r\n\r\n", body or b"")
        data = b"".join(head)
        timeout = self._read_timeout_s if timeout_s is None else timeout_s
        conn = await self._acquire(origin)
        try:
            assert conn.transport is not None
            conn.transport.write(data)
            await conn.wait(timeout)
            while not conn.status and not conn.complete:  # woken by a body-less close: wait on
                await conn.wait(timeout)
        except BaseException:
            self._close(conn)
            raise
        return Http1Response(conn, timeout)

    async def fetch(self, method: bytes, url: str, path: str, body: bytes | None = None,
                    headers: Mapping[str, str] | None = None, *, timeout_s: float) -> tuple[int, bytes]:
        """One whole exchange within ``timeout_s`` in all: ``(status, body)``, the connection kept alive.

        For the side calls (``/v1/models``, ``/tokenize``, health probes,
        ``doctor``'s questions), where the answer is small and wanted whole.
        Raises :class:`UpstreamError` (a deadline passed is a :class:`ReadTimeout`).
        """
        async def exchange() -> tuple[int, bytes]:
            answer = await self.request(method, url, path, body, headers, timeout_s=timeout_s)
            try:
                data = await answer.read()
            except BaseException:
                answer.close()
                raise
            answer.release()
            return answer.status, data

        try:
            return await asyncio.wait_for(exchange(), timeout_s)
        except asyncio.TimeoutError:
            raise ReadTimeout(f"{method.decode()} {url}{path}: no whole answer within {timeout_s:g}s") from None

    async def aclose(self) -> None:
        """Close every idle connection; later requests fail (connections in use close on release)."""
        self._closed = True
        for conns in self._idle.values():
            for conn in list(conns):
                if conn.transport is not None:
                    conn.transport.close()
        self._idle.clear()
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_exception(ConnectFailed("the gateway's client is closed"))

    # --- internals -----------------------------------------------------------------

    async def _acquire(self, origin: Origin) -> _Conn:
        if self._closed:
            raise ConnectFailed("the gateway's client is closed")
        loop = asyncio.get_running_loop()
        while True:
            idle = self._idle.get(origin)
            if idle:
                conn = self._pop_idle(idle, loop.time())
                if conn is not None:
                    return conn
            if self._open < self._max:
                break
            self._evict_idle()  # another engine's idle connection makes room, if there is one
            waiter = loop.create_future()
            self._slot_waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter in self._slot_waiters:
                    self._slot_waiters.remove(waiter)
                raise
            if self._closed:
                raise ConnectFailed("the gateway's client is closed")
        self._open += 1
        conn = _Conn(self, origin, loop)
        try:
            await self._connect(conn, loop)
        except BaseException:
            if conn.transport is not None:
                conn.transport.close()  # connected after all: connection_lost frees the slot
            else:
                self._release_slot(conn)
            raise
        self.opened += 1
        return conn

    def _pop_idle(self, idle: dict[_Conn, None], now: float) -> _Conn | None:
        while idle:
            conn, _ = idle.popitem()  # the most recently used first
            if conn.transport is None or conn.transport.is_closing():
                continue  # closing: connection_lost frees its slot
            if now - conn.idle_since > self._keepalive_s:
                conn.transport.close()
                continue
            conn.reset()
            self.reused += 1
            return conn
        return None

    def _evict_idle(self) -> None:
        """Close the longest-idle connection of any engine (its slot frees in connection_lost)."""
        oldest: _Conn | None = None
        for idle in self._idle.values():
            for conn in idle:  # insertion order: the first is the longest idle of this engine
                if oldest is None or conn.idle_since < oldest.idle_since:
                    oldest = conn
                break
        if oldest is not None:
            self._idle[oldest.origin].pop(oldest, None)
            if oldest.transport is not None:
                oldest.transport.close()

    async def _connect(self, conn: _Conn, loop: asyncio.AbstractEventLoop) -> None:
        origin = conn.origin
        ctx: ssl.SSLContext | None = None
        if origin.ssl:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            ctx = self._ssl
        try:
            await asyncio.wait_for(self._open_transport(conn, loop, ctx), self._connect_timeout_s)
        except asyncio.TimeoutError:
            raise ConnectFailed(f"no connection to {origin.host}:{origin.port} within "
                                f"{self._connect_timeout_s:g}s") from None
        except OSError as err:
            raise ConnectFailed(f"cannot connect to {origin.host}:{origin.port}: {err}") from err

    async def _open_transport(self, conn: _Conn, loop: asyncio.AbstractEventLoop,
                              ctx: ssl.SSLContext | None) -> None:
        """Connect to the first address of the engine's that accepts (resolved names cached)."""
        origin = conn.origin
        if origin.numeric:
            await loop.create_connection(lambda: conn, origin.host, origin.port, ssl=ctx)
            return
        error: OSError | None = None
        for family, address in await self._addresses(origin, loop):
            try:
                await loop.create_connection(lambda: conn, address[0], address[1], family=family, ssl=ctx,
                                             server_hostname=origin.host if ctx is not None else None)
                return
            except OSError as err:
                error = err
        if error is not None:
            self._resolved.pop(origin, None)  # every address failed: resolve afresh next time
            raise error
        raise OSError(f"{origin.host} resolved to no address")

    async def _addresses(self, origin: Origin, loop: asyncio.AbstractEventLoop) -> list[tuple[int, Any]]:
        """``origin``'s addresses, resolved at most once per :data:`RESOLVE_TTL_S` however many connect.

        A burst of requests to a cold pool opens many connections at once;
        resolving the engine's name for each (``getaddrinfo`` on a small
        thread pool) queued them behind one another.
        """
        now = loop.time()
        cached = self._resolved.get(origin)
        if cached is not None and cached[0] > now:
            return cached[1]
        pending = self._resolving.get(origin)
        if pending is None:
            pending = self._resolving[origin] = asyncio.ensure_future(
                loop.getaddrinfo(origin.host, origin.port, type=socket.SOCK_STREAM))
            pending.add_done_callback(lambda _: self._resolving.pop(origin, None))
        infos = await asyncio.shield(pending)
        addresses = [(family, sockaddr) for family, _, _, _, sockaddr in infos]
        self._resolved[origin] = (now + RESOLVE_TTL_S, addresses)
        return addresses

    def _put_idle(self, conn: _Conn) -> None:
        if self._closed or conn.transport is None or conn.transport.is_closing():
            self._close(conn)
            return
        conn.idle_since = conn.loop.time()
        idle = self._idle.get(conn.origin)
        if idle is None:
            idle = self._idle[conn.origin] = {}
        idle[conn] = None
        self._wake_slot()

    @staticmethod
    def _close(conn: _Conn) -> None:
        transport = conn.transport
        if transport is not None and not transport.is_closing():
            transport.close()  # connection_lost follows and frees the slot

    def _lost(self, conn: _Conn) -> None:
        """connection_lost: the slot is free (whether the connection was idle or in use)."""
        idle = self._idle.get(conn.origin)
        if idle is not None:
            idle.pop(conn, None)
        self._release_slot(conn)

    def _release_slot(self, conn: _Conn) -> None:
        if conn.holds_slot:
            conn.holds_slot = False
            self._open -= 1
            self._wake_slot()

    def _wake_slot(self) -> None:
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
