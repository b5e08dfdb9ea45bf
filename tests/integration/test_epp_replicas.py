"""Picker replicas on one real Redis: active-active by default, leader-only when asked.

Real ZmqEventPublishers feed ``serve --state redis://... --epp`` subprocesses;
readiness is read over real gRPC health checking, as Kubernetes probes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import zmq
from support import wait_until
from support.envoy import health
from support.state_harness import Workers
from support.state_serve import Serve, handshake, one_leader
from support.zmq_context import end_context

from tokenspeed_router.endpoints import free_tcp_port

pytestmark = pytest.mark.redis

#: the engines' OpenAI API is never called here: readiness needs a url= to pick
URL = "http://127.0.0.1:9"


@pytest.fixture
def workers() -> Iterator[Workers]:
    ctx: zmq.Context[Any] = zmq.Context()
    w = Workers(["w0", "w1"], ctx)
    yield w
    w.close()
    end_context(ctx, strict=True)


def _replica(name: str, redis_url: str, workers: Workers, ingest: str, *extra: str) -> tuple[Serve, grpc.Channel]:
    port = free_tcp_port()
    serve = Serve(name, redis_url, workers, ingest=ingest, worker_url=URL,
                  extra_args=("--epp", f"127.0.0.1:{port}", *extra))
    return serve, grpc.insecure_channel(f"127.0.0.1:{port}")


def test_active_active_replicas_are_all_ready(redis_url: str, workers: Workers) -> None:
    a, ca = _replica("a", redis_url, workers, "direct")
    b, cb = _replica("b", redis_url, workers, "direct")
    try:
        handshake(workers, a, b)
        for channel in (ca, cb):
            wait_until(lambda c=channel: health(c, "readiness") == "SERVING", 30, what="every replica ready")
    finally:
        for s, c in ((a, ca), (b, cb)):
            c.close()
            s.stop()


def test_leader_only_picking_keeps_followers_not_ready(redis_url: str, workers: Workers) -> None:
    a, ca = _replica("a", redis_url, workers, "stream", "--epp-leader-only")
    b, cb = _replica("b", redis_url, workers, "stream", "--epp-leader-only")
    channels = {"a": ca, "b": cb}
    try:
        leader = wait_until(lambda: one_leader(a, b), 30, what="one leader")
        follower = b if leader is a else a
        handshake(workers, leader)
        wait_until(lambda: health(channels[leader.name], "readiness") == "SERVING", 30, what="the leader ready")
        assert health(channels[follower.name], "readiness") == "NOT_SERVING"
        assert health(channels[follower.name], "envoy.service.ext_proc.v3.ExternalProcessor") == "NOT_SERVING"
        assert health(channels[follower.name], "liveness") == "SERVING"
        leader.kill()  # the follower takes the lease and becomes the one ready picker
        wait_until(lambda: health(channels[follower.name], "readiness") == "SERVING", 30,
                   what="the new leader ready")
    finally:
        for s in (a, b):
            channels[s.name].close()
            s.stop()
