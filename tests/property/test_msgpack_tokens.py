"""``_native.msgpack_tokens`` accepts exactly what the typed ZMQ decoder accepts, with the same values."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenspeed_router.server.api import TokenId

native = pytest.importorskip("tokenspeed_router._native")

_TYPED = msgspec.msgpack.Decoder(list[TokenId])
# ints around every msgpack width boundary, plus values of the wrong type
ITEMS = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**63, -1, -32, -33, -129]),
    st.floats(allow_nan=False),
    st.none(),
    st.booleans(),
    st.text(max_size=3),
)


@settings(max_examples=400, deadline=None)
@given(items=st.lists(ITEMS, max_size=40))
def test_same_verdict_and_values_as_the_typed_decoder(items: list[Any]) -> None:
    raw = msgspec.msgpack.encode(items)
    try:
        want: list[int] | None = _TYPED.decode(raw)
    except msgspec.ValidationError as err:
        want, why = None, str(err)
    try:
        got = memoryview(native.msgpack_tokens(raw)).cast("Q").tolist()
    except ValueError as err:
        assert want is None, f"refused {items!r}: {err}"
        assert str(err) == why.replace("`$[", "`$.token_ids[")  # msgspec's message and JSON path
        return
    assert got == want


@pytest.mark.parametrize("value", [{"a": 1}, "x", 1, None, b"\x00"])
def test_not_an_array(value: Any) -> None:
    with pytest.raises(ValueError, match=r"Expected `array`.*\$\.token_ids`"):
        native.msgpack_tokens(msgspec.msgpack.encode(value))


@pytest.mark.parametrize("raw", [b"", b"\x92\x01", b"\x91\xce\x00\x01", b"\xdc\x00", b"\x91\x01\x01"])
def test_truncated_or_trailing_bytes(raw: bytes) -> None:
    with pytest.raises(ValueError):
        native.msgpack_tokens(raw)
