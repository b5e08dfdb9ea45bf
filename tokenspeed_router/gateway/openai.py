"""The OpenAI request surface the gateway checks before routing, and its error shape.

Only what routing needs is validated (the body must be a JSON object; the
prompt or the messages must be there and well typed; ``stream`` a boolean):
everything else is the engine's business and is forwarded unchanged, unknown
fields included. Errors use OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, so OpenAI clients show
the message instead of failing to parse it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = [
    "OpenAIError",
    "ParsedRequest",
    "error_body",
    "parse_chat",
    "parse_completion",
]

_decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()

#: token ids we accept in a prompt (vocabularies are far smaller; this catches garbage)
_MAX_TOKEN_ID = (1 << 32) - 1


class OpenAIError(Exception):
    """An error answer in OpenAI's shape; ``status`` is the HTTP status."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        type_: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> bytes:
        return error_body(self.message, type_=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    """``{"error": {"message", "type", "param", "code"}}`` encoded."""
    return _encoder.encode({"error": {"message": message, "type": type_, "param": param, "code": code}})


@dataclass
class ParsedRequest:
    """A checked request: the body to forward, and what routing needs from it.

    ``token_ids`` is set when the prompt already is token ids; otherwise
    ``text`` (completions) or the chat fields in ``body`` are tokenized.
    """

    kind: str  # "completions" or "chat"
    body: dict[str, Any]
    stream: bool
    model: str | None
    token_ids: list[int] | None = None
    text: str | None = None

    @property
    def path(self) -> str:
        return "/v1/completions" if self.kind == "completions" else "/v1/chat/completions"

    def client_wants_usage(self) -> bool:
        """Whether the client itself asked for the usage chunk of a stream."""
        opts = self.body.get("stream_options")
        return isinstance(opts, dict) and opts.get("include_usage") is True


def _decode_object(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise OpenAIError(400, "the request body is empty: expected a JSON object", code="invalid_json")
    try:
        body = _decoder.decode(raw)
    except msgspec.DecodeError as err:
        raise OpenAIError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, f"the request body must be a JSON object, got {type(body).__name__}",
                          code="invalid_json")
    return body


def _common(body: dict[str, Any]) -> tuple[bool, str | None]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise OpenAIError(400, f"'stream' must be a boolean, got {stream!r}", param="stream", code="invalid_type")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise OpenAIError(400, f"'model' must be a string, got {model!r}", param="model", code="invalid_type")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise OpenAIError(400, "'stream_options' must be an object", param="stream_options", code="invalid_type")
    return stream, model


def _token_list(value: list[Any], max_tokens: int) -> list[int] | None:
    """``value`` as token ids, or None when it is not a list of ints (bools are not ints here)."""
    try:
        value = msgspec.convert(value, list[int], strict=True)  # C speed: ~2 µs for 256 ids
    except msgspec.ValidationError:
        return None
    if value and (min(value) < 0 or max(value) > _MAX_TOKEN_ID):
        raise OpenAIError(400, "'prompt' token ids must be in 0..2**32-1", param="prompt", code="invalid_value")
    if len(value) > max_tokens:
        raise OpenAIError(400, f"'prompt' has {len(value)} token ids; the limit is {max_tokens}",
                          param="prompt", code="invalid_value")
    return value


def parse_completion(raw: bytes, *, max_tokens: int) -> ParsedRequest:
    """Check a ``POST /v1/completions`` body.

    ``prompt`` may be a string, a list of token ids, or a batch (a list of
    strings or of token-id lists): a batch is routed by its first prompt.
    """
    body = _decode_object(raw)
    stream, model = _common(body)
    if "prompt" not in body or body["prompt"] is None:
        raise OpenAIError(400, "missing required parameter 'prompt'", param="prompt",
                          code="missing_required_parameter")
    prompt = body["prompt"]
    parsed = ParsedRequest("completions", body, stream, model)
    first: Any = prompt
    if isinstance(prompt, list):
        if not prompt:
            raise OpenAIError(400, "'prompt' must not be empty", param="prompt", code="invalid_value")
        ids = _token_list(prompt, max_tokens)
        if ids is not None:
            parsed.token_ids = ids
            return parsed
        first = prompt[0]
        if isinstance(first, list):
            if not first or any(not isinstance(p, list) for p in prompt):
                raise OpenAIError(400, "'prompt' must be a string, a list of token ids, or a batch of those",
                                  param="prompt", code="invalid_type")
            ids = _token_list(first, max_tokens)
            if ids is None:
                raise OpenAIError(400, "'prompt' token-id lists must hold integers only",
                                  param="prompt", code="invalid_type")
            parsed.token_ids = ids
            return parsed
        if not all(isinstance(p, str) for p in prompt):
            raise OpenAIError(400, "'prompt' must be a string, a list of token ids, or a batch of those",
                              param="prompt", code="invalid_type")
    if not isinstance(first, str):
        raise OpenAIError(400, f"'prompt' must be a string or a list of token ids, got {type(prompt).__name__}",
                          param="prompt", code="invalid_type")
    parsed.text = first
    return parsed


def parse_chat(raw: bytes, *, max_tokens: int) -> ParsedRequest:
    """Check a ``POST /v1/chat/completions`` body (``messages``: objects with a string ``role``)."""
    body = _decode_object(raw)
    stream, model = _common(body)
    messages = body.get("messages")
    if messages is None:
        raise OpenAIError(400, "missing required parameter 'messages'", param="messages",
                          code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "'messages' must be a non-empty list", param="messages", code="invalid_type")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise OpenAIError(400, f"'messages[{i}]' must be an object with a string 'role'",
                              param=f"messages[{i}]", code="invalid_type")
    return ParsedRequest("chat", body, stream, model)
