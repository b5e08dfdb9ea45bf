"""ASGI plumbing shared by every HTTP front of the package.

The router's API (``server/http.py``) and the OpenAI gateway (``gateway/``)
answer on plain ASGI callables, skipping Starlette's per-request objects on
the hot path; both need the same three type aliases, the same capped body
read and the same two-message answer. They live here, below both, so that
neither has to borrow from the other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from tokenspeed_router.errors import RouterApiError

__all__ = ["JSON", "Receive", "Scope", "Send", "read_body", "send_response"]

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
#: the content type of every JSON answer
JSON = b"application/json"


async def send_response(send: Send, status: int, body: bytes, content_type: bytes = JSON,
                        headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """A whole answer: ``http.response.start`` (type, length, ``headers``), then the body."""
    head = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if headers:
        head.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


async def read_body(receive: Receive, length: bytes | None, max_body: int) -> bytes:
    """Read a request body of at most ``max_body`` bytes (``Content-Length`` checked first).

    Raises :class:`RouterApiError` 413 past the cap (a chunked body is counted
    as it streams in) and 400 for a bad ``Content-Length`` or a client that
    went away before its body was read.
    """
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise RouterApiError(400, f"invalid Content-Length {length!r}") from None
        if declared > max_body:
            raise RouterApiError(413, f"request body of {declared} bytes exceeds the limit of {max_body}")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise RouterApiError(400, "client disconnected before sending the body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_body:
            raise RouterApiError(413, f"request body exceeds the limit of {max_body} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)

