"""Relaying an engine's server-sent events to the client, event by event.

Bytes are forwarded as soon as an event is complete (a blank line ends it),
never held for the whole answer. The one rewrite: the gateway asks engines for
the usage chunk (``stream_options.include_usage``) to learn
``cached_tokens``; when the client did not ask for it, the usage-only chunk is
dropped again (or its ``usage`` key removed when it also carries choices).
Only events whose text contains ``"usage"`` are parsed, and the first
events of a stream until one carries a generated token
(:attr:`SseRelay.generated`): that, not the first byte, is when the engine's
prefill is done. A chat stream's first event is the ``role`` chunk, which
vLLM (and engine-sim) send *before* the prefill runs; taking it as the first
token would end the prefill's load in the router while it still queues.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["SseRelay", "sse_error_event"]

_decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


def sse_error_event(message: str, *, type_: str = "server_error", code: str | None = None) -> bytes:
    """An OpenAI-shaped error as an SSE event, followed by ``[DONE]`` (how vLLM ends a failed stream)."""
    payload = _encoder.encode({"error": {"message": message, "type": type_, "param": None, "code": code}})
    return b"data: " + payload + b"\n\ndata: [DONE]\n\n"


def _carries_token(event: bytes) -> bool:
    """Whether an SSE event holds generated output: text, content, a tool call or a finish.

    An error event counts too (nothing more will be prefilled). Anything
    unparsable counts, so that an engine with another shape is at worst
    treated as before (first event = first token).
    """
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        try:
            obj = _decoder.decode(data)
        except msgspec.DecodeError:
            return True
        if not isinstance(obj, dict):
            return True
        if "error" in obj:
            return True
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return True
        for choice in choices:
            if not isinstance(choice, dict):
                return True
            if choice.get("text") or choice.get("finish_reason"):
                return True
            delta = choice.get("delta")
            if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls")
                                            or delta.get("reasoning_content")):
                return True
        return False  # a role chunk, or a usage-only chunk
    return False


class SseRelay:
    """Cut an SSE byte stream into whole events; remember the usage; optionally strip it."""

    __slots__ = ("_buf", "_strip", "events", "generated", "usage")

    def __init__(self, *, strip_usage: bool) -> None:
        self._buf = b""
        self._strip = strip_usage
        self.usage: dict[str, Any] | None = None
        self.events = 0
        #: an event with a generated token (or the end of the choice) has been relayed
        self.generated = False

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to forward now: every event completed by ``chunk`` (possibly none)."""
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return b""
        complete, self._buf = buf[: end + 2], buf[end + 2 :]
        self.events += complete.count(b"\n\n")
        if not self.generated:
            self.generated = any(_carries_token(e) for e in complete[:-2].split(b"\n\n"))
        if b'"usage"' not in complete:
            return complete
        kept = [self._event(e) for e in complete[:-2].split(b"\n\n")]
        return b"".join(e + b"\n\n" for e in kept if e)

    def flush(self) -> bytes:
        """Whatever is left at the end of the stream (an unterminated last event)."""
        rest, self._buf = self._buf, b""
        return rest

    def _event(self, event: bytes) -> bytes:
        if b'"usage"' not in event:
            return event
        lines = event.split(b"\n")
        for i, line in enumerate(lines):
            if not line.startswith(b"data:"):
                continue
            try:
                obj = _decoder.decode(line[5:].strip())
            except msgspec.DecodeError:
                return event
            if not isinstance(obj, dict):
                return event
            usage = obj.get("usage")
            if isinstance(usage, dict):
                self.usage = usage
            if not self._strip or "usage" not in obj:
                return event
            if not obj.get("choices"):
                return b""  # the usage-only chunk the client did not ask for
            del obj["usage"]
            lines[i] = b"data: " + _encoder.encode(obj)
            return b"\n".join(lines)
        return event
