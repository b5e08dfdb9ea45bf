"""The query API's request types, validation and errors, shared by HTTP and ZeroMQ.

Both transports decode into the same msgspec structs and call the same
service methods, so a request means the same thing and fails with the same
message whichever way it came (DESIGN §6). Decoding is typed and total: any
bytes a client sends end as a request struct or a :class:`RouterApiError` with a
4xx status naming the problem (msgspec's messages carry the JSON path, e.g.
``Expected `int` >= 0 - at `$.token_ids[2]```).

``lora_id`` is an integer ``>= 0`` or a non-empty string (an adapter name).
Token ids must be integers in ``[0, 2**63)``: engines use 32-bit vocabularies,
the content hash encodes u64, and every client language has a signed 64-bit
integer, so the bound rejects garbage without rejecting any real prompt.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from tokenspeed_router.errors import RouterApiError, TokenspeedError, api_error
from tokenspeed_router.server.config import ApiLimits

__all__ = [
    "MAX_TOKEN_ID",
    "MatchRequest",
    "ReleaseRequest",
    "RouteRequest",
    "ZmqRequest",
    "ZmqRequestRaw",
    "api_error",
    "api_errors",
    "decode_json",
    "validate_request",
]

MAX_TOKEN_ID = 2**63 - 1
TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
#: a LoRA adapter by id (``int >= 0``, what SGLang/TokenSpeed publish) or by name
#: (a non-empty string: vLLM publishes ``lora_name``); the index matches either
LoraId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)] | Annotated[str, Meta(min_length=1, max_length=4096)]
#: a caller's request id: a non-empty string or an integer (its length limit is configurable:
#: :func:`request_id_text`)
RequestId = Annotated[str, Meta(min_length=1)] | int


@contextmanager
def api_errors() -> Iterator[None]:
    """Raise domain errors escaping the block as :class:`RouterApiError` (see :func:`api_error`)."""
    try:
        yield
    except TokenspeedError as err:
        mapped = api_error(err)
        if mapped is err:
            raise
        raise mapped from None


class MatchRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /match`` body."""

    token_ids: list[TokenId]
    lora_id: LoraId | None = None
    salt: str | None = None


class RouteRequest(MatchRequest, frozen=True, kw_only=True):
    """``POST /route`` body: a match plus an optional caller-chosen request id.

    ``explain: true`` adds the decision's cost breakdown as the answer's
    ``explain`` field (DESIGN §13); it must be a JSON boolean.
    """

    request_id: RequestId | None = None
    explain: bool = False


class ReleaseRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /release`` body."""

    request_id: RequestId


# --- ZeroMQ: one msgpack map per request, tagged by "op" ------------------------


class _ZmqBase(msgspec.Struct, frozen=True, kw_only=True, tag_field="op"):
    #: echoed in the reply so clients can pipeline and discard late answers
    id: int | str | None = None
    #: the bearer token (``"Bearer X"`` or just ``"X"``) when auth is on
    auth: str | None = None


class ZmqMatch(_ZmqBase, frozen=True, kw_only=True, tag="match"):
    token_ids: list[TokenId]
    lora_id: LoraId | None = None
    salt: str | None = None


class ZmqRoute(ZmqMatch, frozen=True, kw_only=True, tag="route"):
    request_id: RequestId | None = None
    explain: bool = False


class ZmqRelease(_ZmqBase, frozen=True, kw_only=True, tag="release"):
    request_id: RequestId


class ZmqWorkers(_ZmqBase, frozen=True, kw_only=True, tag="workers"):
    pass


class ZmqHealth(_ZmqBase, frozen=True, kw_only=True, tag="health"):
    pass


ZmqRequest = ZmqMatch | ZmqRoute | ZmqRelease | ZmqWorkers | ZmqHealth


class ZmqMatchRaw(_ZmqBase, frozen=True, kw_only=True, tag="match"):
    """``ZmqMatch`` as the server decodes it when the compiled core is built:
    ``token_ids`` stays the raw msgpack array, read by ``_native.msgpack_tokens``
    into a u64 buffer (1k Python ints cost more to build than a routing decision).
    """

    token_ids: msgspec.Raw
    lora_id: LoraId | None = None
    salt: str | None = None


class ZmqRouteRaw(ZmqMatchRaw, frozen=True, kw_only=True, tag="route"):
    request_id: RequestId | None = None
    explain: bool = False


ZmqRequestRaw = ZmqMatchRaw | ZmqRouteRaw | ZmqRelease | ZmqWorkers | ZmqHealth
ZMQ_OPS = ("match", "route", "release", "workers", "health")


def decode_json(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    """Decode a JSON body into the decoder's type, or raise a 400 :class:`RouterApiError`."""
    if not body:
        raise RouterApiError(400, "empty request body: expected a JSON object")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as err:
        raise RouterApiError(400, f"invalid request: {err}") from None
    except msgspec.DecodeError as err:
        raise RouterApiError(400, f"malformed JSON: {err}") from None
    except RecursionError:
        raise RouterApiError(400, "malformed JSON: nested too deeply") from None


def request_id_text(value: str | int | None, limits: ApiLimits) -> str | None:
    """Normalise a request id to text and bound its length."""
    if value is None:
        return None
    text = value if isinstance(value, str) else str(value)
    if not text:
        raise RouterApiError(400, "request_id must be a non-empty string")
    if len(text) > limits.max_request_id_len:
        raise RouterApiError(
            400, f"request_id is {len(text)} characters, limit {limits.max_request_id_len}"
        )
    return text


def validate_request(req: MatchRequest | ZmqMatch | ZmqMatchRaw, limits: ApiLimits, num_tokens: int | None = None) -> None:
    """Checks msgspec cannot express statically (limits are configurable).

    ``num_tokens``: the prompt length when ``req.token_ids`` is not the
    decoded list (the ZMQ API reads it from the raw msgpack array).
    """
    n = len(req.token_ids) if num_tokens is None else num_tokens
    if n > limits.max_tokens:
        raise RouterApiError(413, f"token_ids has {n} tokens, limit {limits.max_tokens}")
    if req.salt is not None and len(req.salt) > 4096:
        raise RouterApiError(400, "salt is longer than 4096 characters")
