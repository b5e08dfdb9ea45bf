"""The gateway's per-request shortcuts keep the bytes an engine and a client see right."""

from __future__ import annotations

import asyncio
import json
import socket

from tokenspeed_router.gateway.openai import body_asking_usage, parse_chat, parse_completion
from tokenspeed_router.server.http import new_event_loop
from tokenspeed_router.server.http_protocol import CoalescingTransport


def test_usage_patch_adds_include_usage_and_keeps_every_field() -> None:
    raw = b'  {"prompt": [1, 2, 3], "stream": true, "x_unknown": {"a": [1]}, "max_tokens": 4}'
    req = parse_completion(raw, max_tokens=100)
    patched = body_asking_usage(req)
    assert patched.startswith(b'{"stream_options":{"include_usage":true},')  # a byte patch, not re-encoded
    assert json.loads(patched) == {**json.loads(raw), "stream_options": {"include_usage": True}}


def test_usage_merges_into_the_clients_stream_options() -> None:
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "stream": true, "stream_options": {"x": 1}}'
    req = parse_chat(raw, max_tokens=100)
    merged = json.loads(body_asking_usage(req))  # merged and re-encoded, every other field kept
    assert merged == {**json.loads(raw), "stream_options": {"x": 1, "include_usage": True}}
    assert req.raw == raw  # forwarded as is when nothing is added


def test_coalescing_transport_joins_one_turn_and_flushes_before_close() -> None:
    """Writes of one loop turn arrive together and in order; close() loses nothing pending."""
    a, b = socket.socketpair()
    loop = new_event_loop()
    try:
        async def main() -> bytes:
            transport, _ = await loop.create_connection(asyncio.Protocol, sock=a)
            wrapped = CoalescingTransport(transport, loop)  # type: ignore[arg-type]
            wrapped.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
            wrapped.write(b"")
            wrapped.write(b"ok")
            assert not wrapped.is_closing()  # everything else is the real transport's
            wrapped.close()  # in the same turn: the pending bytes must still go out
            b.setblocking(False)
            reader, writer = await asyncio.open_connection(sock=b)
            try:
                return await asyncio.wait_for(reader.read(), timeout=10)
            finally:
                writer.close()
                await writer.wait_closed()

        assert loop.run_until_complete(main()) == b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    finally:
        loop.close()
