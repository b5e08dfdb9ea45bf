"""What the gateway needs from the router process that hosts it: one typed seam.

The gateway is a part the server composes (``server -> gateway``, never
back), so it cannot name ``RouterService`` or the server's config types. It
names the calls it makes instead: the routing calls of
:class:`~tokenspeed_router.router.core.RoutingApi`, the configured workers
and streams, the limits and token it enforces, and the metrics registry it
adds its collectors to. ``RouterService`` satisfies :class:`GatewayHost`
(``server/app.py`` checks it with mypy), and nothing in the gateway reaches
past these names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from prometheus_client.registry import Collector

from tokenspeed_router.router.core import RoutingApi

__all__ = ["GatewayHost", "HostConfig", "HostLimits", "HostMetrics", "StreamSpecLike", "WorkerSpecLike"]


class WorkerSpecLike(Protocol):
    """A configured worker (``--worker``): its name, engine URL and data-parallel ranks."""

    @property
    def name(self) -> str: ...

    @property
    def url(self) -> str | None: ...

    @property
    def dp_ranks(self) -> int: ...


class StreamSpecLike(Protocol):
    """One subscribed stream: the worker it belongs to and its DP rank."""

    @property
    def worker(self) -> str: ...

    @property
    def dp_rank(self) -> int: ...


class HostLimits(Protocol):
    @property
    def max_body_bytes(self) -> int: ...

    @property
    def max_tokens(self) -> int: ...


class HostConfig(Protocol):
    @property
    def auth_token(self) -> str | None: ...

    @property
    def limits(self) -> HostLimits: ...

    @property
    def workers(self) -> Sequence[WorkerSpecLike]: ...


class HostMetrics(Protocol):
    def add_collector(self, collector: Collector) -> None: ...


class GatewayHost(RoutingApi, Protocol):
    """The router process as the gateway sees it (module docstring)."""

    @property
    def config(self) -> HostConfig: ...

    @property
    def metrics(self) -> HostMetrics: ...

    def worker_specs(self) -> Mapping[str, WorkerSpecLike]: ...

    def stream_specs(self) -> Mapping[str, StreamSpecLike]: ...
