"""Settings of the OpenAI-compatible gateway (DESIGN §10), one frozen struct.

They arrive through ``server/config.py`` like every other ``serve`` setting
(flag > ``TOKENSPEED_ROUTER_*`` environment > TOML): ``--tokenizer``,
``--upstream-timeout-s``, ``--upstream-connect-timeout-s``,
``--upstream-max-connections``, ``--upstream-retries``,
``--worker-down-cooldown-s``, ``--truth-window``, ``--otlp-traces-endpoint``. This module imports
nothing of the server so that ``server/config.py`` can embed it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from tokenspeed_router.errors import ConfigError

__all__ = ["ENGINE_TOKENIZER", "GatewayConfig"]

#: ``--tokenizer engine``: ask the worker's own ``POST /tokenize``
ENGINE_TOKENIZER = "engine"


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """How the gateway talks to engines and judges what they report.

    ``upstream_timeout_s`` bounds every wait on an engine after the connection
    is up (writing the request, and each read: time to first byte and the gap
    between two stream chunks), not the whole answer, so long generations are
    fine while a hung engine is not. ``upstream_retries`` is how many *other*
    workers a request may move to when its worker refuses or drops the
    connection before answering. A worker marked down is probed on
    ``GET /health`` and routed to again once it answers, or after
    ``worker_down_cooldown_s`` at the latest.
    """

    tokenizer: str = ENGINE_TOKENIZER
    upstream_timeout_s: float = 600.0
    upstream_connect_timeout_s: float = 5.0
    upstream_max_connections: int = 1024
    upstream_retries: int = 2
    worker_down_cooldown_s: float = 30.0
    #: truth loop: judge a worker on its last N informative requests
    truth_window: int = 16
    #: OTLP/HTTP traces endpoint (``http://collector:4318/v1/traces``): one span per request
    #: (needs the ``otel`` extra); None: no tracing, nothing of OpenTelemetry imported
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizer, str) or not self.tokenizer.strip():
            raise ConfigError(f"tokenizer: expected 'engine' or a path, got {self.tokenizer!r}")
        for name in ("upstream_timeout_s", "upstream_connect_timeout_s", "worker_down_cooldown_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
                raise ConfigError(f"{name} must be a positive finite number, got {value!r}")
        endpoint = self.otlp_traces_endpoint
        if endpoint is not None and (not isinstance(endpoint, str)
                                     or not endpoint.startswith(("http://", "https://"))):
            raise ConfigError(f"otlp_traces_endpoint must be an http(s):// URL, got {endpoint!r}")
        for name, low in (("upstream_max_connections", 1), ("upstream_retries", 0), ("truth_window", 4)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")

    @classmethod
    def setting_names(cls) -> tuple[str, ...]:
        """The setting names (config keys; flags are these with ``-``)."""
        return tuple(f.name for f in fields(cls))
