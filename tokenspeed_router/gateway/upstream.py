"""Where the engines are, the pooled HTTP client that reaches them, and which are down.

One client, made on first use in the serving event loop:
:class:`~tokenspeed_router.gateway.http1.Http1Pool`, a lean keep-alive
HTTP/1.1 client bounded by ``upstream_max_connections``. The proxy legs
(``/v1/completions``, ``/v1/chat/completions``, both P/D legs) stream through
it; the side calls (``/v1/models``, ``/tokenize``, health probes) take whole
answers from it (:meth:`~tokenspeed_router.gateway.http1.Http1Pool.fetch`).
Measured against aiohttp, httpx and others in one run
(``benchmarks/bench_http_stack.py``, docs/gateway.md), it costs half of
aiohttp's CPU per streamed request and a twentieth of httpx's.

Timeouts: ``upstream_connect_timeout_s`` to connect, ``upstream_timeout_s``
for every read (see :class:`~tokenspeed_router.gateway.config.GatewayConfig`).

A worker whose engine refuses or drops the connection before answering is
*down*: :meth:`Upstreams.mark_down` takes every stream of it out of routing
(``RouterService.set_reachable``) and starts a probe that asks its
``GET /health`` until it answers 200 (or ``worker_down_cooldown_s`` passes),
then puts it back. Streams of a data-parallel worker share its URL and are
addressed with the ``X-data-parallel-rank`` header vLLM understands.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from tokenspeed_router.gateway.config import GatewayConfig
from tokenspeed_router.gateway.host import GatewayHost
from tokenspeed_router.gateway.http1 import (
    ConnectFailed,
    ConnectionDropped,
    Http1Pool,
    ReadTimeout,
    UpstreamError,
)

__all__ = ["Target", "Upstreams", "is_timeout", "is_unreachable"]

logger = logging.getLogger(__name__)

#: how often a down worker's /health is asked
PROBE_INTERVAL_S = 0.5
#: idle pooled connections are dropped before servers drop them (uvicorn, vLLM's server: 5 s)
KEEPALIVE_S = 4.0


def is_unreachable(err: BaseException) -> bool:
    """The engine did not take the request: refused, reset, closed, or no connection in time."""
    if isinstance(err, (ConnectFailed, ConnectionDropped)):
        return True
    if isinstance(err, ReadTimeout):
        return False  # connected, then too slow: busy, not gone
    return isinstance(err, ConnectionError)


def is_timeout(err: BaseException) -> bool:
    return isinstance(err, (ReadTimeout, asyncio.TimeoutError))


@dataclass(frozen=True, slots=True)
class Target:
    """One routable stream as an HTTP destination."""

    stream: str  # router/index name (NAME or NAME/dpR)
    worker: str  # configured worker name
    url: str
    dp_rank: int | None  # set for multi-rank workers

    def headers(self) -> dict[str, str]:
        return {"X-data-parallel-rank": str(self.dp_rank)} if self.dp_rank is not None else {}


class Upstreams:
    """Targets of the service's workers, the pooled client, and down marking."""

    def __init__(self, service: GatewayHost, config: GatewayConfig) -> None:
        self._service = service
        self._config = config
        self._pool: Http1Pool | None = None
        self._down: dict[str, float] = {}  # worker -> monotonic time it went down
        self._probes: dict[str, asyncio.Task[None]] = {}
        self.down_events = 0

    def pool(self) -> Http1Pool:
        """The one client for engine calls (``http1.py``): proxy legs and side calls, made on first use."""
        if self._pool is None:
            c = self._config
            self._pool = Http1Pool(max_connections=c.upstream_max_connections,
                                   connect_timeout_s=c.upstream_connect_timeout_s,
                                   read_timeout_s=c.upstream_timeout_s, keepalive_s=KEEPALIVE_S)
        return self._pool

    async def aclose(self) -> None:
        for task in self._probes.values():
            task.cancel()
        for task in list(self._probes.values()):
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._probes.clear()
        if self._pool is not None:
            await self._pool.aclose()
            self._pool = None

    # --- targets ----------------------------------------------------------------

    def targets(self) -> dict[str, Target]:
        """Every stream whose worker has a ``url``, by stream name."""
        specs = self._service.worker_specs()
        out: dict[str, Target] = {}
        for name, sub in self._service.stream_specs().items():
            spec = specs.get(sub.worker)
            if spec is None or spec.url is None:
                continue
            out[name] = Target(name, sub.worker, spec.url, sub.dp_rank if spec.dp_ranks > 1 else None)
        return out

    def worker_urls(self) -> dict[str, str]:
        """Configured worker -> url, for workers that have one and are not down."""
        return {
            name: spec.url
            for name, spec in self._service.worker_specs().items()
            if spec.url is not None and name not in self._down
        }

    def any_url(self, counter: int) -> str | None:
        """A reachable engine to ask for side work (tokenize), rotating with ``counter``."""
        urls = sorted(self.worker_urls().values())
        return urls[counter % len(urls)] if urls else None

    # --- down marking -------------------------------------------------------------

    def is_down(self, worker: str) -> bool:
        return worker in self._down

    def down(self) -> dict[str, float]:
        """Down workers -> seconds they have been down."""
        now = time.monotonic()
        return {w: now - t for w, t in self._down.items()}

    def mark_down(self, target: Target, reason: str) -> None:
        """Stop routing to ``target.worker`` (all its streams) until its probe succeeds."""
        if target.worker in self._down:
            return
        self._down[target.worker] = time.monotonic()
        self.down_events += 1
        streams = [n for n, sub in self._service.stream_specs().items() if sub.worker == target.worker]
        for stream in streams:
            self._service.set_reachable(stream, False)
        logger.warning("worker %s (%s) marked down: %s; probing %s/health", target.worker, target.url,
                       reason, target.url)
        self._probes[target.worker] = asyncio.ensure_future(self._probe(target.worker, target.url, streams))

    def _mark_up(self, worker: str, streams: list[str], why: str) -> None:
        self._down.pop(worker, None)
        self._probes.pop(worker, None)
        for stream in streams:
            self._service.set_reachable(stream, True)
        logger.warning("worker %s back in routing (%s)", worker, why)

    async def _probe(self, worker: str, url: str, streams: list[str]) -> None:
        deadline = time.monotonic() + self._config.worker_down_cooldown_s
        pool = self.pool()
        probe_timeout_s = min(2.0, self._config.upstream_timeout_s)
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            if worker not in self._service.worker_specs():
                self._down.pop(worker, None)
                self._probes.pop(worker, None)
                return
            try:
                status, _ = await pool.fetch(b"GET", url, "/health", timeout_s=probe_timeout_s)
                if status == 200:
                    self._mark_up(worker, streams, "health probe answered 200")
                    return
            except (UpstreamError, OSError):
                pass
            if time.monotonic() >= deadline:
                self._mark_up(worker, streams, f"cooldown of {self._config.worker_down_cooldown_s:g}s over")
                return
