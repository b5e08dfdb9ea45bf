"""A refusal sent before the request body was read reaches a client that is still sending it.

A real ``serve`` on a real socket, a real 34 MB body (over the 8 MB default
``max_body_bytes``) from real clients that send the whole body before they
read: Python's ``http.client`` (with and without ``Connection: close``),
``requests``, ``httpx``, curl, HTTP/1.0 and chunked bodies. Every one must
read the 413 with its JSON error, on the router's API and on the gateway's
``/v1/*`` paths, and a keep-alive connection stays usable after it.
"""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import requests
from support.server import ServeProcess

BODY = b'{"token_ids": [' + b"1," * (17 << 20) + b"1]}"  # 34 MB of valid JSON
ROUTER_PATHS = ("/match", "/route", "/release", "/doctor/expect")
GATEWAY_PATHS = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    proc = ServeProcess([], tmp_path_factory.mktemp("early")).start()
    try:
        yield proc
    finally:
        proc.stop()


def _error(path: str, body: bytes) -> str:
    """The error text of a refusal: ``{"error": "..."}``, or OpenAI's shape on ``/v1/*``."""
    err = json.loads(body)["error"]
    if path.startswith("/v1/"):
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_body", err
        return str(err["message"])
    return str(err)


def _http_client(port: int, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=BODY, headers={"content-type": "application/json", **headers})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.mark.parametrize("path", ROUTER_PATHS + GATEWAY_PATHS)
@pytest.mark.parametrize("headers", [{}, {"connection": "close"}], ids=["keep-alive", "close"])
def test_http_client_reads_the_413(serve: ServeProcess, path: str, headers: dict[str, str]) -> None:
    status, body = _http_client(serve.port, path, headers)
    assert status == 413, body[:200]
    assert f"request body of {len(BODY)} bytes exceeds the limit of {8 << 20}" in _error(path, body)


@pytest.mark.parametrize("path", ["/match", "/v1/completions"])
def test_requests_and_httpx_read_the_413_whole_and_chunked(serve: ServeProcess, path: str) -> None:
    url = serve.url + path

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(BODY), 1 << 16):
            yield BODY[i : i + (1 << 16)]

    answers = [
        requests.post(url, data=BODY, timeout=60),
        requests.post(url, data=BODY, headers={"connection": "close"}, timeout=60),
        requests.post(url, data=chunks(), timeout=60),  # chunked: counted as it streams in
        httpx.post(url, content=BODY, timeout=60),
        httpx.post(url, content=chunks(), timeout=60),
    ]
    for resp in answers:
        assert resp.status_code == 413, resp.text[:200]
        assert "exceeds the limit" in _error(path, resp.content)


def test_curl_reads_the_413(serve: ServeProcess, tmp_path: Path) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    body_file = tmp_path / "big.json"
    body_file.write_bytes(BODY)
    for extra in ([], ["-H", "connection: close"], ["-H", "expect:"], ["-0"]):
        for path in ("/match", "/v1/chat/completions"):
            out = subprocess.run(
                [curl, "-sS", "-X", "POST", "--data-binary", f"@{body_file}", "-w", "\n%{http_code}",
                 *extra, serve.url + path], capture_output=True, timeout=60, check=False)
            assert out.returncode == 0, (extra, out.stderr)
            text, _, code = out.stdout.rpartition(b"\n")
            assert code == b"413", (extra, path, out.stdout[-300:])
            assert "exceeds the limit" in _error(path, text)


def _raw(port: int, head: bytes, body: bytes) -> bytes:
    """Send ``head`` and ``body`` whole on a plain socket, then read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head)
        sock.sendall(body)
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    return data


def test_http10_and_chunked_close_read_the_413(serve: ServeProcess) -> None:
    old = _raw(serve.port, b"POST /match HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % len(BODY), BODY)
    assert old.startswith(b"HTTP/1.1 413 "), old[:200]
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (BODY[i : i + (1 << 16)] for i in
                                                              range(0, len(BODY), 1 << 16)))
    closing = _raw(serve.port, b"POST /route HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n", chunked + b"0\r\n\r\n")
    assert closing.startswith(b"HTTP/1.1 413 "), closing[:200]
    assert b"connection: close" in closing.lower()
    assert b"exceeds the limit" in closing


def test_a_client_waiting_for_100_continue_gets_the_413_and_the_close(serve: ServeProcess) -> None:
    """It sent no body and will send none: the answer, then the connection ends (no drain to wait for)."""
    head = b"POST /match HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(BODY)
    answer = _raw(serve.port, head, b"")
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b"100 Continue" not in answer


def test_keep_alive_connection_is_reused_after_the_413(serve: ServeProcess) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", serve.port, timeout=60)
    try:
        conn.request("POST", "/match", body=BODY)
        first = conn.getresponse()
        assert first.status == 413
        first.read()
        local = conn.sock.getsockname()
        conn.request("POST", "/match", body=b'{"token_ids": [1, 2, 3]}')
        second = conn.getresponse()
        assert second.status == 200 and json.loads(second.read()) == {"scores": {}, "block_size": {}, "tiers": {}}
        assert conn.sock.getsockname() == local  # the same connection: the big body was drained
    finally:
        conn.close()
