"""Read every message waiting on a ZeroMQ socket in one native call (``csrc/zmq_drain.c``).

pyzmq costs 15-25 µs of Python per three-frame message here (a ``recv`` per
frame, a ``getsockopt(RCVMORE)`` that builds an Enum per frame, a raised
``zmq.Again`` to end every drain): more than applying the batch the message
carries (issue 33's profile, docs/service.md). :func:`drainer` gives a
subscriber a function that reads up to N whole messages in one C call
(:func:`sender`: sends a list of messages in one),
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

__all__ = ["MAX_FRAMES", "drainer", "sender"]

#: frames of one message a native drain keeps (csrc/zmq_drain.c: more cannot be a valid
#: message; the rest is read and dropped, so a longer one shows as exactly this many)
MAX_FRAMES = 16

#: ``drain(max_messages) -> [[frame, ...], ...]``: every whole message waiting, at most that many
Drain = Callable[[int], list[list[bytes]]]
#: ``send(messages) -> how many were sent``
Send = Callable[[list[list[bytes]]], int]


@functools.cache
def _linked() -> bool:
    """Whether the compiled extension reached the libzmq pyzmq loaded (once per process)."""
    try:
        from tokenspeed_router._native import zmq_link
    except ImportError:
        return False
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[5].strip() for line in maps if line.count(" ") >= 5 and "libzmq" in line}
    except OSError:
        return False
    return any(zmq_link(path) for path in sorted(p for p in paths if p.startswith("/")))


def drainer(sock: Any) -> Drain | None:
    """A native drain of ``sock`` (a pyzmq socket owned by the calling thread), or None."""
    if not _linked():
        return None
    from tokenspeed_router._native import zmq_drain

    return functools.partial(zmq_drain, int(sock.underlying))


def sender(sock: Any) -> Send | None:
    """``send(messages) -> sent``: each message (a list of bytes frames) sent on ``sock`` without
    waiting, in one native call; stops at the first one libzmq refuses. None without the extension."""
    if not _linked():
        return None
    from tokenspeed_router._native import zmq_send_all

    return functools.partial(zmq_send_all, int(sock.underlying))
