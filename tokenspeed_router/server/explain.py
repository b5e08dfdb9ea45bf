"""Why this worker: which decisions are explained, and what an explained answer says (DESIGN §13).

A decision is explained when the caller asks (``POST /route`` with
``"explain": true``, a ZMQ ``route`` with ``explain: true``, a gateway
request with ``x-tokenspeed-explain: 1``) or when ``serve --explain-sample
RATE`` picks it. Explained decisions answer with the router's cost breakdown
(``RouteDecision.explanation``; the ``explain`` field / the
``x-tokenspeed-route`` header) and, with ``serve --decision-log FILE``, are
written to the decision log (``server/decision_log.py``).

Sampling is deterministic: an integer accumulator per service, so RATE 0.25
explains exactly every fourth decision (decisions ``n`` for which
``floor(n * RATE)`` steps up), whatever their request ids, with no random
draw and no hash on the hot path. Deterministic is what an operator wants:
two runs of the same traffic sample the same decisions, and a test can
count them. (A hash of the request id would also sample consistently across
replicas, but would cost a hash per request and give ``RATE * n`` only on
average.)

The hot path with explanation off pays one ``is None`` test for the sampler
and one for the decision's explanation; ``benchmarks/bench_explain.py``
measures it against the code without either.

This module imports nothing of the service so that ``server/config.py`` can
embed :class:`ExplainConfig`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from tokenspeed_router.errors import ConfigError

__all__ = [
    "DEFAULT_DECISION_LOG_MAX_BYTES",
    "ExplainConfig",
    "ExplainSampler",
    "ExplainStats",
    "ExplainStatsCollector",
    "decision_answer",
]

#: one decision-log file grows to this size, then rotates to ``FILE.1`` (so at most twice this on disk)
DEFAULT_DECISION_LOG_MAX_BYTES = 256 << 20
#: the sampler's fixed-point unit: rates are exact to 1e-9
_UNIT = 1_000_000_000


@dataclass(frozen=True, kw_only=True)
class ExplainConfig:
    """``serve --decision-log FILE [--explain-sample RATE] [--decision-log-max-bytes N]``.

    ``explain_sample``: the fraction of decisions explained without being
    asked, in ``[0, 1]``; None means 1 with a decision log (an operator who
    asks for the log wants decisions in it) and 0 without one.
    """

    decision_log: str | None = None
    explain_sample: float | None = None
    decision_log_max_bytes: int = DEFAULT_DECISION_LOG_MAX_BYTES

    def __post_init__(self) -> None:
        rate = self.explain_sample
        if rate is not None and (
            isinstance(rate, bool) or not isinstance(rate, (int, float)) or math.isnan(rate) or not 0.0 <= rate <= 1.0
        ):
            raise ConfigError(f"explain_sample must be a number in [0, 1] (a fraction of decisions), got {rate!r}")
        size = self.decision_log_max_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size < 4096:
            raise ConfigError(f"decision_log_max_bytes must be an integer >= 4096, got {size!r}")

    @property
    def sample_rate(self) -> float:
        """The rate in force (``explain_sample`` resolved, see the class docstring)."""
        if self.explain_sample is not None:
            return float(self.explain_sample)
        return 1.0 if self.decision_log else 0.0

    @classmethod
    def setting_names(cls) -> tuple[str, ...]:
        """The config keys (flags are these with ``-``)."""
        return tuple(f.name for f in fields(cls))


class ExplainSampler:
    """Picks ``rate`` of the decisions, deterministically (see the module docstring).

    Not thread-safe by itself: the service calls :meth:`take` under its lock.
    """

    __slots__ = ("_acc", "_step", "rate")

    def __init__(self, rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate!r}")
        self.rate = rate
        self._step = round(rate * _UNIT)
        self._acc = 0

    def take(self) -> bool:
        """Whether the next decision is explained."""
        acc = self._acc + self._step
        if acc >= _UNIT:
            self._acc = acc - _UNIT
            return True
        self._acc = acc
        return False


class ExplainStats:
    """Explained decisions by cause (mutated under the service lock, read at scrape time)."""

    __slots__ = ("asked", "sampled")

    def __init__(self) -> None:
        self.asked = 0
        self.sampled = 0


class ExplainStatsCollector(Collector):
    """``tokenspeed_route_explained_total{cause="asked"|"sampled"}``."""

    def __init__(self, stats: ExplainStats) -> None:
        self._stats = stats

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        family = CounterMetricFamily(
            "tokenspeed_route_explained", "routing decisions explained, by cause (asked for, or --explain-sample)",
            labels=["cause"],
        )
        family.add_metric(["asked"], float(self._stats.asked))
        family.add_metric(["sampled"], float(self._stats.sampled))
        yield family


def decision_answer(decision: Any) -> dict[str, Any]:
    """The ``POST /route`` answer (HTTP and ZMQ): DESIGN §6 fields, plus ``explain`` when explained."""
    out: dict[str, Any] = decision.to_dict()
    explanation = decision.explanation
    if explanation is not None:
        out["explain"] = explanation.to_dict()
    return out
