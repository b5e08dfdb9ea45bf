"""Ending a test's ZeroMQ context without letting one rare hang fail the suite.

``zmq_ctx_term`` blocks until every socket of the context is closed. A test
that leaked a socket must fail, and it does: :func:`end_context` names the
sockets still open (``strict``) before it closes them. Once every socket is
closed, ``term`` still hung for the whole test timeout once in CI (in
``zmq::ctx_t::terminate``, the libzmq hang of zeromq/libzmq#2586: every socket
closed, LINGER 0, the reaper's answer never comes). That is libzmq's, not the
code under test's, so ``term`` runs on a daemon thread with a deadline: past
it, the context is logged and parked (kept referenced, so its ``__del__``
never runs in a later test) and the test goes on.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import zmq

__all__ = ["TERM_DEADLINE_S", "end_context"]

logger = logging.getLogger(__name__)

TERM_DEADLINE_S = 20.0
_parked: list[zmq.Context[Any]] = []


def _open_sockets(context: zmq.Context[Any]) -> list[zmq.Socket[Any]]:
    return [s for s in list(context._sockets) if not s.closed]


def end_context(context: zmq.Context[Any], *, strict: bool) -> None:
    """Close what is left of ``context`` and terminate it within :data:`TERM_DEADLINE_S`.

    ``strict``: a socket still open is a leak and fails the test (after it is
    closed, so the context can still end).
    """
    leaked = _open_sockets(context)
    kinds = sorted(zmq.SocketType(s.type).name for s in leaked)
    for sock in leaked:
        sock.close(linger=0)
    done = threading.Event()

    def term() -> None:
        context.term()
        done.set()

    threading.Thread(target=term, name="zmq-term", daemon=True).start()
    if not done.wait(TERM_DEADLINE_S):
        _parked.append(context)
        logger.error("zmq context term() still blocked after %.0f s with every socket closed "
                     "(libzmq terminate hang); context parked", TERM_DEADLINE_S)
    if strict and leaked:
        pytest.fail(f"the test left {len(leaked)} ZeroMQ socket(s) open: {kinds}")
