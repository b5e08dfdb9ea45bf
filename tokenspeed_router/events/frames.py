"""ZeroMQ framing shared by the publisher and the subscriber (DESIGN §3).

* Live message on PUB: ``[topic, seq, payload]``, ``seq`` an unsigned 8-byte
  big-endian counter from 0.
* Replay request from a DEALER: ``[b"", start_seq]`` (8-byte big-endian).
* Replay reply (after the ROUTER identity): vLLM/SGLang ``[b"", topic, seq,
  payload]`` ending with ``[b"", b"", END_SEQ, b""]``; TokenSpeed ``[b"", seq,
  payload]`` ending with ``[b"", END_SEQ, b""]``. We send the vLLM form.
* Data-parallel rank ``r`` publishes on ``port + r`` (vLLM/TokenSpeed/SGLang
  ``offset_endpoint_port``).
"""

from __future__ import annotations

import struct

__all__ = [
    "END_SEQ",
    "SEQ_BYTES",
    "decode_seq",
    "encode_seq",
    "ipv6_endpoint",
    "offset_endpoint_port",
    "split_replay_frames",
]

SEQ_BYTES = 8
#: The replay end marker: -1 as a signed 8-byte big-endian integer.
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)

_SEQ = struct.Struct(">Q")
encode_seq = _SEQ.pack
"""``encode_seq(seq) -> bytes``: 8-byte big-endian unsigned."""


def decode_seq(frame: bytes | bytearray | memoryview) -> int:
    """Read an 8-byte big-endian seq frame (the caller checks the length)."""
    return int(_SEQ.unpack(frame)[0])


def split_replay_frames(frames: list[bytes]) -> tuple[bytes | None, bytes, bytes] | None:
    """One replay reply's ``(topic, seq_frame, payload)``; None if it has neither framing.

    ``topic`` is None for TokenSpeed's topic-less form. The end marker comes
    back as ``seq_frame == END_SEQ``; the caller checks the seq frame's length.
    """
    if len(frames) == 4 and frames[0] == b"":  # vLLM / SGLang / ours
        return frames[1], frames[2], frames[3]
    if len(frames) == 3 and frames[0] == b"":  # TokenSpeed: no topic frame
        return None, frames[1], frames[2]
    return None


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint data-parallel rank ``data_parallel_rank`` uses.

    Same rule as the engines: ``tcp://host:port`` becomes ``port + rank``
    (port ``0`` or ``*``, an OS-chosen port, is left alone); ``inproc://name``
    becomes ``inproc://name_dp{rank}``; anything else (``ipc://``) only works
    for rank 0 and raises :class:`ValueError` otherwise.
    """
    if endpoint is None:
        return None
    if data_parallel_rank < 0:
        raise ValueError(f"data_parallel_rank must be >= 0, got {data_parallel_rank}")
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, sep, port = endpoint.rpartition(":")
        if not sep or base == "tcp":
            raise ValueError(f"tcp endpoint has no port: {endpoint!r}")
        if port in ("0", "*"):
            return endpoint
        try:
            number = int(port)
        except ValueError as err:
            raise ValueError(f"tcp endpoint has a bad port {port!r}: {endpoint!r}") from err
        if number + data_parallel_rank > 65535:
            raise ValueError(f"{endpoint!r} + rank {data_parallel_rank} exceeds port 65535")
        return f"{base}:{number + data_parallel_rank}"
    raise ValueError(
        f"cannot offset {endpoint!r} for data-parallel rank {data_parallel_rank}: "
        "only tcp:// and inproc:// endpoints support several ranks"
    )


def ipv6_endpoint(endpoint: str) -> bool:
    """Whether a socket needs ``zmq.IPV6`` for ``endpoint`` (``tcp://[::1]:5557``).

    The engines' own configs use bracketed IPv6 hosts (see the captures);
    libzmq refuses them unless the socket option is set.
    """
    return endpoint.startswith("tcp://[") or "::" in endpoint
