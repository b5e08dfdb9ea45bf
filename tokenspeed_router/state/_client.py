"""The one place that imports redis (lazily) and builds clients.

``import tokenspeed_router.state`` must work where redis-py is not installed,
so nothing at module level touches it. Clients never retry on their own: the
backend's loops own retries and backoff, and a command that fails fast is what
lets replicas notice an outage and report it instead of hanging.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from tokenspeed_router.errors import ConfigError

if TYPE_CHECKING:
    import redis

    from tokenspeed_router.state.config import RedisStateConfig

__all__ = ["Backoff", "connect", "redis_module", "transient_errors"]


def redis_module() -> Any:
    """Import redis-py, or explain how to get it."""
    try:
        import redis
    except ImportError as err:  # pragma: no cover - redis is a declared dependency
        raise ConfigError("the Redis state backend needs redis-py: pip install redis") from err
    return redis


def connect(config: RedisStateConfig, *, block_ms: int = 0) -> redis.Redis:
    """A client for ``config.url``; ``block_ms`` widens the read timeout for XREAD BLOCK."""
    redis = redis_module()
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(  # type: ignore[no-any-return]
        config.url,
        socket_timeout=config.socket_timeout_s + block_ms / 1000,
        socket_connect_timeout=config.socket_timeout_s,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=0,
    )


def transient_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "Redis is unreachable or restarting": retry with backoff."""
    redis = redis_module()
    return (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, OSError)


class Backoff:
    """Exponential backoff that waits on an Event, so ``close()`` interrupts it at once."""

    def __init__(self, min_s: float, max_s: float, stop: threading.Event) -> None:
        self._min_s = min_s
        self._max_s = max_s
        self._stop = stop
        self._next_s = min_s

    def wait(self) -> bool:
        """Wait the current delay and double it; return True when asked to stop."""
        stopped = self._stop.wait(self._next_s)
        self._next_s = min(self._max_s, self._next_s * 2)
        return stopped

    def reset(self) -> None:
        self._next_s = self._min_s
