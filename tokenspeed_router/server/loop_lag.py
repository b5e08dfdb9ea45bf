"""How late the HTTP event loop runs: the stall every request on it waits out.

A request through the gateway can only be as quick as the loop that serves
it. Anything that holds the loop — a collector pass, a lock held by another
thread, a blocking call, the ingestion thread keeping the GIL — delays every
request in flight at once, which is exactly the "burst of requests all
delayed together" pattern of issue 20. This monitor makes such stalls
visible instead of inferred: a timer asks to run every :data:`INTERVAL_S`
and records how late it actually ran, as
``tokenspeed_http_loop_lag_seconds`` (histogram) and
``tokenspeed_http_loop_longest_lag_seconds`` (the worst since start).

Cost: one timer callback per interval (100 a second), no allocation of
tracked objects, nothing on the request path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenspeed_router.server.metrics import LatencyHistogram

__all__ = ["INTERVAL_S", "LoopLag", "LoopLagCollector"]

#: how often the loop is sampled
INTERVAL_S = 0.01
#: lag buckets (seconds): 1 ms .. 1 s
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class LoopLag:
    """Samples one event loop's lateness (start it from inside the loop)."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self._interval_s = interval_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self.histogram = LatencyHistogram(_BUCKETS)
        self.longest_s = 0.0

    @property
    def samples(self) -> int:
        return self.histogram.samples

    def start(self) -> None:
        """Begin sampling the running loop."""
        self._loop = asyncio.get_running_loop()
        self._schedule()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _schedule(self) -> None:
        assert self._loop is not None
        self._due = self._loop.time() + self._interval_s
        self._handle = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        assert self._loop is not None
        self.record(max(0.0, self._loop.time() - self._due))
        self._schedule()

    def record(self, lag_s: float) -> None:
        self.histogram.observe(lag_s)
        if lag_s > self.longest_s:
            self.longest_s = lag_s


class LoopLagCollector(Collector):
    """Exports a :class:`LoopLag` at scrape time."""

    def __init__(self, lag: LoopLag) -> None:
        self._lag = lag

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        lag = self._lag
        yield lag.histogram.family("tokenspeed_http_loop_lag_seconds",
                                   f"how late the HTTP event loop ran a timer due every {INTERVAL_S:g}s")
        yield GaugeMetricFamily("tokenspeed_http_loop_longest_lag_seconds",
                                "longest HTTP event-loop stall since start", value=lag.longest_s)
