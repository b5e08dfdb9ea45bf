"""ZeroMQ framing helpers: seq frames and the data-parallel port offset."""

from __future__ import annotations

import pytest

from tokenspeed_router.events import END_SEQ, offset_endpoint_port
from tokenspeed_router.events.frames import decode_seq, encode_seq


def test_seq_is_8_byte_big_endian() -> None:
    assert encode_seq(1) == b"\x00" * 7 + b"\x01"
    assert decode_seq(encode_seq(2**64 - 2)) == 2**64 - 2
    assert END_SEQ == b"\xff" * 8


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 3, "tcp://*:5560"),
        ("tcp://[::1]:27100", 1, "tcp://[::1]:27101"),
        ("tcp://127.0.0.1:0", 2, "tcp://127.0.0.1:0"),
        ("tcp://127.0.0.1:*", 2, "tcp://127.0.0.1:*"),
        ("inproc://kv", 2, "inproc://kv_dp2"),
        ("ipc:///tmp/kv", 0, "ipc:///tmp/kv"),
        (None, 1, None),
    ],
)
def test_offset_endpoint_port(endpoint: str | None, rank: int, expected: str | None) -> None:
    assert offset_endpoint_port(endpoint, rank) == expected


@pytest.mark.parametrize("endpoint", ["ipc:///tmp/kv", "tcp://host", "tcp://h:x", "tcp://h:65535"])
def test_offset_rejects_what_cannot_be_offset(endpoint: str) -> None:
    with pytest.raises(ValueError):
        offset_endpoint_port(endpoint, 1)
