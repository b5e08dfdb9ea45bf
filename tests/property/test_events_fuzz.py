"""Fuzz: nothing malformed escapes the decoder or the subscriber's frame checks
except the package's own WireError (decoder) or a counted skip (subscriber)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenspeed_router.errors import WireError
from tokenspeed_router.events import BatchDecoder, EventSubscriber, KVEventBatch

SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=12)
    | st.binary(max_size=12)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"])
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=6)
    | st.dictionaries(st.sampled_from(["type", "block_hashes", "parent_block_hash",
                                       "token_ids", "block_size", "medium", "x"]) | st.text(max_size=5),
                      inner, max_size=6),
    max_leaves=30,
)
_tags = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other", 1, None])


@st.composite
def _near_valid(draw: st.DrawFn) -> Any:
    """Envelopes shaped like a batch whose events are tagged but randomly filled."""
    events = draw(st.lists(
        st.one_of(
            st.builds(lambda tag, rest: [tag, *rest], _tags, st.lists(_values, max_size=6)),
            st.builds(lambda tag, body: {"type": tag, **body}, _tags,
                      st.dictionaries(st.sampled_from(["block_hashes", "parent_block_hash",
                                                       "token_ids", "block_size", "medium"]),
                                      _values, max_size=5)),
        ),
        max_size=4,
    ))
    ts = draw(st.floats(allow_nan=True) | st.integers(-(2**63), 2**64 - 1) | st.none())
    tail = draw(st.lists(_values, max_size=2))
    return [ts, events, *tail]


_DECODER = BatchDecoder()


def _decode_or_wire_error(decoder: BatchDecoder, payload: bytes) -> None:
    try:
        batch = decoder.decode(payload)
    except WireError:
        return
    assert isinstance(batch, KVEventBatch)


@SETTINGS
@given(st.binary(max_size=256))
def test_random_bytes(payload: bytes) -> None:
    _decode_or_wire_error(_DECODER, payload)


@SETTINGS
@given(_values)
def test_random_msgpack(obj: Any) -> None:
    _decode_or_wire_error(_DECODER, msgspec.msgpack.encode(obj))


@SETTINGS
@given(_near_valid())
def test_structurally_wrong_batches(obj: Any) -> None:
    _decode_or_wire_error(_DECODER, msgspec.msgpack.encode(obj))


@SETTINGS
@given(_near_valid(), st.integers(min_value=0, max_value=200), st.binary(min_size=1, max_size=4))
def test_truncated_and_spliced_payloads(obj: Any, cut: int, junk: bytes) -> None:
    payload = msgspec.msgpack.encode(obj)
    _decode_or_wire_error(_DECODER, payload[:cut])
    _decode_or_wire_error(_DECODER, payload[:cut] + junk + payload[cut:])


@pytest.fixture
def subscriber() -> Iterator[EventSubscriber]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = EventSubscriber("fuzz", "inproc://fuzz-nothing-bound", topic="kv", context=ctx,
                          max_payload_bytes=512)
    yield sub
    sub.close()
    ctx.term()


@SETTINGS
@given(frames=st.lists(st.binary(max_size=64), max_size=5))
def test_subscriber_frame_checks_never_raise(subscriber: EventSubscriber, frames: list[bytes]) -> None:
    before = subscriber.statistics().malformed_total
    message = subscriber._frames.parse_live(frames)
    after = subscriber.statistics().malformed_total
    assert (message is None) == (after == before + 1)
    replayed = subscriber._frames.parse_replay([b"", *frames])
    assert replayed is True or replayed is False or replayed.replayed
