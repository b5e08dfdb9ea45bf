"""Rate-limited warnings for hot loops, shared by every package that logs per frame.

A flood of bad frames from one worker must not flood the log: each key (for
instance a worker and a reason) is logged at most once per interval, and the
next message says how many were suppressed in between.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """Log at most one message per key per ``interval_s`` (not thread safe)."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 10.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._last: dict[Hashable, float] = {}
        self._suppressed: dict[Hashable, int] = {}

    def log(self, level: int, key: Hashable, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless ``key`` was logged within the interval.

        Returns whether the message was emitted.
        """
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        self._last[key] = now
        suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            self._logger.log(level, msg + " (%d similar suppressed)", *args, suppressed)
        else:
            self._logger.log(level, msg, *args)
        return True
