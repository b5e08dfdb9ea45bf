"""The garbage collector of a long-running ``serve`` process: no full passes over start-up objects.

Why: CPython's collector runs a *full* pass (every tracked object) whenever the
objects promoted to the oldest generation grow by a quarter. In ``serve`` the
oldest generation is mostly what start-up made — modules, classes, functions,
uvicorn/aiohttp/Starlette/prometheus machinery, msgspec and numpy types
(~45k objects whose traversal takes 20-80 ms on a busy 2-core machine). A
stream of requests promotes a few survivors per request (futures, tasks,
connection state), so a full pass came every couple of seconds, collected
nothing, and stopped the event loop for as long: no request completed for
60-130 ms (issue 17). The fix, as CPython documents for pre-fork servers and
long-lived heaps:

* :func:`settle` — once the process is up (app built, sockets bound, workers
  subscribed): one ``gc.collect()`` so no garbage is kept, then
  ``gc.freeze()``, which moves every surviving object to a permanent
  generation the collector never scans again. Called again after a rebuild
  that creates many long-lived objects (a restored index, a new config);
  freezing only after a collection means no cyclic garbage is ever frozen.
* :func:`configure` — generation-0 threshold raised from 700 to
  :data:`THRESHOLD_YOUNG`: a proxied request allocates a few hundred
  tracked containers that live until it ends, so with 32 requests in flight
  the default threshold collected every couple of requests and traversed the
  same in-flight objects over and over; a collection of the young generation
  stays well under a millisecond at this size.
* :class:`GcPauses` — every collection timed through ``gc.callbacks``
  (two clock reads per collection, a few hundred collections a second at
  most) and exported as ``tokenspeed_gc_pause_seconds`` so an operator sees
  the longest pause, not only a tail latency.

Everything here is process-wide and idempotent; nothing is undone at exit.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from tokenspeed_router.server.metrics import LatencyHistogram

__all__ = ["THRESHOLD_YOUNG", "GcCollector", "GcPauses", "configure", "gc_pauses", "settle"]

logger = logging.getLogger(__name__)

#: generation-0 threshold (CPython's default: 700); generations 1 and 2 keep their defaults
THRESHOLD_YOUNG = 20_000
#: pause histogram buckets (seconds): 50 µs .. 250 ms
_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25)

_configured = False
_lock = threading.Lock()


def configure() -> None:
    """Raise the young-generation threshold and start timing collections (once per process)."""
    global _configured
    with _lock:
        if _configured:
            return
        _configured = True
        _, older, oldest = gc.get_threshold()
        gc.set_threshold(THRESHOLD_YOUNG, older, oldest)
        gc.callbacks.append(_PAUSES.callback)


def settle(why: str = "start-up") -> int:
    """Collect once, then freeze every surviving object out of future collections.

    Returns how many objects are frozen now. Call after start-up and after
    rebuilds that create many long-lived objects.
    """
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.debug("gc settled after %s: %d objects frozen in %.1f ms", why, frozen,
                 (time.perf_counter() - t0) * 1e3)
    return frozen


class GcPauses:
    """Collections timed per generation: a histogram each, and the longest pause."""

    def __init__(self) -> None:
        self._started = 0.0
        self.pauses = [LatencyHistogram(_BUCKETS) for _ in range(3)]
        self.longest = [0.0, 0.0, 0.0]

    @property
    def counts(self) -> list[int]:
        """Collections per generation."""
        return [h.samples for h in self.pauses]

    def callback(self, phase: str, info: dict[str, Any]) -> None:
        # Runs inside the collector, on whichever thread triggered it (under the GIL):
        # plain arithmetic, no allocation of tracked objects.
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        gen = info.get("generation", 2)
        if not 0 <= gen <= 2:
            return
        self.pauses[gen].observe(pause)
        if pause > self.longest[gen]:
            self.longest[gen] = pause


_PAUSES = GcPauses()


def gc_pauses() -> GcPauses:
    """The process-wide pause record (filled once :func:`configure` ran)."""
    return _PAUSES


class GcCollector(Collector):
    """``tokenspeed_gc_pause_seconds{generation}`` and the longest pause per generation."""

    def __init__(self, pauses: GcPauses | None = None) -> None:
        self._pauses = pauses if pauses is not None else _PAUSES

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        p = self._pauses
        hist = HistogramMetricFamily("tokenspeed_gc_pause_seconds",
                                     "time the garbage collector stopped the process, per collection",
                                     labels=["generation"])
        longest = GaugeMetricFamily("tokenspeed_gc_longest_pause_seconds",
                                    "longest collector pause since start", labels=["generation"])
        for gen in range(3):
            hist.add_metric([str(gen)], p.pauses[gen].cumulative(), p.pauses[gen].total)
            longest.add_metric([str(gen)], p.longest[gen])
        yield hist
        yield longest
        yield GaugeMetricFamily("tokenspeed_gc_frozen_objects", "objects frozen out of collection "
                                "(gc.freeze after start-up)", value=float(gc.get_freeze_count()))
