"""The gateway's side of "why this worker" (DESIGN §13): the request header and the answer header.

A client sends ``x-tokenspeed-explain: 1`` (or ``true``; ``0``/``false``
ask for nothing; anything else is a 400 naming the header) and gets the
routing decision back in the ``x-tokenspeed-route`` answer header, as
compact JSON: ``RouteExplanation.to_dict()``, the same object ``POST /route``
answers under ``explain``. Decisions picked by ``serve --explain-sample``
carry the header too.

Header size: each candidate takes about 400 bytes, and common clients refuse
answer headers past 8 KiB (aiohttp's default ``max_field_size`` is 8190).
Past :data:`MAX_HEADER_BYTES` the header keeps the chosen worker and the
cheapest candidates that fit, and says how many it left out
(``"omitted": N``); ``POST /route`` and the decision log always hold every
candidate. Non-ASCII worker names are ``\\u``-escaped: a header is Latin-1.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from tokenspeed_router.gateway.openai import OpenAIError

__all__ = ["EXPLAIN_HEADER", "MAX_HEADER_BYTES", "ROUTE_HEADER", "explain_requested", "route_header"]

#: request header asking for the decision
EXPLAIN_HEADER = b"x-tokenspeed-explain"
#: answer header carrying it
ROUTE_HEADER = b"x-tokenspeed-route"
#: the answer header's largest value (bytes)
MAX_HEADER_BYTES = 8000

_ON = (b"1", b"true")
_OFF = (b"0", b"false", b"")
_encoder = msgspec.json.Encoder()


def explain_requested(value: bytes) -> bool:
    """The ``x-tokenspeed-explain`` value as a flag; a 400 for anything but 1/true/0/false."""
    flag = value.strip().lower()
    if flag in _ON:
        return True
    if flag in _OFF:
        return False
    shown = value[:40].decode("latin-1")
    raise OpenAIError(400, f"header x-tokenspeed-explain must be 1 or 0 (or true/false), got {shown!r}",
                      param="x-tokenspeed-explain", code="invalid_value")


def _encode(obj: dict[str, Any]) -> bytes:
    data = _encoder.encode(obj)
    if data.isascii():
        return data
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def route_header(explanation: Any, max_bytes: int = MAX_HEADER_BYTES) -> bytes:
    """``x-tokenspeed-route``'s value for a ``RouteExplanation`` (see the module docstring)."""
    full = explanation.to_dict()
    data = _encode(full)
    if len(data) <= max_bytes:
        return data
    candidates: list[dict[str, Any]] = full["candidates"]
    # the chosen rows first, then the cheapest: what "why not the others" is mostly about
    ranked = sorted(
        candidates,
        key=lambda c: (not c.get("chosen"), c.get("cost") is None, c.get("cost") or 0.0, c.get("worker", "")),
    )
    kept: list[dict[str, Any]] = []
    base = {**full, "candidates": kept, "omitted": len(candidates)}
    size = len(_encode(base))
    for c in ranked:
        row = len(_encode(c)) + 1
        if size + row > max_bytes:
            break
        kept.append(c)
        size += row
    base["omitted"] = len(candidates) - len(kept)
    return _encode(base)
