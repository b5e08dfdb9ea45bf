"""The serve protocol's bounds on draining a body it answered early (real sockets, real uvicorn)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest
import uvicorn

from tokenspeed_router.asgi import Receive, Scope, Send, send_response
from tokenspeed_router.endpoints import HostPort, bind_socket
from tokenspeed_router.server.http import _run_in_new_loop
from tokenspeed_router.server.http_protocol import http_protocol

DRAIN_BYTES = 1 << 20
DRAIN_S = 0.5


async def _refuse(scope: Scope, receive: Receive, send: Send) -> None:
    """Answer every request at once, without reading its body."""
    await send_response(send, 413, b'{"error": "too big"}')


@pytest.fixture
def port() -> Iterator[int]:
    sock = bind_socket(HostPort("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(
        _refuse, http=http_protocol(drain_max_bytes=DRAIN_BYTES, drain_max_s=DRAIN_S),
        lifespan="off", log_level="warning"))
    started = threading.Event()

    async def main() -> None:
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.005)
        started.set()
        await serving

    thread = threading.Thread(target=_run_in_new_loop, args=(main(),), daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def _read_until_closed(sock: socket.socket) -> tuple[bytes, bool]:
    """Everything the server sent, and whether the connection ended (EOF or reset) before the timeout."""
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except ConnectionResetError:
        return data, True
    except TimeoutError:
        return data, False
    return data, True


def test_a_body_past_the_byte_bound_is_not_drained(port: int) -> None:
    declared = 64 * DRAIN_BYTES
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % declared)
        sent, piece = 0, b"x" * (1 << 16)
        with pytest.raises(OSError):  # reset once the server stops draining
            while sent < declared:
                sock.sendall(piece)
                sent += len(piece)
        assert sent < declared // 2  # closed near the bound (plus the socket buffers), not at the end


def test_a_body_that_stops_coming_is_not_waited_for_past_the_time_bound(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        # half a body, then nothing: the answer comes at once, the connection ends after DRAIN_S
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2000\r\n\r\n" + b"x" * 1000)
        data, closed = _read_until_closed(sock)
        assert data.startswith(b"HTTP/1.1 413 ") and data.endswith(b'{"error": "too big"}')
        assert closed


def test_a_whole_body_under_the_bound_is_drained_then_the_connection_closes(port: int) -> None:
    body = b"x" * (DRAIN_BYTES // 2)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
        sock.sendall(body)  # no reset: the server reads it all
        data, closed = _read_until_closed(sock)
        assert data.startswith(b"HTTP/1.1 413 ") and b"connection: close" in data and closed
