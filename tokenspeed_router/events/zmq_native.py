"""Read every message waiting on a ZeroMQ socket in one native call (``csrc/zmq_drain.c``).

pyzmq costs 15-25 µs of Python per three-frame message here (a ``recv`` per
frame, a ``getsockopt(RCVMORE)`` that builds an Enum per frame, a raised
``zmq.Again`` to end every drain): more than applying the batch the message
carries (issue 33's profile, docs/service.md). :func:`drainer` gives a
subscriber a function that reads up to N whole messages in one C call,
through the very libzmq that pyzmq loaded (found in ``/proc/self/maps``, so
the socket pointer is that library's).

Without the compiled extension, on a system without ``/proc`` or when the
library cannot be linked (pyzmq built with libzmq inside its own module),
:func:`drainer` returns None and the caller keeps pyzmq's ``recv``; both
paths hand back the same frames (tested against each other).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["MAX_FRAMES", "drainer"]

#: frames of one message a native drain keeps (csrc/zmq_drain.c: more cannot be a valid
#: message; the rest is read and dropped, so a longer one shows as exactly this many)
MAX_FRAMES = 16

#: ``drain(max_messages) -> [[frame, ...], ...]``: every whole message waiting, at most that many
Drain = Callable[[int], list[list[bytes]]]


@functools.cache
def _linked() -> Callable[[int, int], list[list[bytes]]] | None:
    try:
        from tokenspeed_router._native import zmq_drain, zmq_link
    except ImportError:
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[5].strip() for line in maps if line.count(" ") >= 5 and "libzmq" in line}
    except OSError:
        return None
    for path in sorted(p for p in paths if p.startswith("/")):
        if zmq_link(path):
            return zmq_drain  # type: ignore[no-any-return]
    return None


def drainer(sock: Any) -> Drain | None:
    """A native drain of ``sock`` (a pyzmq socket owned by the calling thread), or None."""
    drain = _linked()
    if drain is None:
        return None
    address = int(sock.underlying)
    return functools.partial(drain, address)
