"""The token-id fast path of ``parse_completion`` answers exactly as the general path does.

The fast path decodes only ``prompt``/``stream``/``model``/``stream_options``
(typed, limits checked in C) and never builds the body; anything it does not
take goes to the general path. For any body, both must agree on the outcome:
the same token ids, stream flag, model, usage wish and ``stream_options``
presence, or the same error (status, message, param, code).
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenspeed_router.gateway.openai import OpenAIError, parse_completion, parse_completion_general

MAX_TOKENS = 64

token = st.one_of(
    st.integers(min_value=0, max_value=2**32 - 1),
    st.integers(min_value=-(2**70), max_value=2**70),  # out of range, beyond 64 bits
    st.booleans(), st.floats(allow_nan=False, allow_infinity=False), st.none(), st.text(max_size=3),
)
prompt = st.one_of(
    st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=MAX_TOKENS + 4),
    st.lists(token, max_size=6),
    st.lists(st.lists(st.integers(min_value=0, max_value=100_000), max_size=4), max_size=3),  # batches
    st.lists(st.text(max_size=5), max_size=3),
    st.text(max_size=10), st.none(), st.integers(), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
other = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=4),
                  st.dictionaries(st.sampled_from(["include_usage", "x"]), st.booleans(), max_size=2))


@st.composite
def bodies(draw: Any) -> bytes:
    body: dict[str, Any] = {}
    if draw(st.booleans()):
        body["prompt"] = draw(prompt)
    for key in ("stream", "model", "stream_options", "max_tokens", "x_unknown"):
        if draw(st.booleans()):
            body[key] = draw(other)
    text = json.dumps(body)
    if draw(st.integers(0, 9)) == 0:  # not an object, or not JSON at all
        text = draw(st.sampled_from(["[]", "1", "null", "", "{", '"x"', "[1, 2]"]))
    return text.encode()


def outcome(fn: Any, raw: bytes) -> tuple[Any, ...]:
    try:
        req = fn(raw, max_tokens=MAX_TOKENS)
    except OpenAIError as err:
        return ("error", err.status, err.message, err.param, err.code)
    return ("ok", req.kind, req.token_ids, req.text, req.stream, req.model, req.client_wants_usage(),
            req.has_stream_options, req.raw == raw, req.body == json.loads(raw))


@settings(max_examples=600, deadline=None)
@given(bodies())
def test_fast_path_agrees_with_the_general_path(raw: bytes) -> None:
    assert outcome(parse_completion, raw) == outcome(parse_completion_general, raw)


def test_duplicate_keys_resolve_alike() -> None:
    for raw in (b'{"prompt": "a b", "prompt": [1, 2]}', b'{"prompt": [1, 2], "prompt": "a b"}',
                b'{"prompt": [1], "stream": true, "stream": false}'):
        assert outcome(parse_completion, raw) == outcome(parse_completion_general, raw)


def test_fast_path_keeps_the_client_bytes_and_decodes_the_body_only_on_demand() -> None:
    raw = b'{"prompt": [5, 6, 7], "stream": true, "x_unknown": {"a": [1]}, "stream_options": null}'
    req = parse_completion(raw, max_tokens=MAX_TOKENS)
    assert req.token_ids == [5, 6, 7] and req.stream and req.raw is raw
    assert req.has_stream_options and not req.client_wants_usage()
    assert req.body["x_unknown"] == {"a": [1]}
