"""The OpenAI request surface the gateway checks before routing, and its error shape.

Only what routing needs is validated (the body must be a JSON object; the
prompt or the messages must be there and well typed; ``stream`` a boolean):
everything else is the engine's business and is forwarded unchanged, unknown
fields included. Errors use OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, so OpenAI clients show
the message instead of failing to parse it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

__all__ = [
    "OpenAIError",
    "ParsedRequest",
    "body_asking_usage",
    "decode_object",
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


class ParsedRequest:
    """A checked request: the body to forward, and what routing needs from it.

    ``token_ids`` is set when the prompt already is token ids; otherwise
    ``text`` (completions) or the chat fields in ``body`` are tokenized.
    ``body`` is decoded from ``raw`` only when something asks for it (the
    token-id fast path of :func:`parse_completion` never does: it forwards
    ``raw`` as it came).
    """

    __slots__ = ("_body", "has_stream_options", "kind", "model", "raw", "stream", "stream_options", "text",
                 "token_ids")

    def __init__(self, kind: str, body: dict[str, Any] | None, stream: bool, model: str | None, *,
                 token_ids: list[int] | None = None, text: str | None = None, raw: bytes | None = None,
                 stream_options: Any = None, has_stream_options: bool | None = None) -> None:
        if body is None and raw is None:
            raise ValueError("a ParsedRequest needs its body or its raw bytes")
        self.kind = kind  # "completions" or "chat"
        self._body = body
        self.stream = stream
        self.model = model
        self.token_ids = token_ids
        self.text = text
        #: the body as the client sent it: forwarded as is when nothing is added (no re-encoding)
        self.raw = raw
        if body is not None:
            stream_options = body.get("stream_options")
            has_stream_options = "stream_options" in body
        self.stream_options = stream_options
        #: the client sent a ``stream_options`` key (even ``null``): its object must be merged, not patched
        self.has_stream_options = bool(has_stream_options)

    @property
    def body(self) -> dict[str, Any]:
        """The JSON body as a dict (decoded from ``raw`` on first use)."""
        if self._body is None:
            assert self.raw is not None
            self._body = _decoder.decode(self.raw)
        return self._body

    @property
    def path(self) -> str:
        return "/v1/completions" if self.kind == "completions" else "/v1/chat/completions"

    def client_wants_usage(self) -> bool:
        """Whether the client itself asked for the usage chunk of a stream."""
        opts = self.stream_options
        return isinstance(opts, dict) and opts.get("include_usage") is True


class _CompletionHead(msgspec.Struct):
    """The fields of a completions body that routing reads; msgspec skips the rest unbuilt."""

    prompt: msgspec.Raw = msgspec.Raw(b"")
    stream: Any = False
    model: Any = None
    stream_options: Any = msgspec.UNSET


_head_decoder = msgspec.json.Decoder(_CompletionHead)
_ids_decoders: dict[int, msgspec.json.Decoder[list[int]]] = {}


def _ids_decoder(max_tokens: int) -> msgspec.json.Decoder[list[int]]:
    """A decoder of a token-id list within the limits, checked in C (one per limit)."""
    dec = _ids_decoders.get(max_tokens)
    if dec is None:
        token = Annotated[int, msgspec.Meta(ge=0, le=_MAX_TOKEN_ID)]
        ids = Annotated[list[token], msgspec.Meta(min_length=1, max_length=max_tokens)]  # type: ignore[valid-type]
        dec = _ids_decoders[max_tokens] = msgspec.json.Decoder(ids)
    return dec


def _fast_completion(raw: bytes, max_tokens: int) -> ParsedRequest | None:
    """A completions body whose prompt is a valid token-id list, without building the body.

    None for anything else (text, batches, and every error): :func:`parse_completion`
    then takes the general path, which gives the same answers and the same errors.
    """
    try:
        head = _head_decoder.decode(raw)
    except (msgspec.DecodeError, RecursionError):  # ValidationError included
        return None
    prompt = head.prompt
    view = memoryview(prompt)
    if not view or view[0] != 0x5B:  # "[": only a list can be token ids
        return None
    stream, model, opts = head.stream, head.model, head.stream_options
    if stream is None:
        stream = False
    if (not isinstance(stream, bool) or (model is not None and not isinstance(model, str))
            or (opts is not msgspec.UNSET and opts is not None and not isinstance(opts, dict))):
        return None
    try:
        ids = _ids_decoder(max_tokens).decode(prompt)
    except (msgspec.DecodeError, RecursionError):
        return None
    present = opts is not msgspec.UNSET
    return ParsedRequest("completions", None, stream, model, token_ids=ids, raw=raw,
                         stream_options=opts if present else None, has_stream_options=present)


def decode_object(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object, or the 400 that says why not."""
    if not raw:
        raise OpenAIError(400, "the request body is empty: expected a JSON object", code="invalid_json")
    try:
        body = _decoder.decode(raw)
    except msgspec.DecodeError as err:
        raise OpenAIError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None
    except RecursionError:  # msgspec's nesting limit (found by benchmarks/faults.py: was a 500)
        raise OpenAIError(400, "the request body is nested too deeply", code="invalid_json") from None
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
    fast = _fast_completion(raw, max_tokens)
    return fast if fast is not None else parse_completion_general(raw, max_tokens=max_tokens)


def parse_completion_general(raw: bytes, *, max_tokens: int) -> ParsedRequest:
    """:func:`parse_completion` without the token-id fast path (every prompt shape, every error)."""
    body = decode_object(raw)
    stream, model = _common(body)
    if "prompt" not in body or body["prompt"] is None:
        raise OpenAIError(400, "missing required parameter 'prompt'", param="prompt",
                          code="missing_required_parameter")
    prompt = body["prompt"]
    parsed = ParsedRequest("completions", body, stream, model, raw=raw)
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
    body = decode_object(raw)
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
    return ParsedRequest("chat", body, stream, model, raw=raw)


_WITH_USAGE = b'{"stream_options":{"include_usage":true},'


def body_asking_usage(req: ParsedRequest, body: dict[str, Any] | None = None) -> bytes:
    """The body to send the engine with ``stream_options.include_usage`` set (the truth loop
    needs a stream's usage chunk; the relay strips it again when the client did not ask).

    ``body``: a rewritten body to send instead of the client's. The client's own bytes are
    patched when it sent no ``stream_options`` at all (the key goes first, ahead of the
    body's own: no re-encoding); otherwise its object is merged and the body re-encoded.
    """
    if body is None and req.raw is not None and not req.has_stream_options:
        text = req.raw.lstrip()
        if text.startswith(b"{"):  # non-empty here: prompt or messages is required
            return _WITH_USAGE + text[1:]
    body = dict(body if body is not None else req.body)
    opts = dict(body.get("stream_options") or {})
    opts["include_usage"] = True
    body["stream_options"] = opts
    return _encoder.encode(body)
