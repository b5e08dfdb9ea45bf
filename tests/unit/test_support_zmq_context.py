"""The suite's context teardown: a leaked socket fails the test, a clean context ends."""

from __future__ import annotations

import pytest
import zmq
from support.zmq_context import end_context


def test_clean_context_ends() -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = context.socket(zmq.PUB)
    sock.bind("tcp://127.0.0.1:*")
    sock.close(linger=0)
    end_context(context, strict=True)
    assert context.closed


def test_leaked_socket_fails_a_strict_test_and_is_closed() -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.connect("tcp://127.0.0.1:9")  # nothing listens: term would wait on it forever
    with pytest.raises(pytest.fail.Exception, match=r"1 ZeroMQ socket\(s\) open: \['DEALER'\]"):
        end_context(context, strict=True)
    assert sock.closed and context.closed


def test_lenient_teardown_closes_leftovers() -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = context.socket(zmq.SUB)
    sock.connect("tcp://127.0.0.1:9")
    end_context(context, strict=False)
    assert sock.closed and context.closed
