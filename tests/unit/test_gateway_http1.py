"""The gateway's HTTP/1.1 client (gateway/http1.py) against real loopback servers.

Each test runs a small asyncio server on an OS-chosen port that answers in a
chosen way (content-length, chunked, closing, silent, refusing), and checks
what the pool returns and raises, and that connections are reused only when
an answer was read to its end.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tokenspeed_router.gateway.http1 import (
    HIGH_WATER_BYTES,
    ConnectFailed,
    ConnectionDropped,
    Http1Pool,
    ProtocolError,
    ReadTimeout,
)
from tokenspeed_router.gateway.upstream import is_timeout, is_unreachable

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    line = await reader.readline()
    headers: dict[bytes, bytes] = {}
    while True:
        h = await reader.readline()
        if h in (b"\r\n", b""):
            break
        k, _, v = h.partition(b":")
        headers[k.strip().lower()] = v.strip()
    body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
    return line, headers, body


def _answering(answer: bytes) -> Handler:
    """A keep-alive server that writes ``answer`` for every request."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(answer)
            await writer.drain()

    return handler


def _run(handler: Handler, client: Callable[[Http1Pool, str, list[Any]], Awaitable[None]], *,
         read_timeout_s: float = 10.0, max_connections: int = 8) -> list[Any]:
    seen: list[Any] = []

    async def main() -> None:
        connections = 0

        async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            seen.append(("connection", connections))
            try:
                await handler(reader, writer)
            finally:
                writer.close()

        server = await asyncio.start_server(counted, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = Http1Pool(max_connections=max_connections, connect_timeout_s=5, read_timeout_s=read_timeout_s,
                         keepalive_s=30)
        try:
            await asyncio.wait_for(client(pool, f"http://127.0.0.1:{port}", seen), 30)
        finally:
            await pool.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(main())
    return seen


def test_content_length_answers_reuse_one_connection_and_carry_body_and_headers() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                line, headers, body = await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            if not line:
                return
            answer = b'{"echo": ' + body + b', "auth": "' + headers.get(b"authorization", b"") + b'"}'
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Engine: e0\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(answer), answer))
            await writer.drain()

    async def client(pool: Http1Pool, url: str, seen: list[Any]) -> None:
        for i in range(3):
            resp = await pool.post(url, "/v1/completions", b"[%d]" % i, {"authorization": "Bearer k"})
            assert resp.status == 200 and resp.header(b"x-engine") == b"e0"
            assert resp.header(b"content-type") == b"application/json"
            seen.append(await resp.read())
            resp.release()
        seen.append(("pool", pool.opened, pool.reused))

    seen = _run(handler, client)
    assert seen.count(("connection", 1)) == 1 and ("connection", 2) not in seen
    assert seen[-1] == ("pool", 1, 2)
    assert b'"echo": [2], "auth": "Bearer k"' in seen[-2]


def test_chunked_stream_arrives_chunk_by_chunk_then_ends() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"7\r\ndata: 1\r\n")
        await writer.drain()
        await release.wait()  # the client must see chunk 1 before chunk 2 exists
        writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()  # keep the connection open (keep-alive)

    async def client(pool: Http1Pool, url: str, seen: list[Any]) -> None:
        resp = await pool.post(url, "/x", b"{}")
        seen.append(await resp.next_chunk())
        release.set()
        while (chunk := await resp.next_chunk()) is not None:
            seen.append(chunk)
        seen.append(resp.complete)
        resp.release()
        seen.append(pool.idle_connections())

    seen = _run(handler, client)
    assert seen[1:] == [b"data: 1", b"data: 2", True, 1]


def test_refused_connection_is_connect_failed_and_unreachable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once closed

    async def main() -> None:
        pool = Http1Pool(max_connections=4, connect_timeout_s=5, read_timeout_s=5, keepalive_s=4)
        with pytest.raises(ConnectFailed) as info:
            await pool.post(f"http://127.0.0.1:{port}", "/v1/completions", b"{}")
        assert is_unreachable(info.value) and not is_timeout(info.value)
        assert pool.open_connections == 0
        await pool.aclose()

    asyncio.run(main())


def test_close_before_the_answer_is_connection_dropped() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)  # then close without answering

    async def client(pool: Http1Pool, url: str, seen: list[Any]) -> None:
        with pytest.raises(ConnectionDropped) as info:
            await pool.post(url, "/x", b"{}")
        seen.append(is_unreachable(info.value))
        seen.append(pool.open_connections)

    assert _run(handler, client)[-2:] == [True, 0]


def test_close_mid_stream_raises_dropped_from_next_chunk() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()

    async def client(pool: Http1Pool, url: str, seen: list[Any]) -> None:
        resp = await pool.post(url, "/x", b"{}")
        seen.append(await resp.next_chunk())
        with pytest.raises(ConnectionDropped):
            await resp.next_chunk()
        resp.close()

    assert _run(handler, client)[-1] == b"hello"


def test_silent_engine_is_a_read_timeout_not_unreachable() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await reader.read()  # never answers

    async def client(pool: Http1Pool, url: str, seen: list[Any]) -> None:
        with pytest.raises(ReadTimeout) as info:
            await pool.post(url, "/x", b"{}")
        seen.append((is_timeout(info.value), is_unreachable(info.value)))

    assert _run(handler, client, read_timeout_s=0.2)[-1] == (True, False)


def test_garbage_answer_is_a_protocol_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def client(pool: Http1Pool, url: str, seen: list[Any]) -> None:
        with pytest.raises(ProtocolError):
            await pool.post(url, "/x", b"{}")

    _run(handler, client)


def test_unread_answer_closes_its_connection_instead_of_pooling_it() -> None:
    handler = _answering(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")  # never ends

    async def client(pool: Http1Pool, url: str, seen: list[Any]) -> None:
        resp = await pool.post(url, "/x", b"{}")
        assert await resp.next_chunk() == b"abc"
        resp.release()  # not complete: must not go back to the pool
        resp2 = await pool.post(url, "/x", b"{}")
        resp2.close()
        seen.append((pool.opened, pool.reused))

    seen = _run(handler, client)
    assert seen[-1] == (2, 0)


def test_connection_limit_makes_callers_wait_for_a_release() -> None:
    handler = _answering(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    async def client(pool: Http1Pool, url: str, seen: list[Any]) -> None:
        first = await pool.post(url, "/x", b"{}")
        second = asyncio.ensure_future(pool.post(url, "/x", b"{}"))
        await asyncio.sleep(0.05)  # a real chance for the second to (wrongly) get a connection
        seen.append(second.done())
        assert await first.read() == b"ok"
        first.release()
        resp = await asyncio.wait_for(second, 10)
        assert await resp.read() == b"ok"
        resp.release()
        seen.append((pool.opened, pool.reused, pool.open_connections))

    seen = _run(handler, client, max_connections=1)
    assert seen[-2:] == [False, (1, 1, 1)]


def test_a_slow_reader_pauses_the_engine_connection() -> None:
    size = 4 * HIGH_WATER_BYTES

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        writer.write(b"x" * size)
        await writer.drain()
        await reader.read()

    async def client(pool: Http1Pool, url: str, seen: list[Any]) -> None:
        resp = await pool.post(url, "/x", b"{}")
        got = 0
        while (chunk := await resp.next_chunk()) is not None:
            seen.append(len(chunk) <= HIGH_WATER_BYTES + 256 * 1024)  # bounded by the pause, plus one read
            got += len(chunk)
            await asyncio.sleep(0)
        seen.append(got)
        resp.release()

    seen = _run(handler, client)
    assert seen[-1] == size and all(x is True for x in seen[1:-1])


def test_a_host_name_is_resolved_once_for_the_connections_it_needs() -> None:
    handler = _answering(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    async def client(pool: Http1Pool, url: str, seen: list[Any]) -> None:
        named = url.replace("127.0.0.1", "localhost")  # ::1 may come first and be refused: tried in order
        first = await pool.post(named, "/x", b"{}")
        resolved = dict(pool._resolved)
        second = await pool.post(named, "/x", b"{}")  # the first is still open: a second connection
        seen.append((pool.opened, pool._resolved == resolved and len(resolved) == 1))
        for resp in (first, second):
            assert await resp.read() == b"ok"
            resp.release()

    assert _run(handler, client)[-1] == (2, True)


def test_an_unresolvable_host_is_connect_failed() -> None:
    async def main() -> None:
        pool = Http1Pool(max_connections=4, connect_timeout_s=2, read_timeout_s=5, keepalive_s=4)
        with pytest.raises(ConnectFailed):
            await pool.post("http://no-such-engine.invalid:8000", "/v1/completions", b"{}")
        assert pool.open_connections == 0
        await pool.aclose()

    asyncio.run(main())


def _recording(seen: list[Any], answer: bytes) -> Handler:
    """A keep-alive server that records each request (line, headers, body) and writes ``answer``."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                request = await _read_request(reader)
            except asyncio.IncompleteReadError:
                return
            if not request[0]:
                return
            seen.append(request)
            writer.write(answer)
            await writer.drain()

    return handler


def test_side_calls_get_and_post_whole_answers_on_the_pooled_connection() -> None:
    """``fetch``: GET without a body, POST with one, whole answers, one connection for all."""
    requests: list[Any] = []
    answer = b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{"a":\r\n2\r\n1}\r\n0\r\n\r\n'

    async def client(pool: Http1Pool, url: str, seen: list[Any]) -> None:
        seen.append(await pool.fetch(b"GET", url, "/v1/models", headers={"authorization": "Bearer k"},
                                     timeout_s=5))
        seen.append(await pool.fetch(b"POST", url, "/tokenize", b'{"prompt":"hi"}', timeout_s=5))
        seen.append(("pool", pool.opened, pool.reused))

    seen = _run(_recording(requests, answer), client)
    assert seen[-3:] == [(200, b'{"a":1}'), (200, b'{"a":1}'), ("pool", 1, 1)]
    (get_line, get_headers, get_body), (post_line, post_headers, post_body) = requests
    assert get_line == b"GET /v1/models HTTP/1.1\r\n" and get_body == b""
    assert b"content-length" not in get_headers and get_headers[b"authorization"] == b"Bearer k"
    assert post_line == b"POST /tokenize HTTP/1.1\r\n" and post_body == b'{"prompt":"hi"}'
    assert post_headers[b"content-type"] == b"application/json"


def test_a_url_with_a_path_prefixes_every_request() -> None:
    requests: list[Any] = []

    async def client(pool: Http1Pool, url: str, seen: list[Any]) -> None:
        seen.append(await pool.fetch(b"GET", f"{url}/engine-a/", "/health", timeout_s=5))
        resp = await pool.post(f"{url}/engine-a", "/v1/completions", b"{}")
        await resp.read()
        resp.release()

    _run(_recording(requests, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"), client)
    assert [r[0] for r in requests] == [b"GET /engine-a/health HTTP/1.1\r\n",
                                        b"POST /engine-a/v1/completions HTTP/1.1\r\n"]


def test_fetch_gives_up_at_its_own_deadline_even_while_bytes_trickle() -> None:
    """A per-call deadline covers the whole exchange (a health probe is not a completion)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:  # a byte every 50 ms: never a read timeout, never the end
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)

    async def client(pool: Http1Pool, url: str, seen: list[Any]) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(ReadTimeout) as info:
            await pool.fetch(b"GET", url, "/health", timeout_s=0.3)
        seen.append((loop.time() - started < 5, is_timeout(info.value), pool.idle_connections()))

    assert _run(handler, client, read_timeout_s=10)[-1] == (True, True, 0)
